"""What the store holds and has done, for status pages, metrics and ``pubcomp store
stats``: one read snapshot for every figure, and the durable counters."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from .base import StoreBase, bump
from .outbox import NOT_AWAITING, OLDEST_UNDELIVERED, used_bytes


class Stats(StoreBase):
    def count_in(self, db: sqlite3.Connection, name: str, n: int) -> None:
        """Add ``n`` to the durable counter ``name`` inside the caller's transaction: a
        layer above counts its own events with the change they describe (the gateway's
        ``clock_corrected``), under names this store does not know."""
        bump(db, name, n)

    def counters(self) -> dict[str, int]:
        with self._rlock:
            return dict(self._rdb.execute("SELECT name, value FROM counters").fetchall())

    def forget_later(self, first_seq: int, last_seq: int) -> None:
        """A message the broker completed: not backlog, though its deletion is not yet
        committed (rule 3 lets it wait). ``stats`` drops the range once its rows are gone."""
        with self._forgetting_lock:
            ranges = self._forgetting
            if ranges and ranges[-1][1] + 1 >= first_seq >= ranges[-1][0]:
                ranges[-1][1] = max(ranges[-1][1], last_seq)
            else:
                ranges.append([first_seq, last_seq])
            if len(ranges) > 100:  # seq gaps kept them apart: a bound for stats' query
                ranges[0:2] = [[ranges[0][0], ranges[1][1]]]

    def stats(self) -> dict[str, Any]:
        with self._rlock:
            db = self._rdb
            db.execute("BEGIN")  # one snapshot for every figure below
            try:
                with self._forgetting_lock:
                    ranges = [list(r) for r in self._forgetting]
                # A completed message is delivered from its PUBCOMP on; once that is
                # committed it is either gone or awaiting landing, counted there.
                pending = [
                    db.execute(
                        "SELECT COALESCE(SUM(n), 0) FROM outbox o "
                        f"WHERE seq BETWEEN ? AND ? AND {NOT_AWAITING}",
                        (lo, hi),
                    ).fetchone()[0]
                    for lo, hi in ranges
                ]
                awaiting, awaiting_msgs, awaiting_since = db.execute(
                    "SELECT COALESCE(SUM(readings), 0), COUNT(*), MIN(delivered) "
                    "FROM awaiting_landing"
                ).fetchone()
                backlog = db.execute("SELECT COALESCE(SUM(n), 0) FROM outbox").fetchone()[0]
                backlog -= awaiting
                oldest_seq = db.execute(
                    OLDEST_UNDELIVERED
                    + "".join(" AND NOT (o.seq BETWEEN ? AND ?)" for _ in ranges),
                    [x for r in ranges for x in r],
                ).fetchone()[0]
                oldest = db.execute(
                    "SELECT queued FROM outbox WHERE seq = ?", (oldest_seq,)
                ).fetchone()
                inflight = db.execute("SELECT COUNT(*) FROM out_inflight").fetchone()[0]
                dead = db.execute("SELECT COUNT(*) FROM dead_letter").fetchone()[0]
                used = used_bytes(db)
            finally:
                db.execute("COMMIT")
            backlog -= sum(pending)
            gone = [r for r, n in zip(ranges, pending, strict=True) if n == 0]
            if gone:
                with self._forgetting_lock:
                    self._forgetting = [r for r in self._forgetting if r not in gone]
        wal = Path(str(self.path) + "-wal")
        return {
            "store": str(self.path),
            "gateway_id": self.gateway_id,
            "epoch": self.epoch,
            "backlog": backlog,
            "oldest_age_s": round(time.time() - oldest[0], 3) if oldest else None,
            "inflight_messages": inflight,
            # Delivered to the broker, not yet landed in the cloud (rule 9).
            "awaiting_landing": awaiting,
            "awaiting_messages": awaiting_msgs,
            "awaiting_age_s": (
                round(max(0.0, time.time() - awaiting_since), 3) if awaiting_since else None
            ),
            "dead_letter": dead,
            "store_bytes": used,
            "file_bytes": self.path.stat().st_size + (wal.stat().st_size if wal.exists() else 0),
            "quota_bytes": self.quota_bytes,
            "policy": self.policy,
            "counters": self.counters(),
            "replaced_corrupt_store": str(self.moved_aside) if self.moved_aside else None,
        }
