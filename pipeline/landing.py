"""The landing zone: JSON lines, one reading a line, made visible to Spark only when complete.

Layout under the landing root::

    _incoming/{sub or readings}/{writer}-{stamp}-{n}.jsonl   being written (hidden:
                                                 Spark skips "_" paths)
    date=YYYY-MM-DD/{writer}-{stamp}-{n}.jsonl   rolled, complete, never changed again
    _rejected/date=YYYY-MM-DD/{writer}-....jsonl   messages that did not parse, with the reason
    _quarantine/{sub or readings}/{file}.{offset}   what a recovery cut off at that offset
                                                 (neither Spark nor the audit reads it)

The last line of every message the ingest lands carries its receive record,
``"_mqtt": {"session", "packet_id", "qos", "digest", "length", "crc32"}``
(Spark's explicit schema ignores the field): the landing file is the only
durable record of a received QoS 2 message, so one fsync covers the message and
its receive state, and a restart rebuilds the state from the files' tails
(``receive_records``). ``length`` and ``crc32`` are the *seal* (``seal``): the
message's byte length up to the field, and the CRC-32 of those bytes and the
length field, so the record vouches for every byte of its message's lines.

Every append is fsynced before it returns (the caller acknowledges after it).
Rolling: fsync the file, rename it into its date directory, fsync both
directories, so a rolled file is either fully there or not at all.

**Recovery trusts only what it can verify was written whole.** A power cut
may leave any of the pages written since the last fsync on disk, some torn at
512-byte sectors, with holes that read as zeros (devkit/powercut's writeback
model); only the bytes up to the last fsync are known good. So a file left in
``_incoming`` by a crash is read from its start and kept up to the end of the
last thing that verifies with nothing unverified before it
(``verified_length``): for a writer of messages, a message whose seal matches
and which starts where the previous one ended; for a plain writer (status
lines, their rejections), a line that is a JSON object (a hole is zeros, and
no JSON line holds a zero byte). Everything after the first thing that does
not verify is moved to ``_quarantine/`` (where neither Spark nor the audit
looks) and cut: all of it came after the last fsync, so none of it was
acknowledged, the broker delivers it again, and it lands once. Then the file
is rolled. ``receive_records`` yields only records whose seal matches, so an
unverified record never recognises a resend.

Files written before the seal (no ``crc32`` anywhere in the file) are read as
before, with every line of a message also required to parse as JSON: the
best that format allows, and under the zero-hole model enough.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import time
import zlib
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pubcomp.sync.store import fsync_dir

log = logging.getLogger(__name__)


RECEIVE_KEY = "_mqtt"
# The bytes that open a receive record. They cannot occur inside a JSON string
# (its quotes would be escaped), nor as a reading's own key (the schema forbids it).
_MARK = b'"_mqtt":'
# The seal closes the receive record: ``,"length":N,"crc32":"xxxxxxxx"}}`` and the newline.
_LENGTH = b',"length":'
_CRC = b',"crc32":"'
_SEAL = re.compile(rb',"length":(\d{1,12}),"crc32":"([0-9a-f]{8})"\}\}\n')
QUARANTINE = "_quarantine"


def seal(message: bytes) -> bytes:
    """A message's lines, its receive record last on the last line, with the seal added to
    the record: ``length`` (bytes of the message before the field) and ``crc32`` (of
    those bytes and the length field)."""
    last = message.rfind(b"\n", 0, len(message) - 1) + 1
    if not message.endswith(b"}}\n") or message.find(_MARK, last) < 0:
        raise ValueError("a message to seal ends with its receive record")
    body = memoryview(message)[:-3]
    length = _LENGTH + str(len(body)).encode()
    crc = zlib.crc32(length, zlib.crc32(body))
    return b"".join((body, length, _CRC, b"%08x" % crc, b'"}}\n'))


def _seal_at(data: bytes, start: int, nl: int) -> tuple[int, bool] | None:
    """The seal on the line ``data[start:nl + 1]``: (where its message starts, whether the
    CRC matches), or None if the line carries none."""
    k = data.rfind(_LENGTH, start, nl)
    m = _SEAL.fullmatch(data, k, nl + 1) if k >= 0 else None
    if m is None:
        return None
    first = k - int(m[1])
    ok = first >= 0 and zlib.crc32(memoryview(data)[first : m.end(1)]) == int(m[2], 16)
    return first, ok


def _json_object(line: bytes) -> bool:
    # Decoded as UTF-8 first: given bytes, json.loads guesses UTF-16 or -32 from zero
    # bytes, and b"\0{\0}" would pass as {}.
    try:
        return isinstance(json.loads(line.decode("utf-8")), dict)
    except ValueError:  # UnicodeDecodeError too: a hole of 0xff, say
        return False


def verified_length(data: bytes, messages: bool) -> int:
    """How many bytes of a landing file verify as written whole, from the start.

    ``messages``: the file holds messages ending with receive records; a sealed one
    verifies by its CRC and must start where the last verified one ended (an unsealed
    one, in a file from before the seal, by every line parsing). Otherwise every line
    must be a JSON object. Verification stops at the first thing that does not."""
    sealed = messages and _CRC in data
    good = i = 0
    while (nl := data.find(b"\n", i)) >= 0:
        if not messages:
            if not _json_object(data[i:nl]):
                break
            good = nl + 1
        elif sealed:
            found = _seal_at(data, i, nl)
            if found is not None:
                if found != (good, True):
                    break
                good = nl + 1
        elif data.find(_MARK, i, nl) >= 0:
            if not all(map(_json_object, data[good:nl].split(b"\n"))):
                break
            good = nl + 1
        i = nl + 1
    return good


def rejection_line(topic: str, payload: bytes, why: str, received: str, **extra: Any) -> bytes:
    """A refused message as a line of ``_rejected/``: what came, when, why; a payload
    that is not UTF-8 is kept as base64."""
    try:
        text, encoding = payload.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(payload).decode(), "base64"
    rec = {
        "received": received,
        "topic": topic,
        "reason": why,
        "payload": text[:65536],
        "encoding": encoding,
        **extra,
    }
    return json.dumps(rec, ensure_ascii=False).encode() + b"\n"


def _utc_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")


class LandingWriter:
    """One writer's current file in ``dir_name`` (``""`` for readings, ``_rejected``)."""

    def __init__(
        self,
        root: Path,
        writer: str,
        *,
        sub: str = "",
        max_bytes: int = 64 << 20,
        max_age_s: float = 60.0,
        message_records: bool = False,
    ) -> None:
        """``message_records``: every message's last line carries a receive record, which
        ``append`` seals and a recovery verifies (else every line must be JSON)."""
        if not writer or "/" in writer or writer.startswith((".", "_")):
            raise ValueError(f"writer name {writer!r} must be a plain file name part")
        self.root = Path(root)
        self.writer = writer
        self.dest_root = self.root / sub if sub else self.root
        self.incoming = self.root / "_incoming" / (sub or "readings")
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.message_records = message_records
        self.incoming.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self._path: Path | None = None
        self._opened = 0.0
        self._size = 0
        self._n = 0
        self.rolled_files = 0
        self.recover()

    # ------------------------------------------------------------ writing

    def append(self, lines: Sequence[bytes]) -> None:
        """Write complete lines (each ending in a newline) and fsync them. With
        ``message_records``, each item is one message (its lines, the receive record
        last), sealed here."""
        if not lines:
            return
        if self._fd is None:
            self._open()
        data = b"".join(map(seal, lines) if self.message_records else lines)
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)  # type: ignore[arg-type]
            view = view[n:]
        os.fsync(self._fd)  # type: ignore[arg-type]
        self._size += len(data)
        if self._size >= self.max_bytes:
            self.roll()

    def roll_due(self) -> bool:
        return self._fd is not None and time.monotonic() - self._opened >= self.max_age_s

    def maybe_roll(self) -> None:
        if self.roll_due():
            self.roll()

    def roll(self) -> Path | None:
        """Make the current file visible (atomically); returns its final path."""
        if self._fd is None or self._path is None:
            return None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        src, self._path = self._path, None
        if self._size == 0:
            src.unlink()
            fsync_dir(self.incoming)
            return None
        return self._publish(src)

    def close(self) -> None:
        self.roll()

    # ---------------------------------------------------------- internals

    def _open(self) -> None:
        self._n += 1
        self._path = self.incoming / f"{self.writer}-{_utc_stamp()}-{self._n}.jsonl"
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        fsync_dir(self.incoming)  # the new name survives a power cut along with its data
        self._opened = time.monotonic()
        self._size = 0

    def _publish(self, src: Path) -> Path:
        day = datetime.now(UTC).strftime("%Y-%m-%d")
        dest_dir = self.dest_root / f"date={day}"
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / src.name
        os.rename(src, dest)
        fsync_dir(dest_dir)
        fsync_dir(self.incoming)
        self.rolled_files += 1
        return dest

    def recover(self) -> int:
        """Roll this writer's files left in ``_incoming`` by a crash, each cut back to
        what verifies (the rest quarantined); returns how many were rolled."""
        n = 0
        for f in sorted(self.incoming.glob(f"{self.writer}-*.jsonl")):
            data = f.read_bytes()
            keep = verified_length(data, self.message_records)
            if keep < len(data):
                kept = self._quarantine(f, data, keep)
                log.warning(
                    "%s: %d bytes after byte %d do not verify (never acknowledged): cut, "
                    "kept in %s",
                    f, len(data) - keep, keep, kept,
                )  # fmt: skip
                with open(f, "r+b") as fh:
                    fh.truncate(keep)
                    fh.flush()
                    os.fsync(fh.fileno())
            if keep == 0:
                f.unlink()
                continue
            self._publish(f)
            n += 1
        return n

    def _quarantine(self, f: Path, data: bytes, keep: int) -> Path:
        """Keep what a recovery cuts, durably, where nothing reads landing files."""
        where = self.root / QUARANTINE / f.parent.name
        where.mkdir(parents=True, exist_ok=True)
        dest = where / f"{f.name}.{keep}"
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)[keep:]
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(where)
        return dest

    def files_newest_first(self) -> list[Path]:
        """This writer's files, open and rolled, the newest first (names sort by time)."""
        files = [
            *self.incoming.glob(f"{self.writer}-*.jsonl"),
            *self.dest_root.glob(f"date=*/{self.writer}-*.jsonl"),
        ]
        return sorted(files, key=lambda f: f.name, reverse=True)

    def receive_records(self) -> Iterator[dict[str, object]]:
        """The receive records in this writer's files that verify, the newest first (in a
        sealed file, only those whose seal matches; the seal itself is left out).

        The caller stops when it has enough; a file is read only when reached."""
        for f in self.files_newest_first():
            try:
                data = f.read_bytes()
            except FileNotFoundError:  # rolled between the listing and the read
                data = b""
            sealed = _CRC in data
            end = len(data)
            while (mark := data.rfind(_MARK, 0, end)) >= 0:
                start = data.rfind(b"\n", 0, mark) + 1
                stop = data.find(b"\n", mark)
                end = start
                if sealed and (stop < 0 or not (_seal_at(data, start, stop) or (0, False))[1]):
                    continue  # unverified: never used to recognise a resend
                try:
                    rec = json.loads(data[start : stop if stop >= 0 else len(data)])[RECEIVE_KEY]
                except (ValueError, KeyError, TypeError):
                    continue
                if isinstance(rec, dict):
                    rec.pop("length", None)
                    rec.pop("crc32", None)
                    yield rec
