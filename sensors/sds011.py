"""Nova SDS011 particulate sensor: 10-byte frames ``AA C0 d1..d6 CHK AB``.

PM2.5 = (d2 << 8 | d1) / 10 and PM10 = (d4 << 8 | d3) / 10 in µg/m³;
CHK = (d1 + ... + d6) & 0xFF. Command replies (``AA C5 ...``) are skipped.
"""

from __future__ import annotations

from typing import Literal

from .frames import Frame, FrameError
from .serialsensor import SerialOptions, serial_type

HEAD, TAIL, DATA, REPLY = 0xAA, 0xAB, 0xC0, 0xC5


def encode_frame(pm25: float, pm10: float, device: int = 0xA1B2) -> bytes:
    a, b = round(pm25 * 10), round(pm10 * 10)
    d = [a & 0xFF, a >> 8, b & 0xFF, b >> 8, device >> 8, device & 0xFF]
    return bytes([HEAD, DATA, *d, sum(d) & 0xFF, TAIL])


class SDS011Parser:
    def __init__(self) -> None:
        self.buf = bytearray()  # leftovers are bounded by feed: at most one partial frame
        self.junk_bytes = 0

    def feed(self, data: bytes) -> list[Frame | FrameError]:
        self.buf += data
        buf = self.buf
        out: list[Frame | FrameError] = []
        while True:
            i = buf.find(bytes([HEAD]))
            if i < 0:
                self.junk_bytes += len(buf)
                buf.clear()
                return out
            if i:
                self.junk_bytes += i
                del buf[:i]
            if len(buf) < 10:
                return out
            frame = bytes(buf[:10])
            if frame[1] not in (DATA, REPLY) or frame[9] != TAIL:
                out.append(FrameError("bad_frame", f"not a frame: {frame.hex(' ')}"))
                del buf[:1]
                continue
            if sum(frame[2:8]) & 0xFF != frame[8]:
                out.append(
                    FrameError("bad_checksum", f"checksum {frame[8]:#04x} in {frame.hex(' ')}")
                )
                del buf[:1]
                continue
            del buf[:10]
            if frame[1] == REPLY:
                continue
            pm25 = (frame[3] << 8 | frame[2]) / 10
            pm10 = (frame[5] << 8 | frame[4]) / 10
            out.append(Frame({"pm2_5": (pm25, "ug/m3"), "pm10": (pm10, "ug/m3")}, kind="sds011"))


class SDS011Options(SerialOptions):
    type: Literal["sds011"]


SENSOR = serial_type(
    "sds011",
    SDS011Options,
    SDS011Parser,
    summary="Nova SDS011 particulates: PM2.5, PM10",
)
