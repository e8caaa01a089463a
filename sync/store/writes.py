"""The write path: every write of the store runs one way, the group commit's included.

``commit_ops`` is the group commit's transaction (sync/groupcommit.py): ops, each a
function of the connection, in ONE transaction (one fsync), each under its own
savepoint. ``commit`` is the same path for one op, at once, on the caller's thread
(``pubcomp store import``, tests, benchmarks): there is no other way to write.

Both run through ``_write``: a full disk first truncates the WAL and runs the
transaction again; ops that free space (``frees``: deliveries, session transitions)
may then spend the reserve file (files.py); what still does not fit is ``StoreFull``.
One classifier (``_classified``, over ``is_disk_full`` and ``is_unwritable``, which read
SQLite's result code or the errno, never a message's words) names a failure: a file
system that refuses writes is ``StoreUnwritable``, recorded in ``write_state``
(docs/failure-model.md), and the next write that changes rows clears it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..errors import StoreFull, StoreUnwritable
from .base import StoreBase

log = logging.getLogger(__name__)

T = TypeVar("T")
DbOp = Callable[[sqlite3.Connection], Any]  # a change run inside a transaction

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
class StoreIO:
    """What durability cost so far: each commit is one fsync of the WAL
    (``synchronous=FULL``); a checkpoint fsyncs the WAL and the database file."""

    commits: int = 0
    checkpoints: int = 0

    @property
    def fsyncs(self) -> int:
        return self.commits + 2 * self.checkpoints


class WritePath(StoreBase):
    """Transactions, the group commit's ops, and what a failed write is (module docstring)."""

    # ------------------------------------------------------------ the one way in

    def commit_ops(
        self,
        ops: Sequence[tuple[DbOp, bool]],
        *,
        claimed: Callable[[], int] | None = None,
        retry: bool = True,
    ) -> list[tuple[bool, Any]]:
        """The group commit's transaction: ``ops`` (each with whether it frees space) in
        one transaction, each under its own savepoint; returns (True, result) or (False,
        exception) per op. A full disk that truncating the WAL does not cure: the ops
        that free space (deliveries) alone, with the reserve if need be; every other op
        is refused (``StoreFull``) and its waiter stays unacknowledged.

        ``claimed()``: readings up to this seq are being taken into messages whose own
        op is still on its way (the uplink's, sync/groupcommit.py ``claims``): no op of
        this transaction may drop or rewrite them. ``retry=False`` for ops that cannot
        run twice (one consuming an iterator): a full disk refuses them at once."""
        with self._lock:
            self._claimed = claimed
            try:
                return self._commit_ops(ops, retry)
            finally:
                self._claimed = None

    def _commit_ops(self, ops: Sequence[tuple[DbOp, bool]], retry: bool) -> list[tuple[bool, Any]]:
        try:
            return self._write(lambda: self._run_ops([fn for fn, _ in ops]), retry=retry)
        except StoreFull as refusal:
            freeing = [fn for fn, frees in ops if frees]
            if not freeing:
                return [(False, refusal)] * len(ops)
            results = iter(
                self._write(lambda: self._run_ops(freeing), spend_reserve=True, retry=retry)
            )
            if not self.reserve_path.exists():
                self._ensure_reserve()
            return [next(results) if frees else (False, refusal) for _, frees in ops]

    def commit(self, op: DbOp, *, frees: bool = False, retry: bool = True) -> Any:
        """Commit ``op`` now, alone, on this thread, the way the group commit commits a
        group (``commit_ops``: the same transaction, savepoint, retry on a full disk, and
        the reserve only for an op that ``frees``), then tell the listeners, as after a
        group. Returns what ``op`` returned; raises what it, or the disk, raised.

        For what runs without a gateway's ``GroupCommit``: ``pubcomp store import``,
        tests and benchmarks. They pass ``frees`` as the gateway's submitter does (the
        uplink's session transitions and deliveries free; new readings do not)."""
        ok, value = self.commit_ops([(op, frees)], retry=retry)[0]
        self.notify()
        if not ok:
            raise value
        return value

    def add_listener(self, callback: Callable[[], None]) -> None:
        """``callback()`` runs after readings are committed (from the committing thread)."""
        self._listeners.append(callback)

    def notify(self) -> None:
        """Tell the listeners that readings were committed (after a group commit)."""
        for cb in self._listeners:
            cb()

    # ------------------------------------------------------------ transactions

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
                self.io.commits += 1
                if self._floor_pending is not None:
                    self._floor = self._floor_pending
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            finally:
                self._floor_pending = None

    def _run_ops(self, ops: Sequence[DbOp]) -> list[tuple[bool, Any]]:
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

    def checkpoint(self) -> None:
        """Copy the WAL into the database and truncate it: gives its space back to the disk."""
        if self.held:
            return  # opened read-only: the WAL is the card's until it takes writes
        with self._lock, contextlib.suppress(sqlite3.OperationalError):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.io.checkpoints += 1

    # The file's life (files.py) provides these two.
    def _reopen(self) -> None:
        raise NotImplementedError

    def _ensure_reserve(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ failures

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
            ws.kind = diagnose_unwritable(self.path, exc)
            ws.since = ws.last_error_at
            ws.writable = False
            log.error("%s (%s): refusing new readings", UNWRITABLE_TEXT[ws.kind], ws.last_error)
        return StoreUnwritable(
            f"{UNWRITABLE_TEXT[ws.kind]} under {self.path.parent}: refusing new readings "
            f"({ws.last_error})",
            ws.kind,
        )

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


def diagnose_unwritable(path: Path, exc: BaseException) -> str:
    """READ_ONLY or IO_ERRORS: SQLite says IOERR for both, so ask the file system."""
    if getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_READONLY:
        return READ_ONLY
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return READ_ONLY
    probe = Path(f"{path}.probe")
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
