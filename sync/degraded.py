"""Degraded delivery: what the store holds goes out while the store cannot be written.

A dying SD card (ext4 remounted read-only, writes failing with EIO) stops the
QoS 2 session: a new PUBLISH needs its packet id committed first (rule 1), a
PUBREL needs its PUBREC committed first (rule 2). Its persisted state is left
exactly as it is. Meanwhile this module delivers the readings the store holds
on a SEPARATE session, at least once:

- client id ``<client-id>-ro``, clean start, session expiry 0 (3.1.1:
  CleanSession=1): the broker forgets it at disconnect, and it never shares
  a packet id with the main session (packet ids are per session);
- QoS 1, packet ids in memory only, nothing committed;
- every outbox row the store held when the episode began, oldest first
  (in-flight messages' readings and waiting ones alike), read through the
  store's read connection, in the same payload format as the main session's
  messages. Rows committed later (the commit that proves the card healed, a
  node's message right after it) are the QoS 2 session's alone: the read
  connection sees them before this loop sees the store writable again, and
  sending them here would only make copies at the cloud.

When a probe commit succeeds (at most every ``probe_every`` seconds, or any
other commit does), it disconnects and the uplink resumes its QoS 2 session,
which sends everything again: MQTT-level duplicates of what was delivered
here, absorbed by the cloud's dedup on reading ids. The trade: at-least-once
while the card is dying, instead of nothing at all (docs/failure-model.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .client import BrokerURL, ConnectOptions, connect
from .errors import StoreError, TransportError
from .groupcommit import GroupCommit
from .packets import Disconnect, Puback, Publish
from .store import Store

log = logging.getLogger(__name__)

PROBE_EVERY_S = 3.0
WINDOW = 10  # QoS 1 messages in flight on the degraded session


@dataclass
class DegradedStats:
    active: bool = False
    since: float | None = None  # wall time this episode began
    episodes: int = 0
    delivered: int = 0  # readings PUBACKed on the degraded session, ever
    messages: int = 0
    probes: int = 0
    last_error: str | None = None


@dataclass(frozen=True)
class DegradedLink:
    """What the degraded session takes from its uplink, handed over rather than reached
    for (sync/uplink.py builds it): where to connect, and what a message may be."""

    url: BrokerURL
    options: ConnectOptions  # the uplink's; the degraded session's client id is its + "-ro"
    topic: str
    batch: int  # readings per message, at most
    max_bytes: int  # payload bytes per message, at most
    overhead: int  # bytes a payload adds to its readings (what sizes are reckoned with)
    encode: Callable[[list[bytes]], bytes]  # a message's payload from its rows' bodies


class DegradedDelivery:
    """Runs while the store is unwritable; see the module docstring. ``on_state`` is
    told the uplink's state while it runs ("degraded")."""

    def __init__(
        self,
        store: Store,
        commits: GroupCommit,
        link: DegradedLink,
        on_state: Callable[[str], None],
        probe_every: float = PROBE_EVERY_S,
    ) -> None:
        self.store = store
        self.commits = commits
        self.link = link
        self.on_state = on_state
        self.probe_every = probe_every
        self.stats = DegradedStats()
        self.opts: ConnectOptions = dataclasses.replace(
            link.options, client_id=f"{link.options.client_id}-ro"
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver what the store holds until it can be written again (or ``stop``)."""
        st = self.stats
        st.active, st.since, st.episodes = True, time.time(), st.episodes + 1
        self.on_state("degraded")
        log.error(
            "store unwritable: delivering what it holds on session %s (QoS 1, not durable)",
            self.opts.client_id,
        )
        next_probe = time.monotonic() + self.probe_every
        done_upto = 0  # every reading up to this seq was PUBACKed in this episode
        held = await asyncio.to_thread(self.store.newest_seq)
        try:
            while not stop.is_set() and not self.store.write_state.writable:
                if time.monotonic() >= next_probe:
                    if await self._probe():
                        break
                    next_probe = time.monotonic() + self.probe_every
                try:
                    done_upto = await self._session(stop, done_upto, held, next_probe)
                except (TransportError, OSError, TimeoutError) as exc:
                    st.last_error = f"{type(exc).__name__}: {exc}"
                    log.warning("degraded delivery: %s", st.last_error)
                    with contextlib.suppress(TimeoutError):
                        wait = max(0.0, min(1.0, next_probe - time.monotonic()))
                        await asyncio.wait_for(stop.wait(), wait)
        finally:
            st.active = False
        log.warning(
            "store writable again: %d readings were delivered while it was not; "
            "the QoS 2 session resumes and sends them again (the cloud dedups them)",
            st.delivered,
        )

    async def _probe(self) -> bool:
        """A small real commit: True once the store takes writes again."""
        self.stats.probes += 1
        with contextlib.suppress(StoreError):
            await self.commits.submit(self.store.probe_write_in, within=0)
        return self.store.write_state.writable

    async def _session(self, stop: asyncio.Event, done_upto: int, held: int, until: float) -> int:
        """One connection of the degraded session, sending the rows up to ``held``, until
        ``until`` (monotonic), a stop, or the store writable again; returns how far the
        PUBACKs got."""
        conn, _ = await connect(self.link.url, self.opts, clean_start=True, session_expiry=0)
        try:
            cursor = done_upto
            inflight: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()
            next_pid = 0
            while not stop.is_set() and not self.store.write_state.writable:
                while len(inflight) < WINDOW:
                    rows = await asyncio.to_thread(self._next_message, cursor, held)
                    if not rows:
                        break
                    bodies = [b for _, _, b in rows]
                    last = rows[-1][0] + rows[-1][1] - 1
                    next_pid = next_pid % 65535 + 1
                    while next_pid in inflight:
                        next_pid = next_pid % 65535 + 1
                    payload = self.link.encode(bodies)
                    await conn.send(Publish(self.link.topic, payload, 1, packet_id=next_pid))
                    inflight[next_pid] = (last, sum(n for _, n, _ in rows))
                    cursor = last
                left = until - time.monotonic()
                if left <= 0:
                    break
                for pkt in await conn.recv(min(left, 0.5)):
                    if isinstance(pkt, Puback) and pkt.packet_id in inflight:
                        last, n = inflight.pop(pkt.packet_id)
                        self.stats.delivered += n
                        self.stats.messages += 1
                        if not inflight or min(v[0] for v in inflight.values()) > last:
                            done_upto = max(done_upto, last)
                        if not inflight:
                            done_upto = max(done_upto, cursor)
            return done_upto
        finally:
            await conn.close(Disconnect())

    def _next_message(self, after_seq: int, held: int) -> list[tuple[int, int, bytes]]:
        """The outbox rows of the next message above ``after_seq`` and up to ``held``:
        about a batch of readings within the payload limit (the read connection: no
        write needed)."""
        link = self.link
        rows = self.store.waiting_rows(after_seq, link.batch, upto=held)
        out: list[tuple[int, int, bytes]] = []
        size, count = link.overhead, 0
        for seq, n, body in rows:
            if out and (size + len(body) + 1 > link.max_bytes or count + n > link.batch):
                break
            out.append((seq, n, body))
            size, count = size + len(body) + 1, count + n
        return out

    def metrics(self) -> dict[str, Any]:
        st = self.stats
        return {
            "active": st.active,
            "since": st.since if st.active else None,
            "client_id": self.opts.client_id,
            "delivered_while_unwritable": st.delivered,
            "messages": st.messages,
            "episodes": st.episodes,
            "last_error": st.last_error,
        }
