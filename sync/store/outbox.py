"""The outbox: readings in (each given its seq and id), the quota kept, the seq floor
kept, rows read for messages and split for a small broker.

A message's readings are the outbox rows whose ``seq`` lies in its ``[first_seq,
last_seq]`` (sender.py): rows are taken whole and oldest first, so a message is a
contiguous range and moving readings into flight writes no reading row. The ranges
tile the outbox up to ``taken_seq()``; every reading above it waits. The seqs' names
are in the package's docstring.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import StoreFull
from ..ledger import LEDGER_SENSOR
from ..wire import GAUGE, encode_readings, wire_time
from .base import StoreBase, bump
from .ledger import RECORD_SRC, add_event, drop_rows_in, has_record
from .legacy import autoincrement_seq
from .packing import (
    ROW_READINGS,
    decode_body,
    marks_of,
    pack_body,
    packed_rows,
    unpack_body,
)
from .schema import INSERT_OUTBOX

log = logging.getLogger(__name__)

POLICIES = ("drop_oldest", "refuse_new")
# The floor (meta.last_seq) is raised this far ahead of the seqs given, so a light load
# that drains the outbox at every delivery writes it once per block, not every time.
SEQ_BLOCK = 10_000

DELETE_ROWS = "DELETE FROM outbox WHERE seq BETWEEN ? AND ? RETURNING n"
# The first outbox row that no awaiting_landing range covers (the ranges do not overlap,
# so the one that could cover a seq is the one with the greatest first_seq below it).
NOT_AWAITING = (
    "NOT EXISTS (SELECT 1 FROM awaiting_landing a WHERE a.first_seq = "
    "(SELECT MAX(first_seq) FROM awaiting_landing WHERE first_seq <= o.seq) "
    "AND a.last_seq >= o.seq)"
)
OLDEST_UNDELIVERED = f"SELECT MIN(o.seq) FROM outbox o WHERE {NOT_AWAITING}"


@dataclass(slots=True)
class Reading:
    sensor: str
    value: float | None
    ts: str | None = None
    unit: str | None = None
    origin: str | None = None  # default: the gateway id
    flags: Sequence[str] = ()
    id: str | None = None  # default: origin/epoch/seq
    kind: str = GAUGE  # gauge, counter or total (sync.wire.Kind)
    record: dict[str, Any] | None = None  # a gateway's record ($ledger): not a reading


class Outbox(StoreBase):
    """Readings waiting to be sent, and the seqs that name them (module docstring)."""

    # ------------------------------------------------------------ readings in

    def append_in(self, db: sqlite3.Connection, readings: Iterable[Reading]) -> tuple[int, int]:
        """Readings into the outbox, inside the caller's transaction; returns their
        (first, last) seq, or (0, -1) if there were none. If ``readings`` raises part
        way, the op is undone (``Store.commit`` raises it) and nothing is stored. A long
        import honours the quota as it goes. (``pubcomp store import``: a one-shot
        iterator is committed with ``retry=False``, since a full disk cannot run it twice.)"""
        before = self._given
        self._make_room(db, 1)
        self._insert_readings(db, readings, time.time())
        if self._given <= before:
            return 0, -1
        return before + 1, self._given

    def _insert_readings(
        self,
        db: sqlite3.Connection,
        readings: Iterable[Reading],
        now: float,
        src: str | None = None,
        src_seq: int | None = None,
    ) -> None:
        """The one place readings enter the outbox: each gets its seq and id here, and
        its row the node message it came from (``src``: ``node/boot``, ``src_seq``)."""
        before = self._given
        db.executemany(INSERT_OUTBOX, self._rows(readings, db, now, src, src_seq))
        if self._given > before and len(self._skips) > self._skips_told:
            # Seqs no reading will have (the floor's block at an open; those of an op or
            # a transaction undone): told with the next seqs given, in their
            # transaction (sync/store/ledger.py).
            stream = f"{self.gateway_id}/{self.epoch}"
            for lo, hi in self._skips[self._skips_told :]:
                add_event(db, stream, "skipped", lo, hi, at=now)
            self._skips_told = len(self._skips)

    def _append_record_in(self, db: sqlite3.Connection, record: dict[str, Any], now: float) -> int:
        """A ``$ledger`` record into the outbox as a reading (its row ``src = '$ledger'``,
        which the quota never evicts); returns its seq."""
        rec = Reading(LEDGER_SENSOR, None, wire_time(now), None, record=record)
        self._insert_readings(db, [rec], now, RECORD_SRC)
        return self._given

    def _rows(
        self,
        readings: Iterable[Reading],
        db: sqlite3.Connection,
        now: float,
        src: str | None = None,
        src_seq: int | None = None,
    ) -> Iterator[tuple[Any, ...]]:
        """Readings as outbox rows (up to ``ROW_READINGS`` readings and ``ROW_BYTES`` of
        encoded readings each), every reading given its seq and, from the gateway, its
        id ``origin/epoch/seq``."""
        chunk: list[dict[str, Any]] = []
        first = 0
        for k, r in enumerate(readings, 1):
            if r.value is not None and not math.isfinite(r.value):
                raise ValueError(f"reading {r.sensor!r}: value {r.value} is not finite")
            if k % 1000 == 0:
                self._make_room(db, 1000)  # long imports honour the quota as they go
            self._given += 1  # a transaction undone leaves a gap, never a seq given twice
            if not chunk:
                first = self._given
            origin = r.origin or self.gateway_id
            reading: dict[str, Any] = {
                "id": r.id or f"{origin}/{self.epoch}/{self._given}",
                "origin": origin,
                "sensor": r.sensor,
                "ts": r.ts,
                "value": None if r.value is None else float(r.value),
                "unit": r.unit,
                "flags": list(r.flags),
            }
            if r.kind != GAUGE:  # absent means gauge: most readings, and old bodies, say nothing
                reading["kind"] = r.kind
            if r.record is not None:
                reading["record"] = r.record
            chunk.append(reading)
            if len(chunk) == ROW_READINGS:
                for row in packed_rows(first, chunk, now):
                    yield (*row, src, src_seq)
                chunk = []
        if chunk:
            for row in packed_rows(first, chunk, now):
                yield (*row, src, src_seq)

    # ------------------------------------------------------------ the seqs

    def given_seq(self) -> int:
        """The highest seq ever given to a reading in this store (ids never repeat)."""
        return self._given

    def taken_seq(self) -> int:
        """Readings above this seq wait in the outbox; those at or below belong to messages
        (in flight, queued for a new id, or delivered and awaiting landing)."""
        with self._rlock:
            return taken_seq_in(self._rdb)

    def sent_seq(self) -> int:
        """Every seq at or below this has been in a message (or was dropped by the
        quota): the highest seq an end-to-end acknowledgement may name."""
        with self._rlock:
            db = self._rdb
            high = taken_seq_in(db)
            row = db.execute("SELECT MIN(seq) FROM outbox WHERE seq > ?", (high,)).fetchone()
        if row[0] is not None:
            return max(high, int(row[0]) - 1)
        return max(high, self._given)

    def oldest_undelivered_seq(self) -> float:
        """The seq of the oldest reading not yet delivered (waiting, queued or in flight;
        not awaiting landing); infinity if there is none."""
        with self._rlock:
            row = self._rdb.execute(OLDEST_UNDELIVERED).fetchone()
        return float("inf") if row[0] is None else row[0]

    def _untouchable_seq(self, db: sqlite3.Connection) -> int:
        """No op may drop or rewrite a reading at or below this seq: it is in a message,
        or being taken into one whose op is still on its way (``commit_ops``'s
        ``claimed``): a message's payload stays byte-identical for its resends."""
        return max(taken_seq_in(db), self._claimed() if self._claimed is not None else 0)

    def _keep_seq_floor(self, db: sqlite3.Connection) -> None:
        """After deleting readings: if none above them remain, the floor must cover the
        highest seq given (otherwise the next reading could be given a seq again). It
        is raised a block ahead, so a light load that drains the outbox after every
        delivery writes it once per ``SEQ_BLOCK`` readings, not at every delivery
        (seqs skipped after a restart are gaps, never repeats)."""
        if self._given < self._floor:
            return
        if newest_row_end(db) < self._given:
            self._floor_pending = self._given + SEQ_BLOCK  # in force once committed
            db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('last_seq', ?)", (str(self._floor_pending),)
            )

    # ------------------------------------------------------------ the quota

    def _make_room(self, db: sqlite3.Connection, incoming: int) -> None:
        if self.quota_bytes is None:
            return
        used = used_bytes(db)
        if used < self.quota_bytes:
            return
        if self.policy == "refuse_new":
            raise StoreFull(
                f"store {self.path} holds {used} bytes, quota {self.quota_bytes}: "
                "refusing new readings (policy refuse_new)"
            )
        # drop_oldest: drop readings the cloud does not have, oldest first, enough for
        # the incoming ones plus a margin so we do not drop on every append. Messages
        # awaiting landing are the oldest of those (the broker completed them, but it is
        # not the only copy we count on); in-flight ones are never dropped (their packet
        # ids are live at the broker).
        # Each eviction is told to the ledger in this transaction (store seqs, and the node
        # messages the rows held); a $ledger record is never evicted: what it tells is
        # told nowhere else (a message holding one stays awaiting its landing).
        victims, dropped = max(incoming * 2, 64), 0
        awaiting = db.execute(
            "SELECT first_seq, last_seq, readings FROM awaiting_landing ORDER BY first_seq"
        ).fetchall()
        evict: list[tuple[int, int]] = []
        for first, last, n in awaiting:
            if dropped >= victims:
                break
            if has_record(db, first, last):
                continue
            evict.append((first, last))
            dropped += n
        stream, now = f"{self.gateway_id}/{self.epoch}", time.time()
        for first, last in evict:
            db.execute("DELETE FROM awaiting_landing WHERE first_seq = ?", (first,))
            drop_rows_in(db, stream, first, last, "evicted", at=now)
        if evict:
            bump(db, "dropped_awaiting", dropped)
        low = self._untouchable_seq(db)
        rows = db.execute(
            "SELECT seq, n FROM outbox WHERE seq > ? AND src IS NOT ? ORDER BY seq",
            (low, RECORD_SRC),
        )
        last = None
        for seq, n in rows:
            if dropped >= victims:
                break
            last, dropped = seq, dropped + n
        if last is not None:
            drop_rows_in(db, stream, low + 1, last, "evicted", keep_records=True, at=now)
        bump(db, "dropped_quota", dropped)
        self._keep_seq_floor(db)
        log.warning("store quota reached: dropped %d oldest waiting readings", dropped)

    # ------------------------------------------------------------ rows out

    def waiting_rows(
        self, after_seq: int, readings: int, upto: int | None = None
    ) -> list[tuple[int, int, bytes]]:
        """The oldest rows above ``after_seq`` (and beginning at or below ``upto``, when
        given) holding at least ``readings`` readings (or all there are), as (seq, n,
        encoded readings): what the uplink makes messages of."""
        with self._rlock:
            db = self._rdb
            heads = db.execute(
                "SELECT seq, n FROM outbox WHERE seq > ? AND seq <= ? ORDER BY seq LIMIT ?",
                (after_seq, (1 << 62) if upto is None else upto, readings),
            ).fetchall()
            total, last = 0, after_seq
            for seq, n in heads:
                if total >= readings:
                    break
                total, last = total + n, seq
            rows = db.execute(
                "SELECT seq, n, body FROM outbox WHERE seq > ? AND seq <= ? ORDER BY seq",
                (after_seq, last),
            ).fetchall()
        return [(seq, n, unpack_body(body)) for seq, n, body in rows]

    def newest_seq(self) -> int:
        """The last seq of the newest outbox row, through the read connection."""
        with self._rlock:
            return newest_row_end(self._rdb)

    def count_between(self, first_seq: int, last_seq: int) -> int:
        """The readings in the rows that begin between the two seqs (a message's)."""
        with self._rlock:
            return count_readings(self._rdb, [(first_seq, last_seq)])

    def bodies_between(self, first_seq: int, last_seq: int) -> list[bytes]:
        """The encoded readings of a message's rows, in order (its PUBLISH payload's inside)."""
        with self._rlock:
            rows = self._rdb.execute(
                "SELECT body FROM outbox WHERE seq BETWEEN ? AND ? ORDER BY seq",
                (first_seq, last_seq),
            ).fetchall()
        return [unpack_body(r[0]) for r in rows]

    def rows_between(self, first_seq: int, last_seq: int) -> list[tuple[int, int, str | None]]:
        """(seq, n, marks) of the rows that begin between the two seqs: how their readings
        are packed (tools, tests)."""
        with self._rlock:
            rows = self._rdb.execute(
                "SELECT seq, n, marks FROM outbox WHERE seq BETWEEN ? AND ? ORDER BY seq",
                (first_seq, last_seq),
            ).fetchall()
        return [(int(seq), int(n), marks) for seq, n, marks in rows]

    def waiting(self, after_seq: int, limit: int) -> list[tuple[int, dict[str, Any]]]:
        """Up to ``limit`` waiting readings above ``after_seq``, oldest first, as (seq, reading)."""
        out = [
            (seq + i, r)
            for seq, _, body in self.waiting_rows(after_seq, limit)
            for i, r in enumerate(decode_body(body))
        ]
        return out[:limit]

    def readings_between(self, first_seq: int, last_seq: int) -> list[dict[str, Any]]:
        """The readings of the rows that begin between the two seqs, decoded (tools, tests)."""
        return [r for body in self.bodies_between(first_seq, last_seq) for r in decode_body(body)]

    def split_row_in(
        self, db: sqlite3.Connection, seq: int, max_bytes: int, max_readings: int = ROW_READINGS
    ) -> int:
        """Split a waiting row into rows of at most ``max_bytes`` of encoded readings and
        ``max_readings`` readings (a broker whose Maximum Packet Size is smaller than a
        row, an ``uplink.batch`` below a row's readings). Returns the rows made."""
        row = db.execute("SELECT body, queued, src, src_seq FROM outbox WHERE seq = ?", (seq,))
        body, queued, src, src_seq = row.fetchone()
        readings = decode_body(body)
        pieces: list[tuple[int, list[dict[str, Any]]]] = []
        size = 0
        for i, r in enumerate(readings):
            size_r = len(encode_readings([r])) + 1
            if not pieces or size + size_r > max_bytes or len(pieces[-1][1]) >= max_readings:
                pieces.append((seq + i, []))
                size = 0
            pieces[-1][1].append(r)
            size += size_r
        db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))
        db.executemany(
            INSERT_OUTBOX,
            [
                (first, len(rs), marks_of(rs), pack_body(encode_readings(rs)), queued, src, src_seq)
                for first, rs in pieces
            ],
        )
        return len(pieces)


