"""The store's ledger (issue 27): events appended in the transaction of what they
describe, and the op that turns them into one ``$ledger`` record (sync/ledger.py).

- ``ledger_events`` rows are written by the ops that make them happen: the first seq
  given after an open (``skipped``), the quota's ``drop_oldest`` and the broker's
  permanent refusals (``drop_rows_in``: ``evicted``, ``dead_letter``), a node message
  that reports its own drops (``node_dropped``), the ingress's refusals (``refused``).
  A power cut undoes an event with what it describes, never one without the other.
- An event that extends the newest one of its stream, kind and reason (the next seq
  refused, the next row evicted in the same transaction) widens that row instead of
  adding one.
- ``ledger_record_in``: ONE op reads the events, the positions held and the node
  streams stored into since the last record, appends the record to the outbox (it
  travels like any reading: exactly once, end to end) and deletes the events it took.
  The record's row is marked ``src = '$ledger'``: the quota never evicts it, since
  what it tells is told nowhere else.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from typing import Any

from .. import faults
from ..ledger import LEDGER_SENSOR, Event, build_record, merged
from .base import StoreBase
from .packing import decode_body

RECORD_SRC = LEDGER_SENSOR  # outbox.src of a record's row (NULL: the gateway's readings)

# The record's two sides for the crash tests (sync/faults.py): built and appended, its
# transaction not yet committed; committed (passed by the gateway once its op returned).
faults.register("ledger_built", "ledger_committed")


def add_event(
    db: sqlite3.Connection,
    stream: str,
    kind: str,
    lo: int,
    hi: int,
    reason: str | None = None,
    at: float | None = None,
) -> None:
    """Inside the caller's transaction: one ledger event (module docstring)."""
    at = time.time() if at is None else at
    row = db.execute(
        "SELECT rowid, lo, hi, at FROM ledger_events WHERE stream = ? AND kind = ? "
        "AND reason IS ? ORDER BY rowid DESC LIMIT 1",
        (stream, kind, reason),
    ).fetchone()
    # Timed kinds (evicted, dead_letter) merge only within one transaction's instant.
    if (
        row is not None
        and row[1] <= hi + 1
        and lo <= row[2] + 1
        and (kind not in ("evicted", "dead_letter") or row[3] == at)
    ):
        db.execute(
            "UPDATE ledger_events SET lo = ?, hi = ? WHERE rowid = ?",
            (min(lo, row[1]), max(hi, row[2]), row[0]),
        )
        return
    db.execute(
        "INSERT INTO ledger_events (at, stream, kind, lo, hi, reason) VALUES (?, ?, ?, ?, ?, ?)",
        (at, stream, kind, lo, hi, reason),
    )


def node_source(reading_id: str) -> tuple[str, int] | None:
    """(``node/boot``, message seq) of a node reading's id ``node/boot/seq.i``; None for
    the gateway's own ``gateway/epoch/seq``."""
    parts = reading_id.split("/")
    if len(parts) != 3 or "." not in parts[2] or not parts[1].isdigit():
        return None
    seq = parts[2].partition(".")[0]
    return (f"{parts[0]}/{parts[1]}", int(seq)) if seq.isdigit() else None


def row_source(body: bytes) -> tuple[str | None, int | None]:
    """(src, src_seq) of an outbox row written before schema 5, from its first reading."""
    first = decode_body(body)[0]
    if first.get("sensor") == LEDGER_SENSOR:
        return RECORD_SRC, None
    src = node_source(str(first.get("id", "")))
    return (None, None) if src is None else src


def drop_rows_in(
    db: sqlite3.Connection,
    store_stream: str,
    lo: int,
    hi: int,
    kind: str,
    *,
    keep_records: bool = False,
    at: float | None = None,
) -> list[tuple[int, int, bytes]]:
    """Inside the caller's transaction: delete the outbox rows that begin between ``lo``
    and ``hi`` and tell the ledger (``kind``: evicted or dead_letter) which store seqs
    and which node messages went. ``keep_records``: a ``$ledger`` record's row stays.
    Returns the rows deleted, (seq, n, body)."""
    at = time.time() if at is None else at
    skip = "AND src IS NOT ?" if keep_records else "AND ? IS NULL"
    rows = db.execute(
        f"DELETE FROM outbox WHERE seq BETWEEN ? AND ? {skip} RETURNING seq, n, src, src_seq, body",
        (lo, hi, RECORD_SRC if keep_records else None),
    ).fetchall()
    rows.sort()
    for a, b in merged((seq, seq + n - 1) for seq, n, *_ in rows):
        add_event(db, store_stream, kind, a, b, at=at)
    nodes = sorted((src, s) for _, _, src, s, _ in rows if src not in (None, RECORD_SRC))
    for src, s in nodes:
        add_event(db, src, kind, s, s, at=at)
    return [(seq, n, body) for seq, n, _, _, body in rows]


