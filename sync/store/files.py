"""The store's file: opened (or created) with the pragmas durability needs, a corrupt
file moved aside (rule 8), a file on a card that refuses writes held read-only, the
disk reserve kept, and closed.

- ``synchronous=FULL`` in WAL mode: the WAL is fsynced at every commit, so a commit
  survives a power cut; small pages for new files (every commit rewrites each page
  it touches, so on flash the page size is the unit of wear); a bounded WAL.
- A file that fails to open or ``PRAGMA quick_check`` is renamed to
  ``NAME.corrupt-YYYYmmddTHHMMSSZ`` (with its ``-wal``/``-shm``), logged, and a new store
  with a new epoch is created. Nothing is deleted.
- Held: when the card refuses writes at the start (read-only, I/O errors), the file
  is opened read-only (in place, or a copy in memory when its WAL's index must be
  rebuilt) so what it holds can still be delivered (sync/degraded.py); every write
  first tries to open it for writing again (``_reopen``).
- The reserve (``NAME.reserve``, 2 MiB): room kept on the disk for the transactions
  that free space; the write path spends it (writes.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import sqlite3
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from ..errors import CorruptStore, StoreError, StoreUnwritable
from ..wire import wire_time
from . import legacy
from .outbox import POLICIES, seq_given_on_disk
from .producers import has_seen_keys
from .schema import SCHEMA, SCHEMA_VERSION
from .writes import (
    UNWRITABLE_TEXT,
    StoreIO,
    WritePath,
    WriteState,
    diagnose_unwritable,
    is_unwritable,
)

log = logging.getLogger(__name__)

WAL_BYTES = 1 << 20
REOPEN_EVERY_S = 1.0  # a held store tries to open for writing at most this often
HELD_COPY_MAX = 256 << 20  # a held store with a WAL is copied to memory up to this size
# Small pages for new stores: every commit rewrites each page it touches in full
# (a WAL frame per page), and a commit touches a few pages however small the
# change, so on flash the page size is the unit of wear (docs/architecture.md).
PAGE_SIZE = 512


class StoreFile(WritePath):
    """The file's life (module docstring). Sets up every room's state."""

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
        self.moved_aside = None
        self._lock = threading.RLock()
        self._rlock = threading.RLock()
        self._listeners = []
        self.io = StoreIO()
        self._floor_pending = None
        self._claimed = None
        # Messages the broker has completed whose deletion rides a later commit (rule 3
        # lets it wait): their readings are delivered, and ``stats`` says so at once.
        self._forgetting = []
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
        self._held_error = None
        self._held_copy = None  # where a held store is read, if copied
        self._reopen_at = 0.0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._open_writable()
        except StoreUnwritable as exc:
            if not hold_if_unwritable:
                raise
            self._open_held(exc)

    @property
    def held_copy(self) -> Path | None:
        """Where a held store is read from, if it had to be copied (None otherwise)."""
        return self._held_copy

    def pragmas(self) -> dict[str, Any]:
        """The write connection's durability settings, as SQLite reports them."""
        with self._lock:
            return {
                name: self._db.execute(f"PRAGMA {name}").fetchone()[0]
                for name in ("journal_mode", "synchronous", "page_size", "wal_autocheckpoint")
            }

    def probe(self) -> None:
        """Take and release the write lock: raises if the store cannot commit now (held,
        there is no write lock to take: a read says whether the store answers)."""
        with self._lock:
            if self.held:
                self._db.execute("SELECT 1 FROM meta LIMIT 1").fetchone()
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("ROLLBACK")

    def close(self) -> None:
        with self._lock, self._rlock:
            self._rdb.close()
            self._db.close()
        self._drop_held_copy()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            self._migrate()
        except (sqlite3.Error, OSError) as exc:
            # A card that refuses writes (read-only, I/O errors) is not a corrupt store:
            # moving the file aside would strand what it holds under another name.
            if not is_unwritable(exc):
                raise
            if new is not None:
                new.close()
            kind = diagnose_unwritable(self.path, exc)
            raise StoreUnwritable(
                f"cannot open the store {self.path}: {UNWRITABLE_TEXT[kind]} ({exc}); "
                "nothing was moved or deleted",
                kind,
            ) from exc
        with self._lock:
            self._given = self._floor = seq_given_on_disk(self._db)
            # Stores made before schema 2 kept message keys one row each in ``seen``.
            self._legacy_seen = has_seen_keys(self._db)
        # Reads on their own connection: WAL lets them see every committed
        # transaction without waiting for a commit (and its fsync) in progress.
        self._rdb = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._ensure_reserve()

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
            else:
                legacy.check_version(db, int(meta.get("schema_version", 0)), self.path)
        return meta["epoch"], meta["gateway_id"]

    def _migrate(self) -> None:
        """A file of an older schema brought up to this one, once, in one transaction."""
        with self._lock:
            if legacy.outbox_packed(self._db):
                return
        with self._tx() as db:
            moved = legacy.pack_outbox(db, self.epoch)
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

    # ------------------------------------------------------------ held

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
                with self._lock:
                    self._given = self._floor = seq_given_on_disk(self._db)
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


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a create, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
