"""What every room of the store shares: the state a ``Store`` holds (set up by
``files.StoreFile.__init__``, declared here so each room can be checked alone) and the
durable counters' one statement.

The rooms are mixins over this base; ``Store`` (the package's ``__init__``) is made of
them all. A room that builds on another inherits it (the sender, the producers and the
clock correction build on the outbox; the file's life on the write path); the write
path's two calls into the file's life are declared there (``_reopen``,
``_ensure_reserve``).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .writes import StoreIO, WriteState


class StoreBase:
    # The file (files.py)
    path: Path
    epoch: str
    gateway_id: str
    moved_aside: Path | None  # where a corrupt file was moved, if this open did so
    held: bool  # opened read-only: the card refused writes at the start
    _db: sqlite3.Connection  # writes (and the reads a transaction makes)
    _rdb: sqlite3.Connection  # reads outside a transaction: WAL lets them not wait
    _lock: threading.RLock  # around _db
    _rlock: threading.RLock  # around _rdb
    _gateway_id_given: str | None
    _held_error: BaseException | None
    _held_copy: Path | None
    _reopen_at: float
    # The write path (writes.py)
    io: StoreIO
    write_state: WriteState
    reserve_path: Path
    reserve_bytes: int
    refused_disk_full: int
    _listeners: list[Callable[[], None]]
    # The seqs (outbox.py: the table of names is in the package's docstring)
    quota_bytes: int | None
    policy: str
    _given: int
    _floor: int
    _floor_pending: int | None
    _claimed: Callable[[], int] | None  # during commit_ops: readings being taken into messages
    # Producers (producers.py)
    _legacy_seen: bool
    # Stats (stats.py)
    _forgetting: list[list[int]]
    _forgetting_lock: threading.Lock


def bump(db: sqlite3.Connection, name: str, n: int) -> None:
    """Add ``n`` to the durable counter ``name``, inside the caller's transaction."""
    if n:
        db.execute(
            "INSERT INTO counters VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            (name, n),
        )
