"""The end-to-end acknowledgement (issue 24, design rule 9): the ingest tells each
gateway which of its store's seqs are durably in the landing zone.

A gateway keeps every reading the broker completed until it hears this, so the
broker is a relay, never the only copy. The ledger records, per gateway topic, the
seqs landed (only after the landing file's fsync returned: the caller adds a
group's spans once its write is durable). The publisher sends each gateway's
ranges on ``{prefix}/{gateway}/landed/{ingest}``, QoS 1, retained (a gateway that
reconnects learns them at once), at most once per ``interval`` per gateway, so
the broker carries about one small message a second per gateway. Each ingest
process has its own topic, so the acknowledgements of several ingests sharing one
gateway's messages combine at the gateway (ranges, not one watermark).

The acknowledgement is cumulative but bounded (``MAX_LANDED_RANGES``, the oldest
ranges dropped first); a gateway that missed a dropped range publishes those
readings again after its landing timeout, and the pipeline removes the copy.
At a start the publisher reads its own retained acknowledgements back, so a
restarted ingest does not forget what it had said.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pubcomp.sync import wire
from pubcomp.sync.client import Backoff, BrokerURL, ConnectOptions, connect
from pubcomp.sync.packets import (
    Disconnect,
    Puback,
    Publish,
    Suback,
    Subscribe,
    Subscription,
)
from pubcomp.sync.ranges import RangeSet
from pubcomp.sync.running import reconnecting

log = logging.getLogger(__name__)

READINGS_LEVEL = "/readings"


@dataclass(frozen=True, slots=True)
class Span:
    """What one landed message carried of its gateway's store (the ``outbox`` field)."""

    topic: str  # the message's topic: {prefix}/{gateway}/readings
    gateway: str
    epoch: str
    first: int
    last: int


def span_of(topic: str, msg: object) -> Span | None:
    """The message's span, if it names one (an end-to-end gateway's) and its topic has
    the shape the acknowledgement's topic is made from."""
    if not isinstance(msg, dict) or not topic.endswith(READINGS_LEVEL):
        return None
    box, gateway = msg.get("outbox"), msg.get("gateway")
    if not isinstance(box, dict) or not isinstance(gateway, str):
        return None
    epoch, first, last = box.get("epoch"), box.get("first"), box.get("last")
    if not (isinstance(epoch, str) and type(first) is int and type(last) is int):
        return None
    if not 1 <= first <= last:
        return None
    return Span(topic, gateway, epoch, first, last)


def landed_topic(readings_topic: str, ingest: str) -> str:
    return readings_topic[: -len(READINGS_LEVEL)] + f"/landed/{ingest}"


@dataclass
class _Entry:
    gateway: str
    epoch: str
    ranges: RangeSet = field(default_factory=RangeSet)
    published: float = 0.0  # monotonic: the last acknowledgement sent
    dirty: bool = False


@dataclass
class LandedStats:
    spans: int = 0  # messages landed that named their span
    published: int = 0  # acknowledgements published
    puback_wait: int = 0  # acknowledgements waiting for their PUBACK right now
    seeded: int = 0  # gateways whose ranges were read back from our retained messages
    already_landed: int = 0  # messages not written again: every seq already landed
    last_error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class Ledger:
    """Per gateway (by its readings topic): the seqs landed, and whether it must be told."""

    def __init__(self, ingest: str, *, interval: float = 1.0) -> None:
        self.ingest = ingest
        self.interval = interval
        self.entries: dict[str, _Entry] = {}
        self.stats = LandedStats()
        self.wake = asyncio.Event()

    def covers(self, span: Span) -> bool:
        e = self.entries.get(span.topic)
        return e is not None and e.epoch == span.epoch and e.ranges.covers(span.first, span.last)

    def add(self, spans: Iterable[Span], *, durable: bool = True) -> None:
        """Spans whose lines are on disk (``durable``: their fsync returned)."""
        assert durable, "only what is on disk may be acknowledged"
        added = False
        for s in spans:
            e = self.entries.get(s.topic)
            if e is None or e.epoch != s.epoch:
                # A gateway's new store (a replaced card): its old epoch is gone for good.
                e = self.entries[s.topic] = _Entry(s.gateway, s.epoch)
            e.ranges.add(s.first, s.last)
            e.ranges.cap(wire.MAX_LANDED_RANGES)
            e.dirty = added = True
            self.stats.spans += 1
        if added:
            self.wake.set()

    def seed(self, topic: str, ack: wire.LandedAck) -> None:
        """Our own retained acknowledgement, read back at a start."""
        readings = topic[: topic.rindex("/landed/")] + READINGS_LEVEL
        e = self.entries.get(readings)
        if e is not None and e.epoch != ack.epoch:
            return  # we have landed from a newer store since
        if e is None:
            e = self.entries[readings] = _Entry(ack.gateway, ack.epoch)
            self.stats.seeded += 1
        e.ranges.update(ack.landed)
        e.ranges.cap(wire.MAX_LANDED_RANGES)

    def due(self, now: float) -> tuple[list[tuple[str, _Entry]], float | None]:
        """Entries to publish now, and seconds until the next one is due (None: none)."""
        out: list[tuple[str, _Entry]] = []
        later: float | None = None
        for topic, e in self.entries.items():
            if not e.dirty:
                continue
            wait = e.published + self.interval - now
            if wait <= 0:
                out.append((topic, e))
            else:
                later = wait if later is None else min(later, wait)
        return out, later