def seq_given_on_disk(db: sqlite3.Connection) -> int:
    """At an open: the highest seq any trace on disk says was given (the floor in
    ``meta.last_seq``, an old file's ``AUTOINCREMENT`` counter, the dead letters, the
    newest row), so ids ``origin/epoch/seq`` are never given twice."""
    floor = db.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
    dead = db.execute("SELECT MAX(seq) FROM dead_letter").fetchone()
    return max(
        int(floor[0]) if floor else 0, autoincrement_seq(db), dead[0] or 0, newest_row_end(db)
    )


def skipped_block(db: sqlite3.Connection, floor: int) -> list[tuple[int, int]]:
    """At an open: the seqs the next reading's seq jumps over (the floor's block), as a
    list of one range (or none). Below it: the newest seq any trace on disk says was
    given (the newest row, a dead letter, the last $ledger record: a clean stop builds
    one, so after one the block is exact; after a power cut it may cover seqs given and
    already gone from the store, landed)."""
    dead = db.execute("SELECT MAX(seq) FROM dead_letter").fetchone()[0] or 0
    told = db.execute("SELECT value FROM meta WHERE key = 'ledger_seq'").fetchone()
    seen = max(newest_row_end(db), dead, int(told[0]) if told else 0)
    return [(seen + 1, floor)] if floor > seen else []


