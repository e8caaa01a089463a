"""Node ingress: the gateway is the MQTT server its nodes publish to.

A broker in between would acknowledge from RAM, so the gateway answers each
PUBLISH itself, and only after the readings are committed (fsynced) to the
store. Per node: credentials (user name = node id, scrypt hash in the fleet
file), its own topic only (``nodes/{id}/readings``), payload and rate limits,
the wire format's JSON Schema. A bad message is rejected and counted; nothing
a node sends can crash the gateway or hold up another node.

Node software (issue 28; gateway/nodeoffer.py): a node may subscribe to its own
``nodes/{id}/update`` and nothing else, and ask on ``nodes/{id}/update/req``;
each request is a PUBLISH like any other (the same rate and window) and gets
one answer, queued with the other replies. Nothing of it reaches the store.

Exactly once: a message's key ``{node}/{boot}/{seq}`` is committed with its
readings, so a repeated PUBLISH (a QoS 1 retry, a QoS 2 DUP, a retry after a
gateway crash) is acknowledged and never stored twice. That makes QoS 2
packet-id state redundant here: it is kept in memory only (see
docs/architecture.md).

What one client may cost is bounded (issue 25; docs/failure-model.md, "Hostile
clients"): connections in all and not yet logged in (in all and per address),
each refused at accept with one counter and no log line; the 10 s login
timeout covers TLS, CONNECT and the password check; a CONNECT of at most 4 kB;
per connection, at most ``RECEIVE_MAXIMUM`` PUBLISHes and ``MAX_UNANSWERED``
other packets whose replies are not yet written (the reader stops reading
until the writer catches up), other packets at the PUBLISH rate plus 10 a
second (a flood closes the connection), at most ``READ_LIMIT`` bytes read
ahead and ``WRITE_HIGH`` bytes waiting to be sent, for ``write_timeout_s`` at
most (a peer that reads nothing is closed). Anything that goes wrong in a
connection is counted and logged, summarised (ratelog.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import resource
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
from .errors import ClientStalled, IngressConfigError
from .intake import Intake
from .nodeoffer import OfferServer
from .ratelog import Summary

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0  # accept to CONNACK: TLS, the CONNECT and the password check
CONNECT_MAX_BYTES = 4096  # a node's CONNECT is ~100 bytes; user names of 64 kB are garbage
RECEIVE_MAXIMUM = 20
MAX_UNANSWERED = 10  # packets other than PUBLISH whose replies are not yet written
HEADROOM = 512  # fixed header, topic and properties around a payload
READ_CHUNK = 16 * 1024
READ_LIMIT = 32 * 1024  # asyncio buffers up to twice this before it stops reading the socket
WRITE_HIGH = 16 * 1024  # replies waiting beyond this: wait (write_timeout_s) for the peer
# File descriptors beyond max_connections: the store, threads, the uplink, the health
# server, serial ports, and connections accepted in one go before the limit closes them
# (asyncio accepts up to the listen backlog, 100, per wake-up).
FD_RESERVE = 256
SHOWN_NAME = 64  # characters of a refused user name in the log

# The reasons counted (fixed: nothing a client sends becomes a key). Exported from 0.
REFUSED_CONNECTION = ("max_connections", "max_pending_logins", "max_pending_logins_per_address")
REFUSED_LOGIN = ("unknown_user", "no_password", "wrong_client_id", "bad_password")
CLOSED = (
    "login_timeout",
    "protocol_error",
    "write_stalled",
    "control_flood",
    "internal_error",
    "refusal_cut_short",  # a held-back refusal closed early to make room (max_connections)
    "evicted_for_a_login",  # a login from a penalised address, for one from another
)

# A packet's replies, sent at once or once the commit it waits for has returned, and
# whether it is a PUBLISH (its place in the receive window) or another packet.
Reply = list[Packet] | asyncio.Future[list[Packet] | None]
Queued = tuple[Reply, bool]


@dataclass(eq=False)
class _Conn:
    """One admitted connection, as the limits see it."""

    address: str
    task: asyncio.Task[None] | None = None
    open: bool = True  # counted in Ingress.open
    logging_in: bool = True  # counted among the pending logins


@dataclass
class NodeStats:
    connected: bool = False
    last_seen: float | None = None  # wall clock
    messages: int = 0
    readings: int = 0
    duplicates: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    update_subscribed: bool = False  # this connection subscribed to nodes/{id}/update
    software: dict[str, Any] | None = None  # what the node last said of it (nodeoffer.py)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclass
class Listener:
    """One listening socket and its counters (``pubcomp_ingress_*{listener=...}``)."""

    name: str  # "plain" or "tls"
    port: int
    tls: bool
    accepted: int = 0  # connections admitted (within the limits; before any TLS handshake)
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
        events: Summary | None = None,
        updates: OfferServer | None = None,
    ) -> None:
        self.intake = intake
        self.updates = updates  # node software offers; None: subscriptions refused
        self.node_hashes = nodes  # node id -> scrypt hash
        self.cfg = config
        # clock.stamp(mono) -> (ISO time, flags) for messages without a time of their own.
        self.clock = clock
        self.events = events or Summary()  # repeated log lines, summarised
        self._verifier = Verifier()
        self.stats: dict[str, NodeStats] = collections.defaultdict(NodeStats)
        # Every key below is a fixed reason, never what a client sent: bounded memory.
        self.refused_connections: collections.Counter[str] = collections.Counter()
        self.refused_logins: collections.Counter[str] = collections.Counter()
        self.closed: collections.Counter[str] = collections.Counter()  # connections we ended
        self.listeners = [Listener(*spec) for spec in listener_specs(config)]
        self._servers: list[asyncio.Server] = []
        self._tls: ssl.SSLContext | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: dict[str, asyncio.StreamWriter] = {}
        self.open = 0
        self.pending_logins = 0
        self._pending_by_address: collections.Counter[str] = collections.Counter()
        self._logging_in: dict[_Conn, None] = {}  # oldest first
        self._refusing: dict[_Conn, None] = {}  # refusals held back, oldest first

    async def start(self) -> int:
        """Bind every listener; the first one's port (``listeners`` has them all)."""
        self._check_descriptors()
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
                functools.partial(self._accept, ls), self.cfg.host, ls.port, limit=READ_LIMIT
            )
            self._servers.append(server)
            ls.port = server.sockets[0].getsockname()[1]
            log.info("ingress: %s listener on %s:%d", ls.name, self.cfg.host, ls.port)
        return self.listeners[0].port

    def _check_descriptors(self) -> None:
        """max_connections must stay below the file descriptor limit: past it, accept()
        fails (EMFILE) and asyncio logs a traceback per attempt (issue 25)."""
        need = self.cfg.max_connections + FD_RESERVE
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft >= need:
            return
        if hard == resource.RLIM_INFINITY or hard >= need:
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
            return
        raise IngressConfigError(
            f"ingress.max_connections {self.cfg.max_connections} needs {need} file descriptors "
            f"(and {FD_RESERVE} for the rest of the gateway); this process may open {hard} "
            f"(LimitNOFILE= in the unit): lower max_connections or raise LimitNOFILE"
        )

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for w in list(self._live.values()):
            w.close()
        await cancel_all(self._tasks)
        await self._verifier.close()

    def figures(self) -> dict[str, Any]:
        """The ingress's own counters, for the snapshot (status, metrics)."""
        v = self._verifier
        return {
            "open": self.open,
            "pending_logins": self.pending_logins,
            "max_connections": self.cfg.max_connections,
            "max_pending_logins": self.cfg.max_pending_logins,
            "refused_connections": dict(self.refused_connections),
            "refused_logins": dict(self.refused_logins),
            "closed": dict(self.closed),
            "password_checks": v.checks,
            "password_checks_waiting": v.waiting,
            "wrong_passwords_from_cache": v.answered_from_cache,
        }

    # ------------------------------------------------------------ admission

    def _accept(self, ls: Listener, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        """Called as the connection is made: within the limits it gets a task; over one,
        it is closed here and counted, which costs no task, no read and no log line.

        Two kinds of connection give way to a newcomer rather than turn it away: a
        refusal being held back (its answer is known; at max_connections), and a login
        from an address that failed lately, for one from an address that did not (at
        max_pending_logins): a guesser on many addresses cannot keep every place."""
        peer = w.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        refused = ""
        if self.open >= self.cfg.max_connections:
            victim = next(iter(self._refusing), None)
            if victim is None:
                refused = "max_connections"
            else:
                self._evict(victim, "refusal_cut_short")
        if not refused and self.pending_logins >= self.cfg.max_pending_logins:
            victim = self._penalised_login(address)
            if victim is None:
                refused = "max_pending_logins"
            else:
                self._evict(victim, "evicted_for_a_login")
        if not refused and (
            self._pending_by_address[address] >= self.cfg.max_pending_logins_per_address
        ):
            refused = "max_pending_logins_per_address"
        if refused:
            self.refused_connections[refused] += 1
            w.transport.abort()
            self.events.log(
                log, logging.WARNING, ("refused", refused),
                "ingress: refused a connection from %s: %s", address, refused,
            )  # fmt: skip
            return
        conn = _Conn(address)
        self.open += 1
        self.pending_logins += 1
        self._pending_by_address[address] += 1
        self._logging_in[conn] = None
        w.transport.set_write_buffer_limits(high=WRITE_HIGH)
        task = conn.task = asyncio.ensure_future(self._on_listener(ls, r, w, conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _penalised_login(self, address: str) -> _Conn | None:
        """The oldest login under way from an address that failed lately, if ``address``
        did not (at most max_pending_logins to look through)."""
        throttle = self._verifier.throttle
        if throttle.penalised(address):
            return None
        return next((c for c in self._logging_in if throttle.penalised(c.address)), None)

    def _evict(self, conn: _Conn, why: str) -> None:
        self.closed[why] += 1
        self._logged_in(conn)
        self._refusing.pop(conn, None)
        self._closed(conn)
        if conn.task is not None:
            conn.task.cancel()  # its finally closes the socket

    def _logged_in(self, conn: _Conn) -> None:
        """Free the connection's place among those logging in (once)."""
        if conn.logging_in:
            conn.logging_in = False
            del self._logging_in[conn]
            self.pending_logins -= 1
            self._pending_by_address[conn.address] -= 1
            if self._pending_by_address[conn.address] <= 0:
                del self._pending_by_address[conn.address]

    def _closed(self, conn: _Conn) -> None:
        if conn.open:
            conn.open = False
            self.open -= 1

    async def _on_listener(
        self, ls: Listener, r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: _Conn
    ) -> None:
        ls.accepted += 1
        ls.open += 1
        try:
            await self._connection(ls, r, w, conn)
        except Exception as exc:  # nothing escapes a connection's task unlogged
            self.closed["internal_error"] += 1
            self.events.log(
                log, logging.ERROR, ("internal_error", type(exc).__name__),
                "ingress: connection from %s failed: %r", conn.address, exc, exc_info=True,
            )  # fmt: skip
        finally:
            ls.open -= 1
            self._closed(conn)
            self._logged_in(conn)
            self._refusing.pop(conn, None)
            if w.transport.get_write_buffer_size():
                w.transport.abort()  # a peer that reads nothing would hold the socket open
            else:
                w.close()

    # ------------------------------------------------------------ a node

    async def _connection(
        self, ls: Listener, r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: _Conn
    ) -> None:
        address = conn.address
        dec = Decoder(None, CONNECT_MAX_BYTES)
        node: str | None = None
        try:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    if ls.tls and not await self._handshake(ls, w, address):
                        return
                    connect, first = await self._first_packet(r, dec)
                    node = await self._authenticate(connect, w, dec.version or MQTT_5, conn)
            except TimeoutError:
                self.closed["login_timeout"] += 1
                return
            if node is None:
                return
            self._logged_in(conn)
            dec.max_packet_size = self.cfg.max_payload_bytes + HEADROOM
            await self._serve(node, connect, dec, first, r, w)
        except ProtocolError as exc:
            # MQTT-4.8.0-1: close on a protocol violation (5.0: say why first, once the
            # CONNACK has gone: MQTT-3.14.0-1).
            self.closed["protocol_error"] += 1
            if node:
                self.stats[node].rejected["protocol_error"] += 1
            self.events.log(
                log, logging.WARNING, ("protocol_error", node),
                "ingress: %s: protocol error: %s", node or address, exc,
            )  # fmt: skip
            if node and dec.version == MQTT_5 and not w.is_closing():
                w.write(encode(Disconnect(exc.reason), MQTT_5))
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self.cfg.write_timeout_s):
                        await w.drain()
        except ClientStalled:
            self.closed["write_stalled"] += 1
            if node:
                self.stats[node].rejected["write_stalled"] += 1
            self.events.log(
                log, logging.WARNING, ("write_stalled", node),
                "ingress: %s read nothing for %g s: closed", node, self.cfg.write_timeout_s,
            )  # fmt: skip
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except StoreFull as exc:
            # Not acknowledged: the node keeps the message and retries later.
            self.events.log(
                log, logging.ERROR, ("store_full",),
                "ingress: %s: not acknowledged, store full: %s", node, exc,
            )  # fmt: skip
            if node:
                self.stats[node].rejected["store_full"] += 1
        except StoreUnwritable as exc:
            # A dying card: the same as a full disk, the node keeps the message.
            self.events.log(
                log, logging.ERROR, ("store_unwritable",),
                "ingress: %s: not acknowledged: %s", node, exc,
            )  # fmt: skip
            if node:
                self.stats[node].rejected["store_unwritable"] += 1
        finally:
            if node and self._live.get(node) is w:
                del self._live[node]
                self.stats[node].connected = False
                self.stats[node].update_subscribed = False

    async def _handshake(self, ls: Listener, w: asyncio.StreamWriter, address: str) -> bool:
        assert self._tls is not None
        try:
            await w.start_tls(self._tls, ssl_handshake_timeout=CONNECT_TIMEOUT)
        except OSError as exc:  # ssl.SSLError, a reset
            ls.tls_failures += 1
            self.events.log(
                log, logging.WARNING, ("tls_failure", ls.name),
                "ingress: %s listener: TLS handshake with %s failed: %s", ls.name, address, exc,
            )  # fmt: skip
            return False
        return True

    async def _first_packet(
        self, r: asyncio.StreamReader, dec: Decoder
    ) -> tuple[Connect, list[Packet]]:
        while True:
            data = await r.read(READ_CHUNK)
            if not data:
                raise ConnectionError("closed before CONNECT")
            pkts = dec.feed(data)
            if pkts:
                first = pkts[0]
                assert isinstance(first, Connect)  # the decoder refuses anything else first
                return first, pkts[1:]

    async def _authenticate(
        self, c: Connect, w: asyncio.StreamWriter, version: int, conn: _Conn
    ) -> str | None:
        address = conn.address
        node = c.username or ""
        known = self.node_hashes.get(node)
        if known is None:
            refused = "unknown_user"  # no scrypt: there is no hash to check against
        elif c.password is None:
            refused = "no_password"
        elif c.client_id not in ("", node):
            refused = "wrong_client_id"  # a node connects as itself
        elif not await self._verifier.verify(node, c.password, known, address):
            refused = "bad_password"
        else:
            return node
        self.refused_logins[refused] += 1
        if known is not None:
            self.stats[node].rejected["bad_credentials"] += 1
        shown = node if len(node) <= SHOWN_NAME else f"{node[:SHOWN_NAME]}... ({len(node)} chars)"
        self.events.log(
            log, logging.WARNING, ("login", refused),
            "ingress: refused a login from %s: %s (user %r)", address, refused, shown,
        )  # fmt: skip
        # Held back rather than answered at once, and its address's next password check
        # waits as long (Verifier.verify): a guesser gets no more scrypt than one check per
        # delay. A sleeping task is all a held refusal costs (within the login timeout); it
        # no longer holds a place among the logins, and gives up its place among the
        # connections to a newcomer (_accept).
        delay = self._verifier.throttle.failed(address, node if known else None)
        self._logged_in(conn)
        self._refusing[conn] = None
        await asyncio.sleep(delay)
        self._refusing.pop(conn, None)
        code = Reason.BAD_USER_NAME_OR_PASSWORD if version == MQTT_5 else 4
        w.write(encode(Connack(False, code), version))
        await w.drain()
        return None

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
        st.update_subscribed = False
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
        await self._drain(w)
        limiter = RateLimiter(self.cfg.max_messages_per_second)
        # Other packets (PINGREQ, PUBREL, SUBSCRIBE, ...): a node sends a PUBREL per QoS 2
        # message and a PINGREQ per keepalive, so the PUBLISH rate plus 10 a second, with
        # a burst of two windows' worth. Faster is a flood (issue 25: a PINGREQ flood from
        # a client that read nothing stalled the gateway for 25 s): the connection closes.
        control = RateLimiter(
            self.cfg.max_messages_per_second + 10,
            self.cfg.max_messages_per_second + 10 + 2 * RECEIVE_MAXIMUM,
        )
        keepalive = c.keepalive * 1.5 if c.keepalive else None
        # Pipelined: PUBLISHes are taken while earlier ones are still being committed
        # (up to the receive maximum), so one node's messages share fsyncs too; the
        # writer sends each one's replies once its commit has returned, in arrival
        # order (MQTT-4.6.0-2/-3: held back, never reordered). A PUBLISH keeps its place
        # in the window, and another packet its place among MAX_UNANSWERED, until its
        # reply is written: a peer that does not read stops the reader.
        replies: asyncio.Queue[Queued | None] = asyncio.Queue()
        window = asyncio.Semaphore(RECEIVE_MAXIMUM)
        unanswered = asyncio.Semaphore(MAX_UNANSWERED)
        writer = asyncio.create_task(self._write_replies(replies, w, version, window, unanswered))
        reader = asyncio.create_task(
            self._read_packets(node, dec, pending, r, session, version, limiter, control,
                               keepalive, replies, window, unanswered)
        )  # fmt: skip
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer in done:
                writer.result()  # a refused commit (StoreFull, StoreUnwritable), a stall
                return
            reader.result()  # a protocol error closes the connection at once
            await replies.put(None)  # a clean end: the acknowledgements owed still go out
            await writer
        finally:
            await cancel_all((reader, writer))
            while not replies.empty():  # owed, never to be sent: their errors are known
                left = replies.get_nowait()
                if left is not None and isinstance(left[0], asyncio.Future):
                    left[0].add_done_callback(_retrieved)

    async def _drain(self, w: asyncio.StreamWriter) -> None:
        """Wait while more than WRITE_HIGH bytes wait to be sent; a peer that reads none
        of them for write_timeout_s is gone (or hostile): ClientStalled."""
        try:
            async with asyncio.timeout(self.cfg.write_timeout_s):
                await w.drain()
        except TimeoutError:
            raise ClientStalled from None

    async def _read_packets(
        self,
        node: str,
        dec: Decoder,
        pending: list[Packet],
        r: asyncio.StreamReader,
        session: ReceiverSession,
        version: int,
        limiter: RateLimiter,
        control: RateLimiter,
        keepalive: float | None,
        replies: asyncio.Queue[Queued | None],
        window: asyncio.Semaphore,
        unanswered: asyncio.Semaphore,
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
                    await replies.put((future, True))
                    continue
                if not isinstance(pkt, Publish) and control.delay() > 0:
                    self._flood(node, version, replies)
                    return
                await unanswered.acquire()  # released when its reply is written
                out = await self._packet(node, pkt, session, version, limiter)
                if out is None:
                    unanswered.release()
                    return
                await replies.put((out, False))
            async with asyncio.timeout(keepalive):  # not wait_for: see sync/client.py recv
                data = await r.read(READ_CHUNK)
            if not data:
                return
            st.last_seen = time.time()
            pending = dec.feed(data)

    def _flood(self, node: str, version: int, replies: asyncio.Queue[Queued | None]) -> None:
        self.closed["control_flood"] += 1
        self.stats[node].rejected["control_flood"] += 1
        self.events.log(
            log, logging.WARNING, ("control_flood", node),
            "ingress: %s: more packets other than PUBLISH than %g a second: closed",
            node, self.cfg.max_messages_per_second + 10,
        )  # fmt: skip
        if version == MQTT_5:  # after what is owed (5.0: 0x96, message rate too high)
            replies.put_nowait(([Disconnect(Reason.MESSAGE_RATE_TOO_HIGH)], False))

    async def _write_replies(
        self,
        replies: asyncio.Queue[Queued | None],
        w: asyncio.StreamWriter,
        version: int,
        window: asyncio.Semaphore,
        unanswered: asyncio.Semaphore,
    ) -> None:
        while (item := await replies.get()) is not None:
            reply, is_publish = item
            packets = reply if isinstance(reply, list) else await reply
            if w.is_closing():  # the peer is gone (or taken over): nothing more to say
                return
            if packets:
                w.write(b"".join(encode(p, version) for p in packets))
            (window if is_publish else unanswered).release()
            if replies.empty() or w.transport.get_write_buffer_size() > WRITE_HIGH:
                await self._drain(w)

    async def _packet(
        self, node: str, pkt: Packet, session: ReceiverSession, version: int, limiter: RateLimiter
    ) -> list[Packet] | None:
        """The replies to one packet; None to close the connection."""
        st = self.stats[node]
        if isinstance(pkt, Publish):
            wait = limiter.delay()
            if wait > 0:
                # Backpressure instead of refusal: this node is slowed, others are not.
                if self.updates is not None and pkt.topic == f"nodes/{node}/update/req":
                    self.updates.paced(node)  # a download at full speed: nothing was wrong
                else:
                    st.rejected["rate_limited"] += 1
                await asyncio.sleep(wait)
            return await self._publish(node, pkt, session, version)
        if isinstance(pkt, Pingreq):
            return [Pingresp()]
        if isinstance(pkt, Subscribe):
            wanted = [f"nodes/{node}/update"]
            if self.updates is not None and [x.topic_filter for x in pkt.subscriptions] == wanted:
                st.update_subscribed = True  # its software offers, at QoS 0
                return [Suback(pkt.packet_id, [0])]
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
        if self.updates is not None and pkt.topic == f"nodes/{node}/update/req":
            return await self._update_request(node, pkt, ack)
        reason, readings, key = self._check(node, pkt)
        if reason is not None:
            st.rejected[reason[1]] += 1
            self.events.log(
                log, logging.INFO, ("rejected", node, reason[1]),
                "ingress: %s: rejected message: %s", node, reason[1],
            )  # fmt: skip
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

    async def _update_request(self, node: str, pkt: Publish, ack: Packet | None) -> list[Packet]:
        """A node's software request: its answer goes to its update topic (if subscribed)."""
        assert self.updates is not None
        st = self.stats[node]
        answer = await self.updates.answer(node, pkt.payload, st.rejected)
        st.software = self.updates.software.get(node)
        out: list[Packet] = [] if ack is None else [ack]
        if answer is not None and st.update_subscribed:
            out.append(Publish(f"nodes/{node}/update", answer))
        return out

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
        try:
            readings = self._readings(node, msg)
        except (ValueError, OverflowError):
            # The schema's pattern admits 2026-02-30, and ts - dt may fall before year 1:
            # no time the store could hold (issue 25). Refused, never left unacknowledged.
            return (Reason.PAYLOAD_FORMAT_INVALID, "invalid_time"), [], None
        return None, readings, f"{node}/{msg.boot}/{msg.seq}"

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
