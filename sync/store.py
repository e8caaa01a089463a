"""The durable session store: one SQLite file per gateway (design section 3).

Rules this module enforces (numbers as in the design):

1. A packet id is committed with its message before the PUBLISH is written
   (``begin_messages`` commits; the caller sends afterwards).
2. A PUBREC is committed (state PUBREL_SENT) before the PUBREL is sent.
3. PUBCOMP deletes the in-flight row and its readings in one transaction.
4. Resume order is the in-flight table's ``ord``; a lost session re-queues
   every in-flight message under a new id and counts it.
5. Receivers commit what they received together with its packet id
   (``in_qos2``) before acknowledging.
6. Every method takes a list and commits once: many readings and transitions
   per fsync.
7. A disk quota with ``drop_oldest`` or ``refuse_new``.
8. A corrupt file is moved aside with a timestamp, never deleted.

Every reading has a seq, but the outbox keeps readings packed: one row per
batch that was committed together (a node's message, the sensor readings of
one group commit), holding seqs ``seq .. seq + n - 1`` as the cloud wire format
already encoded (zlib-compressed when that is smaller). A commit then writes
a few pages per message instead of a B-tree row per reading, and the uplink
builds a PUBLISH by joining bodies, without decoding them (docs/architecture.md,
"What is written when").

A message's readings are the outbox rows whose ``seq`` lies in the in-flight
row's ``[first_seq, last_seq]``: rows are taken whole and oldest first, so a
message is a contiguous range and moving readings into flight writes no
reading row. The ranges tile the outbox up to the highest ``last_seq``; every
reading above it is waiting. A message whose packet id died (session lost,
refused by the broker) keeps its range and waits as ``QUEUED`` for a new id,
ahead of newer readings.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from .session import OutState
from .wire import GAUGE, encode_readings, wire_time

log = logging.getLogger(__name__)

T = TypeVar("T")
DbOp = Callable[[sqlite3.Connection], Any]  # a change run inside a transaction

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

SCHEMA = (
    OUTBOX
    + """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
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
-- Messages the broker completed (PUBCOMP / PUBACK) that the cloud ingest has not yet
-- said are landed (rule 9): their readings stay in the outbox until it does.
CREATE TABLE IF NOT EXISTS awaiting_landing (
    first_seq  INTEGER PRIMARY KEY,
    last_seq   INTEGER NOT NULL,
    readings   INTEGER NOT NULL,  -- how many (the outbox rows' n, summed)
    delivered  REAL NOT NULL      -- wall-clock seconds of the broker's completion
);
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

POLICIES = ("drop_oldest", "refuse_new")
# A node's seen seqs are kept as ranges; past this many gaps the oldest two ranges
# merge (a message that old, missing all along, is taken as seen: see node_seen).
MAX_SEEN_RANGES = 64
SEQ_BLOCK = 10_000
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
WAL_BYTES = 1 << 20
REOPEN_EVERY_S = 1.0  # a held store tries to open for writing at most this often
HELD_COPY_MAX = 256 << 20  # a held store with a WAL is copied to memory up to this size
# Small pages for new stores: every commit rewrites each page it touches in full
# (a WAL frame per page), and a commit touches a few pages however small the
# change, so on flash the page size is the unit of wear (docs/architecture.md).
PAGE_SIZE = 512


class StoreError(Exception):
    pass


class StoreFull(StoreError):
    """The quota (or the disk) is full and the policy refuses new readings."""


class CorruptStore(StoreError):
    pass


class StoreUnwritable(StoreError):
    """The store's file system refuses writes: a dying SD card (ext4 remounted itself
    read-only, or writes fail with I/O errors). Nothing in the failed commit is durable,
    so nothing in it may be acknowledged; reads still work (docs/failure-model.md)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind  # READ_ONLY or IO_ERRORS


READ_ONLY, IO_ERRORS = "read-only", "io-errors"
UNWRITABLE_TEXT = {
    READ_ONLY: "store file system is read-only",
    IO_ERRORS: "store writes fail with I/O errors",
}
# Primary result codes (the low byte of an extended code) that mean the file system
# will not take our writes: SQLITE_READONLY* (a read-only file or mount),
# SQLITE_IOERR* (EIO, and EROFS on a file already open read-write: SQLite reports a
# failed write() as SQLITE_IOERR_WRITE whatever its errno), SQLITE_CANTOPEN (the WAL or
# journal cannot be created). SQLITE_FULL is the full disk's own path (StoreFull).
_UNWRITABLE_CODES = {sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN}


@dataclass(slots=True)
class WriteState:
    """Can the store commit? Set by a commit that failed with StoreUnwritable, cleared
    by the next that succeeds (``Store.unwritable`` / ``Store.wrote``)."""

    writable: bool = True
    kind: str | None = None  # READ_ONLY or IO_ERRORS while not writable
    since: float | None = None  # wall time of the first failure of this episode
    last_error: str | None = None  # as raised, e.g. "disk I/O error (SQLITE_IOERR_WRITE)"
    last_error_at: float | None = None
    errors: int = 0  # commits that failed so, ever (pubcomp_store_write_errors_total)
    refused_readings: int = 0  # readings refused because of it (not acknowledged)

    @property
    def text(self) -> str | None:
        return None if self.kind is None else UNWRITABLE_TEXT[self.kind]


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


@dataclass(slots=True)
class StoreIO:
    """What durability cost so far: each commit is one fsync of the WAL
    (``synchronous=FULL``); a checkpoint fsyncs the WAL and the database file."""

    commits: int = 0
    checkpoints: int = 0

    @property
    def fsyncs(self) -> int:
        return self.commits + 2 * self.checkpoints


@dataclass(slots=True)
class Message:
    """One in-flight message as the uplink needs it to (re)send."""

    ord: int
    packet_id: int | None  # None while QUEUED
    qos: int
    state: OutState
    topic: str
    first_seq: int
    last_seq: int


class Store:
    """The gateway's durable session store. One instance per process and file.

    Methods are thread-safe (one lock around the one connection) so that the
    uplink's event loop and driver threads can share it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        gateway_id: str | None = None,
        quota_bytes: int | None = None,
        policy: str = "refuse_new",
        reserve_bytes: int = 2 << 20,
        hold_if_unwritable: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"store policy must be one of {POLICIES}, not {policy!r}")
        self.path = Path(path)
        self.quota_bytes = quota_bytes
        self.policy = policy
        self.moved_aside: Path | None = None
        self._lock = threading.RLock()
        self._rlock = threading.RLock()
        self._listeners: list[Any] = []
        self.io = StoreIO()
        self._floor_pending: int | None = None
        # Readings up to here are being taken into messages whose commit is still on
        # its way (a group commit): no quota drop or clock correction may touch them.
        self.claimed_seq = 0
        # Messages the broker has completed whose deletion rides a later commit (rule 3
        # lets it wait): their readings are delivered, and ``stats`` says so at once.
        self._forgetting: list[list[int]] = []
        self._forgetting_lock = threading.Lock()
        # Room kept on the disk for the transactions that free space: when the disk
        # fills, deliveries (which delete readings) must still be able to commit.
        self.reserve_path = Path(f"{self.path}.reserve")
        self.reserve_bytes = reserve_bytes
        self.refused_disk_full = 0
        self.write_state = WriteState()
        self._gateway_id_given = gateway_id
        # Held: opened read-only because the card refused writes at the start (see
        # ``_open_held``); every write first tries to open it for writing again.
        self.held = False
        self._held_error: BaseException | None = None
        self._held_copy: Path | None = None  # where a held store is read, if copied
        self._reopen_at = 0.0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._open_writable()
        except StoreUnwritable as exc:
            if not hold_if_unwritable:
                raise
            self._open_held(exc)

    # ------------------------------------------------------------ opening

    def _open_writable(self) -> None:
        """Open (or create) the store for writing; a corrupt file is moved aside. A card
        that refuses writes raises StoreUnwritable and moves nothing."""
        new: sqlite3.Connection | None = None
        try:
            try:
                new = self._open()
            except (sqlite3.DatabaseError, CorruptStore) as exc:
                if is_unwritable(exc):
                    raise
                self.moved_aside = self._move_aside(exc)
                new = self._open()
            self._db = new
            self.epoch, self.gateway_id = self._init_meta(self._gateway_id_given)
            self._pack_old_outbox()
        except (sqlite3.Error, OSError) as exc:
            # A card that refuses writes (read-only, I/O errors) is not a corrupt store:
            # moving the file aside would strand what it holds under another name.
            if not is_unwritable(exc):
                raise
            if new is not None:
                new.close()
            kind = self._diagnose_unwritable(exc)
            raise StoreUnwritable(
                f"cannot open the store {self.path}: {UNWRITABLE_TEXT[kind]} ({exc}); "
                "nothing was moved or deleted",
                kind,
            ) from exc
        self._seq = self._seq_floor = self._highest_seq()
        with self._lock:
            # Stores made before schema 2 kept message keys one row each in ``seen``.
            self._legacy_seen = (
                self._db.execute("SELECT 1 FROM seen LIMIT 1").fetchone() is not None
            )
        # Reads on their own connection: WAL lets them see every committed
        # transaction without waiting for a commit (and its fsync) in progress.
        self._rdb = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._ensure_reserve()

    def _open_held(self, refused: StoreUnwritable) -> None:
        """The card refused writes at the start: open the file read-only, so what it
        holds can still be delivered (sync/degraded.py) and the status told, while
        nothing new is taken in. Raises ``refused`` if the file cannot even be read."""
        if not self.path.exists():
            raise refused
        try:
            conns, how = self._read_only_connections()
            try:
                meta = dict(conns[0].execute("SELECT key, value FROM meta").fetchall())
                if int(meta.get("schema_version", 0)) != SCHEMA_VERSION or "epoch" not in meta:
                    raise StoreError(
                        f"schema {meta.get('schema_version')} cannot be read without being "
                        f"converted (this pubcomp writes {SCHEMA_VERSION})"
                    )
                self._db, self._rdb = conns
                self.epoch, self.gateway_id = meta["epoch"], meta["gateway_id"]
                self._seq = self._seq_floor = self._highest_seq()
            except BaseException:
                for c in conns:
                    c.close()
                raise
        except (sqlite3.Error, OSError, StoreError) as exc:
            self._drop_held_copy()
            log.error("store %s cannot be read either (%s)", self.path, exc)
            raise refused from exc
        self._legacy_seen = False
        self.held = True
        self._held_error = refused.__cause__ or refused
        ws = self.write_state
        ws.writable, ws.kind = False, refused.kind
        ws.since = ws.last_error_at = time.time()
        ws.last_error = str(self._held_error)
        ws.errors += 1
        log.error(
            "%s: opened the store read-only (%s) to deliver what it holds; "
            "nothing new is taken in until the card takes writes again",
            refused,
            how,
        )

    def _read_only_connections(self) -> tuple[list[sqlite3.Connection], str]:
        """Two connections (writes, reads) that only read the store, and how they read.

        Without a WAL, ``immutable=1`` reads the file as it is (``mode=ro`` would have
        to create the shared-memory file on a disk that refuses it; nothing else writes
        the file, and without a WAL there is nothing immutable misses). With a WAL,
        ``mode=ro`` reads it if its shared-memory index is sound; after a crash the index
        must be rebuilt, which writes, so the file and its WAL are copied to memory and
        read there. Too big to copy: ``immutable=1``, and the WAL's commits wait for
        the card to heal (they are not lost: nothing is ever deleted while held).
        """

        def connect(uri: str) -> sqlite3.Connection:
            return sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)

        def pair(uri: str) -> list[sqlite3.Connection]:
            conns = [connect(uri)]
            try:
                conns[0].execute("SELECT COUNT(*) FROM meta").fetchone()
                conns.append(connect(uri))
            except BaseException:
                conns[0].close()
                raise
            return conns

        wal = Path(f"{self.path}-wal")
        if not (wal.exists() and wal.stat().st_size):
            return pair(f"file:{self.path}?immutable=1"), "immutable=1"
        with contextlib.suppress(sqlite3.Error):
            return pair(f"file:{self.path}?mode=ro"), "mode=ro"
        size = self.path.stat().st_size + wal.stat().st_size
        for where in (os.environ.get("RUNTIME_DIRECTORY"), "/dev/shm", tempfile.gettempdir()):
            if not where or not os.path.isdir(where):
                continue
            with contextlib.suppress(OSError):
                if shutil.disk_usage(where).free < 2 * size or size > HELD_COPY_MAX:
                    continue
                copy = Path(tempfile.mkdtemp(prefix="pubcomp-held-", dir=where))
                self._held_copy = copy
                shutil.copyfile(self.path, copy / self.path.name)
                shutil.copyfile(wal, copy / wal.name)
                return pair(f"file:{copy / self.path.name}"), f"a copy in {copy}, WAL and all"
            self._drop_held_copy()
        log.warning(
            "store %s: its WAL (%d bytes) cannot be read in place nor copied; reading the "
            "file alone: the WAL's readings are delivered once the card takes writes",
            self.path,
            wal.stat().st_size,
        )
        return pair(f"file:{self.path}?immutable=1"), "immutable=1, without its WAL"

    def _drop_held_copy(self) -> None:
        if self._held_copy is not None:
            shutil.rmtree(self._held_copy, ignore_errors=True)
            self._held_copy = None

    def _reopen(self) -> None:
        """Held: try to open the store for writing again (at most every REOPEN_EVERY_S,
        since on a dead card each try costs an open). Raises StoreUnwritable while the
        card still refuses."""
        refused = self._held_error or OSError(errno.EROFS, "opened read-only")
        now = time.monotonic()
        if now < self._reopen_at:
            raise self.unwritable(refused)
        self._reopen_at = now + REOPEN_EVERY_S
        held = (self._db, self._rdb)
        try:
            self._open_writable()
        except StoreUnwritable as exc:
            self._db, self._rdb = held
            self._held_error = exc.__cause__ or exc
            raise self.unwritable(self._held_error) from exc
        except BaseException:
            self._db, self._rdb = held
            raise
        with self._rlock:
            for c in held:
                c.close()
        self._drop_held_copy()
        self.held = False
        log.warning("store %s opened for writing again: the card takes writes", self.path)

    # ------------------------------------------------------------ opening

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute(f"PRAGMA page_size={PAGE_SIZE}")  # a new file only; WAL fixes it
            db.execute("PRAGMA journal_mode=WAL")
            # FULL: the WAL is fsynced at every commit, so a commit survives a power cut.
            db.execute("PRAGMA synchronous=FULL")
            # A bounded WAL: checkpoint every 1 MiB and truncate it back to 1 MiB, so
            # the reserve below always covers one checkpoint on a full disk.
            page = db.execute("PRAGMA page_size").fetchone()[0]
            db.execute(f"PRAGMA wal_autocheckpoint={WAL_BYTES // page}")
            db.execute(f"PRAGMA journal_size_limit={WAL_BYTES}")
            db.execute("PRAGMA foreign_keys=ON")
            row = db.execute("PRAGMA quick_check").fetchone()
            if row[0] != "ok":
                raise CorruptStore(f"integrity check failed: {row[0]}")
            db.executescript(SCHEMA)
        except BaseException:
            db.close()
            raise
        return db

    def _move_aside(self, exc: BaseException) -> Path:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(str(self.path) + suffix)
            if src.exists():
                src.rename(Path(str(aside) + suffix))
        fsync_dir(self.path.parent)
        log.error(
            "store %s is corrupt (%s); moved aside to %s and started a new store "
            "(new epoch). The old file is kept for recovery.",
            self.path,
            exc,
            aside,
        )
        return aside

    def _init_meta(self, gateway_id: str | None) -> tuple[str, str]:
        with self._tx() as db:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            if "epoch" not in meta:
                import socket

                meta = {
                    # A new random epoch per file: a replaced SD card never repeats ids.
                    "epoch": secrets.token_hex(6),
                    "gateway_id": gateway_id or socket.gethostname(),
                    "schema_version": str(SCHEMA_VERSION),
                    "created": wire_time(),
                }
                if self.moved_aside:
                    meta["replaced_corrupt_store"] = str(self.moved_aside)
                db.executemany("INSERT INTO meta VALUES (?, ?)", meta.items())
            elif int(meta.get("schema_version", 0)) > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema {meta['schema_version']}, newer than this "
                    f"pubcomp ({SCHEMA_VERSION}); upgrade pubcomp"
                )
            elif int(meta.get("schema_version", 0)) < SCHEMA_VERSION:
                db.execute(
                    "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
                )
        return meta["epoch"], meta["gateway_id"]

    def _pack_old_outbox(self) -> None:
        """Stores made before schema 3 kept one outbox row per reading: rewrite them as
        rows of one reading each (same seqs, so every in-flight range stays valid), with
        the highest seq given so far kept in ``meta.last_seq``. Once, in one transaction."""
        with self._lock:
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(outbox)")}
        if "body" in columns:
            return
        with self._tx() as db:
            top = db.execute("SELECT COALESCE(MAX(seq), 0) FROM outbox").fetchone()[0]
            if self._has_autoincrement(db):
                auto = db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'")
                top = max(top, *(r[0] for r in auto.fetchall()))
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
                        "id": rid or f"{origin}/{self.epoch}/{seq}",
                        "origin": origin,
                        "sensor": sensor,
                        "ts": ts,
                        "value": value,
                        "unit": unit,
                        "flags": names,
                    }
                    encoded = [encode_readings([reading])]
                    packed.append(_outbox_row(seq, encoded, set(names), queued))
                db.executemany(INSERT_OUTBOX, packed)
                moved += len(packed)
            db.execute("DROP TABLE outbox_v2")
            inflight = db.execute(
                "SELECT sql FROM sqlite_master WHERE name = 'out_inflight'"
            ).fetchone()[0]
            if "AUTOINCREMENT" in inflight.upper():  # schema 1 and 2
                db.execute("ALTER TABLE out_inflight RENAME TO out_inflight_v2")
                create = SCHEMA[SCHEMA.index("CREATE TABLE IF NOT EXISTS out_inflight") :]
                db.execute(create[: create.index(";")])
                db.execute("INSERT INTO out_inflight SELECT * FROM out_inflight_v2")
                db.execute("DROP TABLE out_inflight_v2")
        log.info("store %s: outbox packed (schema 3), %d readings kept", self.path, moved)

    def _ensure_reserve(self) -> None:
        if not self.reserve_bytes or self.reserve_path.exists():
            return
        try:
            with open(self.reserve_path, "wb") as f:
                f.write(b"\0" * self.reserve_bytes)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            # No room for it now; try again after the next delivery frees space.
            with contextlib.suppress(OSError):
                self.reserve_path.unlink()

    def checkpoint(self) -> None:
        """Copy the WAL into the database and truncate it: gives its space back to the disk."""
        if self.held:
            return  # opened read-only: the WAL is the card's until it takes writes
        with self._lock, contextlib.suppress(sqlite3.OperationalError):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.io.checkpoints += 1

    def _write(self, tx: Callable[[], T], *, spend_reserve: bool = False, retry: bool = True) -> T:
        """Run ``tx`` (a transaction) the way every write of the store is run.

        On a full disk: truncate the WAL and run it again (``retry``: only a transaction
        that can run twice, not one consuming a one-shot iterator); for one that frees
        space (``spend_reserve``: deliveries, session transitions), release the reserve
        and run it once more. Failures are named in ``_classified``.
        """
        with self._lock, self._classified():
            try:
                return tx()
            except sqlite3.OperationalError as exc:
                if not (retry and is_disk_full(exc)):
                    raise
            self.checkpoint()
            try:
                return tx()
            except sqlite3.OperationalError as exc:
                if not (is_disk_full(exc) and spend_reserve and self.reserve_path.exists()):
                    raise
            log.error("disk full under %s: releasing the reserve to keep delivering", self.path)
            self.reserve_path.unlink()
            self.checkpoint()
            return tx()

    @contextlib.contextmanager
    def _classified(self) -> Iterator[None]:
        """The one place a write's failure is named: a file system that refuses writes is
        ``StoreUnwritable`` (recorded in ``write_state``), a full disk ``StoreFull``.
        A write that changed rows proves the store writable again."""
        with self._lock:
            if self.held:
                self._reopen()
            before = self._db.total_changes
            try:
                yield
            except (sqlite3.Error, OSError) as exc:
                if is_unwritable(exc):
                    raise self.unwritable(exc) from exc
                if is_disk_full(exc):
                    # The failed transaction's frames stay in the WAL: truncating it
                    # gives their space back to whoever writes next (a delivery).
                    self.checkpoint()
                    raise self._refuse_full(exc) from exc
                raise
            # An empty commit writes nothing, so it proves nothing about the disk.
            if self._db.total_changes != before:
                self.wrote()

    def close(self) -> None:
        with self._lock, self._rlock:
            self._rdb.close()
            self._db.close()
        self._drop_held_copy()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
                self.io.commits += 1
                if self._floor_pending is not None:
                    self._seq_floor = self._floor_pending
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            finally:
                self._floor_pending = None

    def run_ops(self, ops: Sequence[DbOp]) -> list[tuple[bool, Any]]:
        """Run ``ops`` in ONE transaction (one fsync), each under its own savepoint.

        Returns (True, result) or (False, exception) per op: an op that raises is
        undone alone. A full disk is not an op's failure: it undoes the whole
        transaction and raises, so the caller can make room and try again.
        """
        out: list[tuple[bool, Any]] = []
        with self._tx() as db:
            for fn in ops:
                db.execute("SAVEPOINT op")
                try:
                    out.append((True, fn(db)))
                except sqlite3.OperationalError as exc:
                    if is_disk_full(exc) or is_unwritable(exc):
                        raise  # the disk's failure, not the op's: the whole group fails
                    db.execute("ROLLBACK TO op")
                    self._floor_pending = None  # undone with the op: write it again later
                    out.append((False, exc))
                except Exception as exc:
                    db.execute("ROLLBACK TO op")
                    self._floor_pending = None
                    out.append((False, exc))
                db.execute("RELEASE op")
        return out

    def commit_ops(self, ops: Sequence[tuple[DbOp, bool]]) -> list[tuple[bool, Any]]:
        """The group commit's transaction: ``ops`` (each with whether it frees space) in
        one transaction, as ``run_ops``. A full disk that truncating the WAL does not
        cure: the ops that free space (deliveries) alone, with the reserve if need be;
        every other op is refused (``StoreFull``) and its waiter stays unacknowledged."""
        try:
            return self._write(lambda: self.run_ops([fn for fn, _ in ops]))
        except StoreFull as refusal:
            freeing = [fn for fn, frees in ops if frees]
            if not freeing:
                return [(False, refusal)] * len(ops)
            results = iter(self._write(lambda: self.run_ops(freeing), spend_reserve=True))
            if not self.reserve_path.exists():
                self._ensure_reserve()
            return [next(results) if frees else (False, refusal) for _, frees in ops]

    def _refuse_full(self, exc: BaseException) -> StoreFull:
        """The disk is full and nothing more can be freed: the error new data gets."""
        self.refused_disk_full += 1
        return StoreFull(f"disk full under {self.path}: refusing new readings ({exc})")

    def unwritable(self, exc: BaseException) -> StoreUnwritable:
        """A commit failed because the file system refuses writes: record it (the first
        failure of an episode finds out whether the mount is read-only) and return the
        error its waiters get. Call from the committing thread (it may touch the disk)."""
        ws = self.write_state
        ws.errors += 1
        ws.last_error = f"{exc} ({getattr(exc, 'sqlite_errorname', type(exc).__name__)})"
        ws.last_error_at = time.time()
        if ws.writable or ws.kind is None:
            ws.kind = self._diagnose_unwritable(exc)
            ws.since = ws.last_error_at
            ws.writable = False
            log.error("%s (%s): refusing new readings", UNWRITABLE_TEXT[ws.kind], ws.last_error)
        return StoreUnwritable(
            f"{UNWRITABLE_TEXT[ws.kind]} under {self.path.parent}: refusing new readings "
            f"({ws.last_error})",
            ws.kind,
        )

    def _diagnose_unwritable(self, exc: BaseException) -> str:
        """READ_ONLY or IO_ERRORS: SQLite says IOERR for both, so ask the file system."""
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_READONLY:
            return READ_ONLY
        if isinstance(exc, OSError) and exc.errno == errno.EROFS:
            return READ_ONLY
        probe = Path(f"{self.path}.probe")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"1")
                os.fsync(fd)
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    probe.unlink()
        except OSError as err:
            return READ_ONLY if err.errno == errno.EROFS else IO_ERRORS
        return IO_ERRORS  # the probe got through: the writes fail, not the mount

    def wrote(self) -> None:
        """A commit that changed something succeeded: the store is writable (again)."""
        ws = self.write_state
        if not ws.writable:
            log.warning(
                "store writable again after %.0f s %s",
                time.time() - (ws.since or time.time()),
                ws.text,
            )
            ws.writable, ws.kind, ws.since = True, None, None

    def probe_write_in(self, db: sqlite3.Connection) -> None:
        """A small real write (an empty transaction writes nothing): can we commit again?"""
        db.execute(
            "INSERT INTO meta (key, value) VALUES ('write_probe', ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (str(time.time()),),
        )

    def notify(self) -> None:
        """Tell the listeners that readings were committed (after a group commit)."""
        for cb in self._listeners:
            cb()

    # ------------------------------------------------------------ readings

    def add_listener(self, callback: Any) -> None:
        """``callback()`` runs after readings are committed (from the committing thread)."""
        self._listeners.append(callback)

    def append(self, readings: Iterable[Reading]) -> tuple[int, int]:
        """Commit readings to the outbox in one transaction; returns (first, last) seq.

        When this returns, the readings are on disk (fsynced) and may be
        acknowledged. If ``readings`` raises part way, nothing is stored, and
        (0, -1) means there were none. A full disk raises ``StoreFull``; a
        sequence (not a one-shot iterator) is retried once after the WAL is
        truncated. A file system that refuses writes raises ``StoreUnwritable``.
        """
        now = time.time()

        def insert() -> tuple[int, int]:
            with self._tx() as db:
                before = self._last_seq(db)
                self._make_room(db, 1)
                self._insert_readings(db, readings, now)
                return before, self._last_seq(db)

        before, last = self._write(insert, retry=isinstance(readings, Sequence))
        if last <= before:
            return 0, -1
        self.notify()
        return before + 1, last

    def append_batches(
        self,
        batches: Sequence[tuple[str | None, Sequence[Reading]]],
        state: dict[str, str] | None = None,
    ) -> list[bool]:
        """Commit several producers' batches in ONE transaction (one fsync), for group commit.

        Each batch has an optional message key (``node/boot/seq``): a batch whose key
        was seen before is not stored again and reports False (acknowledge it all the
        same). ``state`` is saved in the same transaction (e.g. a pulse counter's
        total, so it never runs ahead of or behind its committed readings).
        Raises StoreFull (nothing stored) when the quota or the disk refuses, and
        StoreUnwritable when the file system refuses writes.
        """

        def commit() -> list[bool]:
            with self._tx() as db:
                return self.append_batches_in(db, batches, state)

        results = self._write(commit)
        if any(results):
            self.notify()
        return results

    def append_batches_in(
        self,
        db: sqlite3.Connection,
        batches: Sequence[tuple[str | None, Sequence[Reading]]],
        state: dict[str, str] | None = None,
    ) -> list[bool]:
        """``append_batches`` inside the caller's transaction (a group commit's op)."""
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

    def _insert_readings(
        self, db: sqlite3.Connection, readings: Iterable[Reading], now: float
    ) -> None:
        """The one place readings enter the outbox: each gets its seq and id here."""
        db.executemany(INSERT_OUTBOX, self._rows(readings, db, now))

    def _seen_before(self, db: sqlite3.Connection, key: str, now: float) -> bool:
        """Was this message key stored before? If not, remember it (in this transaction).

        A node's keys are ``node/boot/seq``: one row per node and boot holds the seqs
        stored as ranges (one range for a node that sends in order), so a commit of
        several nodes' messages rewrites one small page, not a B-tree leaf per node.
        Other keys keep one row each in ``seen``.
        """
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

    def get_state(self, key: str) -> str | None:
        with self._rlock:
            row = self._rdb.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def prune_seen(self, older_than_s: float) -> int:
        """Forget message keys older than this (a retry never comes that late): a
        node's boots not written to since, and single keys. Returns the rows forgotten."""
        cutoff = time.time() - older_than_s

        def commit() -> int:
            with self._tx() as db:
                n: int = db.execute("DELETE FROM node_seen WHERE at < ?", (cutoff,)).rowcount
                n += db.execute("DELETE FROM seen WHERE at < ?", (cutoff,)).rowcount
                self._legacy_seen = db.execute("SELECT 1 FROM seen LIMIT 1").fetchone() is not None
            return n

        return self._write(commit)

    def shift_times_in(
        self, db: sqlite3.Connection, after_seq: int, shift_s: float, flag: str, add_flag: str
    ) -> int:
        """Correct the timestamps of waiting readings flagged ``flag`` (not yet ``add_flag``)
        by ``shift_s``, and add ``add_flag``; returns how many were corrected.

        Only readings above ``after_seq`` and not yet in a message are touched: a
        message's payload must stay byte-identical for its DUP resends. What the
        flags mean, and whether to count the correction, is the caller's business.
        """
        low = max(after_seq, self._inflight_high_seq(db))
        # The row holding seq low + 1 may begin at or below low: start from it.
        start = db.execute("SELECT MAX(seq) FROM outbox WHERE seq <= ?", (low + 1,)).fetchone()[0]
        rows = db.execute(
            "SELECT seq, body FROM outbox WHERE seq >= ? AND marks LIKE ?",
            (start or low + 1, f"%{flag}%"),
        ).fetchall()
        fixed, updates = 0, []
        for seq, body in rows:
            readings = decode_body(body)
            changed = False
            for i, r in enumerate(readings):
                names, ts = r["flags"], r["ts"]
                if seq + i <= low or flag not in names or add_flag in names or ts is None:
                    continue
                t = datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() + shift_s
                r["ts"], r["flags"] = wire_time(t), [*names, add_flag]
                fixed, changed = fixed + 1, True
            if changed:
                updates.append((_marks(readings), pack_body(encode_readings(readings)), seq))
        db.executemany("UPDATE outbox SET marks = ?, body = ? WHERE seq = ?", updates)
        return fixed

    def probe(self) -> None:
        """Take and release the write lock: raises if the store cannot commit now (held,
        there is no write lock to take: a read says whether the store answers)."""
        with self._lock:
            if self.held:
                self._db.execute("SELECT 1 FROM meta LIMIT 1").fetchone()
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("ROLLBACK")

    def last_seq(self) -> int:
        """The highest seq ever given to a reading in this store."""
        with self._rlock:
            return self._last_seq(self._rdb)

    def _rows(
        self, readings: Iterable[Reading], db: sqlite3.Connection, now: float
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
            self._seq += 1  # a transaction undone leaves a gap, never a seq given twice
            if not chunk:
                first = self._seq
            origin = r.origin or self.gateway_id
            reading = {
                "id": r.id or f"{origin}/{self.epoch}/{self._seq}",
                "origin": origin,
                "sensor": r.sensor,
                "ts": r.ts,
                "value": None if r.value is None else float(r.value),
                "unit": r.unit,
                "flags": list(r.flags),
            }
            if r.kind != GAUGE:  # absent means gauge: most readings, and old bodies, say nothing
                reading["kind"] = r.kind
            chunk.append(reading)
            if len(chunk) == ROW_READINGS:
                yield from _packed_rows(first, chunk, now)
                chunk = []
        if chunk:
            yield from _packed_rows(first, chunk, now)

    def _last_seq(self, db: sqlite3.Connection) -> int:
        return self._seq

    def _highest_seq(self) -> int:
        """The highest seq given so far: ids ``origin/epoch/seq`` are never given twice,
        so the floor survives the outbox draining (``meta.last_seq``, and the
        AUTOINCREMENT counter of stores made before schema 2)."""
        with self._lock:
            db = self._db
            floor = db.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
            auto = None
            if self._has_autoincrement(db):
                auto = db.execute(
                    "SELECT seq FROM sqlite_sequence WHERE name = 'outbox'"
                ).fetchone()
            dead = db.execute("SELECT MAX(seq) FROM dead_letter").fetchone()
            top = self._top_seq(db)
        return max(int(floor[0]) if floor else 0, auto[0] if auto else 0, dead[0] or 0, top)

    @staticmethod
    def _top_seq(db: sqlite3.Connection) -> int:
        """The last seq of the newest outbox row (0 if empty): a rowid look-up."""
        row = db.execute("SELECT seq + n - 1 FROM outbox ORDER BY seq DESC LIMIT 1").fetchone()
        return int(row[0]) if row else 0

    @staticmethod
    def _has_autoincrement(db: sqlite3.Connection) -> bool:
        return (
            db.execute("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'").fetchone()
            is not None
        )

    def _keep_seq_floor(self, db: sqlite3.Connection) -> None:
        """After deleting readings: if none above them remain, the floor must cover the
        highest seq given (otherwise the next reading could be given a seq again). It
        is raised a block ahead, so a light load that drains the outbox after every
        delivery writes it once per ``SEQ_BLOCK`` readings, not at every delivery
        (seqs skipped after a restart are gaps, never repeats)."""
        if self._seq < self._seq_floor:
            return
        if self._top_seq(db) < self._seq:
            self._floor_pending = self._seq + SEQ_BLOCK  # in force once committed
            db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('last_seq', ?)", (str(self._floor_pending),)
            )

    def _used_bytes(self, db: sqlite3.Connection) -> int:
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        free = db.execute("PRAGMA freelist_count").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
        return int((pages - free) * size)

    def _make_room(self, db: sqlite3.Connection, incoming: int) -> None:
        if self.quota_bytes is None:
            return
        used = self._used_bytes(db)
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
        victims, dropped = max(incoming * 2, 64), 0
        awaiting = db.execute(
            "SELECT first_seq, last_seq, readings FROM awaiting_landing ORDER BY first_seq"
        )
        evict: list[tuple[int, int]] = []
        for first, last, n in awaiting:
            if dropped >= victims:
                break
            evict.append((first, last))
            dropped += n
        for first, last in evict:
            db.execute("DELETE FROM awaiting_landing WHERE first_seq = ?", (first,))
            db.execute(_DELETE_ROWS, (first, last)).fetchall()
        if evict:
            self._bump(db, "dropped_awaiting", dropped)
        low = self._inflight_high_seq(db)
        rows = db.execute("SELECT seq, n FROM outbox WHERE seq > ? ORDER BY seq", (low,))
        last = None
        for seq, n in rows:
            if dropped >= victims:
                break
            last, dropped = seq, dropped + n
        if last is not None:
            db.execute("DELETE FROM outbox WHERE seq > ? AND seq <= ?", (low, last))
        self._bump(db, "dropped_quota", dropped)
        self._keep_seq_floor(db)
        log.warning("store quota reached: dropped %d oldest waiting readings", dropped)

    def _inflight_high_seq(self, db: sqlite3.Connection) -> int:
        return max(_messages_high_seq(db), self.claimed_seq)

    def waiting_rows(self, after_seq: int, readings: int) -> list[tuple[int, int, bytes]]:
        """The oldest rows above ``after_seq`` holding at least ``readings`` readings (or
        all there are), as (seq, n, encoded readings): what the uplink makes messages of."""
        with self._rlock:
            db = self._rdb
            heads = db.execute(
                "SELECT seq, n FROM outbox WHERE seq > ? ORDER BY seq LIMIT ?",
                (after_seq, readings),
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

    def forget_later(self, first_seq: int, last_seq: int) -> None:
        """A message the broker completed: not backlog, though its deletion is not yet
        committed. ``stats`` drops the range once its rows are gone."""
        with self._forgetting_lock:
            ranges = self._forgetting
            if ranges and ranges[-1][1] + 1 >= first_seq >= ranges[-1][0]:
                ranges[-1][1] = max(ranges[-1][1], last_seq)
            else:
                ranges.append([first_seq, last_seq])
            if len(ranges) > 100:  # seq gaps kept them apart: a bound for stats' query
                ranges[0:2] = [[ranges[0][0], ranges[1][1]]]

    def count_between(self, first_seq: int, last_seq: int) -> int:
        """The readings in the rows that begin between the two seqs (a message's)."""
        with self._rlock:
            return int(self._count_in(self._rdb, [(first_seq, last_seq)]))

    def bodies_between(self, first_seq: int, last_seq: int) -> list[bytes]:
        """The encoded readings of a message's rows, in order (its PUBLISH payload's inside)."""
        with self._rlock:
            rows = self._rdb.execute(
                "SELECT body FROM outbox WHERE seq BETWEEN ? AND ? ORDER BY seq",
                (first_seq, last_seq),
            ).fetchall()
        return [unpack_body(r[0]) for r in rows]

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
        row = db.execute("SELECT body, queued FROM outbox WHERE seq = ?", (seq,))
        body, queued = row.fetchone()
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
                (first, len(rs), _marks(rs), pack_body(encode_readings(rs)), queued)
                for first, rs in pieces
            ],
        )
        return len(pieces)

    # ------------------------------------------------------ sender session

    def load_session(self, session: str) -> tuple[bool, int, list[Message]]:
        """(established, last_packet_id, this session's messages in original order)."""
        with self._rlock:
            row = self._rdb.execute(
                "SELECT established, last_packet_id FROM sessions WHERE session = ?", (session,)
            ).fetchone()
            msgs = self._rdb.execute(
                "SELECT ord, packet_id, qos, state, topic, first_seq, last_seq "
                "FROM out_inflight WHERE session = ? ORDER BY ord",
                (session,),
            ).fetchall()
        established, last = (bool(row[0]), row[1]) if row else (False, 0)
        live = [m[1] for m in msgs if m[1] is not None]
        if msgs and msgs[-1][1] is not None:
            last = msgs[-1][1]  # the newest message's id: ids go on from there
        elif live:
            last = max(last, *live)
        return (
            established,
            last,
            [
                Message(o, pid, qos, OutState(state), topic, first, last_seq)
                for o, pid, qos, state, topic, first, last_seq in msgs
            ],
        )

    def oldest_seq(self) -> float:
        """The seq of the oldest reading not yet delivered (waiting, queued or in flight;
        not awaiting landing); infinity if there is none."""
        with self._rlock:
            row = self._rdb.execute(_OLDEST_UNDELIVERED).fetchone()
        return float("inf") if row[0] is None else row[0]

    def high_seq(self) -> int:
        """Readings above this seq wait in the outbox; those at or below belong to messages
        (in flight, queued for a new id, or delivered and awaiting landing)."""
        with self._rlock:
            return _messages_high_seq(self._rdb)

    def sent_high_seq(self) -> int:
        """Every seq at or below this has been in a message (or was dropped by the
        quota): the highest seq an end-to-end acknowledgement may name."""
        with self._rlock:
            db = self._rdb
            high = _messages_high_seq(db)
            row = db.execute("SELECT MIN(seq) FROM outbox WHERE seq > ?", (high,)).fetchone()
        if row[0] is not None:
            return max(high, int(row[0]) - 1)
        return max(high, self._seq)

    def awaiting_messages(self) -> int:
        """Messages delivered to the broker and not yet landed in the cloud."""
        with self._rlock:
            return int(self._rdb.execute("SELECT COUNT(*) FROM awaiting_landing").fetchone()[0])

    def adopt_orphans(self, session: str) -> int:
        """Take over messages of another session (the broker or client id changed).

        Their ids mean nothing to this session's broker, so they wait as QUEUED
        for new ids; their readings are counted as resent after session loss.
        """

        def commit() -> int:
            with self._tx() as db:
                return self.adopt_orphans_in(db, session)

        return self._write(commit)

    def adopt_orphans_in(self, db: sqlite3.Connection, session: str) -> int:
        rows = db.execute(
            "UPDATE out_inflight SET session = ?, packet_id = NULL, state = 'QUEUED' "
            "WHERE session != ? RETURNING first_seq, last_seq",
            (session, session),
        ).fetchall()
        self._bump(db, "resent_after_session_loss", self._count_in(db, rows))
        return len(rows)

    def session_started_in(self, db: sqlite3.Connection, session: str) -> None:
        db.execute(
            "INSERT INTO sessions (session, established, updated) VALUES (?, 1, ?) "
            "ON CONFLICT(session) DO UPDATE SET established = 1, updated = excluded.updated",
            (session, time.time()),
        )

    def begin_messages(self, session: str, messages: Sequence[Message]) -> None:
        """Rule 1: commit packet ids (state PUBLISH_SENT) before the PUBLISHes are sent.

        A message with ``ord == 0`` is new and is inserted (its ord is filled
        in); others are QUEUED messages getting a new id.
        """
        if messages:

            def commit() -> list[int]:
                with self._tx() as db:
                    return self.begin_messages_in(db, session, messages)

            for m, o in zip(messages, self._write(commit, spend_reserve=True), strict=True):
                m.ord, m.state = o, OutState.PUBLISH_SENT

    def begin_messages_in(
        self, db: sqlite3.Connection, session: str, messages: Sequence[Message]
    ) -> list[int]:
        """``begin_messages`` inside the caller's transaction; returns each message's ord
        (the caller fills them in once the commit has returned)."""
        ords = []
        for m in messages:
            if m.ord:
                db.execute(
                    "UPDATE out_inflight SET packet_id = ?, state = 'PUBLISH_SENT', qos = ? "
                    "WHERE ord = ?",
                    (m.packet_id, m.qos, m.ord),
                )
                ords.append(m.ord)
            else:
                row = db.execute(
                    "INSERT INTO out_inflight "
                    "(session, packet_id, state, qos, topic, first_seq, last_seq) "
                    "VALUES (?, ?, 'PUBLISH_SENT', ?, ?, ?, ?) RETURNING ord",
                    (session, m.packet_id, m.qos, m.topic, m.first_seq, m.last_seq),
                ).fetchone()
                ords.append(int(row[0]))
        # sessions.last_packet_id is not rewritten here (one page less per commit): the
        # last id handed out is the newest in-flight message's, which this commits.
        return ords

    def apply(
        self,
        session: str,
        *,
        released: Sequence[int] = (),
        completed: Sequence[int] = (),
        refused: Sequence[tuple[int, int, bool]] = (),
    ) -> int:
        """Commit acknowledgements in one transaction (rules 2, 3, 6); returns readings delivered.

        ``released``: PUBREC received, now PUBREL_SENT. ``completed``: PUBCOMP or
        PUBACK, delete the message and its readings. ``refused``: (packet id,
        reason, permanent): the broker refused it; permanent refusals move the
        readings to ``dead_letter``, others wait as QUEUED for a new id.
        """
        if not (released or completed or refused):
            return 0

        def commit() -> int:
            with self._tx() as db:
                return self.apply_in(db, session, released, completed, refused)

        delivered = self._write(commit, spend_reserve=True)
        if completed and not self.reserve_path.exists():
            self._ensure_reserve()
        return int(delivered)

    def apply_in(
        self,
        db: sqlite3.Connection,
        session: str,
        released: Sequence[int] = (),
        completed: Sequence[int] = (),
        refused: Sequence[tuple[int, int, bool]] = (),
        awaiting: Sequence[int] = (),
    ) -> int:
        """``apply`` inside the caller's transaction. ``awaiting``: completed by the
        broker like ``completed``, but not yet landed in the cloud (rule 9): the message
        leaves the session and its readings stay, in ``awaiting_landing``."""
        delivered = 0
        db.executemany(
            "UPDATE out_inflight SET state = 'PUBREL_SENT' WHERE session = ? AND packet_id = ?",
            [(session, p) for p in released],
        )
        now = time.time()
        for pid in awaiting:
            row = db.execute(
                "DELETE FROM out_inflight WHERE session = ? AND packet_id = ? "
                "RETURNING first_seq, last_seq",
                (session, pid),
            ).fetchone()
            if row:
                n = self._count_in(db, [row])
                db.execute(
                    "INSERT OR REPLACE INTO awaiting_landing VALUES (?, ?, ?, ?)", (*row, n, now)
                )
                delivered += n
                self._bump(db, "delivered", n)
                self._bump(db, "messages_completed", 1)
        for pid in completed:
            row = db.execute(
                "DELETE FROM out_inflight WHERE session = ? AND packet_id = ? "
                "RETURNING first_seq, last_seq",
                (session, pid),
            ).fetchone()
            if row:
                n = sum(r[0] for r in db.execute(_DELETE_ROWS, row).fetchall())
                delivered += n
                self._bump(db, "delivered", n)
                self._bump(db, "messages_completed", 1)
        for pid, reason, permanent in refused:
            if not permanent:
                db.execute(
                    "UPDATE out_inflight SET packet_id = NULL, state = 'QUEUED' "
                    "WHERE session = ? AND packet_id = ?",
                    (session, pid),
                )
                self._bump(db, "refused_by_broker", 1)
                continue
            row = db.execute(
                "DELETE FROM out_inflight WHERE session = ? AND packet_id = ? "
                "RETURNING first_seq, last_seq",
                (session, pid),
            ).fetchone()
            if not row:
                continue
            now = time.time()
            dead = [
                (
                    *(seq + i, r["id"], r["origin"], r["sensor"], r["ts"], r["value"], r["unit"]),
                    *(",".join(r["flags"]) or None, reason, now),
                )
                for seq, body in db.execute(
                    "SELECT seq, body FROM outbox WHERE seq BETWEEN ? AND ?", row
                ).fetchall()
                for i, r in enumerate(decode_body(body))
            ]
            db.executemany(
                "INSERT OR REPLACE INTO dead_letter VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", dead
            )
            db.execute(_DELETE_ROWS, row).fetchall()
            self._bump(db, "dead_lettered", len(dead))
        if completed or refused:
            self._keep_seq_floor(db)
        return delivered

    # ------------------------------------------------- end to end (rule 9)

    def landed_in(self, db: sqlite3.Connection, ranges: Iterable[tuple[int, int]]) -> int:
        """The cloud has landed these seqs: every awaiting message they cover whole goes,
        with its readings. Returns the readings let go (counted as ``landed``)."""
        gone = 0
        for lo, hi in ranges:
            rows = db.execute(
                "DELETE FROM awaiting_landing WHERE first_seq >= ? AND first_seq <= ? "
                "AND last_seq <= ? RETURNING first_seq, last_seq",
                (lo, hi, hi),
            ).fetchall()
            for row in rows:
                gone += sum(r[0] for r in db.execute(_DELETE_ROWS, row).fetchall())
        if gone:
            self._bump(db, "landed", gone)
            self._keep_seq_floor(db)
        return gone

    def forget_queued_in(self, db: sqlite3.Connection, ords: Sequence[int]) -> int:
        """Queued messages (no packet id) that the cloud has landed meanwhile: they go
        without being sent again. Returns the readings let go (counted as ``landed``)."""
        gone = 0
        for o in ords:
            row = db.execute(
                "DELETE FROM out_inflight WHERE ord = ? AND packet_id IS NULL "
                "RETURNING first_seq, last_seq",
                (o,),
            ).fetchone()
            if row:
                gone += sum(r[0] for r in db.execute(_DELETE_ROWS, row).fetchall())
        if gone:
            self._bump(db, "landed", gone)
            self._keep_seq_floor(db)
        return gone

    def resend_awaiting_in(
        self,
        db: sqlite3.Connection,
        session: str,
        topic: str,
        *,
        delivered_before: float = math.inf,
        landed: Callable[[int, int], bool] | None = None,
        counter: str = "resent_not_landed",
    ) -> list[Message]:
        """Awaiting messages completed before ``delivered_before`` (all by default) that
        ``landed`` does not cover: published again, as new messages (QUEUED, a new
        packet id each) with the same readings, so the same reading ids; the cloud's
        dedup removes any copy. Returns them (oldest first), counted under ``counter``."""
        rows = db.execute(
            "SELECT first_seq, last_seq, readings FROM awaiting_landing "
            "WHERE delivered < ? ORDER BY first_seq",
            (delivered_before,),
        ).fetchall()
        out: list[Message] = []
        again = 0
        for first, last, n in rows:
            db.execute("DELETE FROM awaiting_landing WHERE first_seq = ?", (first,))
            if landed is not None and landed(first, last):
                gone = sum(r[0] for r in db.execute(_DELETE_ROWS, (first, last)).fetchall())
                self._bump(db, "landed", gone)
                continue
            qos = 2
            row = db.execute(
                "INSERT INTO out_inflight (session, packet_id, state, qos, topic, first_seq, "
                "last_seq) VALUES (?, NULL, 'QUEUED', ?, ?, ?, ?) RETURNING ord",
                (session, qos, topic, first, last),
            ).fetchone()
            out.append(Message(int(row[0]), None, qos, OutState.QUEUED, topic, first, last))
            again += n
        self._bump(db, counter, again)
        if len(out) < len(rows):
            self._keep_seq_floor(db)
        return out

    def requeue_lost(self, session: str) -> int:
        """The broker lost the session: every message with an id waits for a new one.

        Returns the readings concerned, also counted as ``resent_after_session_loss``;
        the cloud's dedup on reading ids absorbs any copy the broker did deliver.
        """

        def commit() -> int:
            with self._tx() as db:
                return self.requeue_lost_in(db, session)

        return int(self._write(commit, spend_reserve=True))

    def requeue_lost_in(self, db: sqlite3.Connection, session: str) -> int:
        rows = db.execute(
            "UPDATE out_inflight SET packet_id = NULL, state = 'QUEUED' "
            "WHERE session = ? AND packet_id IS NOT NULL RETURNING first_seq, last_seq",
            (session,),
        ).fetchall()
        n = self._count_in(db, rows)
        self._bump(db, "resent_after_session_loss", n)
        return n

    def _count_in(self, db: sqlite3.Connection, ranges: Iterable[tuple[int, int]]) -> int:
        return sum(
            db.execute(
                "SELECT COALESCE(SUM(n), 0) FROM outbox WHERE seq BETWEEN ? AND ?", r
            ).fetchone()[0]
            for r in ranges
        )

    # ---------------------------------------------------- receiver session

    def qos2_pending(self, session: str) -> set[int]:
        with self._rlock:
            return {
                r[0]
                for r in self._rdb.execute(
                    "SELECT packet_id FROM in_qos2 WHERE session = ?", (session,)
                )
            }

    def qos2_record(self, db: sqlite3.Connection, session: str, packet_id: int) -> None:
        """Inside ``transaction()``: remember a QoS 2 id together with what it carried."""
        db.execute(
            "INSERT OR REPLACE INTO in_qos2 VALUES (?, ?, ?)", (session, packet_id, time.time())
        )

    def qos2_forget(self, session: str, packet_ids: Iterable[int]) -> None:
        rows = [(session, p) for p in packet_ids]

        def commit() -> None:
            with self._tx() as db:
                db.executemany("DELETE FROM in_qos2 WHERE session = ? AND packet_id = ?", rows)

        self._write(commit)

    def qos2_reset(self, session: str) -> None:
        def commit() -> None:
            with self._tx() as db:
                db.execute("DELETE FROM in_qos2 WHERE session = ?", (session,))

        self._write(commit)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One durable transaction for receivers that store data and ids together
        (the caller's block runs once: a full disk is not retried, it raises StoreFull)."""
        with self._classified(), self._tx() as db:
            yield db

    # --------------------------------------------------------------- stats

    def _bump(self, db: sqlite3.Connection, name: str, n: int) -> None:
        if n:
            db.execute(
                "INSERT INTO counters VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                (name, n),
            )

    def count_in(self, db: sqlite3.Connection, name: str, n: int) -> None:
        """Add ``n`` to the durable counter ``name`` inside the caller's transaction: a
        layer above counts its own events with the change they describe (the gateway's
        ``clock_corrected``), under names this store does not know."""
        self._bump(db, name, n)

    def counters(self) -> dict[str, int]:
        with self._rlock:
            return dict(self._rdb.execute("SELECT name, value FROM counters").fetchall())

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
                        f"WHERE seq BETWEEN ? AND ? AND {_NOT_AWAITING}",
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
                    _OLDEST_UNDELIVERED
                    + "".join(" AND NOT (o.seq BETWEEN ? AND ?)" for _ in ranges),
                    [x for r in ranges for x in r],
                ).fetchone()[0]
                oldest = db.execute(
                    "SELECT queued FROM outbox WHERE seq = ?", (oldest_seq,)
                ).fetchone()
                inflight = db.execute("SELECT COUNT(*) FROM out_inflight").fetchone()[0]
                dead = db.execute("SELECT COUNT(*) FROM dead_letter").fetchone()[0]
                used = self._used_bytes(db)
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


