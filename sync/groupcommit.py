"""Group commit: one transaction and one fsync for everything that is waiting.

Every durable change on a gateway goes through one ``GroupCommit``: node
messages (whose PUBACK waits for it), sensor readings, and the uplink's
session transitions (a new PUBLISH's packet id, a PUBREC before its PUBREL, a
PUBCOMP). Each change is an *op*, a function run inside the group's SQLite
transaction under its own savepoint, so one op's failure (a refused batch)
does not undo the others. Ops run in the order they were submitted, within a
group and across groups, and a waiter hears of its op only after the COMMIT
covering it has returned (``synchronous=FULL``: after the fsync). That is
what lets an acknowledgement be held back, never sent early, never reordered
(MQTT-4.6.0-2/-3).

A COMMIT the file system refuses (a dying card: read-only, or I/O errors)
fails every op of its group with ``StoreUnwritable`` and marks the store
unwritable (``Store.write_state``); the next COMMIT that succeeds clears it.

When to commit is a matter of deadlines, not of arrival: each op says how
long it may wait (``within``). A PUBACK a node is waiting for may wait a few
milliseconds (``commit_delay``), so the messages of several nodes share an
fsync. A group is full, and goes at once, when as many producers wait in it as
waited together lately and each of them has at least half as many messages
unacknowledged as it lately had at most: four nodes with one message in
flight each are all in with four messages, and none will send more before it
hears from this commit; one node keeping twenty in flight is in with ten,
since waiting for its window to fill would stall it. A PUBCOMP may wait
seconds, because forgetting it is never urgent (a PUBREL resent after a crash
only draws another PUBCOMP); a sensor reading nobody waits for may wait a
second.
Whatever is pending rides the first commit any deadline calls for. While one
commit runs (in a worker thread, so the event loop keeps receiving),
everything that arrives gathers for the next.

Sources are polled on the event loop as a group forms (the intake's sensor
readings and driver state), so what a source hands over is taken at one
instant and a driver's saved state never runs ahead of its readings.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import CommitStopped, StoreFull, StoreUnwritable
from .store import DbOp, Store

log = logging.getLogger(__name__)

Source = Callable[[], None]


@dataclass(slots=True)
class _Op:
    fn: DbOp
    deadline: float
    frees: bool  # deletes data (deliveries): may spend the store's disk reserve
    done: asyncio.Future[Any] | None
    # The producer waiting for it (a node, for its PUBACK): counts towards a full group
    peer: str | None = None
    # Readings up to this seq are taken into the message(s) this op commits (``submit``)
    claims: int = 0


@dataclass
class CommitStats:
    commits: int = 0
    failed_commits: int = 0
    last_error: str | None = None  # the last commit's failure, cleared by a good one
    last_error_at: float | None = None


class GroupCommit:
    """Commits a store's pending ops in groups; see the module docstring."""

    def __init__(self, store: Store, *, commit_delay: float = 0.002, max_ops: int = 5000) -> None:
        self.store = store
        self.commit_delay = commit_delay
        self.max_ops = max_ops
        self.stats = CommitStats()
        self._pending: collections.deque[_Op] = collections.deque()
        self._sources: list[Source] = []
        self._poke_deadline: float | None = None
        self._wake = asyncio.Event()
        self._closed = False
        self._running = False
        self._ended = False  # the loop is gone (cancelled, or closed and done)
        self._committing: list[_Op] = []  # the group in the worker thread
        # How many producers waited together in recent groups: once that many are
        # waiting again, the group is as full as it gets and need not wait its delay.
        self._recent_peers: collections.deque[int] = collections.deque(maxlen=16)
        self._peers_pending: collections.Counter[str] = collections.Counter()  # in _pending
        self._unacked: collections.Counter[str] = collections.Counter()  # pending or committing
        # Each producer's unacknowledged count at its recent submits, and their maximum:
        # what it keeps in flight when it sends as fast as it may.
        self._window: dict[str, collections.deque[int]] = {}
        self._peak: dict[str, int] = {}
        # The claims of ops not yet committed (``submit``), and their highest, which the
        # committing thread reads (``claimed``) while it runs a group.
        self._claims: collections.Counter[int] = collections.Counter()
        self._claimed = 0

    # ------------------------------------------------------------ producers

    def submit(
        self,
        fn: DbOp,
        *,
        within: float | None = None,
        frees: bool = False,
        peer: str | None = None,
        claims: int = 0,
    ) -> Any:
        """Queue ``fn(db)`` for a group; returns a future of its result, set after the COMMIT.

        ``within``: the longest it may wait for company (default ``commit_delay``).
        ``peer``: the producer that waits for this commit (a node): when as many
        producers wait as did together lately, the group commits at once.
        ``claims``: ``fn`` takes the readings up to this seq into messages whose payloads
        are built already (the uplink's new PUBLISHes): until it is committed, no other
        op (a quota drop, a clock correction) may drop or rewrite them.
        """
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue(_Op(fn, self._deadline(within), frees, fut, peer, claims))
        return fut

    def claimed(self) -> int:
        """The highest seq claimed by an op not yet committed (0 if none): what the store
        keeps every op of a group from touching (``Store.commit_ops``'s ``claimed``)."""
        return self._claimed

    def submit_nowait(self, fn: DbOp, *, within: float, frees: bool = False) -> None:
        """Queue ``fn(db)`` with nobody waiting for it (a failure is logged and counted)."""
        self._queue(_Op(fn, self._deadline(within), frees, None))

    def add_source(self, source: Source) -> None:
        """``source()`` is called on the event loop as each group forms; what it submits
        then leads the group, ahead of ops queued earlier (see module docstring)."""
        self._sources.append(source)

    def poke(self, within: float) -> None:
        """A source has something: commit within ``within`` seconds."""
        deadline = self._deadline(within)
        if self._poke_deadline is None or deadline < self._poke_deadline:
            self._poke_deadline = deadline
        self._wake.set()

    async def flush(self) -> None:
        """Return once everything submitted so far is committed (or failed)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue(_Op(lambda db: None, 0.0, False, fut))
        await fut

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _deadline(self, within: float | None) -> float:
        return time.monotonic() + (self.commit_delay if within is None else max(0.0, within))

    def _queue(self, op: _Op) -> None:
        if self._closed and not self._running:
            raise RuntimeError("group commit is closed")
        if self._ended:  # nobody would ever commit it, and its waiter would wait forever
            raise CommitStopped("the group commit has stopped: nothing more is committed")
        self._pending.append(op)
        if op.claims:
            self._claims[op.claims] += 1
            self._claimed = max(self._claimed, op.claims)
        if op.peer is not None:
            self._peers_pending[op.peer] += 1
            self._unacked[op.peer] += 1
            window = self._window.setdefault(op.peer, collections.deque(maxlen=32))
            window.append(self._unacked[op.peer])
            self._peak[op.peer] = max(window)
        if op.deadline <= time.monotonic() or len(self._pending) >= self.max_ops or self._full():
            self._wake.set()
        elif self._next_deadline() == op.deadline:
            self._wake.set()  # an earlier deadline than the loop is sleeping towards

    # -------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Commit until ``close()``; then commit everything left and return."""
        self._running = True
        try:
            while True:
                await self._wait_for_deadline()
                if self._pending or self._poke_deadline is not None:
                    await self._commit_group()
                elif self._closed:
                    return
        finally:
            self._running = False
            self._ended = True
            self._fail_waiters()

    def _fail_waiters(self) -> None:
        """A cancelled loop leaves ops queued, and maybe a group whose COMMIT it stopped
        waiting for: their waiters hear so now (else they, and a gateway's stop that
        awaits one, would wait forever). Not acknowledged, whether or not it is on disk."""
        left = [*self._committing, *self._pending]
        self._committing, self._pending = [], collections.deque()
        for op in left:
            if op.done is not None and not op.done.done():
                op.done.set_exception(
                    CommitStopped("the group commit stopped before this op's COMMIT returned")
                )

    def close(self) -> None:
        """Finish: ``run`` commits everything queued so far, then returns (it is not
        cancelled, so no commit is cut off between the disk and its waiters)."""
        self._closed = True
        self._wake.set()

    def _full(self) -> bool:
        want = max(self._recent_peers, default=0)
        if not want or len(self._peers_pending) < want:
            return False
        blocked = sum(self._unacked[p] >= (self._peak[p] + 1) // 2 for p in self._peers_pending)
        return blocked >= want

    def _next_deadline(self) -> float | None:
        candidates = [op.deadline for op in self._pending]
        if self._poke_deadline is not None:
            candidates.append(self._poke_deadline)
        return min(candidates) if candidates else None

    async def _wait_for_deadline(self) -> None:
        while True:
            self._wake.clear()
            deadline = self._next_deadline()
            if self._closed or len(self._pending) >= self.max_ops or self._full():
                return
            now = time.monotonic()
            if deadline is not None and deadline <= now:
                return
            timeout = None if deadline is None else deadline - now
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    async def _commit_group(self) -> None:
        self._poke_deadline = None
        queued = len(self._pending)
        for source in self._sources:
            source()
        added = [self._pending.pop() for _ in range(len(self._pending) - queued)]
        self._pending.extendleft(added)  # popped newest first: extendleft restores their order
        group: list[_Op] = []
        while self._pending and len(group) < self.max_ops:
            group.append(self._pending.popleft())
        if not group:
            return
        peers = collections.Counter(op.peer for op in group if op.peer is not None)
        self._peers_pending -= peers  # Counter subtraction drops producers left at zero
        if peers:
            self._recent_peers.append(len(peers))
        self._committing = group
        try:
            outcomes = await asyncio.to_thread(self._commit, group)
        except Exception as exc:  # the COMMIT failed: nothing in the group is durable
            # (StoreUnwritable included: no waiter hears anything but this failure)
            self.stats.failed_commits += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            self.stats.last_error_at = time.time()
            log.error("group commit of %d ops failed: %s", len(group), exc)
            outcomes = [(False, exc)] * len(group)
        else:
            self.stats.commits += 1
            self.stats.last_error = None
            self.store.notify()
        self._committing = []  # (not on a cancel: the loop's end tells these waiters)
        self._unacked -= peers  # (the window of a producer stays: nodes are few and named)
        claims = collections.Counter(op.claims for op in group if op.claims)
        if claims:
            self._claims -= claims
            self._claimed = max(self._claims, default=0)
        for op, (ok, value) in zip(group, outcomes, strict=True):
            if op.done is None:
                if not ok and not isinstance(value, StoreFull | StoreUnwritable):
                    log.error("store change with no waiter failed: %s", value)
                continue
            if op.done.done():
                continue
            if ok:
                op.done.set_result(value)
            else:
                op.done.set_exception(value)

    def _commit(self, group: list[_Op]) -> list[tuple[bool, Any]]:
        """In the worker thread: the group's transaction (``Store.commit_ops``: a full
        disk makes room or refuses what adds data; a file system that refuses writes
        fails the whole group with ``StoreUnwritable``, recorded in the store)."""
        return self.store.commit_ops([(op.fn, op.frees) for op in group], claimed=self.claimed)
