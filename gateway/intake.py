"""Intake: every reading on its way into the store, through the gateway's group commit.

Node messages wait for their commit (the ingress sends PUBACK only after it)
and may wait ``commit_delay`` for company, or longer for a node that sends
seldom (its *patience*, below); sensor readings, which nobody
waits for, gather for up to ``sensor_delay`` and ride whatever commit comes
first. The commits themselves are the shared ``GroupCommit``'s (one
transaction, one fsync for node messages, sensor readings and the uplink's
session transitions alike); see sync/groupcommit.py.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pubcomp.sync.errors import StoreFull, StoreUnwritable
from pubcomp.sync.groupcommit import GroupCommit
from pubcomp.sync.store import Reading, Store

log = logging.getLogger(__name__)

SENSOR_DELAY_S = 1.0
# A node's PUBACK may be held for this share of the time between its messages (up to
# ``max_hold``): a node that reports every 10 s waits up to 0.5 s, and the messages of
# a quiet fleet share fsyncs instead of paying one each. A node that sends as fast as it
# is acknowledged has a gap of one commit, so its patience stays below ``commit_delay``
# and it is never slowed (docs/architecture.md, "What is written when").
PATIENCE = 0.05


@dataclass
class IntakeStats:
    committed_readings: int = 0
    duplicates: int = 0
    refused_full: int = 0
    refused_unwritable: int = 0  # node messages refused: the store's file system refuses writes
    last_error: str | None = None  # the last failed commit of readings, cleared by a good one
    counters: collections.Counter[str] = field(default_factory=collections.Counter)


class Intake:
    def __init__(
        self,
        store: Store,
        *,
        commits: GroupCommit | None = None,
        commit_delay: float = 0.002,
        sensor_delay: float = SENSOR_DELAY_S,
        max_hold: float = 0.0,
        on_commit: Callable[[Sequence[Reading]], None] | None = None,
    ) -> None:
        self.store = store
        self.commits = commits or GroupCommit(store, commit_delay=commit_delay)
        self._own_commits = commits is None
        self.on_commit = on_commit  # sees the sensor readings of each commit, after it
        self.sensor_delay = sensor_delay
        self.max_hold = max_hold
        self._arrivals: dict[str, tuple[float, float | None]] = {}  # producer: (last, smoothed gap)
        self.stats = IntakeStats()
        self._sensor: list[Reading] = []
        self._state: dict[str, str] = {}
        self._in_flight = 0  # readings handed to the group commit, not yet committed
        self.commits.add_source(self._take_sensor_readings)

    async def submit(
        self, key: str | None, readings: Sequence[Reading], producer: str | None = None
    ) -> bool:
        """Commit a message's readings; True if stored, False if ``key`` was seen before.

        Raises StoreFull or StoreUnwritable when the store refuses: the caller must
        not acknowledge.
        """
        batch = [(key, readings)]
        self._in_flight += len(readings)
        patience = self.patience(producer)
        try:
            stored: bool = await self.commits.submit(
                lambda db: self.store.append_batches_in(db, batch)[0],
                within=patience,
                # A patient message waits for its deadline: it must not count towards
                # the "as many as waited together lately" rule, which would send it alone.
                peer=(producer or "") if patience is None else None,
            )
        except StoreFull:
            self.stats.refused_full += 1
            raise
        except StoreUnwritable:
            self.stats.refused_unwritable += 1
            self.store.write_state.refused_readings += len(readings)
            raise
        except Exception as exc:
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._in_flight -= len(readings)
        self.stats.last_error = None
        if stored:
            self.stats.committed_readings += len(readings)
        else:
            self.stats.duplicates += 1
        return stored

    def patience(self, producer: str | None) -> float | None:
        """How long this producer's message may wait for company, if longer than the
        commit delay: ``PATIENCE`` of the shorter of its last gap and its smoothed gap
        (a node speeding up is served at once), at most ``max_hold``."""
        if producer is None or self.max_hold <= 0:
            return None
        now = time.monotonic()
        last, smooth = self._arrivals.get(producer, (None, None))
        if last is None:  # its first message: no gap known yet
            self._arrivals[producer] = (now, None)
            return None
        gap = now - last
        smooth = gap if smooth is None else 0.8 * smooth + 0.2 * gap
        self._arrivals[producer] = (now, smooth)
        within = min(self.max_hold, PATIENCE * min(gap, smooth))
        return within if within > self.commits.commit_delay else None

    def add(self, reading: Reading) -> None:
        """A sensor reading: committed with the next group, at the latest after ``sensor_delay``."""
        self._sensor.append(reading)
        self.commits.poke(self.sensor_delay)

    def set_state(self, key: str, value: str) -> None:
        """Saved in the next commit, atomically with the readings before it."""
        self._state[key] = value
        self.commits.poke(self.sensor_delay)

    @property
    def queued(self) -> int:
        return len(self._sensor) + self._in_flight

    def _take_sensor_readings(self) -> None:
        """Called on the event loop as a group forms: hand over the readings and the state
        gathered so far, at one instant (a driver's state never runs ahead of its readings)."""
        if not (self._sensor or self._state):
            return
        readings, self._sensor = self._sensor, []
        state, self._state = self._state, {}
        batch: list[tuple[str | None, Sequence[Reading]]] = [(None, readings)] if readings else []
        self._in_flight += len(readings)
        fut = self.commits.submit(
            lambda db: self.store.append_batches_in(db, batch, state), within=0
        )
        fut.add_done_callback(lambda f: self._sensor_committed(f, readings, state))

    def _sensor_committed(
        self, fut: asyncio.Future[Any], readings: list[Reading], state: dict[str, str]
    ) -> None:
        self._in_flight -= len(readings)
        exc = fut.exception()
        if exc is None:
            self.stats.committed_readings += len(readings)
            self.stats.last_error = None
            if self.on_commit is not None and readings:
                self.on_commit(readings)
            return
        if isinstance(exc, StoreFull | StoreUnwritable):
            log.error("store refused %d sensor readings: %s", len(readings), exc)
            if isinstance(exc, StoreUnwritable):  # a dying card, not a full one
                self.stats.counters["sensor_readings_refused_unwritable"] += len(readings)
                self.store.write_state.refused_readings += len(readings)
            else:
                self.stats.counters["sensor_readings_refused"] += len(readings)
        else:
            log.error("committing %d sensor readings failed: %s", len(readings), exc)
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            self.stats.counters["sensor_readings_lost"] += len(readings)
        self._state = state | self._state  # the state is saved again with the next readings

    async def run(self) -> None:
        """Standalone use (tests, benchmarks): run this intake's own group commit until
        ``close()``. A gateway shares one GroupCommit and runs it itself."""
        if self._own_commits:
            await self.commits.run()

    def close(self) -> None:
        if self._own_commits:
            self.commits.close()
