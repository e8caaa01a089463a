"""Plantower PMS5003 particulate sensor: 32-byte frames ``42 4D``, length 28, 16-bit sum.

Datasheet frame: start ``0x42 0x4D``; frame length (2 bytes, big endian) = 28;
13 data words; a checksum word = the sum of the 30 bytes before it. Data words
1-3 are PM1.0/PM2.5/PM10 at "CF=1", 4-6 the same under atmospheric conditions
(what we report, in µg/m³), 7-12 particle counts per 0.1 L above 0.3, 0.5, 1,
2.5, 5 and 10 µm.
"""

from __future__ import annotations

import struct
from typing import Literal

from .frames import Frame, FrameError
from .serialsensor import SerialOptions, serial_type

START = b"\x42\x4d"
FRAME_LEN = 32


def encode_frame(pm1: int, pm25: int, pm10: int, counts: tuple[int, ...] = (0,) * 6) -> bytes:
    """A valid frame (for tests, the simulator and the benchmark)."""
    words = (pm1, pm25, pm10, pm1, pm25, pm10, *counts, 0)
    body = START + struct.pack(">H13H", 28, *words)
    return body + struct.pack(">H", sum(body) & 0xFFFF)


class PMS5003Parser:
    def __init__(self) -> None:
        self.buf = bytearray()  # leftovers are bounded by feed: at most one partial frame
        self.junk_bytes = 0

    def feed(self, data: bytes) -> list[Frame | FrameError]:
        self.buf += data
        buf = self.buf
        out: list[Frame | FrameError] = []
        while True:
            i = buf.find(START)
            if i < 0:
                keep = 1 if buf[-1:] == START[:1] else 0  # a start split across reads
                self.junk_bytes += len(buf) - keep
                del buf[: len(buf) - keep]
                return out
            if i:
                self.junk_bytes += i
                del buf[:i]
            if len(buf) < FRAME_LEN:
                return out
            length = struct.unpack_from(">H", buf, 2)[0]
            if length != 28:
                out.append(FrameError("bad_frame", f"frame length {length}, expected 28"))
                del buf[:2]  # resynchronise on the next start inside
                continue
            frame = bytes(buf[:FRAME_LEN])
            check = struct.unpack_from(">H", frame, 30)[0]
            if sum(frame[:30]) & 0xFFFF != check:
                out.append(FrameError("bad_checksum", f"checksum {check:#06x} != sum of frame"))
                del buf[:2]
                continue
            del buf[:FRAME_LEN]
            w = struct.unpack_from(">13H", frame, 4)
            out.append(
                Frame(
                    {
                        "pm1_0": (float(w[3]), "ug/m3"),
                        "pm2_5": (float(w[4]), "ug/m3"),
                        "pm10": (float(w[5]), "ug/m3"),
                        "n0_3": (float(w[6]), "1/0.1L"),
                    },
                    kind="pms5003",
                )
            )


class PMS5003Options(SerialOptions):
    type: Literal["pms5003"]


SENSOR = serial_type(
    "pms5003",
    PMS5003Options,
    PMS5003Parser,
    summary="Plantower PMS5003 particulates: PM1, PM2.5, PM10",
)
