"""pipeline/rollout.py's rules on their own: how waves are cut, and the gates' verdicts
for what a broker cannot easily be made to show (silence, a timeout, a gateway offline
at its wave). The real-process rollouts are in tests/test_release_rollout.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest

from pubcomp.pipeline import rollout as ro
from pubcomp.pipeline.releasecmd import judge_release
from pubcomp.sync.releaselink import FleetSeen, Seen


def test_waves_canaries_first_then_cumulative_shares_of_the_fleet() -> None:
    gws = [f"gw-{i:02d}" for i in range(20)]
    waves = ro.plan_waves(gws, ["gw-07"], [0.1, 0.5, 1.0])
    assert waves[0] == ["gw-07"]
    assert [len(w) for w in waves] == [1, 1, 8, 10]  # 10 % = 2 with the canary, 50 % = 10
    assert sorted(g for w in waves for g in w) == sorted(gws)


def test_every_wave_has_a_gateway_and_the_last_reaches_everyone() -> None:
    assert ro.plan_waves(["a", "b", "c"], [], [0.01]) == [["a"], ["b", "c"]]
    assert ro.plan_waves(["a"], ["a"], [0.5, 1.0]) == [["a"]]
    with pytest.raises(ValueError, match="not a gateway"):
        ro.plan_waves(["a"], ["z"], [1.0])
    assert ro.parse_shares("10%,50%,100%") == [0.1, 0.5, 1.0]
    with pytest.raises(ValueError, match="must grow"):
        ro.parse_shares("50%,10%")


class Scripted:
    """A subject whose gateways answer as scripted: state per gateway once published."""

    label = "release 9"

    def __init__(self, answers: dict[str, ro.State]) -> None:
        self.answers = answers
        self.published: list[str] = []
        self.reverted_gws: list[str] = []

    async def publish(self, gateway: str) -> None:
        self.published.append(gateway)

    def judge(self, seen: Seen | None, since: float) -> tuple[ro.State, str]:
        assert seen is not None
        return self.answers.get(seen.gateway, "sent"), "scripted"

    async def revert(self, gateways: Sequence[str]) -> dict[str, str]:
        self.reverted_gws = list(gateways)
        return {g: "published release 10" for g in gateways}

    def reverted(self, gateway: str, seen: Seen | None) -> bool:
        return True


class SimClock:
    """The rollout's clock, moved only by its pump: its limits (0.3 s here) are counted
    in pumps, not in the wall time a busy machine takes between them."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)
        self.t += seconds


def _fleet(online: dict[str, bool]) -> FleetSeen:
    f = FleetSeen({})
    for g, up in online.items():
        s = Seen(g, online=up, drain_rate=5.0)
        s.history.append((0.0, 0, 5.0))
        f.gateways[g] = s
    return f


def _run(
    subject: Scripted,
    waves: list[list[str]],
    fleet: FleetSeen,
    rate_after: float = 5.0,
    **rules: float,
) -> ro.Result:
    lines: list[str] = []
    now = SimClock()

    async def pump(timeout: float) -> None:
        # Each online gateway's status comes on (silence would fail a committed one).
        await now.sleep(min(timeout, 0.01))
        for s in fleet.gateways.values():
            if s.online:
                s.history.append((now(), 0, rate_after))

    r = ro.Rules(**{"timeout_s": 0.3, "settle_s": 0.0, "revert_timeout_s": 0.3, **rules})  # type: ignore[arg-type]
    return asyncio.run(
        ro.roll_out(subject, waves, fleet, pump, r, lines.append, canary=True, clock=now)
    )


def test_a_gateway_that_says_nothing_fails_its_wave_and_the_updated_ones_are_reverted() -> None:
    fleet = _fleet({"a": True, "b": True, "c": True})
    subject = Scripted({"a": "committed"})  # b never answers
    result = _run(subject, [["a"], ["b"], ["c"]], fleet)
    assert not result.complete and result.halted_at == 1
    assert result.tracks["b"].state == "silent"
    assert subject.published == ["a", "b"]  # c never had it
    assert subject.reverted_gws == ["a", "b"]


def test_an_offline_gateway_is_published_to_but_not_waited_for() -> None:
    fleet = _fleet({"a": True, "b": False})
    subject = Scripted({"a": "committed"})
    result = _run(subject, [["a", "b"]], fleet)
    assert result.complete, result.why
    assert result.tracks["b"].state == "offline" and "b" in subject.published


