"""Store and forward: drain the outbox to the cloud broker, exactly once.

One loop per connection:

1. resume: PUBREL / DUP PUBLISH for every in-flight message, in original
   order, before anything new (design rule 4, MQTT-4.4.0-1, 4.6.0-1);
2. fill the send window (Receive Maximum) with the oldest waiting readings,
   committing the packet ids *before* writing the PUBLISHes (rule 1);
3. read whatever acknowledgements arrived, commit them in one transaction,
   then write the PUBRELs they call for (rules 2, 3, 6).

The session rules live in ``session.py``; this module only orders durable
commits before socket writes and handles reconnects.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import faults
from .backoff import Backoff
from .client import BrokerURL, Connection, ConnectOptions, connect
from .degraded import DegradedDelivery, DegradedLink
from .endtoend import EndToEnd
from .errors import (
    ConnectionClosed,
    ConnectRefused,
    ProtocolError,
    SessionError,
    StoreFull,
    StoreUnwritable,
)
from .faults import crash_point
from .groupcommit import GroupCommit
from .packets import (
    MQTT_5,
    MQTT_311,
    Disconnect,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    Subscription,
)
from .running import reconnecting
from .session import (
    PERMANENT_REFUSALS,
    Completed,
    Ignored,
    Outgoing,
    OutState,
    Refused,
    Released,
    Reply,
    ResendPublish,
    SenderSession,
)
from .store import Message, Store
from .wire import encode_payload, payload_head

log = logging.getLogger(__name__)

# Crash points (sync/faults.py) of the outbound QoS 2 handshake, in order:
# publish_persisted (packet ids committed, PUBLISH not yet written), publish_written
# (PUBREC not yet received), pubrec_received (decoded, not yet committed),
# pubrel_written (PUBCOMP not yet received), pubcomp_received (decoded, its deletion
# not yet committed).
faults.register(
    "publish_persisted", "publish_written", "pubrec_received", "pubrel_written", "pubcomp_received"
)

# Room left in a PUBLISH for its fixed header, topic and properties.
_PUBLISH_OVERHEAD = 512


@dataclass
class UplinkConfig:
    topic_prefix: str = "telemetry"
    qos: int = 2
    batch: int = 100  # readings per message
    max_bytes: int = 128 * 1024  # payload bytes per message
    idle_poll: float = 0.5  # seconds between outbox polls when idle
    # A message short of a full batch waits up to this long for more readings, and
    # while nothing is backed up the session transitions wait as long for company in
    # a group commit: fewer, fuller messages and fewer fsyncs (docs/architecture.md).
    linger: float = 0.0
    # A PUBCOMP (or PUBACK) is forgotten lazily: a PUBREL resent after a crash only
    # draws another PUBCOMP, so its commit can wait for company this long.
    completion_delay: float = 2.0
    # On a graceful stop, deliver what waits for up to this long before disconnecting.
    drain_on_stop: float = 0.0
    # A refused message is sent again after a back-off (REFUSAL_BACKOFF, doubling up to
    # REFUSAL_BACKOFF_MAX while the broker goes on refusing); after this many refusals
    # of the same message it goes to the dead letters, like a permanent refusal.
    max_refusals: int = 10
    # End to end (design rule 9, sync/endtoend.py): a message the broker completed stays
    # in the store until the cloud ingest says it is landed; one not landed within
    # ``landed_timeout`` is published again (the timeout doubling, up to
    # ``landed_timeout_max``, while nothing lands). Off: PUBCOMP lets readings go, as a
    # cloud without the acknowledgement (an older ingest, another consumer) needs.
    end_to_end: bool = True
    landed_timeout: float = 120.0
    landed_timeout_max: float = 3600.0
    # HMAC key of this gateway's acknowledgements (``pubcomp ingest landed-key``): with
    # it, only an ingest holding the fleet's master key can make the gateway let go.
    landed_key: bytes | None = None


REFUSAL_BACKOFF = 0.5
STORE_FULL_BACKOFF = 2.0  # no new PUBLISH for this long after the disk refused one's ids
# The crash points (sync/faults.py) hit as a packet is read, before the session sees it.
RECEIVED_CRASH_POINTS: dict[type, str] = {Pubrec: "pubrec_received", Pubcomp: "pubcomp_received"}
REFUSAL_BACKOFF_MAX = 30.0
RATE_HORIZON = 30.0  # seconds of deliveries the drain rate averages over


@dataclass
class UplinkStatus:
    state: str = "starting"
    connected_since: float | None = None
    # Not connected since (wall time): the gateway's start, or the connection's loss.
    down_since: float | None = field(default_factory=time.time)
    last_error: str | None = None  # as raised: "ConnectionRefusedError: [Errno 111] ..."
    last_error_text: str | None = None  # the same as a sentence for an operator
    last_error_at: float | None = None
    qos_in_use: int | None = None
    receive_maximum: int | None = None
    delivered: int = 0
    last_delivery_at: float | None = None
    # The backlog found at the last connection, until it is delivered; then the drain.
    catch_up: dict[str, Any] | None = None
    last_drain: dict[str, Any] | None = None
    last_outage: dict[str, float] | None = None  # {"from", "to"}: the last time it was down
    ignored: collections.Counter[str] = field(default_factory=collections.Counter)
    # (monotonic time, delivered so far), pruned by age, not by count: a drain of
    # thousands of one-reading messages must still reach back to its first delivery.
    _rate_window: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    _connected_mono: float | None = None
    _first_delivery_mono: float | None = None  # the first since connecting

    def record_delivery(self, n: int) -> None:
        self.delivered += n
        self.last_delivery_at = time.time()
        now = time.monotonic()
        if self._connected_mono is not None and self._first_delivery_mono is None:
            # The window starts here (after this batch): the handshake and the
            # session's resends are not part of a drain's pace.
            self._first_delivery_mono = now
        self._append_rate(now)

    def _append_rate(self, now: float) -> None:
        self._rate_window.append((now, self.delivered))
        window = self._rate_window
        # Keep one entry at or before the horizon: it is the base of the oldest window.
        while len(window) > 1 and window[1][0] <= now - RATE_HORIZON:
            window.popleft()

    def record_connected(self) -> None:
        self._connected_mono = time.monotonic()
        self._first_delivery_mono = None
        self._append_rate(self._connected_mono)

    def record_down(self) -> None:
        self._connected_mono = None
        self.connected_since = None
        if self.down_since is None:
            self.down_since = time.time()

    def drain_rate(self, horizon: float = RATE_HORIZON) -> float:
        """Readings per second delivered over the last ``horizon`` seconds of this connection.

        Deliveries from before an outage do not count: while the uplink is down the
        rate is 0, and after it connects again the window starts at the first delivery.
        """
        if self._connected_mono is None or self._first_delivery_mono is None:
            return 0.0
        now = time.monotonic()
        start = max(now - horizon, self._first_delivery_mono)
        if now - start < 1.0:
            return 0.0  # too soon after connecting to say
        base = next((d for t, d in reversed(self._rate_window) if t <= start), None)
        if base is None:
            base = next((d for t, d in self._rate_window if t >= start), self.delivered)
        return (self.delivered - base) / (now - start)


def explain(exc: BaseException, url: BrokerURL, connect_timeout: float | None = None) -> str:
    """What went wrong with the uplink, as a sentence an operator can act on."""
    where = f"{url.host}:{url.port}"
    if isinstance(exc, ConnectRefused):
        if exc.code in (0x04, 0x05, 0x86, 0x87, 0x8C):
            return (
                f"the broker at {where} refused our credentials or client id ({exc}); "
                "check uplink.username, the password file and the broker's ACL"
            )
        return f"the broker at {where} refused the connection ({exc})"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"the broker's TLS certificate at {where} was not accepted "
            f"({exc.verify_message}); check uplink.ca_file"
        )
    if isinstance(exc, ssl.SSLError):
        why = exc.reason or exc
        return f"the TLS handshake with {where} failed ({why}); check the uplink's TLS settings"
    if isinstance(exc, ConnectionRefusedError):
        return f"nothing accepts connections at {where}: the broker is down or not listening there"
    if isinstance(exc, socket.gaierror):
        return f"the broker's host name {url.host!r} does not resolve (DNS, or no network)"
    if isinstance(exc, TimeoutError):
        limit = f" within {connect_timeout:g} s" if connect_timeout else ""
        return f"no answer from {where}{limit}: the network or a firewall drops the packets"
    if isinstance(exc, OSError) and exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return f"no route to {where}: the gateway's network is down"
    if isinstance(exc, ConnectionClosed):
        why = str(exc)
        if why.startswith("keepalive"):
            return f"the broker at {where} stopped answering (keepalive timeout): the link dropped"
        if why.startswith("broker sent DISCONNECT"):
            return f"the broker at {where} disconnected us ({why.removeprefix('broker sent ')})"
        return f"the connection to {where} was closed ({why})"
    if isinstance(exc, OSError):
        return f"the connection to {where} failed: {exc.strerror or exc}"
    if isinstance(exc, ProtocolError):
        return f"the broker at {where} sent something that is not valid MQTT ({exc})"
    return f"{type(exc).__name__}: {exc}"


class Uplink:
    def __init__(
        self,
        store: Store,
        broker: str,
        options: ConnectOptions,
        config: UplinkConfig | None = None,
        *,
        commits: GroupCommit | None = None,
    ) -> None:
        self.store = store
        # Shared with the gateway's intake when given; otherwise the uplink's own.
        self.commits = commits or GroupCommit(store, commit_delay=0.0)
        self._own_commits = commits is None
        self.url = BrokerURL.parse(broker)
        self.opts = options
        self.cfg = config or UplinkConfig()
        if self.cfg.qos not in (1, 2):
            raise ValueError("uplink QoS must be 1 or 2")
        self.session_key = f"{self.url}#{options.client_id}"
        self.topic = f"{self.cfg.topic_prefix}/{store.gateway_id}/readings"
        self.landed_topic = f"{self.cfg.topic_prefix}/{store.gateway_id}/landed/+"
        self.status = UplinkStatus()
        self.e2e: EndToEnd | None = None
        # The longest a payload's head can be (what a message's size is reckoned with).
        self._head = payload_head(
            store.gateway_id, (store.epoch, 2**63 - 1, 2**63 - 1) if self.cfg.end_to_end else None
        )
        if self.cfg.end_to_end:
            self.e2e = EndToEnd(
                store.gateway_id,
                store.epoch,
                timeout=self.cfg.landed_timeout,
                timeout_max=self.cfg.landed_timeout_max,
                key=self.cfg.landed_key,
            )
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Called with the backlog found on each connection: the top of an outage's peak.
        self.on_connect: Callable[[int], None] | None = None
        store.add_listener(self._on_new_readings)
        # While the store cannot be written, what it holds goes out on a session of its
        # own (sync/degraded.py); this session's persisted state waits untouched.
        link = DegradedLink(
            self.url,
            options,
            self.topic,
            self.cfg.batch,
            self.cfg.max_bytes,
            overhead=len(self._head) + 2,
            encode=lambda bodies: encode_payload(store.gateway_id, bodies),
        )
        self.degraded = DegradedDelivery(store, self.commits, link, self._set_state)

    def _set_state(self, state: str) -> None:
        self.status.state = state

    # ------------------------------------------------------------ public

    async def run(self, stop: asyncio.Event | None = None, exit_when_drained: bool = False) -> None:
        """Deliver until ``stop`` is set (or the store is drained, with the flag)."""
        self._loop = asyncio.get_running_loop()
        committer = asyncio.create_task(self.commits.run()) if self._own_commits else None
        try:
            await self._run(stop or asyncio.Event(), exit_when_drained)
        finally:
            if committer is not None:
                self.commits.close()
                await committer

    async def commit(
        self, fn: Any, urgent: bool = True, frees: bool = True, claims: int = 0
    ) -> Any:
        """Run ``fn(db)`` in the next group commit and wait until it is durable.

        Everything the uplink commits is a session transition or a delivery, never new
        data: on a full disk it may spend the store's reserve (``frees``), since what it
        leads to (PUBCOMP, landing) frees room again. ``claims``: the readings up to this
        seq are in payloads built already (sync/groupcommit.py ``submit``)."""
        within = None if urgent else self.cfg.linger
        return await self.commits.submit(fn, within=within, frees=frees, claims=claims)

    async def _run(self, stop: asyncio.Event, exit_when_drained: bool) -> None:
        adopted: list[int] = []  # once, before the first connection (a held store waits)
        key = self.session_key

        async def connection(backoff: Backoff) -> bool:
            """One connection; True once there is nothing more to do (drained, stopped)."""
            while True:
                try:
                    if not adopted:
                        n = await self.commit(lambda db: self.store.adopt_orphans_in(db, key))
                        adopted.append(n)
                        if n:
                            log.warning("%d in-flight messages of another session re-queued", n)
                    drained = await self._connection(stop, exit_when_drained, backoff)
                    return drained or stop.is_set()
                except StoreUnwritable as exc:
                    self._failed(str(exc), exc)
                    with contextlib.suppress(Exception):
                        await self.commits.flush()
                    await self.degraded.run(stop)
                    backoff.reset()
                    if stop.is_set():
                        return True
                    # Writable again: resume the session at once; it sends it all again.

        await reconnecting(stop, connection, self._down)

    async def _down(self, why: str, exc: BaseException) -> None:
        self._failed(why, exc)
        # Before the session is read again: every transition of the last connection
        # (lazy PUBCOMPs included) is committed, or failed and is not in the store.
        with contextlib.suppress(Exception):
            await self.commits.flush()
        self.status.record_down()
        self.status.state = "backoff"

    def metrics(self, st: dict[str, Any] | None = None) -> dict[str, Any]:
        """The uplink's figures; ``st`` is a fresh ``store.stats()`` if the caller has one."""
        st = st or self.store.stats()
        status = self.status
        connected = status.state == "connected"
        rate = status.drain_rate() if connected else 0.0
        backlog = st["backlog"]
        return {
            "state": status.state,
            "broker": str(self.url),
            "qos": status.qos_in_use or self.cfg.qos,
            "receive_maximum": status.receive_maximum,
            "backlog": backlog,
            "oldest_age_s": st["oldest_age_s"],
            "inflight_messages": st["inflight_messages"],
            "drain_rate": round(rate, 1),
            # Only while a held backlog drains: a rate left from before an outage, or the
            # steady flow of a caught-up uplink, promises nothing about an end.
            "eta_s": (
                round(backlog / rate, 1)
                if connected and status.catch_up and rate > 0 and backlog
                else None
            ),
            "delivered": status.delivered,
            "last_delivery_at": status.last_delivery_at,
            "connected_since": status.connected_since,
            "down_since": None if connected else status.down_since,
            "catch_up": status.catch_up,
            "last_drain": status.last_drain,
            "last_outage": status.last_outage,
            "resent_after_session_loss": st["counters"].get("resent_after_session_loss", 0),
            "refused_by_broker": st["counters"].get("refused_by_broker", 0),
            "dead_letter": st["dead_letter"],
            "last_error_text": status.last_error_text,
            "last_error_at": status.last_error_at,
            "last_error": self.status.last_error,
            "degraded": self.degraded.metrics(),
            "end_to_end": self._end_to_end(st),
        }

    def _end_to_end(self, st: dict[str, Any]) -> dict[str, Any]:
        """Delivered readings kept until the cloud has landed them (rule 9), or why not."""
        e2e = self.e2e
        if e2e is None:
            return {"enabled": False}
        c = st["counters"]
        return {
            "enabled": True,
            "subscription": e2e.subscription,
            "subscription_refused": e2e.refused_by,
            "awaiting_landing": st["awaiting_landing"],
            "awaiting_messages": st["awaiting_messages"],
            "awaiting_age_s": st["awaiting_age_s"],
            "landed": c.get("landed", 0),
            "last_landed_at": e2e.landed_at,
            "landed_timeout_s": e2e.timeout(),
            "resent_not_landed": c.get("resent_not_landed", 0),
            "dropped_awaiting": c.get("dropped_awaiting", 0),
            "acks": dict(e2e.acks),
        }

    # ----------------------------------------------------------- internals

    def _on_new_readings(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            if asyncio.get_running_loop() is loop:
                self._wakeup.set()
                return
        except RuntimeError:
            pass
        loop.call_soon_threadsafe(self._wakeup.set)

    def _failed(self, why: str, exc: BaseException) -> None:
        st = self.status
        st.last_error = why
        st.last_error_text = explain(exc, self.url, self.opts.connect_timeout)
        st.last_error_at = time.time()
        st.record_down()
        log.warning("uplink to %s: %s (%s)", self.url, st.last_error_text, why)

    async def _connected(self) -> None:
        """Count the backlog found on connecting; log a line if the uplink was down."""
        st = self.status
        stats = await asyncio.to_thread(self.store.stats)
        backlog, down = stats["backlog"], st.down_since
        st.catch_up = None
        # A backlog worth a line when it is gone: held through an outage or a restart
        # (more than a batch), not the few readings a short batch lingers with.
        if backlog and (
            (down is not None and st.last_error_at is not None) or backlog > self.cfg.batch
        ):
            st.catch_up = {
                "since": time.time(),
                "backlog": backlog,
                "up_to_seq": self.store.given_seq(),
                "delivered_before": st.delivered,
            }
        if self.on_connect is not None:
            self.on_connect(backlog)
        if down is not None and st.last_error_at is not None:
            st.last_outage = {"from": down, "to": time.time()}
            log.info(
                "uplink to %s connected again after %.0f s down; %d readings waiting",
                self.url,
                time.time() - down,
                backlog,
            )
        st.down_since = None

    def _check_drained(self) -> None:
        """Once the readings waiting at the connection are all delivered: log the drain."""
        c = self.status.catch_up
        if c is None or self.store.oldest_undelivered_seq() <= c["up_to_seq"]:
            return
        now = time.time()
        took = now - c["since"]
        self.status.catch_up = None
        self.status.last_drain = {"at": now, "readings": c["backlog"], "seconds": round(took, 1)}
        log.info("backlog drained: %d readings delivered in %.1f s", c["backlog"], took)

    async def _open(self) -> tuple[Connection, bool, int, int]:
        """Connect; returns (connection, session_present, receive max, max QoS)."""
        established, _, _ = self.store.load_session(self.session_key)
        self.status.state = "connecting"
        clean = not established
        conn, connack = await connect(
            self.url, self.opts, clean_start=clean, session_expiry=0 if clean else None
        )
        if clean:
            # A new store: the clean connection only cleared any stale session (a
            # replaced SD card's ids). Now open the persistent one with clean start
            # off: a 3.1.1 clean session ends with its connection, and Mosquitto
            # 2.0 does not persist a 5.0 session begun with Clean Start=1.
            await conn.close(Disconnect())
            conn, connack = await connect(self.url, self.opts, clean_start=False)
            if connack.session_present:
                await conn.close()
                raise SessionError("broker kept a session we had just cleared")
        if clean:
            key = self.session_key
            await self.commit(lambda db: self.store.session_started_in(db, key))
        props = connack.properties
        rm = props.get("receive_maximum", 65535) if self.opts.version == MQTT_5 else 65535
        return conn, connack.session_present, rm, props.get("maximum_qos", 2)

    async def _connection(
        self, stop: asyncio.Event, exit_when_drained: bool, backoff: Backoff
    ) -> bool:
        conn, present, receive_max, max_qos = await self._open()
        try:
            link = await self._resume(conn, present, receive_max, max_qos)
            backoff.reset()
            await link.resend()
            await link.subscribe_landed()
            while not stop.is_set():
                if not self.store.write_state.writable:  # another commit failed: a dying card
                    raise StoreUnwritable(self.store.write_state.text or "", "")
                await link.resend_unlanded()
                await link.fill_window()
                if exit_when_drained and link.drained():
                    self.status.state = "drained"
                    await conn.close(Disconnect())
                    return True
                await link.read_acks(await self._recv_or_wakeup(conn, stop, link))
            await self._drain_before_stop(conn, link)
            return False
        finally:
            # A DISCONNECT with reason 0 keeps the session (session expiry > 0 in
            # 5.0, CleanSession=0 in 3.1.1); the store keeps everything in flight.
            with contextlib.suppress(Exception):
                await self.commits.flush()
            await conn.close(Disconnect() if stop.is_set() else None)

    async def _drain_before_stop(self, conn: Connection, link: _Link) -> None:
        """A graceful stop (producers already stopped) delivers what waits, lingering no
        more, for up to ``drain_on_stop`` seconds; what is left stays in the store."""
        if self.cfg.drain_on_stop <= 0:
            return
        out_of_time = asyncio.Event()
        timer = asyncio.get_running_loop().call_later(self.cfg.drain_on_stop, out_of_time.set)
        link.lingering = False
        try:
            while not out_of_time.is_set():
                await link.fill_window()
                if link.delivered_all():
                    return
                await link.read_acks(await self._recv_or_wakeup(conn, out_of_time, link))
        finally:
            timer.cancel()

    async def _resume(
        self, conn: Connection, present: bool, receive_max: int, max_qos: int
    ) -> _Link:
        _, last_pid, messages = self.store.load_session(self.session_key)
        session = SenderSession(
            conn.version,
            [Outgoing(m.packet_id, m.qos, OutState(m.state)) for m in messages if m.packet_id],
            last_pid,
        )
        resume = session.on_connack(
            present, clean_start=False, receive_maximum=receive_max, maximum_qos=max_qos
        )
        if self.opts.version == MQTT_311:
            # 3.1.1 has no Receive Maximum; 20 is Mosquitto's default inflight limit.
            session.receive_maximum = min(session.receive_maximum, 20)
        e2e = self.e2e
        if resume.lost or (e2e is not None and not present and self.store.awaiting_messages()):
            # A broker without our session may have lost what it completed, too: what
            # awaits landing goes out again at once (same reading ids; rule 9).
            key, topic = self.session_key, self.topic

            def requeue(db: Any) -> tuple[int, int]:
                n = self.store.requeue_lost_in(db, key)
                again = []
                if e2e is not None:
                    again = self.store.resend_awaiting_in(
                        db, key, topic, landed=e2e.covers, counter="resent_after_session_loss"
                    )
                return n, len(again)

            n, again = await self.commit(requeue, frees=True)
            log.warning(
                "broker lost our session: %d messages in flight (%d readings) and %d "
                "delivered but not landed re-queued with new ids",
                len(resume.lost),
                n,
                again,
            )
            _, _, messages = self.store.load_session(self.session_key)
        qos = session.effective_qos(self.cfg.qos)
        if qos == 0:
            raise SessionError("broker allows only QoS 0; exactly-once needs QoS 1 or 2")
        max_bytes = self.cfg.max_bytes
        if conn.broker_max_packet_size:
            max_bytes = min(max_bytes, conn.broker_max_packet_size - _PUBLISH_OVERHEAD)
        self.status.state = "connected"
        self.status.connected_since = time.time()
        self.status.record_connected()
        await self._connected()
        self.status.receive_maximum = session.receive_maximum
        self.status.qos_in_use = qos
        return _Link(self, conn, session, messages, resume.resend, qos, max_bytes)

    def is_landed_topic(self, topic: str) -> bool:
        head = self.landed_topic[:-1]  # ".../landed/"
        return topic.startswith(head) and "/" not in topic[len(head) :]

    async def _recv_or_wakeup(
        self, conn: Connection, stop: asyncio.Event, link: _Link
    ) -> list[Any]:
        """Wait for packets; return early on a stop, or when new readings could fill a free slot."""
        idle = not link.session.inflight
        timeout = self.cfg.idle_poll if idle else None
        for left in (link.linger_left(), link.hold_left(), link.landing_check_left()):
            if left is not None:
                timeout = left if timeout is None else min(timeout, left)
        recv = asyncio.ensure_future(conn.recv(timeout))
        others = {asyncio.ensure_future(stop.wait())}
        if link.session.send_quota() > 0:
            self._wakeup.clear()
            others.add(asyncio.ensure_future(self._wakeup.wait()))
        done, _ = await asyncio.wait({recv, *others}, return_when=asyncio.FIRST_COMPLETED)
        for t in others:
            t.cancel()
        if recv in done:
            return recv.result()
        recv.cancel()  # Connection.recv keeps decoded packets for the next call
        with contextlib.suppress(asyncio.CancelledError):
            await recv
        return []


class _Link:
    """The uplink's state for one live connection."""

    def __init__(
        self,
        up: Uplink,
        conn: Connection,
        session: SenderSession,
        messages: list[Message],
        resend: list[ResendPublish | Pubrel],
        qos: int,
        max_bytes: int,
    ) -> None:
        self.up, self.store, self.conn, self.session = up, up.store, conn, session
        self.key = up.session_key
        self.live: dict[int, Message] = {m.packet_id: m for m in messages if m.packet_id}
        self.queued = collections.deque(m for m in messages if m.state == OutState.QUEUED)
        self.pending_resend = resend
        self.qos = qos
        self.max_bytes = max_bytes
        self.cursor = self.store.taken_seq()
        self.partial_since: float | None = None  # when a short batch began to linger
        self.lingering = up.cfg.linger > 0
        self.backed_up = False  # a full batch was waiting at the last fill
        self.refusals: dict[int, int] = {}  # per message (ord): refusals so far
        self.held_until = 0.0  # no new PUBLISH before this (monotonic): backing off
        self.store_full = False  # the last fill found the disk full (logged once)
        self.completing = 0  # completions submitted whose commit has not returned yet
        self.e2e = up.e2e
        self.next_landing_check = time.monotonic()
        if self.e2e is not None:
            self.e2e.sent(self.store.sent_seq())
            if self.e2e.epoch != self.store.epoch:  # the store was replaced under us
                self.e2e.epoch = self.store.epoch

    def urgent(self) -> bool:
        """Commit the session's transitions at once (not lingering for company) while a
        backlog drains or the send window is full (then the fsync is what limits the
        rate), and when lingering is off (no linger set, or a stop is draining)."""
        return self.backed_up or not self.lingering or self.session.send_quota() == 0

    def hold_left(self) -> float | None:
        """Seconds the link still backs off after refusals, or None."""
        left = self.held_until - time.monotonic()
        return left if left > 0 else None

    def linger_left(self) -> float | None:
        """Seconds until a lingering short batch must go, or None if none lingers."""
        if self.partial_since is None:
            return None
        return max(0.0, self.partial_since + self.up.cfg.linger - time.monotonic())

    def delivered_all(self) -> bool:
        """Nothing left to send."""
        return not self.live and not self.queued and not self.store.waiting_rows(self.cursor, 1)

    def drained(self) -> bool:
        """Nothing left to send; end to end, nothing left awaiting its landing either."""
        if not self.delivered_all():
            return False
        # A completion on its way may be a move to awaiting_landing: not drained until
        # it is committed and what it moved is landed too.
        return self.e2e is None or (self.completing == 0 and self.store.awaiting_messages() == 0)

    def landing_check_left(self) -> float | None:
        """Seconds until the next look for messages not landed in time, or None."""
        if self.e2e is None:
            return None
        return max(0.0, self.next_landing_check - time.monotonic())

    async def subscribe_landed(self) -> None:
        """Ask for the ingests' acknowledgements (retained: the newest arrive at once)."""
        if self.e2e is None:
            return
        pid = self.session.allocate_control()
        self.e2e.subscription = "requested"
        await self.conn.send(Subscribe(pid, [Subscription(self.up.landed_topic, qos=1)]))

    async def resend_unlanded(self) -> None:
        """Messages delivered longer than the landing timeout ago and still not landed:
        published again (rule 9), oldest first, after what is queued already."""
        e2e = self.e2e
        if e2e is None or time.monotonic() < self.next_landing_check:
            return
        self.next_landing_check = time.monotonic() + e2e.check_every()
        timeout = e2e.timeout()
        cutoff = time.time() - timeout
        key, topic = self.key, self.up.topic
        again: list[Message] = await self.up.commit(
            lambda db: self.store.resend_awaiting_in(
                db, key, topic, delivered_before=cutoff, landed=e2e.covers
            ),
            urgent=False,
            frees=True,
        )
        if again:
            e2e.resent()
            self.queued.extend(again)
            log.warning(
                "%d delivered messages not landed within %.0f s: publishing them again "
                "(the next round waits %.0f s unless something lands)",
                len(again),
                timeout,
                e2e.timeout(),
            )

    def payload_of(self, m: Message) -> bytes:
        bodies = self.store.bodies_between(m.first_seq, m.last_seq)
        return self.encode(bodies, m.first_seq, m.last_seq)

    def encode(self, bodies: list[bytes], first: int, last: int) -> bytes:
        """A message's payload; end to end it names its seqs, for the acknowledgement."""
        span = None if self.e2e is None else (self.store.epoch, first, last)
        return encode_payload(self.store.gateway_id, bodies, span)

    async def resend(self) -> None:
        """MQTT-4.4.0-1 / 4.6.0-1: in-flight packets again, same ids, original order."""
        pkts: list[Publish | Pubrel] = []
        for pkt in self.pending_resend:
            if isinstance(pkt, ResendPublish):
                m = self.live[pkt.packet_id]
                pkts.append(pkt.publish(m.topic, self.payload_of(m)))
            else:
                pkts.append(pkt)
        if pkts:
            log.info("resuming session: %d packets resent", len(pkts))
            await self.conn.send(*pkts)

    async def fill_window(self) -> None:
        """New PUBLISHes up to the send quota: re-queued messages first, then oldest readings."""
        if self.hold_left() is not None:
            return  # the broker refused lately, or the disk is full: not yet
        cursor, popped = self.cursor, list[Message]()
        try:
            await self._fill(popped)
        except StoreFull as exc:
            # Full even for the reserve: nothing new goes out for a while; what is in
            # flight goes on, and its completions free room (the reserve is made again).
            self.cursor = cursor
            for m in popped:
                m.packet_id = None
            self.queued.extendleft(reversed(popped))
            self.held_until = time.monotonic() + STORE_FULL_BACKOFF
            if not self.store_full:
                log.warning("%s: no new messages until deliveries free room", exc)
            self.store_full = True
        else:
            self.store_full = False

    async def _fill(self, popped: list[Message]) -> None:
        quota = self.session.send_quota()
        fresh: list[tuple[Message, bytes]] = []
        landed: list[int] = []
        while quota and self.queued:
            m = self.queued.popleft()
            if self.e2e is not None and self.e2e.covers(m.first_seq, m.last_seq):
                landed.append(m.ord)  # landed while it waited: nothing to send
                continue
            popped.append(m)
            m.packet_id = self.session.allocate(self.qos).packet_id
            m.qos = self.qos
            fresh.append((m, self.payload_of(m)))
            quota -= 1
        if quota:
            batches, split = self._batches(quota)
            fresh += batches
            if split is not None and not fresh:
                # A row larger than a message may be: split it (rare: a small Maximum
                # Packet Size, or uplink.batch below the rows' 100 readings), then fill
                # again. Its readings keep their seqs, so their ids.
                seq, most = split
                room = self.max_bytes - len(self.up._head) - 2
                await self.up.commit(
                    lambda db: self.store.split_row_in(db, seq, room, most), True, frees=True
                )
                return await self._fill(popped)
        if landed:
            self.up.commits.submit(
                lambda db: self.store.forget_queued_in(db, landed),
                within=self.up.cfg.completion_delay,
                frees=True,
            )
        if not fresh:
            return
        msgs = [m for m, _ in fresh]
        if self.e2e is not None:
            self.e2e.sent(max(m.last_seq for m in msgs))
        # Rule 1: the packet ids are durable before the PUBLISHes are written. Until
        # that commit returns, the readings up to the cursor are claimed: no quota drop
        # or clock correction committed meanwhile may change what these payloads carry.
        try:
            # A session transition: on a full disk it may spend the reserve (frees), as
            # the deliveries it leads to give the room back.
            ords = await self.up.commit(
                lambda db: self.store.begin_messages_in(db, self.key, msgs),
                self.urgent(),
                frees=True,
                claims=self.cursor,
            )
        except BaseException:
            for m in msgs:
                self.session.forget_allocation(m.packet_id)  # type: ignore[arg-type]
            raise
        for m, o in zip(msgs, ords, strict=True):
            m.ord, m.state = o, OutState.PUBLISH_SENT
        crash_point("publish_persisted")
        for m, _ in fresh:
            self.live[m.packet_id] = m  # type: ignore[index]
        await self.conn.send(*(Publish(m.topic, p, m.qos, packet_id=m.packet_id) for m, p in fresh))
        crash_point("publish_written")

    def _batches(self, quota: int) -> tuple[list[tuple[Message, bytes]], tuple[int, int] | None]:
        """New messages of whole outbox rows, oldest first, at most ``batch`` readings and
        ``max_bytes`` each (a row is never split between messages), and, if a row alone
        is larger than that and stopped the filling, its seq and the readings a row may
        hold: it must be split first."""
        batch, head = self.up.cfg.batch, len(self.up._head) + 2
        rows = self.store.waiting_rows(self.cursor, quota * batch)
        self.backed_up = sum(n for _, n, _ in rows) >= batch
        if not rows:
            self.partial_since = None
            return [], None
        if not self.backed_up and self.lingering:
            if self.partial_since is None:
                self.partial_since = time.monotonic()
            if self.linger_left():
                return [], None  # a short batch: wait for more readings to share its message
        self.partial_since = None
        out: list[tuple[Message, bytes]] = []
        i = 0
        while i < len(rows) and len(out) < quota:
            first, size, count = rows[i][0], head, 0
            bodies: list[bytes] = []
            while i < len(rows) and count < batch:
                seq, n, body = rows[i]
                if bodies and (size + len(body) + 1 > self.max_bytes or count + n > batch):
                    break
                if (size + len(body) > self.max_bytes and n > 1) or n > batch:
                    return out, (seq, batch)  # alone, it is still too large: split it first
                bodies.append(body)
                size, count, i = size + len(body) + 1, count + n, i + 1
            last = rows[i - 1][0] + rows[i - 1][1] - 1
            pid = self.session.allocate(self.qos).packet_id
            m = Message(0, pid, self.qos, OutState.QUEUED, self.up.topic, first, last)
            out.append((m, self.encode(bodies, first, last)))
            self.cursor = last
        return out, None

    def _forgotten(self, _: asyncio.Future[int]) -> None:
        self.completing -= 1
        self.up._check_drained()

    def _let_go(self, done: asyncio.Future[int]) -> None:
        ok = not done.cancelled() and done.exception() is None
        if self.e2e is not None and ok and done.result():
            self.e2e.landed()

    def _subscribed(self, pkt: Suback) -> None:
        assert self.e2e is not None
        code = pkt.reason_codes[0] if pkt.reason_codes else 0x80
        if code >= 0x80:
            self.e2e.subscription = f"refused {code:#04x}"
            self.e2e.refused_by = code
            log.warning(
                "the broker refused our subscription to %s (%#04x): no landed "
                "acknowledgements will arrive, so delivered readings are kept and "
                "published again after uplink.landed_timeout_s; check the broker's ACL",
                self.up.landed_topic,
                code,
            )
        else:
            self.e2e.subscription = f"granted QoS {code}"
            self.e2e.refused_by = None

    async def read_acks(self, pkts: list[Any]) -> None:
        """Commit what the acknowledgements say in one transaction, then answer."""
        released: list[int] = []
        completed: list[int] = []
        awaiting: list[int] = []
        refused: list[tuple[int, int, bool]] = []
        replies: list[Any] = []
        landed: list[tuple[int, int]] = []
        status = self.up.status
        e2e = self.e2e
        for pkt in pkts:
            point = RECEIVED_CRASH_POINTS.get(type(pkt))
            if point is not None:
                crash_point(point)
            if isinstance(pkt, Suback) and self.session.control_done(pkt.packet_id):
                self._subscribed(pkt)
                continue
            if e2e is not None and isinstance(pkt, Publish) and self.up.is_landed_topic(pkt.topic):
                ack = e2e.judge(pkt.payload)
                if ack is not None:
                    landed += ack.landed
                if pkt.qos == 1 and pkt.packet_id is not None:
                    # Nothing to commit first: the letting go is lazy, and the retained
                    # acknowledgement comes again at the next subscription if it is lost.
                    replies.append(Puback(pkt.packet_id))
                elif pkt.qos == 2 and pkt.packet_id is not None:
                    replies.append(Pubrec(pkt.packet_id))
                continue
            out = self.session.receive(pkt)
            if isinstance(out, Released):
                released.append(out.packet_id)
                replies.append(out.reply)
            elif isinstance(out, Completed):
                m = self.live.pop(out.packet_id, None)
                if e2e is not None and (m is None or not e2e.covers(m.first_seq, m.last_seq)):
                    awaiting.append(out.packet_id)  # the broker has it; the cloud not yet
                else:
                    completed.append(out.packet_id)
                if m is not None:  # delivered now, whenever its deletion is committed
                    self.refusals.pop(m.ord, None)
                    status.record_delivery(self.store.count_between(m.first_seq, m.last_seq))
                    self.store.forget_later(m.first_seq, m.last_seq)
            elif isinstance(out, Refused):
                m = self.live.pop(out.packet_id, None)
                times = 1 if m is None else self.refusals.get(m.ord, 0) + 1
                permanent = out.reason in PERMANENT_REFUSALS or times >= self.up.cfg.max_refusals
                refused.append((out.packet_id, out.reason, permanent))
                if m is not None and not permanent:
                    self.refusals[m.ord] = times
                    m.packet_id, m.state = None, OutState.QUEUED
                    self.queued.append(m)
                elif m is not None:
                    self.refusals.pop(m.ord, None)
                log.warning(
                    "broker refused packet %d with reason %#04x (%s)",
                    out.packet_id,
                    out.reason,
                    f"dead-lettered after {times} refusals"
                    if permanent
                    else f"refusal {times} of {self.up.cfg.max_refusals}; will retry with a new id",
                )
            elif isinstance(out, Reply):
                replies.append(out.packet)
            elif isinstance(out, Ignored):
                status.ignored[out.packet] += 1
                log.debug("ignored: %s", out.why)
                if out.answer is not None:
                    replies.append(out.answer)
        if completed or awaiting:
            # Lazily: it rides the next commit (or waits ``completion_delay``), because a
            # PUBREL resent after a crash only draws another PUBCOMP (design rule 3). The
            # ids are free at the broker already; a message given one of them later is
            # committed after this, since the group commit keeps the order of its ops.
            done = self.up.commits.submit(
                lambda db: self.store.apply_in(
                    db, self.key, completed=completed, awaiting=awaiting
                ),
                within=self.up.cfg.completion_delay,
                frees=True,
            )
            self.completing += 1
            done.add_done_callback(self._forgotten)
        if landed:
            # Lazily too: until it is committed the readings are only kept a little
            # longer; it runs after any awaiting move above (the group keeps order).
            let_go = self.up.commits.submit(
                lambda db: self.store.landed_in(db, landed),
                within=self.up.cfg.completion_delay,
                frees=True,
            )
            let_go.add_done_callback(self._let_go)
        if released or refused:
            # Rule 2: a PUBREC is durable before its PUBREL goes out. A session
            # transition: on a full disk it may spend the reserve, as the PUBCOMP it
            # leads to frees room.
            await self.up.commit(
                lambda db: self.store.apply_in(db, self.key, released=released, refused=refused),
                self.urgent(),
                frees=True,
            )
        if replies:
            await self.conn.send(*replies)
            if released:
                crash_point("pubrel_written")
        retried = [n for m in self.queued if (n := self.refusals.get(m.ord))]
        if any(not p for _, _, p in refused) and retried:
            # The broker is pushing back: do not hammer it. The back-off doubles with
            # each refusal of the same message; the connection (and its keepalive)
            # goes on meanwhile.
            backoff = REFUSAL_BACKOFF * 2 ** (max(retried) - 1)
            self.held_until = time.monotonic() + min(REFUSAL_BACKOFF_MAX, backoff)
