"""Intake: every reading on its way into the store, committed in groups.

Node messages wait for their commit (the ingress sends PUBACK only after it);
sensor readings are committed with the next group. While one commit runs (in a
worker thread, so the event loop keeps receiving), everything that arrives
gathers into the next one: under load, one fsync covers many messages from
many nodes, and an idle gateway commits a lone message at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pubcomp.sync.store import Reading, Store, StoreFull

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    key: str | None
    readings: Sequence[Reading]
    done: asyncio.Future[bool] | None  # None for sensor readings (nobody waits)


@dataclass
class _Op:
    """Store work that must follow every commit queued before it (a clock correction)."""

    fn: Callable[[], Any]
    done: asyncio.Future[Any]


@dataclass
class IntakeStats:
    committed_readings: int = 0
    commits: int = 0
    duplicates: int = 0
    refused_full: int = 0
    largest_group: int = 0
    last_error: str | None = None  # the last commit's failure, cleared by a good commit
    counters: collections.Counter[str] = field(default_factory=collections.Counter)


class Intake:
    def __init__(
        self,
        store: Store,
        *,
        max_group: int = 2000,
        on_commit: Callable[[Sequence[Reading]], None] | None = None,
    ) -> None:
        self.store = store
        self.on_commit = on_commit  # sees the sensor readings of each commit, after it
        self.max_group = max_group
        self.stats = IntakeStats()
        self._pending: collections.deque[_Pending | _Op] = collections.deque()
        self._state: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._closed = False

    async def submit(self, key: str | None, readings: Sequence[Reading]) -> bool:
        """Commit a message's readings; True if stored, False if ``key`` was seen before.

        Raises StoreFull when the store refuses: the caller must not acknowledge.
        """
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(key, readings, fut))
        self._wake.set()
        return await fut

    def add(self, reading: Reading) -> None:
        """A sensor reading: committed with the next group."""
        self._pending.append(_Pending(None, (reading,), None))
        self._wake.set()

    def set_state(self, key: str, value: str) -> None:
        """Saved in the next commit, atomically with the readings before it."""
        self._state[key] = value
        self._wake.set()

    async def after_commits(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the event loop once everything queued before it is committed.

        On the loop thread, so it cannot interleave with the uplink taking
        readings into messages.
        """
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append(_Op(fn, fut))
        self._wake.set()
        return await fut

    @property
    def queued(self) -> int:
        return sum(len(p.readings) for p in self._pending if isinstance(p, _Pending))

    async def run(self) -> None:
        """Commit until ``close()``; then commit what is left and return."""
        while True:
            self._wake.clear()
            await self._drain()
            if self._closed:
                return
            await self._wake.wait()

    def close(self) -> None:
        """Finish: ``run`` commits everything queued so far, then returns (not cancelled,
        so no commit is cut off between the disk and the waiting nodes)."""
        self._closed = True
        self._wake.set()

    async def _drain(self) -> None:
        while self._pending or self._state:
            head = self._pending[0] if self._pending else None
            if isinstance(head, _Op):
                self._pending.popleft()
                try:
                    head.done.set_result(head.fn())
                except Exception as exc:
                    head.done.set_exception(exc)
            else:
                await self._commit_group()

    async def _commit_group(self) -> None:
        group: list[_Pending] = []
        readings = 0
        while self._pending and readings < self.max_group:
            p = self._pending[0]
            if isinstance(p, _Op):
                break
            group.append(self._pending.popleft())
            readings += len(p.readings)
        # State goes with the last of what was queued before it, never ahead of it.
        state: dict[str, str] = {}
        if not any(isinstance(p, _Pending) for p in self._pending):
            state, self._state = self._state, {}
        # Sensor readings ride along as one keyless batch; node messages keep their keys.
        sensor = [r for p in group if p.done is None for r in p.readings]
        nodes = [p for p in group if p.done is not None]
        batches: list[tuple[str | None, Sequence[Reading]]] = [(p.key, p.readings) for p in nodes]
        if sensor:
            batches.append((None, sensor))
        try:
            results = await asyncio.to_thread(self.store.append_batches, batches, state)
        except StoreFull as exc:
            self.stats.refused_full += len(nodes)
            for p in nodes:
                if not p.done.done():  # type: ignore[union-attr]
                    p.done.set_exception(exc)  # type: ignore[union-attr]
            if sensor:
                log.error("store refused %d sensor readings: %s", len(sensor), exc)
                self.stats.counters["sensor_readings_refused"] += len(sensor)
            self._state = state | self._state
            return
        except Exception as exc:  # a bug or an I/O error: fail the waiters, keep running
            log.exception("intake commit failed")
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            if sensor:
                self.stats.counters["sensor_readings_lost"] += len(sensor)
            for p in nodes:
                if not p.done.done():  # type: ignore[union-attr]
                    p.done.set_exception(exc)  # type: ignore[union-attr]
            self._state = state | self._state
            return
        self.stats.commits += 1
        self.stats.last_error = None
        self.stats.largest_group = max(self.stats.largest_group, len(group))
        for p, stored in zip(nodes, results, strict=False):
            if stored:
                self.stats.committed_readings += len(p.readings)
            else:
                self.stats.duplicates += 1
            if not p.done.done():  # type: ignore[union-attr]
                p.done.set_result(stored)  # type: ignore[union-attr]
        self.stats.committed_readings += len(sensor)
        if self.on_commit is not None and sensor:
            self.on_commit(sensor)
