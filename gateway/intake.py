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
from collections.abc import Sequence
from dataclasses import dataclass, field

from pubcomp.sync.store import Reading, Store, StoreFull

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    key: str | None
    readings: Sequence[Reading]
    done: asyncio.Future[bool] | None  # None for sensor readings (nobody waits)


@dataclass
class IntakeStats:
    committed_readings: int = 0
    commits: int = 0
    duplicates: int = 0
    refused_full: int = 0
    largest_group: int = 0
    counters: collections.Counter[str] = field(default_factory=collections.Counter)


class Intake:
    def __init__(self, store: Store, *, max_group: int = 2000) -> None:
        self.store = store
        self.max_group = max_group
        self.stats = IntakeStats()
        self._pending: collections.deque[_Pending] = collections.deque()
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

    async def run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending or self._state:
                    await self._commit_group()
        finally:
            await self.flush()

    async def flush(self) -> None:
        """Commit whatever is pending (on shutdown)."""
        while self._pending or self._state:
            await self._commit_group()

    async def _commit_group(self) -> None:
        group: list[_Pending] = []
        readings = 0
        while self._pending and readings < self.max_group:
            p = self._pending.popleft()
            group.append(p)
            readings += len(p.readings)
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
            for p in nodes:
                if not p.done.done():  # type: ignore[union-attr]
                    p.done.set_exception(exc)  # type: ignore[union-attr]
            self._state = state | self._state
            return
        self.stats.commits += 1
        self.stats.largest_group = max(self.stats.largest_group, len(group))
        for p, stored in zip(nodes, results, strict=False):
            if stored:
                self.stats.committed_readings += len(p.readings)
            else:
                self.stats.duplicates += 1
            if not p.done.done():  # type: ignore[union-attr]
                p.done.set_result(stored)  # type: ignore[union-attr]
        self.stats.committed_readings += len(sensor)
