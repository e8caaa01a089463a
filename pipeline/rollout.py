"""Staged rollout with automatic revert (issue 28, part 4): ``pubcomp fleet rollout``.

Theory of operation
-------------------
A rollout takes one release to the fleet in waves: pinned canaries first, then waves
by share of the fleet (``plan_waves``). For each wave it publishes the release to the
wave's gateways (retained: an offline gateway takes it when it reconnects, and takes
only the newest, skipping versions in between) and watches their status messages:

- a gateway is **committed** when its status says ``release.state`` committed with
  the release's version; **failed** when the version is in its ``bad`` list, or it
  reports ``rolled_back`` or ``refused`` after the publish; **silent** when an online
  gateway says nothing after the publish, or goes offline, before the wave's timeout
  (silence counts as failure);
- a committed gateway must then still deliver: its uplink's drain rate (readings a
  second, from its status) measured ``settle_s`` after the commit is at least
  ``readings_share`` of what it was before the publish (**dropped** otherwise; a
  gateway that delivered nothing before has nothing to drop);
- a gateway offline when its wave starts is not waited for (it catches up when it
  reconnects); it is shown as such, and counted as neither.

The wave's gate passes when every gateway is committed (and delivering), or offline,
with at most ``max_failures`` failures. A failed gate (or the wave's timeout) halts
the rollout and reverts, automatically, every gateway the release was published to:
each gets its previous configuration (what its status reported running before, the
text from the release history) as a NEW release version, so a gateway that marked
the failed version bad takes the revert like any newer release, and the retained
message that an offline gateway would fetch is the revert, not the failure.

The rollout is a function (``roll_out``) over a ``Subject``: what is published, how a
gateway's state is judged and how it is reverted, so that node software (issue 28,
part 5) can be rolled out by the same waves and gates. ``ReleaseSubject`` is the
gateway configuration release.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pubcomp.sync.releaselink import FleetSeen, Seen

State = Literal[
    "waiting",  # not yet in a wave
    "sent",  # published; nothing heard since
    "applying",  # its status says it is fetching, verifying, in trial ...
    "committed",  # runs the release; its readings are being measured
    "healthy",  # committed, and delivers as before
    "offline",  # offline when its wave began: catches up when it reconnects
    "failed",  # refused it, or rolled back
    "silent",  # said nothing (or went offline) before the timeout
    "dropped",  # committed, but delivers less than before
    "timeout",  # still applying when the wave's time ran out
]
PASSING: tuple[State, ...] = ("healthy", "offline")
FAILING: tuple[State, ...] = ("failed", "silent", "dropped", "timeout")


@dataclass(frozen=True)
class Rules:
    """The gates of every wave."""

    timeout_s: float = 600.0
    max_failures: int = 0
    readings_share: float = 0.5
    settle_s: float = 60.0
    revert_timeout_s: float = 300.0


def plan_waves(
    gateways: Sequence[str], canaries: Sequence[str], shares: Sequence[float]
) -> list[list[str]]:
    """Canaries (pinned) first, then waves by share of the whole fleet (cumulative:
    10%, 50%, 100% means a tenth updated after the first wave ...). Every gateway is
    in exactly one wave; no wave is empty; the last reaches 100%."""
    missing = [c for c in canaries if c not in gateways]
    if missing:
        raise ValueError(f"canary {', '.join(missing)}: not a gateway of this release")
    waves: list[list[str]] = []
    if canaries:
        waves.append(list(dict.fromkeys(canaries)))
    rest = [g for g in sorted(gateways) if g not in canaries]
    done = len(gateways) - len(rest)
    for share in [*shares, 1.0]:
        if not 0 < share <= 1:
            raise ValueError(f"wave share {share:g}: expected a share of the fleet in (0, 1]")
        upto = min(len(gateways), max(done + 1, math.ceil(share * len(gateways))))
        take = rest[: max(0, upto - done)]
        if take:
            waves.append(take)
            rest = rest[len(take) :]
            done += len(take)
    return waves


def parse_shares(text: str) -> list[float]:
    """``10%,50%,100%`` (or ``0.1,0.5,1``) as shares."""
    out = []
    for part in text.split(","):
        p = part.strip()
        v = float(p[:-1]) / 100 if p.endswith("%") else float(p)
        out.append(v)
    if out != sorted(out):
        raise ValueError(f"{text}: waves must grow (10%,50%,100%)")
    return out


class Subject(Protocol):
    """What is rolled out: published to a gateway, judged from its status, reverted."""

    label: str

    def publish(self, gateway: str) -> Awaitable[None]: ...

    def judge(self, seen: Seen | None, since: float) -> tuple[State, str]: ...

    def revert(self, gateways: Sequence[str]) -> Awaitable[dict[str, str]]: ...

    def reverted(self, gateway: str, seen: Seen | None) -> bool: ...


@dataclass
class Track:
    gateway: str
    wave: int
    state: State = "waiting"
    detail: str = ""
    published_at: float | None = None
    committed_at: float | None = None
    rate_before: float | None = None
    rate_after: float | None = None
    revert: str = ""


@dataclass
class Result:
    complete: bool
    halted_at: int | None  # the wave whose gate failed
    why: str
    tracks: dict[str, Track] = field(default_factory=dict)


Emit = Callable[[str], None]


def _rate(seen: Seen | None, after: float) -> float | None:
    """The mean drain rate of the statuses that arrived after ``after``."""
    if seen is None:
        return None
    rates = [r for at, _d, r in seen.history if at >= after and r is not None]
    return sum(rates) / len(rates) if rates else None


def _before(seen: Seen | None) -> float | None:
    if seen is None or seen.drain_rate is None:
        return None
    rates = [r for _at, _d, r in seen.history[-5:] if r is not None]
    return sum(rates) / len(rates) if rates else seen.drain_rate


async def roll_out(
    subject: Subject,
    waves: Sequence[Sequence[str]],
    fleet: FleetSeen,
    pump: Callable[[float], Awaitable[None]],
    rules: Rules,
    emit: Emit,
    *,
    canary: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> Result:
    """Run the waves (``canary``: the first is the pinned canaries). ``pump(timeout)``
    feeds ``fleet`` the messages that come within ``timeout`` s (returns at the first,
    or at the timeout)."""
    tracks = {g: Track(g, i) for i, w in enumerate(waves) for g in w}
    updated: list[str] = []

    def change(t: Track, state: State, detail: str) -> None:
        if (state, detail) != (t.state, t.detail):
            t.state, t.detail = state, detail
            emit(f"  {t.gateway:<20} {state:<10} {detail}".rstrip())

    for i, wave in enumerate(waves):
        name = "canary" if i == 0 and canary else f"wave {i + 1}"
        emit(f"{name}: {len(wave)} gateway(s): {', '.join(wave)}")
        start = clock()
        for g in wave:
            t = tracks[g]
            seen = fleet.gateways.get(g)
            t.rate_before = _before(seen)
            await subject.publish(g)
            t.published_at = clock()
            updated.append(g)
            if seen is not None and not seen.online:
                change(t, "offline", "offline: takes it when it reconnects (retained)")
            else:
                change(t, "sent", f"published {subject.label}")
        deadline = start + rules.timeout_s
        while True:
            now = clock()
            for g in wave:
                _step(tracks[g], fleet.gateways.get(g), subject, rules, now, change)
            states = [tracks[g].state for g in wave]
            failures = [g for g in wave if tracks[g].state in FAILING]
            if len(failures) > rules.max_failures:
                break
            if all(s in PASSING or s in FAILING for s in states):
                break
            if now >= deadline:
                for g in wave:
                    t = tracks[g]
                    if t.state not in PASSING and t.state not in FAILING:
                        change(t, "timeout" if t.state != "sent" else "silent", t.detail)
                break
            await pump(min(1.0, max(0.05, deadline - now)))
        failures = [g for g in wave if tracks[g].state in FAILING]
        passed = len(failures) <= rules.max_failures
        emit(
            f"{name}: {'passed' if passed else 'FAILED'}: "
            + ", ".join(f"{g} {tracks[g].state}" for g in wave)
        )
        if not passed:
            why = f"{name}'s gate failed: " + ", ".join(
                f"{g} {tracks[g].state} ({tracks[g].detail})" for g in failures
            )
            emit(f"halted: {why}; reverting {len(updated)} gateway(s): {', '.join(updated)}")
            await _revert(subject, updated, tracks, fleet, pump, rules, emit, clock)
            return Result(False, i, why, tracks)
    return Result(True, None, "every wave passed", tracks)


def _step(
    t: Track,
    seen: Seen | None,
    subject: Subject,
    rules: Rules,
    now: float,
    change: Callable[[Track, State, str], None],
) -> None:
    if t.state in PASSING or t.state in FAILING or t.published_at is None:
        return
    state, detail = subject.judge(seen, t.published_at)
    if state == "committed":
        if t.committed_at is None:
            t.committed_at = now
        settle = t.committed_at + rules.settle_s
        after = _rate(seen, settle) if now >= settle else None
        if after is None:
            change(t, "committed", f"{detail}; measuring readings for {rules.settle_s:g} s")
            return
        t.rate_after = after
        before = t.rate_before
        if before and after < rules.readings_share * before:
            change(t, "dropped", f"readings {before:.2f}/s before, {after:.2f}/s after")
        else:
            change(
                t,
                "healthy",
                f"{detail}; readings {_fmt(before)}/s before, {after:.2f}/s after",
            )
        return
    change(t, state, detail)


def _fmt(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}"


async def _revert(
    subject: Subject,
    updated: list[str],
    tracks: dict[str, Track],
    fleet: FleetSeen,
    pump: Callable[[float], Awaitable[None]],
    rules: Rules,
    emit: Emit,
    clock: Callable[[], float],
) -> None:
    outcome = await subject.revert(updated)
    for g in updated:
        tracks[g].revert = outcome.get(g, "")
        emit(f"  {g:<20} revert     {tracks[g].revert}")
    waiting = [g for g in updated if outcome.get(g, "").startswith("published")]
    deadline = clock() + rules.revert_timeout_s
    while waiting and clock() < deadline:
        for g in list(waiting):
            seen = fleet.gateways.get(g)
            if subject.reverted(g, seen):
                tracks[g].revert += "; reverted"
                emit(f"  {g:<20} reverted   runs its previous configuration again")
                waiting.remove(g)
            elif seen is not None and not seen.online:
                tracks[g].revert += "; offline: takes the revert when it reconnects"
                waiting.remove(g)
        if waiting:
            await pump(min(1.0, max(0.05, deadline - clock())))
    for g in waiting:
        tracks[g].revert += f"; not confirmed within {rules.revert_timeout_s:g} s"
        emit(f"  {g:<20} revert     not confirmed within {rules.revert_timeout_s:g} s")


def table(result: Result) -> list[list[str]]:
    rows = []
    for t in sorted(result.tracks.values(), key=lambda t: (t.wave, t.gateway)):
        rows.append(
            [
                str(t.wave + 1),
                t.gateway,
                t.state,
                _fmt(t.rate_before),
                _fmt(t.rate_after),
                t.revert or "-",
            ]
        )
    return rows


TABLE_HEADER = ["wave", "gateway", "state", "readings/s before", "after", "revert"]


def render(result: Result) -> str:
    from pubcomp.sync.tables import text_table

    head = "rollout complete" if result.complete else f"rollout HALTED: {result.why}"
    return head + "\n" + text_table(TABLE_HEADER, table(result))
