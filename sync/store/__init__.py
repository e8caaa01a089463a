"""The durable session store: one SQLite file per gateway (design section 3).

A package of rooms, one concern each; ``Store`` is made of them all (they are mixins
over ``base.StoreBase``, which declares the state they share)::

    files.py      the file's life: open, pragmas, a corrupt file moved aside, the
                  read-only held copy, the disk reserve, close
    writes.py     the write path: commit_ops (the group commit's), commit (one op,
                  at once), a full disk, a file system that refuses writes
    outbox.py     readings in (seqs and ids given), the quota, the seq floor, rows
                  read for messages and split for a small broker
    packing.py    how a row's readings are encoded and compressed (no file)
    producers.py  node message keys stored once (dedup); a driver's saved state
    clock.py      clock correction of waiting readings
    sender.py     the sender session: messages in flight, awaiting landing (rule 9),
                  dead letters
    receiver.py   what an old QoS 2 receiver's file holds (read once by the ingest)
    stats.py      one snapshot of every figure; the durable counters
    ledger.py     the ledger (issue 27): events appended in the transaction of what they
                  describe, and the op that makes a $ledger record of them
    legacy.py     every migration of a file written by an older pubcomp
    schema.py     the tables, and the schema version

**One write API.** Every change is an op: a method named ``..._in(db, ...)``, run inside
a transaction. A gateway submits ops to its ``GroupCommit`` (sync/groupcommit.py),
which commits them with ``Store.commit_ops``; anything else (``pubcomp store import``,
tests, benchmarks) commits an op with ``Store.commit(op, frees=...)``, the same path for
a group of one. There is no second way to write, so what the tests prove is what the
gateway runs.

Rules (numbers as in docs/architecture.md, "The store's rules"): 1-4 the sender
session (sender.py); 5 receivers commit what they received with its id (the ingress's
message keys, producers.py); 6 grouped commits (writes.py); 7 the quota with
``drop_oldest`` or ``refuse_new`` (outbox.py); 8 a corrupt file moved aside, never
deleted (files.py); 9 end to end, delivered messages kept until landed (sender.py).

**The seqs.** Every reading is given a seq (its id, from the gateway, is
``origin/epoch/seq``); a seq is never given twice. Which seq is which::

    given_seq()               the highest seq ever given to a reading (in memory:
                              ``_given``)
    _floor                    the floor in force (``meta.last_seq``): after a restart
                              seqs go on above it, even if the outbox drained;
                              ``_keep_seq_floor`` raises it ``SEQ_BLOCK`` ahead
    seq_given_on_disk(db)     at an open: the highest seq any trace on disk says was
                              given (the floor, an old file's AUTOINCREMENT counter,
                              the dead letters, the newest row); ``_given`` starts there
    newest_row_end(db)        the last seq of the newest outbox row (0 if empty)
                              (``newest_seq()`` through the read connection)
    taken_seq()               the highest seq any message holds (in flight, queued,
                              awaiting landing): readings above it wait; the uplink's
                              cursor starts there (``taken_seq_in(db)`` in a transaction)
    claimed                   readings up to here are being taken into messages whose
                              op is still on its way: a parameter of ``commit_ops``
                              (the group commit's ``claims``), never set from outside
    _untouchable_seq(db)      max(taken, claimed): no quota drop or clock correction
                              changes a reading at or below it
    oldest_undelivered_seq()  the oldest reading not yet delivered (awaiting landing
                              counts as delivered); infinity if none
    sent_seq()                every seq at or below it has been in a message (or was
                              dropped): the highest an end-to-end acknowledgement may
                              name
    Message.first_seq,        a message's range of whole rows (the columns of
    Message.last_seq          ``out_inflight``; not ``meta.last_seq``, the floor)
"""

from __future__ import annotations

from ..errors import CorruptStore, StoreError, StoreFull, StoreUnwritable
from .clock import ClockCorrection
from .files import PAGE_SIZE, StoreFile, fsync_dir
from .ledger import RECORD_SRC, Ledger
from .outbox import POLICIES, SEQ_BLOCK, Reading
from .packing import ROW_BYTES, ROW_READINGS, decode_body, pack_body, unpack_body
from .producers import MAX_SEEN_RANGES, Producers, add_to_ranges
from .receiver import held_receive_ids
from .schema import SCHEMA, SCHEMA_VERSION
from .sender import Message, Sender
from .stats import Stats
from .writes import (
    IO_ERRORS,
    READ_ONLY,
    DbOp,
    StoreIO,
    WriteState,
    is_disk_full,
    is_unwritable,
)


class Store(StoreFile, Producers, ClockCorrection, Sender, Stats, Ledger):
    """The gateway's durable session store. One instance per process and file.

    Methods are thread-safe (one lock around the write connection, one around the read
    connection) so that the uplink's event loop, the group commit's thread and driver
    threads can share it.
    """


__all__ = [
    "IO_ERRORS",
    "MAX_SEEN_RANGES",
    "PAGE_SIZE",
    "POLICIES",
    "READ_ONLY",
    "RECORD_SRC",
    "ROW_BYTES",
    "ROW_READINGS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SEQ_BLOCK",
    "CorruptStore",
    "DbOp",
    "Message",
    "Reading",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreIO",
    "StoreUnwritable",
    "WriteState",
    "add_to_ranges",
    "decode_body",
    "fsync_dir",
    "held_receive_ids",
    "is_disk_full",
    "is_unwritable",
    "pack_body",
    "unpack_body",
]
