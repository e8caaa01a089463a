"""What producers hand in beside their readings: node message keys, stored once each
(a node retrying a message it never saw acknowledged is acknowledged, not stored
again), and a driver's saved state, committed with the readings it counted.

A node's keys are ``node/boot/seq``: one row per node and boot holds the seqs stored
as ranges (one range for a node that sends in order), so a commit of several nodes'
messages rewrites one small page, not a B-tree leaf per node. Other keys keep one row
each in ``seen`` (as schema 1 kept node keys too: legacy.py).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence

from .outbox import Outbox, Reading

# A node's seen seqs are kept as ranges; past this many gaps the oldest two ranges
# merge (a message that old, missing all along, is taken as seen).
MAX_SEEN_RANGES = 64


class Producers(Outbox):
    """Batches of readings with their message keys and driver state (module docstring)."""

    def append_batches_in(
        self,
        db: sqlite3.Connection,
        batches: Sequence[tuple[str | None, Sequence[Reading]]],
        state: dict[str, str] | None = None,
    ) -> list[bool]:
        """Several producers' batches inside the caller's transaction (a group commit's op).

        Each batch has an optional message key (``node/boot/seq``): a batch whose key
        was seen before is not stored again and reports False (acknowledge it all the
        same). ``state`` is saved in the same transaction (e.g. a pulse counter's
        total, so it never runs ahead of or behind its committed readings). Raises
        StoreFull (nothing stored) when the quota refuses.
        """
        now = time.time()
        results: list[bool] = []
        self._make_room(db, sum(len(b) for _, b in batches))
        for key, readings in batches:
            if key is not None and self._seen_before(db, key, now):
                results.append(False)
                continue
            self._insert_readings(db, readings, now)
            results.append(True)
        if state:
            db.executemany("INSERT OR REPLACE INTO state VALUES (?, ?)", list(state.items()))
        return results

    def _seen_before(self, db: sqlite3.Connection, key: str, now: float) -> bool:
        """Was this message key stored before? If not, remember it (in this transaction)."""
        producer, _, tail = key.rpartition("/")
        node, _, boot = producer.rpartition("/")
        if not (node and boot.isdigit() and tail.isdigit()):
            return db.execute("INSERT OR IGNORE INTO seen VALUES (?, ?)", (key, now)).rowcount == 0
        if self._legacy_seen and db.execute("SELECT 1 FROM seen WHERE key = ?", (key,)).fetchone():
            return True
        row = db.execute(
            "SELECT seqs FROM node_seen WHERE producer = ? AND boot = ?", (node, int(boot))
        ).fetchone()
        ranges: list[list[int]] = json.loads(row[0]) if row else []
        seq = int(tail)
        if any(lo <= seq <= hi for lo, hi in ranges):
            return True
        db.execute(
            "INSERT OR REPLACE INTO node_seen VALUES (?, ?, ?, ?)",
            (node, int(boot), json.dumps(add_to_ranges(ranges, seq), separators=(",", ":")), now),
        )
        return False

    def prune_seen_in(self, db: sqlite3.Connection, older_than_s: float) -> int:
        """Forget message keys older than this (a retry never comes that late): a node's
        boots not written to since, and single keys. Returns the rows forgotten."""
        cutoff = time.time() - older_than_s
        n: int = db.execute("DELETE FROM node_seen WHERE at < ?", (cutoff,)).rowcount
        n += db.execute("DELETE FROM seen WHERE at < ?", (cutoff,)).rowcount
        self._legacy_seen = has_seen_keys(db)
        return n

    def get_state(self, key: str) -> str | None:
        """A driver's saved state (``append_batches_in``'s ``state``), as last committed."""
        with self._rlock:
            row = self._rdb.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None


def has_seen_keys(db: sqlite3.Connection) -> bool:
    """Does ``seen`` hold any key (a store made before schema 2 kept node keys there)?"""
    return db.execute("SELECT 1 FROM seen LIMIT 1").fetchone() is not None


def add_to_ranges(ranges: list[list[int]], seq: int) -> list[list[int]]:
    """``ranges`` (sorted, disjoint, inclusive) with ``seq`` added, neighbours merged."""
    out = sorted([*ranges, [seq, seq]])
    merged: list[list[int]] = [out[0]]
    for lo, hi in out[1:]:
        if lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    while len(merged) > MAX_SEEN_RANGES:
        merged[0:2] = [[merged[0][0], merged[1][1]]]
    return merged
