"""The landing zone: JSON lines, one reading a line, made visible to Spark only when complete.

Layout under the landing root::

    _incoming/{writer}-{stamp}-{n}.jsonl   being written (hidden: Spark skips "_" paths)
    date=YYYY-MM-DD/{writer}-{stamp}-{n}.jsonl   rolled, complete, never changed again
    _rejected/date=YYYY-MM-DD/{writer}-....jsonl   messages that did not parse, with the reason

The last line of every message the ingest lands carries its receive record,
``"_mqtt": {"session", "packet_id", "qos", "digest"}`` (Spark's explicit
schema ignores the field): the landing file is the only durable record of a
received QoS 2 message, so one fsync covers the message and its receive
state, and a restart rebuilds the state from the files' tails
(``receive_records``).

Every append is fsynced before it returns (the caller acknowledges after it).
Rolling: fsync the file, rename it into its date directory, fsync both
directories, so a rolled file is either fully there or not at all. A file
left in ``_incoming`` by a crash is rolled at the next start, its torn last
line (a power cut mid-write) cut off first, and then any lines after the
last receive record (the first lines of a message whose last line never made
it): none of them was acknowledged, so the broker will deliver the message
again, and it lands once.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import time
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
        """``message_records``: every message's last line carries a receive record, so a
        recovered file is cut back to its last one."""
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
        """Write complete lines (each ending in a newline) and fsync them."""
        if not lines:
            return
        if self._fd is None:
            self._open()
        data = b"".join(lines)
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
        """Roll this writer's files left in ``_incoming`` by a crash; returns how many."""
        n = 0
        for f in sorted(self.incoming.glob(f"{self.writer}-*.jsonl")):
            data = f.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep < len(data):
                log.warning("%s: cutting a torn last line (%d bytes)", f, len(data) - keep)
                with open(f, "r+b") as fh:
                    fh.truncate(keep)
                    fh.flush()
                    os.fsync(fh.fileno())
            if self.message_records:
                mark = data.rfind(_MARK, 0, keep)
                end = data.find(b"\n", mark) + 1 if mark >= 0 else keep
                if end < keep:
                    log.warning("%s: cutting %d bytes of an unfinished message", f, keep - end)
                    with open(f, "r+b") as fh:
                        fh.truncate(end)
                        fh.flush()
                        os.fsync(fh.fileno())
                    keep = end
            if keep == 0:
                f.unlink()
                continue
            self._publish(f)
            n += 1
        return n

    def files_newest_first(self) -> list[Path]:
        """This writer's files, open and rolled, the newest first (names sort by time)."""
        files = [
            *self.incoming.glob(f"{self.writer}-*.jsonl"),
            *self.dest_root.glob(f"date=*/{self.writer}-*.jsonl"),
        ]
        return sorted(files, key=lambda f: f.name, reverse=True)

    def receive_records(self) -> Iterator[dict[str, object]]:
        """The receive records in this writer's files, the newest first.

        The caller stops when it has enough; a file is read only when reached."""
        for f in self.files_newest_first():
            try:
                data = f.read_bytes()
            except FileNotFoundError:  # rolled between the listing and the read
                data = b""
            end = len(data)
            while (mark := data.rfind(_MARK, 0, end)) >= 0:
                start = data.rfind(b"\n", 0, mark) + 1
                stop = data.find(b"\n", mark)
                end = start
                try:
                    rec = json.loads(data[start : stop if stop >= 0 else len(data)])[RECEIVE_KEY]
                except (ValueError, KeyError, TypeError):
                    continue
                if isinstance(rec, dict):
                    yield rec