def test_failures_up_to_the_threshold_pass_the_wave() -> None:
    fleet = _fleet({"a": True, "b": True, "c": True})
    subject = Scripted({"a": "committed", "b": "failed", "c": "committed"})
    assert _run(subject, [["a", "b", "c"]], fleet, max_failures=1).complete
    assert not _run(Scripted(dict(subject.answers)), [["a", "b", "c"]], fleet).complete


def test_a_drop_in_readings_after_the_commit_fails_the_gate() -> None:
    fleet = _fleet({"a": True})
    result = _run(Scripted({"a": "committed"}), [["a"]], fleet, rate_after=0.5)  # was 5/s
    assert result.tracks["a"].state == "dropped"
    assert _run(Scripted({"a": "committed"}), [["a"]], _fleet({"a": True}), rate_after=2.6).complete


def test_a_committed_gateway_that_then_says_nothing_fails_by_the_timeout() -> None:
    fleet = _fleet({"a": True})
    lines: list[str] = []
    now = SimClock()

    async def silent(timeout: float) -> None:
        await now.sleep(min(timeout, 0.01))

    r = ro.Rules(timeout_s=0.3, settle_s=0.0, revert_timeout_s=0.1)
    subject = Scripted({"a": "committed"})
    result = asyncio.run(ro.roll_out(subject, [["a"]], fleet, silent, r, lines.append, clock=now))
    assert result.tracks["a"].state == "timeout" and not result.complete


def _statuses(*msgs: dict[str, object]) -> Seen:
    """A gateway's status messages as the rollout takes them off the broker, in order."""
    fleet = FleetSeen({"telemetry/g/status": "g"})
    for i, m in enumerate(msgs):
        fleet.add("telemetry/g/status", json.dumps(m).encode(), retained=False, now=10.0 + i)
    return fleet.gateways["g"]


def _online(state: str, version: int | None = None) -> dict[str, object]:
    return {"online": True, "release": {"state": state, "version": version, "bad": []}}


WILL = {"online": False, "reason": "will"}


def test_a_will_after_the_gateway_said_it_restarts_is_not_silence() -> None:
    """A switch re-executes the gateway: its status says ``switched``, then the process
    goes. If the broker then publishes its Will (a DISCONNECT lost: a CI run halted a
    rollout on "went offline during its wave"), it is starting again; the wave's timeout
    still fails one that never comes back. A gateway that drops mid-trial is silent."""
    switching = _statuses(_online("staged"), _online("switched"), WILL)
    assert judge_release(1, switching, since=5.0)[0] == "applying"
    rolling = _statuses(_online("trial", 1), _online("rolling_back", 1), WILL)
    assert judge_release(1, rolling, since=5.0)[0] == "applying"
    crashed = _statuses(_online("staged"), _online("trial", 1), WILL)
    assert judge_release(1, crashed, since=5.0) == ("silent", "went offline during its wave")
    back = _statuses(_online("switched"), WILL, _online("committed", 1))
    assert judge_release(1, back, since=5.0)[0] == "committed"


def test_a_restarting_gateway_that_never_comes_back_times_out() -> None:
    """The same judgement inside a rollout: once published, the gateway says it switches
    and its Will follows; applying until the wave's timeout, then a failure (reverted)."""
    fleet = FleetSeen({"telemetry/a/status": "a"})
    fleet.add("telemetry/a/status", json.dumps(_online("idle")).encode(), False, 0.0)
    said: list[dict[str, object]] = [_online("switched"), WILL]
    states: list[str] = []

    class Release(Scripted):
        def judge(self, seen: Seen | None, since: float) -> tuple[ro.State, str]:
            got = judge_release(1, seen, since)
            states.append(got[0])
            return got

    async def pump(timeout: float) -> None:
        await asyncio.sleep(min(timeout, 0.01))
        if said:
            fleet.add("telemetry/a/status", json.dumps(said.pop(0)).encode(), False, 1e9)

    r = ro.Rules(timeout_s=0.3, settle_s=0.0, revert_timeout_s=0.1)
    result = asyncio.run(ro.roll_out(Release({}), [["a"]], fleet, pump, r, lambda _: None))
    assert "applying" in states and "silent" not in states, states
    assert result.tracks["a"].state == "timeout" and not result.complete
