"""The fleet seen from the cloud: gateways from their status messages, worst first.

One place for the judgement, so ``pubcomp fleet watch`` (the retained status
messages, live), ``pubcomp fleet status`` (the warehouse's ``gateway_health``)
and the report's fleet page agree. Pure Python: the watch runs without Spark.

Worst first: offline (or silent) gateways, then the age of the oldest reading
waiting on a gateway (held: its uplink is not delivering, or the reading waited
over a minute; a reading in passing does not count), then an
unsynchronised clock, then the least room for the store (disk free, or what is
left of its quota).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from pubcomp.sync.exitcodes import (
    EXIT_CLOCK,
    EXIT_DISK,
    EXIT_NOT_DELIVERING,
    EXIT_OFFLINE,
    EXIT_OK,
    EXIT_UNHEALTHY,
)
from pubcomp.sync.gatewaystatus import (
    ClockSource,
    Level,
    NodeStatus,
    OfflineStatus,
    OnlineStatus,
    SensorStatus,
    parse,
)
from pubcomp.sync.tables import text_table
from pubcomp.sync.units import duration, size

from .fleetcli import STALE_S  # the default of --stale-s, where pydantic is not imported

# `pubcomp fleet status` / `fleet watch --once` exit with the code of the worst problem in
# the fleet, in this order (sync/exitcodes.py; 0: all delivering).
SEVERITY = (EXIT_OFFLINE, EXIT_NOT_DELIVERING, EXIT_UNHEALTHY, EXIT_CLOCK, EXIT_DISK)

HELD_S = 60.0  # a reading waiting this long is held (not just in passing)
ROOM_LOW_BYTES = 100e6  # disk free, or quota left, under this: the store may soon refuse
QUOTA_HIGH = 0.9  # or the store past this share of its quota

STATES = {
    EXIT_OK: "ok",
    EXIT_UNHEALTHY: "UNHEALTHY",
    EXIT_OFFLINE: "OFFLINE",
    EXIT_NOT_DELIVERING: "NOT DELIVERING",
    EXIT_CLOCK: "CLOCK",
    EXIT_DISK: "DISK",
}


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class At:
    """Where a fact is in an online status message (sync/gatewaystatus.py): ``uplink.backlog``."""

    path: str


class Facts(BaseModel):
    """The figures of a gateway's newest online status that the fleet views show: one
    column each in ``gateway_health`` (pipeline/health.py derives the columns, and the
    Spark expressions that fill them, from this), the same read from a live message
    (``facts_of``). None: not known (an offline gateway never seen online, or a field
    its gateway's version did not send)."""

    model_config = ConfigDict(frozen=True)

    uptime_s: Annotated[float | None, At("uptime_s")] = None
    level: Annotated[Level | None, At("verdict.level")] = None
    headline: Annotated[str | None, At("verdict.headline")] = None
    problems: Annotated[list[str], At("problems")] = Field(default_factory=list)
    uplink_state: Annotated[str | None, At("uplink.state")] = None
    backlog: Annotated[int | None, At("uplink.backlog")] = None
    inflight: Annotated[int | None, At("uplink.inflight_messages")] = None
    oldest_age_s: Annotated[float | None, At("uplink.oldest_age_s")] = None
    drain_rate: Annotated[float | None, At("uplink.drain_rate")] = None
    eta_s: Annotated[float | None, At("uplink.eta_s")] = None
    delivered: Annotated[int | None, At("uplink.delivered")] = None
    last_error: Annotated[str | None, At("uplink.last_error")] = None
    # None: a gateway from before issue 24 (it said nothing).
    end_to_end: Annotated[bool | None, At("uplink.end_to_end")] = None
    awaiting_landing: Annotated[int | None, At("uplink.awaiting_landing")] = None
    awaiting_age_s: Annotated[float | None, At("uplink.awaiting_age_s")] = None
    clock_source: Annotated[ClockSource | None, At("clock.source")] = None
    clock_synced: Annotated[bool | None, At("clock.synced")] = None
    store_bytes: Annotated[int | None, At("store.bytes")] = None
    quota_bytes: Annotated[int | None, At("store.quota_bytes")] = None
    disk_free_bytes: Annotated[int | None, At("store.disk_free_bytes")] = None
    flash_bytes_per_day: Annotated[float | None, At("flash.bytes_per_day")] = None
    sensors: Annotated[dict[str, SensorStatus], At("sensors")] = Field(default_factory=dict)
    nodes: Annotated[dict[str, NodeStatus], At("nodes")] = Field(default_factory=dict)


def fact_paths() -> dict[str, str]:
    """Each fact's name and its place in the message, in ``Facts``' order."""
    out = {}
    for name, f in Facts.model_fields.items():
        (at,) = (m for m in f.metadata if isinstance(m, At))
        out[name] = at.path
    return out


def facts_of(msg: OnlineStatus) -> dict[str, Any]:
    """The facts of an online message, by name (as ``GatewayView`` takes them)."""
    out = {}
    for name, path in fact_paths().items():
        value: Any = msg
        for part in path.split("."):
            value = getattr(value, part)
        out[name] = value
    return out


class _Seen(BaseModel):
    """What the cloud knows of a gateway from its newest message, online or not."""

    gateway: str
    fleet: str | None = None
    online: bool = False
    reason: str = ""
    ts: float | None = None  # the newest message's time, by the gateway's clock
    seen: float | None = None  # when the cloud received it (None: unknown, e.g. retained)
    version: str | None = None
    started: float | None = None


class GatewayView(Facts, _Seen):
    """What the cloud knows of one gateway: its newest status, and the facts of its last
    online one when the newest is an offline message (a Will carries no figures)."""

    model_config = ConfigDict(frozen=False)

    facts_ts: float | None = None  # the time of the status the facts come from
    history: list[tuple[float, int]] = Field(default_factory=list)  # (minute, backlog max)

    @property
    def when(self) -> float | None:
        return self.seen if self.seen is not None else self.ts

    @property
    def sensor_faults(self) -> int:
        return sum(s.faults for s in self.sensors.values())

    @property
    def nodes_connected(self) -> int:
        return sum(n.connected for n in self.nodes.values())

    def room(self) -> float | None:
        """Bytes the store can still grow by: disk free, or what is left of its quota."""
        cands = []
        if self.disk_free_bytes is not None:
            cands.append(float(self.disk_free_bytes))
        if self.quota_bytes and self.store_bytes is not None:
            cands.append(float(self.quota_bytes - self.store_bytes))
        return min(cands) if cands else None

    def oldest_now(self, now: float) -> float | None:
        """The oldest waiting reading's age now: it goes on ageing while nothing is delivered."""
        if self.oldest_age_s is None:
            return None
        base = self.facts_ts if self.facts_ts is not None else now
        delivering = self.online and self.uplink_state == "connected"
        return self.oldest_age_s + (0.0 if delivering else max(0.0, now - base))


Message = OnlineStatus | OfflineStatus


def view(
    msg: Message | dict[str, Any],
    seen: float | None = None,
    last_online: Message | dict[str, Any] | None = None,
) -> GatewayView:
    """A gateway from its newest status message (and its last online one, if that is older)."""
    m = parse(msg) if isinstance(msg, dict) else msg
    last = parse(last_online) if isinstance(last_online, dict) else last_online
    facts = m if isinstance(m, OnlineStatus) else last
    kept: dict[str, Any] = {}
    if isinstance(facts, OnlineStatus):
        kept = facts_of(facts)
        # The figures' time by the cloud's clock when known (a gateway's clock may be wrong).
        kept["facts_ts"] = seen if facts is m and seen is not None else parse_time(facts.ts)
    return GatewayView(
        gateway=m.gateway,
        fleet=m.fleet,
        online=m.online,
        reason=m.reason,
        ts=parse_time(m.ts),
        seen=seen,
        version=m.version,
        started=parse_time(m.started),
        **kept,
    )


@dataclass
class Judgement:
    code: int
    why: str

    @property
    def state(self) -> str:
        return STATES[self.code]


def judge(v: GatewayView, now: float, stale_s: float = STALE_S) -> Judgement:
    """The gateway's worst problem, as an exit code and a short sentence."""
    if not v.online:
        if v.reason == "stopped":
            return Judgement(EXIT_OFFLINE, f"stopped cleanly at {_clock(v.ts)}")
        since = f" (seen {_clock(v.seen)})" if v.seen is not None else ""
        return Judgement(EXIT_OFFLINE, f"connection lost, the broker sent its Will{since}")
    if v.when is not None and now - v.when > stale_s:
        return Judgement(EXIT_OFFLINE, f"silent: no status for {duration(now - v.when)}")
    if v.level == "unhealthy":
        return Judgement(EXIT_UNHEALTHY, "; ".join(v.problems) or (v.headline or "unhealthy"))
    if v.level == "down":
        return Judgement(EXIT_NOT_DELIVERING, v.headline or f"uplink {v.uplink_state}")
    if v.clock_synced is False:
        return Judgement(EXIT_CLOCK, "clock not synchronised: readings flagged clock_unsynced")
    room = v.room()
    full = bool(v.quota_bytes and (v.store_bytes or 0) >= QUOTA_HIGH * v.quota_bytes)
    if full or (room is not None and room < ROOM_LOW_BYTES):
        return Judgement(EXIT_DISK, f"store has {size(room)} of room left")
    return Judgement(EXIT_OK, v.headline or "delivering")


def rank_key(v: GatewayView, now: float) -> tuple[Any, ...]:
    age = v.oldest_now(now) or 0.0
    delivering = v.online and v.uplink_state == "connected" and v.level != "down"
    held = age if age >= HELD_S or not delivering else 0.0
    room = v.room()
    return (
        v.online,
        -held,
        v.clock_synced is not False,
        math.inf if room is None else room,
        v.gateway,
    )


def rank(views: list[GatewayView], now: float) -> list[GatewayView]:
    """Worst first: offline, oldest unsent reading, clock, disk (then by name)."""
    return sorted(views, key=lambda v: rank_key(v, now))


def fleet_code(judged: list[Judgement]) -> int:
    codes = {j.code for j in judged}
    return next((c for c in SEVERITY if c in codes), EXIT_OK)


# ------------------------------------------------------------------ text


def _clock(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


HEADER = [
    "gateway",
    "state",
    "uplink",
    "backlog",
    "oldest",
    "drain/s",
    "unlanded",
    "clock",
    "store",
    "disk free",
    "faults",
    "nodes",
    "version",
    "last status",
]


def row(v: GatewayView, j: Judgement, now: float) -> list[str]:
    store = size(v.store_bytes) + (f" of {size(v.quota_bytes)}" if v.quota_bytes else "")
    age = v.oldest_now(now)
    return [
        v.gateway,
        j.state,
        (v.uplink_state or "-") if v.online else f"({v.uplink_state or '-'})",
        "-" if v.backlog is None else f"{v.backlog:,}",
        duration(age) if age is not None else "-",
        "-" if v.drain_rate is None else f"{v.drain_rate:,.1f}",
        unlanded(v),
        "-"
        if v.clock_source is None
        else ("synced" if v.clock_synced else "UNSYNCED") + f" ({v.clock_source})",
        store if v.store_bytes is not None else "-",
        size(v.disk_free_bytes),
        str(v.sensor_faults) if v.sensors else "-",
        f"{v.nodes_connected}/{len(v.nodes)}" if v.nodes else "-",
        v.version or "-",
        f"{duration(now - v.when)} ago" if v.when is not None else "-",
    ]


def unlanded(v: GatewayView) -> str:
    """Delivered to the broker, not yet landed in the cloud: how many, for how long."""
    if v.end_to_end is None:
        return "-"
    if not v.end_to_end:
        return "off"
    n = v.awaiting_landing or 0
    if n and v.awaiting_age_s is not None:
        return f"{n:,} ({duration(v.awaiting_age_s)})"
    return f"{n:,}"


def headline(views: list[GatewayView], judged: list[Judgement]) -> str:
    if not views:
        return "no gateway has sent a status"
    n = len(views)
    bad = [j for j in judged if j.code != EXIT_OK]
    if not bad:
        return f"OK: all {n} gateways online and delivering, clocks synchronised"
    counts: dict[str, int] = {}
    for j in bad:
        counts[j.state] = counts.get(j.state, 0) + 1
    order = [STATES[c] for c in SEVERITY]
    parts = [f"{counts[s]} {s}" for s in order if s in counts]
    return f"{len(bad)} of {n} gateways need attention: " + ", ".join(parts)


def render(views: list[GatewayView], now: float | None = None, stale_s: float = STALE_S) -> str:
    """The fleet as ``fleet status`` and ``fleet watch`` print it: headline, table, reasons."""
    now = time.time() if now is None else now
    ranked = rank(views, now)
    judged = [judge(v, now, stale_s) for v in ranked]
    out = [headline(ranked, judged)]
    if ranked:
        out += [
            "",
            text_table(HEADER, [row(v, j, now) for v, j in zip(ranked, judged, strict=True)]),
        ]
        why = [f"  {v.gateway}: {j.why}" for v, j in zip(ranked, judged, strict=True) if j.code]
        if why:
            out += ["", *why]
    return "\n".join(out)


def code(views: list[GatewayView], now: float | None = None, stale_s: float = STALE_S) -> int:
    now = time.time() if now is None else now
    if not views:
        return EXIT_OFFLINE
    return fleet_code([judge(v, now, stale_s) for v in views])
