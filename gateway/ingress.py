"""Node ingress: the gateway is the MQTT server its nodes publish to.

A broker in between would acknowledge from RAM, so the gateway answers each
PUBLISH itself, and only after the readings are committed (fsynced) to the
store. Per node: credentials (user name = node id, scrypt hash in the fleet
file), its own topic only (``nodes/{id}/readings``), payload and rate limits,
the wire format's JSON Schema. A bad message is rejected and counted; nothing
a node sends can crash the gateway or hold up another node.

Exactly once: a message's key ``{node}/{boot}/{seq}`` is committed with its
readings, so a repeated PUBLISH (a QoS 1 retry, a QoS 2 DUP, a retry after a
gateway crash) is acknowledged and never stored twice. That makes QoS 2
packet-id state redundant here: it is kept in memory only (see
docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import ssl
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pubcomp.sync import wire
from pubcomp.sync.codec import Decoder, ProtocolError, encode
from pubcomp.sync.packets import (
    MQTT_5,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Reason,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from pubcomp.sync.running import cancel_all
from pubcomp.sync.session import Deliver, Forget, Reack, ReceiverSession
from pubcomp.sync.session import Reply as SessionReply
from pubcomp.sync.store import Reading, StoreFull, StoreUnwritable

from .config import IngressSection
from .credentials import Verifier
from .intake import Intake

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
RECEIVE_MAXIMUM = 20
HEADROOM = 512  # fixed header, topic and properties around a payload

# A packet's replies: sent at once, or once the commit it waits for has returned.
Reply = list[Packet] | asyncio.Future[list[Packet] | None]


@dataclass
class NodeStats:
    connected: bool = False
    last_seen: float | None = None  # wall clock
    messages: int = 0
    readings: int = 0
    duplicates: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class IngressConfigError(Exception):
    """The ingress cannot start as configured (one line: the key, the file, why)."""


@dataclass
class Listener:
    """One listening socket and its counters (``pubcomp_ingress_*{listener=...}``)."""

    name: str  # "plain" or "tls"
    port: int
    tls: bool
    accepted: int = 0  # connections accepted (before any TLS handshake)
    open: int = 0
    tls_failures: int = 0  # handshakes that failed: plaintext clients, refused certificates

    def as_dict(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "tls": self.tls,
            "accepted": self.accepted,
            "open": self.open,
            "tls_failures": self.tls_failures,
        }


def listener_specs(cfg: IngressSection) -> list[tuple[str, int, bool]]:
    """(name, port, tls) for each listener the section asks for."""
    if cfg.tls_port is not None:
        return [("plain", cfg.port, False), ("tls", cfg.tls_port, True)]
    tls = bool(cfg.tls_cert)
    return [("tls" if tls else "plain", cfg.port, tls)]


class RateLimiter:
    """Token bucket: ``rate`` messages a second with a burst of ``burst``."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst or max(1.0, rate)
        self.tokens = self.burst
        self.last = time.monotonic()

    def delay(self) -> float:
        """Seconds to wait before the next message may be taken (and take it)."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        self.tokens -= 1
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class Ingress:
    def __init__(
        self,
        intake: Intake,
        nodes: dict[str, str],
        config: IngressSection,
        *,
        clock: Any = None,
    ) -> None:
        self.intake = intake
        self.node_hashes = nodes  # node id -> scrypt hash
        self.cfg = config
        # clock.stamp(mono) -> (ISO time, flags) for messages without a time of their own.
        self.clock = clock
        self._verifier = Verifier()
        self.stats: dict[str, NodeStats] = collections.defaultdict(NodeStats)
        self.rejected_connections: collections.Counter[str] = collections.Counter()
        self.listeners = [Listener(*spec) for spec in listener_specs(config)]
        self._servers: list[asyncio.Server] = []
        self._tls: ssl.SSLContext | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: dict[str, asyncio.StreamWriter] = {}

    async def start(self) -> int:
        """Bind every listener; the first one's port (``listeners`` has them all)."""
        if self.cfg.tls_cert:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            try:
                ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise IngressConfigError(
                    f"ingress.tls_cert {self.cfg.tls_cert} / ingress.tls_key {self.cfg.tls_key}: "
                    f"cannot load: {getattr(exc, 'strerror', None) or exc}"
                ) from None
            self._tls = ctx
        for ls in self.listeners:
            # TLS is set up per connection (start_tls), not by the server, so that a
            # failed handshake (a plaintext client, a wrong certificate) is counted.
            server = await asyncio.start_server(
                functools.partial(self._accept, ls), self.cfg.host, ls.port, limit=1 << 20
            )
            self._servers.append(server)
            ls.port = server.sockets[0].getsockname()[1]
            log.info("ingress: %s listener on %s:%d", ls.name, self.cfg.host, ls.port)
        return self.listeners[0].port

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for w in list(self._live.values()):
            w.close()
        await cancel_all(self._tasks)

    def _accept(self, ls: Listener, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._on_listener(ls, r, w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_listener(
        self, ls: Listener, r: asyncio.StreamReader, w: asyncio.StreamWriter
    ) -> None:
        ls.accepted += 1
        ls.open += 1
        try:
            if ls.tls:
                assert self._tls is not None
                try:
                    await w.start_tls(self._tls, ssl_handshake_timeout=CONNECT_TIMEOUT)
                except OSError as exc:  # ssl.SSLError, a reset, the handshake timeout
                    ls.tls_failures += 1
                    log.warning(
                        "ingress: %s listener: TLS handshake with %s failed: %s",
                        ls.name,
                        w.get_extra_info("peername"),
                        exc,
                    )
                    w.close()
                    return
            await self._connection(r, w)
        finally:
            ls.open -= 1

    # ------------------------------------------------------------ a node

    async def _connection(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peer = w.get_extra_info("peername")
        dec = Decoder(None, self.cfg.max_payload_bytes + HEADROOM)
        node: str | None = None
        try:
            connect, pending = await asyncio.wait_for(self._first_packet(r, dec), CONNECT_TIMEOUT)
            node = await self._authenticate(connect, w, dec.version or MQTT_5)
            if node is None:
                return
            await self._serve(node, connect, dec, pending, r, w)
        except ProtocolError as exc:
            # MQTT-4.8.0-1: close on a protocol violation (5.0: say why first).
            who = node or str(peer)
            log.warning("ingress: %s: protocol error: %s", who, exc)
            if node:
                self.stats[node].rejected["protocol_error"] += 1
            if dec.version == MQTT_5:
                with contextlib.suppress(Exception):
                    w.write(encode(Disconnect(exc.reason), MQTT_5))
                    await w.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except StoreFull as exc:
            # Not acknowledged: the node keeps the message and retries later.
            log.error("ingress: %s: not acknowledged, store full: %s", node, exc)
            if node:
                self.stats[node].rejected["store_full"] += 1
        except StoreUnwritable as exc:
            # A dying card: the same as a full disk, the node keeps the message.
            log.error("ingress: %s: not acknowledged: %s", node, exc)
            if node:
                self.stats[node].rejected["store_unwritable"] += 1
        finally:
            if node and self._live.get(node) is w:
                del self._live[node]
                self.stats[node].connected = False
            w.close()
            with contextlib.suppress(Exception):
                await w.wait_closed()

    async def _first_packet(
        self, r: asyncio.StreamReader, dec: Decoder
    ) -> tuple[Connect, list[Packet]]:
        while True:
            data = await r.read(65536)
            if not data:
                raise ConnectionError("closed before CONNECT")
            pkts = dec.feed(data)
            if pkts:
                first = pkts[0]
                assert isinstance(first, Connect)  # the decoder refuses anything else first
                return first, pkts[1:]

    async def _authenticate(self, c: Connect, w: asyncio.StreamWriter, version: int) -> str | None:
        node = c.username or ""
        known = self.node_hashes.get(node)
        ok = (
            known is not None
            and c.password is not None
            and await self._verifier.verify(node, c.password, known)
        )
        if ok and c.client_id not in ("", node):
            ok = False  # a node connects as itself
        if not ok:
            self.rejected_connections[node or "(no user name)"] += 1
            if node in self.node_hashes:
                self.stats[node].rejected["bad_credentials"] += 1
            code = Reason.BAD_USER_NAME_OR_PASSWORD if version == MQTT_5 else 4
            w.write(encode(Connack(False, code), version))
            await w.drain()
            log.warning("ingress: refused connection for user %r", node)
            return None
        return node

    async def _serve(
        self,
        node: str,
        c: Connect,
        dec: Decoder,
        pending: list[Packet],
        r: asyncio.StreamReader,
        w: asyncio.StreamWriter,
    ) -> None:
        version = c.protocol_level
        old = self._live.get(node)
        if old is not None:
            old.close()  # session take-over: the newest connection wins
        self._live[node] = w
        st = self.stats[node]
        st.connected = True
        session = ReceiverSession(version)
        props = {}
        if version == MQTT_5:
            props = {
                "receive_maximum": RECEIVE_MAXIMUM,
                "maximum_packet_size": self.cfg.max_payload_bytes + HEADROOM,
                "retain_available": 0,
                "wildcard_subscription_available": 0,
                "subscription_identifier_available": 0,
                "shared_subscription_available": 0,
                "topic_alias_maximum": 0,
            }
        # Node state that matters lives in the store (message keys), so a node that
        # asked to keep its session always finds one.
        w.write(encode(Connack(not c.clean_start, 0, props), version))
        await w.drain()
        limiter = RateLimiter(self.cfg.max_messages_per_second)
        keepalive = c.keepalive * 1.5 if c.keepalive else None
        # Pipelined: PUBLISHes are taken while earlier ones are still being committed
        # (up to the receive maximum), so one node's messages share fsyncs too; the
        # writer sends each one's replies once its commit has returned, in arrival
        # order (MQTT-4.6.0-2/-3: held back, never reordered).
        replies: asyncio.Queue[Reply | None] = asyncio.Queue()
        window = asyncio.Semaphore(RECEIVE_MAXIMUM)
        writer = asyncio.create_task(self._write_replies(replies, w, version, window))
        reader = asyncio.create_task(
            self._read_packets(node, dec, pending, r, session, version, limiter, keepalive,
                               replies, window)
        )  # fmt: skip
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer in done:
                writer.result()  # a refused commit (StoreFull, StoreUnwritable): no more acks
                return
            reader.result()  # a protocol error closes the connection at once
            await replies.put(None)  # a clean end: the acknowledgements owed still go out
            await writer
        finally:
            await cancel_all((reader, writer))
            while not replies.empty():  # owed, never to be sent: their errors are known
                left = replies.get_nowait()
                if isinstance(left, asyncio.Future):
                    left.add_done_callback(_retrieved)

    async def _read_packets(
        self,
        node: str,
        dec: Decoder,
        pending: list[Packet],
        r: asyncio.StreamReader,
        session: ReceiverSession,
        version: int,
        limiter: RateLimiter,
        keepalive: float | None,
        replies: asyncio.Queue[Reply | None],
        window: asyncio.Semaphore,
    ) -> None:
        """Read and check packets; queue each one's replies (a commit's, for a PUBLISH)."""
        st = self.stats[node]
        while True:
            for pkt in pending:
                if isinstance(pkt, Publish) and pkt.qos:
                    await window.acquire()  # released when its acknowledgement is written
                    future = asyncio.ensure_future(
                        self._packet(node, pkt, session, version, limiter)
                    )
                    future.add_done_callback(lambda _: window.release())
                    reply: Reply = future
                else:
                    out = await self._packet(node, pkt, session, version, limiter)
                    if out is None:
                        return
                    reply = out
                await replies.put(reply)
            async with asyncio.timeout(keepalive):  # not wait_for: see sync/client.py recv
                data = await r.read(65536)
            if not data:
                return
            st.last_seen = time.time()
            pending = dec.feed(data)

    async def _write_replies(
        self,
        replies: asyncio.Queue[Reply | None],
        w: asyncio.StreamWriter,
        version: int,
        window: asyncio.Semaphore,
    ) -> None:
        while (reply := await replies.get()) is not None:
            packets = reply if isinstance(reply, list) else await reply
            if packets:
                w.write(b"".join(encode(p, version) for p in packets))
                if replies.empty():
                    await w.drain()

    async def _packet(
        self, node: str, pkt: Packet, session: ReceiverSession, version: int, limiter: RateLimiter
    ) -> list[Packet] | None:
        """The replies to one packet; None to close the connection."""
        st = self.stats[node]
        if isinstance(pkt, Publish):
            wait = limiter.delay()
            if wait > 0:
                # Backpressure instead of refusal: this node is slowed, others are not.
                st.rejected["rate_limited"] += 1
                await asyncio.sleep(wait)
            return await self._publish(node, pkt, session, version)
        if isinstance(pkt, Pingreq):
            return [Pingresp()]
        if isinstance(pkt, Subscribe):
            st.rejected["subscribe"] += 1
            code = Reason.NOT_AUTHORIZED if version == MQTT_5 else 0x80
            return [Suback(pkt.packet_id, [code] * len(pkt.subscriptions))]
        if isinstance(pkt, Unsubscribe):
            codes: list[int] = (
                [Reason.NO_SUBSCRIPTION_EXISTED] * len(pkt.topic_filters)
                if version == MQTT_5
                else []
            )
            return [Unsuback(pkt.packet_id, codes)]
        if isinstance(pkt, Disconnect):
            return None
        if isinstance(pkt, Pubrel | Puback | Pubrec | Pubcomp):
            # The session's; we publish nothing to nodes, so only a PUBREL is answered.
            match session.receive(pkt):
                case Forget(ack=ack):
                    return [ack]
                case SessionReply(packet=packet):
                    return [packet]
            return []
        raise ProtocolError(f"unexpected {type(pkt).__name__} from a client", Reason.PROTOCOL_ERROR)

    async def _publish(
        self, node: str, pkt: Publish, session: ReceiverSession, version: int
    ) -> list[Packet]:
        st = self.stats[node]
        outcome = session.receive(pkt)
        if isinstance(outcome, Reack):
            return [outcome.ack]  # a repeat of a QoS 2 message we already own (MQTT-4.3.3-2)
        if not isinstance(outcome, Deliver):  # (a PUBLISH is always one or the other)
            raise ProtocolError(f"PUBLISH {pkt.packet_id}: {outcome}", Reason.PROTOCOL_ERROR)
        ack = outcome.ack
        reason, readings, key = self._check(node, pkt)
        if reason is not None:
            st.rejected[reason[1]] += 1
            log.info("ingress: %s: rejected message: %s", node, reason[1])
            if ack is None:
                return []
            return [session.refuse(pkt, reason[0]) if version == MQTT_5 else ack]
        # StoreFull, StoreUnwritable: no ack at all (this raises, the connection closes)
        stored = await self.intake.submit(key, readings, node)
        st.messages += 1
        if stored:
            st.readings += len(readings)
        else:
            st.duplicates += 1
        return [ack] if ack is not None else []

    def _check(
        self, node: str, pkt: Publish
    ) -> tuple[tuple[int, str] | None, list[Reading], str | None]:
        """(rejection (reason code, counter name) or None, readings, message key)."""
        if pkt.topic != f"nodes/{node}/readings":
            return (Reason.NOT_AUTHORIZED, "foreign_topic"), [], None
        if len(pkt.payload) > self.cfg.max_payload_bytes:
            # 0x95 (packet too large) is not a PUBACK/PUBREC code (5.0 tables 3-4, 3-5)
            return (Reason.QUOTA_EXCEEDED, "oversize"), [], None
        msg = wire.parse_node_message(pkt.payload)
        if isinstance(msg, str):
            return (Reason.PAYLOAD_FORMAT_INVALID, msg), [], None
        if msg.node != node:
            return (Reason.NOT_AUTHORIZED, "wrong_node"), [], None
        if len(msg.readings) > self.cfg.max_readings_per_message:
            return (Reason.QUOTA_EXCEEDED, "too_many_readings"), [], None
        return None, self._readings(node, msg), f"{node}/{msg.boot}/{msg.seq}"

    def _readings(self, node: str, msg: wire.NodeMessage) -> list[Reading]:
        flags: list[str] = []
        if msg.ts is None:
            if self.clock is None:
                base = datetime.now(UTC)
            else:
                now, clock_flags = self.clock.stamp(time.monotonic())
                base = datetime.fromisoformat(now.replace("Z", "+00:00"))
                flags += clock_flags
            flags.append("ts_from_gateway")
        else:
            base = datetime.fromisoformat(msg.ts.replace("Z", "+00:00"))
        stamps: dict[float, str] = {}  # readings of a message mostly share their dt (0)

        def stamp(dt: float) -> str:
            ts = stamps.get(dt)
            if ts is None:
                ts = stamps[dt] = wire.wire_time(base - timedelta(seconds=dt))
            return ts

        prefix = f"{node}/{msg.boot}/{msg.seq}."
        return [
            Reading(
                sensor=rd.sensor,
                value=rd.value,
                ts=stamp(rd.dt),
                unit=rd.unit,
                origin=node,
                flags=flags,
                id=f"{prefix}{i}",
                kind=rd.kind,
            )
            for i, rd in enumerate(msg.readings)
        ]
