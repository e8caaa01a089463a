"""How readings are kept in the outbox: packed rows, their bodies encoded once.

Every reading has a seq, but the outbox keeps readings packed: one row per batch that
was committed together (a node's message, the sensor readings of one group commit),
holding seqs ``seq .. seq + n - 1`` as the cloud wire format already encoded (zlib-
compressed when that is smaller). A commit then writes a few pages per message instead
of a B-tree row per reading, and the uplink builds a PUBLISH by joining bodies, without
decoding them (docs/architecture.md, "What is written when"). Pure functions: no file.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from ..wire import encode_readings

# An outbox row holds at most this many readings and this much encoded JSON (before
# compression): the uplink's default batch, and few enough bytes that a broker with a
# small Maximum Packet Size rarely makes the uplink split one (``split_row_in``).
ROW_READINGS = 100
ROW_BYTES = 16 << 10
# Bodies this long or longer are compressed: zlib level 1 with a 4 kB window and a
# preset dictionary of what every reading repeats (keys, an id, a timestamp), so one
# reading of 126 bytes is kept in 52 and 100 readings (12.6 kB of JSON) in 0.9 kB, in
# 4 us. The dictionary is part of the file format: a stream names its dictionary by
# Adler-32 (RFC 1950), so a new one must be added beside it, never edited.
COMPRESS_FROM = 32
BODY_DICT = (
    b'"flags":["clock_unsynced","ts_from_gateway","clock_corrected"]'
    b'{"id":"node-1/1/1.0","origin":"node-1","sensor":"temperature",'
    b'"ts":"2026-11-23T00:00:00.000Z","value":0.0,"unit":"C","flags":[]},'
    b'{"id":"gw/0123456789ab/1","origin":"gw","sensor":"humidity",'
    b'"ts":"2026-11-23T12:34:56.789Z","value":12.5,"unit":"%","flags":[]}'
)


def marks_of(readings: Iterable[dict[str, Any]]) -> str | None:
    """A row's ``marks``: every flag its readings carry, comma separated."""
    return ",".join(sorted({f for r in readings for f in r["flags"]})) or None


def outbox_row(first: int, encoded: list[bytes], marks: set[str], now: float) -> tuple[Any, ...]:
    """An outbox row (seq, n, marks, body, queued) of readings already encoded one by one."""
    body = pack_body(b",".join(encoded))
    return (first, len(encoded), ",".join(sorted(marks)) or None, body, now)


def packed_rows(first: int, chunk: list[dict[str, Any]], now: float) -> Iterator[tuple[Any, ...]]:
    """``chunk``'s readings (seqs from ``first``) as one row, or as several when their
    encoding passes ``ROW_BYTES`` (long sensor names, many flags): encoded in one call,
    since a reading at a time costs twice the CPU at a node's 100-reading messages."""
    raw = encode_readings(chunk)
    if len(raw) <= ROW_BYTES:
        yield (first, len(chunk), marks_of(chunk), pack_body(raw), now)
        return
    encoded: list[bytes] = []
    flags: set[str] = set()
    size = 0
    for seq, r in enumerate(chunk, first):
        one = encode_readings([r])
        if encoded and size + len(one) > ROW_BYTES:
            yield outbox_row(seq - len(encoded), encoded, flags, now)
            encoded, flags, size = [], set(), 0
        encoded.append(one)
        flags.update(r["flags"])
        size += len(one) + 1
    yield outbox_row(first + len(chunk) - len(encoded), encoded, flags, now)


def pack_body(raw: bytes) -> bytes:
    """What the outbox stores for encoded readings: zlib when that is smaller.
    Encoded readings begin with ``{``, a zlib stream never does (RFC 1950)."""
    if len(raw) >= COMPRESS_FROM:
        z = zlib.compressobj(1, zlib.DEFLATED, 12, 2, zdict=BODY_DICT)
        packed = z.compress(raw) + z.flush()
        if len(packed) < len(raw):
            return packed
    return raw


def unpack_body(stored: bytes) -> bytes:
    if stored[:1] == b"{":
        return stored
    if stored[1] & 0x20:  # FDICT: compressed against BODY_DICT
        z = zlib.decompressobj(zdict=BODY_DICT)
        return z.decompress(stored) + z.flush()
    return zlib.decompress(stored)


def decode_body(stored: bytes) -> list[dict[str, Any]]:
    readings: list[dict[str, Any]] = json.loads(b"[" + unpack_body(stored) + b"]")
    return readings