class AckPublisher:
    """Publishes the ledger's acknowledgements on a connection of its own (a clean
    session: nothing in it needs to outlive a connection)."""

    def __init__(
        self,
        broker: str,
        options: ConnectOptions,
        ledger: Ledger,
        subscribed_topic: str,
        *,
        master_key: bytes | None = None,
    ) -> None:
        self.url = BrokerURL.parse(broker)
        self.opts = dataclasses.replace(options, client_id=f"{options.client_id}-landed")
        self.ledger = ledger
        self.master_key = master_key
        # Our own retained acknowledgements, under the readings topic filter we subscribe.
        if subscribed_topic.startswith("$share/"):
            subscribed_topic = subscribed_topic.split("/", 2)[2]
        self.own_filter = landed_topic(subscribed_topic, ledger.ingest)
        self._pid = 0

    async def run(self, stop: asyncio.Event) -> None:
        await reconnecting(stop, lambda b: self._connection(stop, b), self._failed)

    def _failed(self, why: str, _: BaseException) -> None:
        self.ledger.stats.last_error = why
        log.warning("landed acknowledgements to %s: %s", self.url, why)

    def _next_pid(self) -> int:
        self._pid = self._pid % 0xFFFF + 1
        return self._pid

    async def _connection(self, stop: asyncio.Event, backoff: Backoff) -> None:
        conn, _ = await connect(self.url, self.opts, clean_start=True, session_expiry=0)
        ledger = self.ledger
        unacked: dict[int, _Entry] = {}
        try:
            sub_pid = self._next_pid()
            await conn.send(Subscribe(sub_pid, [Subscription(self.own_filter, qos=0)]))
            backoff.reset()
            # Everything is told again on a new connection: an acknowledgement whose
            # PUBACK never came may not have reached the broker.
            for e in ledger.entries.values():
                e.dirty = e.dirty or bool(e.ranges)
                e.published = 0.0
            while not stop.is_set():
                ledger.wake.clear()  # before looking: a span added meanwhile wakes us
                due, later = ledger.due(time.monotonic())
                out = [self._publish(topic, e, unacked) for topic, e in due]
                if out:
                    await conn.send(*out)
                    ledger.stats.published += len(out)
                ledger.stats.puback_wait = len(unacked)
                timeout = 1.0 if later is None else min(1.0, later)
                pkts = await conn.recv_until(stop, timeout, ledger.wake)
                for pkt in pkts:
                    if isinstance(pkt, Puback):
                        unacked.pop(pkt.packet_id, None)
                    elif isinstance(pkt, Publish) and pkt.retain:
                        self._seed(pkt)
                    elif isinstance(pkt, Suback):
                        log.info("reading back acknowledgements on %s", self.own_filter)
        finally:
            # What was published and not acknowledged is told again next time.
            for e in unacked.values():
                e.dirty = True
            await conn.close(Disconnect() if stop.is_set() else None)

    def _publish(self, topic: str, e: _Entry, unacked: dict[int, _Entry]) -> Publish:
        key = None if self.master_key is None else wire.gateway_key(self.master_key, e.gateway)
        ranges = list(e.ranges)
        payload = wire.encode_landed(e.gateway, e.epoch, self.ledger.ingest, ranges, key=key)
        e.dirty = False
        e.published = time.monotonic()
        pid = self._next_pid()
        unacked[pid] = e
        where = landed_topic(topic, self.ledger.ingest)
        return Publish(where, payload, 1, retain=True, packet_id=pid)

    def _seed(self, pkt: Publish) -> None:
        ack = wire.parse_landed(pkt.payload)
        if isinstance(ack, wire.LandedAck) and ack.ingest == self.ledger.ingest:
            self.ledger.seed(pkt.topic, ack)