def newest_row_end(db: sqlite3.Connection) -> int:
    """The last seq of the newest outbox row (0 if empty): a rowid look-up."""
    row = db.execute("SELECT seq + n - 1 FROM outbox ORDER BY seq DESC LIMIT 1").fetchone()
    return int(row[0]) if row else 0


def taken_seq_in(db: sqlite3.Connection) -> int:
    """The highest seq any message holds: in flight, queued, or awaiting landing."""
    row = db.execute(
        "SELECT MAX((SELECT COALESCE(MAX(last_seq), 0) FROM out_inflight), "
        "(SELECT COALESCE(MAX(last_seq), 0) FROM awaiting_landing))"
    ).fetchone()
    return int(row[0])


def count_readings(db: sqlite3.Connection, ranges: Iterable[tuple[int, int]]) -> int:
    """The readings in the rows that begin within each (first, last) seq range."""
    return sum(
        int(
            db.execute(
                "SELECT COALESCE(SUM(n), 0) FROM outbox WHERE seq BETWEEN ? AND ?", r
            ).fetchone()[0]
        )
        for r in ranges
    )


def used_bytes(db: sqlite3.Connection) -> int:
    """Bytes in pages that hold data (the quota's measure; free pages do not count)."""
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    free = db.execute("PRAGMA freelist_count").fetchone()[0]
    size = db.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)