def held_receive_ids(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """(session, packet id) of every QoS 2 message a store file's receiver holds
    (``in_qos2``), read without opening the file for writing: a file another program
    or version left, which is never written again. Raises StoreError if it cannot be
    read (the caller need not know the store is SQLite)."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT session, packet_id FROM in_qos2").fetchall()
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise StoreError(str(exc)) from exc
    return [(str(key), int(pid)) for key, pid in rows]


def is_disk_full(exc: BaseException) -> bool:
    """The disk (not the quota) is full: by SQLite's result code or the errno, never by
    the words of a message, which SQLite and the C library are free to change."""
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOSPC
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == sqlite3.SQLITE_FULL


def is_unwritable(exc: BaseException) -> bool:
    """The file system refuses our writes (read-only, I/O errors): see StoreUnwritable."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.EROFS, errno.EIO)
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in _UNWRITABLE_CODES


INSERT_OUTBOX = "INSERT INTO outbox (seq, n, marks, body, queued) VALUES (?, ?, ?, ?, ?)"


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


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a create, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_DELETE_ROWS = "DELETE FROM outbox WHERE seq BETWEEN ? AND ? RETURNING n"
# The first outbox row that no awaiting_landing range covers (the ranges do not overlap,
# so the one that could cover a seq is the one with the greatest first_seq below it).
_NOT_AWAITING = (
    "NOT EXISTS (SELECT 1 FROM awaiting_landing a WHERE a.first_seq = "
    "(SELECT MAX(first_seq) FROM awaiting_landing WHERE first_seq <= o.seq) "
    "AND a.last_seq >= o.seq)"
)
_OLDEST_UNDELIVERED = f"SELECT MIN(o.seq) FROM outbox o WHERE {_NOT_AWAITING}"


def _messages_high_seq(db: sqlite3.Connection) -> int:
    """The highest seq any message holds: in flight, queued, or awaiting landing."""
    row = db.execute(
        "SELECT MAX((SELECT COALESCE(MAX(last_seq), 0) FROM out_inflight), "
        "(SELECT COALESCE(MAX(last_seq), 0) FROM awaiting_landing))"
    ).fetchone()
    return int(row[0])


def _marks(readings: Iterable[dict[str, Any]]) -> str | None:
    return ",".join(sorted({f for r in readings for f in r["flags"]})) or None


def _outbox_row(first: int, encoded: list[bytes], marks: set[str], now: float) -> tuple[Any, ...]:
    body = pack_body(b",".join(encoded))
    return (first, len(encoded), ",".join(sorted(marks)) or None, body, now)


def _packed_rows(first: int, chunk: list[dict[str, Any]], now: float) -> Iterator[tuple[Any, ...]]:
    """``chunk``'s readings (seqs from ``first``) as one row, or as several when their
    encoding passes ``ROW_BYTES`` (long sensor names, many flags): encoded in one call,
    since a reading at a time costs twice the CPU at a node's 100-reading messages."""
    raw = encode_readings(chunk)
    if len(raw) <= ROW_BYTES:
        yield (first, len(chunk), _marks(chunk), pack_body(raw), now)
        return
    encoded: list[bytes] = []
    flags: set[str] = set()
    size = 0
    for seq, r in enumerate(chunk, first):
        one = encode_readings([r])
        if encoded and size + len(one) > ROW_BYTES:
            yield _outbox_row(seq - len(encoded), encoded, flags, now)
            encoded, flags, size = [], set(), 0
        encoded.append(one)
        flags.update(r["flags"])
        size += len(one) + 1
    yield _outbox_row(first + len(chunk) - len(encoded), encoded, flags, now)


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
