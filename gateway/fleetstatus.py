"""The gateway's health, published to the cloud broker: the fleet seen from the cloud.

A retained QoS 1 message on ``{prefix}/{gateway}/status`` (docs/wire-format.md),
on a connection of its own to the uplink's broker (the same URL, TLS and
credentials; client id ``{gateway}-status``, clean session), made with aiomqtt.
Its Will is a retained offline message on the same topic, so the broker marks
the gateway offline when the connection is lost without a DISCONNECT (a power
cut, a kill, a cut cable: after 1.5 keepalives). A clean stop publishes an
offline message itself, then disconnects.

Why not through the uplink (docs/architecture.md): status is latest-value-wins,
so it must not wait behind a backlog in the durable QoS 2 outbox, and it must
cost no fsync on the gateway's flash. Nothing here is written to disk; a status
lost in a cut is replaced by the next one.

What it says is ``Gateway.snapshot()`` (the same figures as ``pubcomp status``,
``/status.json`` and ``/metrics``) and ``status.verdict()`` (the same headline
and exit code), projected onto the message's model (sync/gatewaystatus.py, from
which its JSON Schema is derived); nothing is computed twice.

When: at each connection; when something an operator acts on changes (the
uplink's state, old readings waiting or not and, while they wait, the backlog;
the clock; health; the store near its quota; a sensor's state, faults or
restarts; a node connecting or leaving), at most every ``min_interval_s``; and
at least every ``heartbeat_s``, so the cloud's per-minute history has points.
The change check runs at the gateway's backlog sample (every 2 s), on the
store figures that sample already read.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiomqtt

from pubcomp import __version__
from pubcomp.sync.client import Backoff, BrokerURL, TLSOptions
from pubcomp.sync.gatewaystatus import (
    STATUS_V,
    ClockStatus,
    FlashStatus,
    NodeStatus,
    OfflineReason,
    OfflineStatus,
    OnlineReason,
    OnlineStatus,
    ReleaseStatus,
    SensorStatus,
    StoreStatus,
    UplinkStatus,
    Verdict,
    dumps,
)
from pubcomp.sync.running import reconnecting

from .clock import iso
from .config import GatewayConfig
from .status import verdict

log = logging.getLogger(__name__)

OLD_S = 60.0  # readings waiting this long count as "held", and the backlog is then watched
QUOTA_WARN = 0.9  # the store past this share of its quota is a change worth sending
PUBLISH_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 3.0

Snapshot = Callable[[dict[str, Any] | None], Awaitable[dict[str, Any]]]


def _iso(t: float | None) -> str | None:
    return None if t is None else iso(t)


def status_message(
    snap: dict[str, Any], *, msg_id: str, reason: OnlineReason, started: float
) -> OnlineStatus:
    """A snapshot as a status message (sync/gatewaystatus.py)."""
    level, headline, code = verdict(snap)
    up, st, clk = snap["uplink"], snap["store"], snap["clock"]
    flash = snap.get("flash") or {}
    rel = snap.get("release")
    extra: dict[str, Any] = {}
    if rel is not None:  # optional: set only by a gateway run with --release-dir
        extra["release"] = ReleaseStatus(
            version=rel["version"],
            sha256=rel["sha256"],
            state=rel["state"],
            previous=rel["previous"],
            bad=list(rel["bad"]),
            last_error=rel["last_error"],
            **({"candidate": rel["candidate"]} if rel.get("candidate") is not None else {}),
        )
    return OnlineStatus(
        v=STATUS_V,
        gateway=snap["gateway"],
        fleet=snap["fleet"],
        id=msg_id,
        online=True,
        reason=reason,
        ts=iso(snap["time"]),
        version=__version__,
        started=iso(started),
        uptime_s=snap["uptime_s"],
        verdict=Verdict(level=level, headline=headline, exit=code),
        problems=list(snap["health_problems"]),
        uplink=UplinkStatus(
            state=up["state"],
            broker=up["broker"],
            qos=up["qos"],
            connected_since=_iso(up.get("connected_since")),
            down_since=_iso(up.get("down_since")),
            backlog=up["backlog"],
            inflight_messages=up["inflight_messages"],
            oldest_age_s=up["oldest_age_s"],
            drain_rate=up["drain_rate"],
            eta_s=up["eta_s"],
            delivered=up["delivered"],
            last_error=up.get("last_error_text") or up.get("last_error"),
            last_error_at=_iso(up.get("last_error_at")),
            **_landing(up.get("end_to_end") or {}),
        ),
        store=StoreStatus(
            bytes=st["store_bytes"],
            quota_bytes=st["quota_bytes"],
            disk_free_bytes=st["disk_free_bytes"],
        ),
        flash=FlashStatus(
            bytes_per_day=flash.get("bytes_per_day"), life_years=flash.get("life_years")
        ),
        clock=ClockStatus(
            source=clk["source"], synced=bool(clk["synced"]), corrections=clk["corrections"]
        ),
        sensors={
            sid: SensorStatus(
                type=s["type"],
                state=s["state"],
                readings=s["readings"],
                faults=s["faults"],
                fault_kinds=s["fault_kinds"],
                restarts=s["restarts"],
                last_error=s["last_error"],
                last=s["last"],
            )
            for sid, s in sorted(snap["sensors"].items())
        },
        nodes={
            nid: NodeStatus(
                connected=bool(n["connected"]),
                last_seen=_iso(n["last_seen"]),
                messages=n["messages"],
                rejected=sum(n["rejected"].values()),
                # the version of its application files (pubcomp node update), if it said
                software=(n.get("software") or {}).get("version"),
            )
            for nid, n in sorted(snap["nodes"].items())
        },
        **extra,
    )


def _landing(e2e: dict[str, Any]) -> dict[str, Any]:
    """End to end's fields, set only while it is on (unset fields are left out)."""
    if not e2e.get("enabled"):
        return {"end_to_end": False}
    return {
        "end_to_end": True,
        "awaiting_landing": e2e["awaiting_landing"],
        "awaiting_age_s": e2e["awaiting_age_s"],
    }


