"""NMEA 0183 GPS: GGA (position, fix quality, satellites, altitude) and RMC (UTC date/time).

Each sentence is ``$<talker><type>,...*hh\\r\\n`` with ``hh`` the XOR of every
character between ``$`` and ``*``. Sentences with a bad or missing checksum are
reported; other sentence types are counted and skipped. A valid RMC gives a
trusted UTC time (``Frame.utc``) the gateway can use as a clock source.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from .frames import Frame, FrameError
from .serialsensor import SerialOptions, serial_type

MAX_SENTENCE = 120  # NMEA says 82; receivers overrun it a little


def checksum(body: str) -> int:
    c = 0
    for ch in body.encode("ascii", "replace"):
        c ^= ch
    return c


def sentence(body: str) -> bytes:
    """``$body*hh\\r\\n`` (for tests and the simulator)."""
    return f"${body}*{checksum(body):02X}\r\n".encode()


def _degrees(value: str, hemi: str) -> float | None:
    if not value:
        return None
    dot = value.index(".") if "." in value else len(value)
    deg = float(value[: dot - 2]) + float(value[dot - 2 :]) / 60
    return round(-deg if hemi in ("S", "W") else deg, 7)


def _num(value: str) -> float | None:
    return float(value) if value else None


class NMEAParser:
    def __init__(self) -> None:
        self.buf = bytearray()  # leftovers are bounded by feed: at most one partial frame
        self.skipped: dict[str, int] = {}

    def feed(self, data: bytes) -> list[Frame | FrameError]:
        self.buf += data
        buf = self.buf
        out: list[Frame | FrameError] = []
        while True:
            start = buf.find(b"$")
            if start < 0:
                buf.clear()
                return out
            del buf[:start]
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) > MAX_SENTENCE:
                    out.append(FrameError("bad_frame", "sentence too long"))
                    del buf[:1]
                    continue
                return out
            line = bytes(buf[:end]).rstrip(b"\r")
            del buf[: end + 1]
            if b"$" in line[1:]:  # a sentence cut short by the start of another
                out.append(FrameError("bad_frame", "truncated sentence"))
                buf[:0] = line[line.rindex(b"$") :] + b"\n"
                continue
            item = self.parse_line(line)
            if item is not None:
                out.append(item)

    def parse_line(self, line: bytes) -> Frame | FrameError | None:
        try:
            text = line.decode("ascii")
        except UnicodeDecodeError:
            return FrameError("bad_frame", "non-ASCII bytes in sentence")
        body, star, given = text[1:].partition("*")
        if not star:
            return FrameError("bad_frame", f"no checksum: {text[:40]!r}")
        try:
            ok = int(given[:2], 16) == checksum(body)
        except ValueError:
            ok = False
        if not ok:
            return FrameError("bad_checksum", f"checksum {given!r} wrong for {text[:40]!r}")
        fields = body.split(",")
        kind = fields[0][2:]
        try:
            if kind == "GGA":
                return self._gga(fields)
            if kind == "RMC":
                return self._rmc(fields)
        except (ValueError, IndexError) as exc:
            return FrameError("bad_frame", f"{kind}: {exc}")
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        return None

    def _gga(self, f: list[str]) -> Frame:
        quality = int(f[6] or 0)
        values: dict[str, tuple[float | None, str | None]] = {
            "fix": (float(quality), None),
            "satellites": (float(int(f[7] or 0)), None),
        }
        if quality:
            values |= {
                "lat": (_degrees(f[2], f[3]), "deg"),
                "lon": (_degrees(f[4], f[5]), "deg"),
                "alt": (_num(f[9]), "m"),
                "hdop": (_num(f[8]), None),
            }
        return Frame(values, kind="GGA")

    def _rmc(self, f: list[str]) -> Frame:
        valid = f[2] == "A"
        values: dict[str, tuple[float | None, str | None]] = {}
        utc = None
        if valid:
            hh, mm, ss = int(f[1][0:2]), int(f[1][2:4]), float(f[1][4:])
            yy = int(f[9][4:6])
            # Two-digit year, pivoted as POSIX %y does (69-99 -> 19xx). The gateway
            # still sanity-checks a GPS time before trusting it as a clock.
            day, month, year = int(f[9][0:2]), int(f[9][2:4]), (1900 if yy >= 69 else 2000) + yy
            utc = datetime(year, month, day, hh, mm, int(ss), int(ss % 1 * 1e6), tzinfo=UTC)
            knots = _num(f[7])
            values["speed"] = (None if knots is None else round(knots * 0.514444, 3), "m/s")
        return Frame(values, utc=utc, kind="RMC")


class NMEAOptions(SerialOptions):
    type: Literal["nmea"]


SENSOR = serial_type(
    "nmea",
    NMEAOptions,
    NMEAParser,
    summary="NMEA 0183 GPS: position, and UTC as a clock source",
    clock_source="gps",
)
