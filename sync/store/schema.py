"""The store's file format: its tables, and the version this pubcomp writes.

What each table holds, and the rules that keep them, are in the package's docstring
and docs/architecture.md ("The store's rules"); how files of older versions are
brought up to this one is in ``legacy.py``.
"""

from __future__ import annotations

# 2: node_seen; outbox.seq without AUTOINCREMENT in new files. 3: packed outbox rows.
# 4: awaiting_landing (end to end: delivered messages kept until the cloud has them).
SCHEMA_VERSION = 4

OUTBOX = """
CREATE TABLE IF NOT EXISTS outbox (
    seq     INTEGER PRIMARY KEY,  -- the row's first seq; seqs are never reused (meta.last_seq)
    n       INTEGER NOT NULL,     -- readings in the row: seqs seq .. seq + n - 1
    marks   TEXT,                 -- every flag its readings carry, comma separated
    body    BLOB NOT NULL,        -- the readings, encoded (sync.wire.encode_readings)
    queued  REAL NOT NULL         -- wall-clock seconds when stored
);
"""

OUT_INFLIGHT = """
CREATE TABLE IF NOT EXISTS out_inflight (
    -- Original send order: a new row gets the highest ord + 1, after every message still
    -- here (no sqlite_sequence row to rewrite: one page less per commit).
    ord        INTEGER PRIMARY KEY,
    session    TEXT NOT NULL,
    packet_id  INTEGER,           -- NULL while QUEUED (its old id died with a session)
    state      TEXT NOT NULL CHECK (state IN ('QUEUED', 'PUBLISH_SENT', 'PUBREL_SENT')),
    qos        INTEGER NOT NULL,
    topic      TEXT NOT NULL,
    first_seq  INTEGER NOT NULL,
    last_seq   INTEGER NOT NULL,
    UNIQUE (session, packet_id)
);
"""

INSERT_OUTBOX = "INSERT INTO outbox (seq, n, marks, body, queued) VALUES (?, ?, ?, ?, ?)"

SCHEMA = (
    OUTBOX
    + """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"""
    + OUT_INFLIGHT
    + """-- Messages the broker completed (PUBCOMP / PUBACK) that the cloud ingest has not yet
-- said are landed (rule 9): their readings stay in the outbox until it does.
CREATE TABLE IF NOT EXISTS awaiting_landing (
    first_seq  INTEGER PRIMARY KEY,
    last_seq   INTEGER NOT NULL,
    readings   INTEGER NOT NULL,  -- how many (the outbox rows' n, summed)
    delivered  REAL NOT NULL      -- wall-clock seconds of the broker's completion
);
-- A QoS 2 receiver's packet ids, committed with what they carried. No pubcomp writes it
-- any more; the ingest reads it once from a landing zone's old state file
-- (receiver.py ``held_receive_ids``).
CREATE TABLE IF NOT EXISTS in_qos2 (
    session   TEXT NOT NULL,
    packet_id INTEGER NOT NULL,
    received  REAL NOT NULL,
    PRIMARY KEY (session, packet_id)
);
CREATE TABLE IF NOT EXISTS sessions (
    session        TEXT PRIMARY KEY,
    last_packet_id INTEGER NOT NULL DEFAULT 0,
    established    INTEGER NOT NULL DEFAULT 0,
    updated        REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS seen (
    key  TEXT PRIMARY KEY,     -- a producer's message key, e.g. node/boot/seq
    at   REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS node_seen (
    producer TEXT NOT NULL,    -- a node id
    boot     INTEGER NOT NULL, -- its boot counter
    seqs     TEXT NOT NULL,    -- JSON [[lo, hi], ...]: message seqs stored, as ranges
    at       REAL NOT NULL,    -- last change
    PRIMARY KEY (producer, boot)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dead_letter (
    seq     INTEGER PRIMARY KEY,
    id      TEXT NOT NULL,
    origin  TEXT NOT NULL,
    sensor  TEXT NOT NULL,
    ts      TEXT,
    value   REAL,
    unit    TEXT,
    flags   TEXT,
    reason  INTEGER NOT NULL,
    at      REAL NOT NULL
);
"""
)