def offline_message(
    gateway: str, fleet: str, *, msg_id: str, reason: OfflineReason, started: float, at: float
) -> OfflineStatus:
    """The Will (``reason: will``, ``ts`` the time its connection was made) or a clean stop."""
    return OfflineStatus(
        v=STATUS_V,
        gateway=gateway,
        fleet=fleet,
        id=msg_id,
        online=False,
        reason=reason,
        ts=iso(at),
        version=__version__,
        started=iso(started),
    )


def change_key(snap: dict[str, Any]) -> tuple[Any, ...]:
    """What an operator acts on: a status goes out when this differs from the last one sent."""
    up, st, clk = snap["uplink"], snap["store"], snap["clock"]
    old = (up["oldest_age_s"] or 0) >= OLD_S
    quota = st["quota_bytes"]
    e2e = up.get("end_to_end") or {}
    # Delivered and not landed for a while: the cloud's side lags, and while it does the
    # count is watched like the backlog's.
    lagging = (e2e.get("awaiting_age_s") or 0) >= OLD_S
    return (
        up["state"],
        old,
        up["backlog"] if old or up["state"] != "connected" else None,
        lagging,
        e2e.get("awaiting_landing") if lagging else None,
        clk["source"],
        snap["healthy"],
        bool(quota and st["store_bytes"] >= QUOTA_WARN * quota),
        tuple(
            (sid, s["state"], s["faults"], s["restarts"])
            for sid, s in sorted(snap["sensors"].items())
        ),
        tuple((nid, n["connected"]) for nid, n in sorted(snap["nodes"].items())),
        _release_key(snap.get("release")),
    )


