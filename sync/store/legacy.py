"""Store files written by older pubcomps, brought up to this one's schema: every
migration is here, and nothing else in the store needs to know an old file's shape.

- schema 1 (one outbox row per reading, ``AUTOINCREMENT`` seqs; message keys one row
  each in ``seen``), 2 (``node_seen`` ranges for node keys; new files without
  ``AUTOINCREMENT``): their outbox is packed once at the open (``pack_outbox``), seqs
  kept, so every in-flight range stays valid; the highest seq ever given, which the
  ``AUTOINCREMENT`` counter remembered, is carried into ``meta.last_seq``
  (``autoincrement_seq``); keys left in ``seen`` are still read (producers.py);
- schema 3 (packed rows): nothing to convert; 4 adds ``awaiting_landing``, which
  ``CREATE TABLE IF NOT EXISTS`` makes (schema.py);
- a file from a NEWER pubcomp is refused (``check_version``), never converted back.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ..errors import StoreError
from ..wire import encode_readings
from .packing import outbox_row
from .schema import INSERT_OUTBOX, OUT_INFLIGHT, OUTBOX, SCHEMA_VERSION


def check_version(db: sqlite3.Connection, found: int, path: Path) -> None:
    """Inside the open's transaction: refuse a newer file, mark an older one as this
    version's (its tables are brought up to date by ``CREATE TABLE IF NOT EXISTS`` and
    ``pack_outbox``)."""
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema {found}, newer than this pubcomp ({SCHEMA_VERSION}); "
            "upgrade pubcomp"
        )
    if found < SCHEMA_VERSION:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))


def has_autoincrement(db: sqlite3.Connection) -> bool:
    """Was this file made with ``AUTOINCREMENT`` tables (schema 1, and 2's old files)?"""
    return (
        db.execute("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'").fetchone()
        is not None
    )


def autoincrement_seq(db: sqlite3.Connection) -> int:
    """The highest seq the outbox's ``AUTOINCREMENT`` counter ever gave (0 if none)."""
    if not has_autoincrement(db):
        return 0
    row = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone()
    return int(row[0]) if row else 0


def outbox_packed(db: sqlite3.Connection) -> bool:
    """Does the outbox hold packed rows (schema 3 on)?"""
    return "body" in {r[1] for r in db.execute("PRAGMA table_info(outbox)")}


def pack_outbox(db: sqlite3.Connection, epoch: str) -> int:
    """Inside a transaction: rewrite a schema 1 or 2 outbox (one row per reading) as rows
    of one reading each, same seqs and ids, with the highest seq given so far kept in
    ``meta.last_seq``; ``out_inflight`` loses its ``AUTOINCREMENT`` (one page less per
    commit). Returns the readings kept."""
    top = db.execute("SELECT COALESCE(MAX(seq), 0) FROM outbox").fetchone()[0]
    top = max(top, autoincrement_seq(db))
    floor = db.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
    top = max(top, int(floor[0]) if floor else 0)
    db.execute("INSERT OR REPLACE INTO meta VALUES ('last_seq', ?)", (str(top),))
    db.execute("ALTER TABLE outbox RENAME TO outbox_v2")
    db.execute(OUTBOX.strip().rstrip(";"))  # (executescript would COMMIT first)
    old = db.execute(
        "SELECT seq, rid, origin, sensor, ts, value, unit, flags, queued "
        "FROM outbox_v2 ORDER BY seq"
    )
    moved = 0
    while rows := old.fetchmany(1000):
        packed = []
        for seq, rid, origin, sensor, ts, value, unit, flags, queued in rows:
            names = flags.split(",") if flags else []
            reading = {
                "id": rid or f"{origin}/{epoch}/{seq}",
                "origin": origin,
                "sensor": sensor,
                "ts": ts,
                "value": value,
                "unit": unit,
                "flags": names,
            }
            encoded = [encode_readings([reading])]
            packed.append(outbox_row(seq, encoded, set(names), queued))
        db.executemany(INSERT_OUTBOX, packed)
        moved += len(packed)
    db.execute("DROP TABLE outbox_v2")
    inflight = db.execute("SELECT sql FROM sqlite_master WHERE name = 'out_inflight'").fetchone()[0]
    if "AUTOINCREMENT" in inflight.upper():  # schema 1 and 2
        db.execute("ALTER TABLE out_inflight RENAME TO out_inflight_v2")
        db.execute(OUT_INFLIGHT.strip().rstrip(";"))
        db.execute("INSERT INTO out_inflight SELECT * FROM out_inflight_v2")
        db.execute("DROP TABLE out_inflight_v2")
    return moved