def has_record(db: sqlite3.Connection, lo: int, hi: int) -> bool:
    """Does a row beginning between ``lo`` and ``hi`` hold a ``$ledger`` record?"""
    return (
        db.execute(
            "SELECT 1 FROM outbox WHERE seq BETWEEN ? AND ? AND src = ? LIMIT 1",
            (lo, hi, RECORD_SRC),
        ).fetchone()
        is not None
    )


def held_ranges(db: sqlite3.Connection, store_stream: str) -> dict[str, list[list[int]]]:
    """Every position the outbox holds: the store's seqs, and each node stream's message
    seqs (one scan each; no index, so that no reading's write pays for one)."""
    held = {
        store_stream: merged(
            (seq, seq + n - 1) for seq, n in db.execute("SELECT seq, n FROM outbox ORDER BY seq")
        )
    }
    spans: dict[str, list[tuple[int, int]]] = {}
    for src, s in db.execute(
        "SELECT src, src_seq FROM outbox WHERE src IS NOT NULL AND src != ? AND "
        "src_seq IS NOT NULL ORDER BY src, src_seq",
        (RECORD_SRC,),
    ):
        spans.setdefault(src, []).append((s, s))
    for src, ss in spans.items():
        held[src] = merged(ss)
    return held


def stored_since(db: sqlite3.Connection, since: float) -> dict[str, list[list[int]]]:
    """The node streams stored into since ``since``: every message seq stored so far."""
    out: dict[str, list[list[int]]] = {}
    for node, boot, seqs in db.execute(
        "SELECT producer, boot, seqs FROM node_seen WHERE at >= ?", (since,)
    ):
        out[f"{node}/{boot}"] = json.loads(seqs)
    return out


def events_in(db: sqlite3.Connection) -> list[Event]:
    return [
        Event(at, stream, kind, lo, hi, reason)
        for at, stream, kind, lo, hi, reason in db.execute(
            "SELECT at, stream, kind, lo, hi, reason FROM ledger_events ORDER BY rowid"
        )
    ]


def meta_float(db: sqlite3.Connection, key: str) -> float | None:
    row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else float(row[0])


class Ledger(StoreBase):
    """The record's op, and the ledger's reads for tools and tests (module docstring)."""

    @property
    def store_stream(self) -> str:
        return f"{self.gateway_id}/{self.epoch}"

    def ledger_event_in(
        self,
        db: sqlite3.Connection,
        events: Iterable[tuple[str, str, int, int, str | None]],
    ) -> None:
        """Events (stream, kind, lo, hi, reason) in the caller's transaction: e.g. the
        ingress's refusals, which ride the group commit like a message."""
        now = time.time()
        for stream, kind, lo, hi, reason in events:
            add_event(db, stream, kind, lo, hi, reason, at=now)

    def ledger_record_in(self, db: sqlite3.Connection, now: float | None = None) -> int:
        """The group commit's op: build the ``$ledger`` record, append it to the outbox
        and delete the events it took, in the caller's transaction. Returns its seq."""
        now = time.time() if now is None else now
        since = meta_float(db, "ledger_at")
        if since is None:
            created = db.execute("SELECT value FROM meta WHERE key = 'created'").fetchone()
            since = _parse_time(created[0]) if created else now
        record = build_record(
            window=(since, now),
            top=self._given,
            store_stream=self.store_stream,
            events=events_in(db),
            held=held_ranges(db, self.store_stream),
            stored=stored_since(db, since),
        )
        # The events taken go first: appending the record may add one (the first seq
        # given since an open: ``skipped``), which the next record tells.
        db.execute("DELETE FROM ledger_events")
        seq = self._append_record_in(db, record, now)
        db.executemany(
            "INSERT OR REPLACE INTO meta VALUES (?, ?)",
            [("ledger_at", repr(now)), ("ledger_seq", str(seq))],
        )
        faults.crash_point("ledger_built", str(seq))
        return seq

    def ledger_events(self) -> list[Event]:
        """The events not yet told (tools, tests)."""
        with self._rlock:
            return events_in(self._rdb)

    def _append_record_in(self, db: sqlite3.Connection, record: dict[str, Any], now: float) -> int:
        raise NotImplementedError  # the outbox's (outbox.py)


def _parse_time(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