def _release_key(rel: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """A release's every step is news to a rollout waiting on it (its state, the version
    running, the one under way, what was marked bad)."""
    if rel is None:
        return None
    return (rel["state"], rel["version"], rel.get("candidate"), tuple(rel["bad"]))


class StatusPublisher:
    """Publishes the gateway's status; ``run()`` is one of the gateway's tasks."""

    def __init__(
        self,
        cfg: GatewayConfig,
        snapshot: Snapshot,
        *,
        started: float,
        subscriptions: Sequence[str] = (),
        on_message: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self.cfg = cfg
        # Topics this connection also subscribes to (QoS 1), at every connection: a
        # release and the release keys (gateway/release_apply.py), retained, so the
        # newest comes at once after an outage.
        self.subscriptions = tuple(subscriptions)
        self.on_message = on_message
        self.snapshot = snapshot
        self.started = started
        self.topic = cfg.status_topic()
        self.url = BrokerURL.parse(cfg.uplink.broker)
        self.run_id = secrets.token_hex(6)  # this process's messages: {run}/{n}
        self.published = 0
        self.connected = False
        self.last_error: str | None = None
        self._n = 0
        self._connections = 0
        self._stats: dict[str, Any] | None = None
        self._wake = asyncio.Event()
        self._last_key: tuple[Any, ...] | None = None
        self._last_at = 0.0  # monotonic
        # Set when the gateway stops to re-execute itself (a release's switch or rollback):
        # the stop then says so in an online status, not "offline" (below, ``_stopped``).
        self.restarting = False
        self._closing = asyncio.Event()  # ``close()``: say goodbye, disconnect, end
        self._task: asyncio.Task[Any] | None = None

    def sampled(self, stats: dict[str, Any]) -> None:
        """The gateway's backlog sample: fresh store figures, so look for a change."""
        self._stats = stats
        self._wake.set()

    def _next_id(self) -> str:
        self._n += 1
        return f"{self.run_id}/{self._n}"

    def _client(self) -> aiomqtt.Client:
        up = self.cfg.uplink
        self._connections += 1  # each connection's Will has an id of its own
        will = offline_message(
            self.cfg.id,
            self.cfg.fleet,
            msg_id=f"{self.run_id}/will-{self._connections}",
            reason="will",
            started=self.started,
            at=time.time(),
        )
        v5 = up.protocol == "5"
        tls = TLSOptions(up.ca_file, up.cert_file, up.key_file)
        return aiomqtt.Client(
            self.url.host,
            self.url.port,
            identifier=f"{self.cfg.id}-status",
            username=up.username,
            password=up.password.get_secret_value() if up.password else None,
            protocol=aiomqtt.ProtocolVersion.V5 if v5 else aiomqtt.ProtocolVersion.V311,
            clean_session=None if v5 else True,  # 5.0: clean start, no session expiry
            keepalive=up.keepalive or 30,
            will=aiomqtt.Will(self.topic, dumps(will), qos=1, retain=True),
            tls_context=tls.context() if self.url.tls else None,
            timeout=PUBLISH_TIMEOUT_S,
        )

    async def close(self, timeout: float = 3 * STOP_TIMEOUT_S + 2) -> bool:
        """The clean stop: the goodbye (``_stopped``) published, then a DISCONNECT, so
        the broker keeps the Will; True if ``run()`` ended within ``timeout`` (the caller
        cancels it otherwise, and the Will says offline).

        Not done in ``run()``'s cancellation: the gateway's stop cancels its chores again
        every 0.25 s until they end (sync/running.cancel_all), which could cut the
        goodbye short when its snapshot or its PUBACK took longer (a loaded gateway, a
        cellular link), and with it the release state a rollout waits on."""
        self._closing.set()
        self._wake.set()
        if self._task is None:
            return True
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        return bool(done)

    async def run(self) -> None:
        self._task = asyncio.current_task()
        await reconnecting(
            self._closing,  # set by close(); a cancel (the stop's net) also ends it
            self._connection,
            self._failed,
            backoff=Backoff(base=0.5, cap=60.0),
            errors=(aiomqtt.MqttError,),
        )

    async def _connection(self, backoff: Backoff) -> None:
        try:
            async with self._client() as client:
                self.connected = True
                backoff.reset()
                if self.last_error:
                    log.info("status link to %s is back", self.url)
                self.last_error = None
                if not self._closing.is_set():
                    await self._publish(client, await self.snapshot(self._stats), "connected")
                    for topic in self.subscriptions:
                        await client.subscribe(topic, qos=1)
                    await self._loop(client)
                await self._stopped(client)
                _keep_the_disconnect(client)
        except aiomqtt.MqttError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # a failed DISCONNECT while stopping
                raise asyncio.CancelledError from exc
            raise
        finally:
            self.connected = False

    def _failed(self, why: str, exc: BaseException) -> None:
        if self.last_error is None:
            log.warning("status link to %s: %s (retrying)", self.url, exc)
        self.last_error = str(exc)

    async def _loop(self, client: aiomqtt.Client) -> None:
        st = self.cfg.status
        # A lost connection is noticed at once (and the status sent again on the next
        # one), not at the next publish: a restarted broker may have lost the retained one.
        lost = asyncio.ensure_future(_until_lost(client, self.on_message))
        try:
            while not self._closing.is_set():
                idle = st.heartbeat_s - (time.monotonic() - self._last_at)
                wake = asyncio.ensure_future(self._wake.wait())
                done, _ = await asyncio.wait(
                    {wake, lost}, timeout=max(idle, 0.0), return_when=asyncio.FIRST_COMPLETED
                )
                wake.cancel()
                if lost in done:
                    lost.result()
                if self._closing.is_set():
                    return
                self._wake.clear()
                snap = await self.snapshot(self._stats)
                since = time.monotonic() - self._last_at
                if since >= st.heartbeat_s:
                    await self._publish(client, snap, "heartbeat")
                elif change_key(snap) != self._last_key:
                    if since < st.min_interval_s:
                        await asyncio.sleep(st.min_interval_s - since)
                        snap = await self.snapshot(self._stats)
                    await self._publish(client, snap, "changed")
        finally:
            lost.cancel()

    async def _publish(
        self, client: aiomqtt.Client, snap: dict[str, Any], reason: OnlineReason
    ) -> None:
        msg = status_message(snap, msg_id=self._next_id(), reason=reason, started=self.started)
        await client.publish(self.topic, dumps(msg), qos=1, retain=True)
        self._last_key, self._last_at = change_key(snap), time.monotonic()
        self.published += 1
        log.debug("status %s: %s", reason, msg.verdict.headline)

    async def _stopped(self, client: aiomqtt.Client) -> None:
        """A clean stop says so (then the DISCONNECT keeps the Will from being sent).

        A stop to re-execute (``restarting``) publishes the status as it is instead, its
        release part saying ``switched`` or ``rolling_back``: the new process says more
        within seconds, and a rollout waiting on this gateway sees it applying, not gone
        offline in its wave (which it must count as a failure). If the new process never
        comes, the status stays that one, ageing (``pubcomp fleet status``'s last status);
        systemd's ``Restart=always`` starts it again."""
        if self.restarting:
            try:
                snap = await asyncio.wait_for(self.snapshot(self._stats), STOP_TIMEOUT_S)
                await asyncio.wait_for(self._publish(client, snap, "changed"), STOP_TIMEOUT_S)
                return
            except Exception as exc:  # anything, while stopping: the offline message then
                log.warning("status: the restarting status was not sent (%s)", exc)
        msg = offline_message(
            self.cfg.id,
            self.cfg.fleet,
            msg_id=self._next_id(),
            reason="stopped",
            started=self.started,
            at=time.time(),
        )
        try:
            await asyncio.wait_for(
                client.publish(self.topic, dumps(msg), qos=1, retain=True), STOP_TIMEOUT_S
            )
        except (aiomqtt.MqttError, TimeoutError) as exc:
            log.warning("status: the offline message was not sent (%s); the Will says it", exc)


def _keep_the_disconnect(client: aiomqtt.Client) -> None:
    """Stop aiomqtt's keepalive task before the DISCONNECT is queued. paho-mqtt 2.2's
    keepalive check (``_check_keepalive``), run by that task every second, closes the
    socket when a keepalive falls due while the client is disconnecting, dropping the
    DISCONNECT still queued: the broker then publishes the Will ("offline") although the
    stop was clean. Its ticks line up with the status changes (both count whole seconds
    from the start), so this happened at about one release switch in six."""
    task = getattr(client, "_misc_task", None)  # private: tests/test_fleet_status.py pins it
    if isinstance(task, asyncio.Task) and not task.done():
        task.cancel()


async def _until_lost(
    client: aiomqtt.Client, on_message: Callable[[str, bytes], None] | None
) -> None:
    """Hands each message of the subscriptions on; returns only by raising, when the link
    ends."""
    async for msg in client.messages:
        if on_message is not None and isinstance(msg.payload, bytes | bytearray):
            on_message(msg.topic.value, bytes(msg.payload))
    raise aiomqtt.MqttError("status connection closed")
