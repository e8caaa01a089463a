"""The apply rules without I/O (gateway/release_rules.py): the transitions, what a start
does in each phase with ``current`` before or after its rename, the trial's gates; and
the release directory's writes (gateway/release_disk.py) on a real folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from pubcomp.gateway import release_rules as rules
from pubcomp.gateway.release_disk import ReleaseDir

B = rules.Baseline(sensors_reading=("t",), sensors_silent=("dead",), nodes_connected=("n1",))


def _through(*steps: str, version: int = 8) -> rules.ApplyState:
    """A state taken through the named steps from a gateway running release 7."""
    st = rules.ApplyState(phase="committed", version=7, sha256="a" * 64, newest=7)
    for step in steps:
        if step == "fetched":
            st, _ = rules.fetched(st, version, "b" * 64, "{}", "d1")
        elif step == "switched":
            st, _ = rules.switched(st, B)
        elif step == "trial":
            st, _ = rules.trial_started(st)
        else:
            st, _ = getattr(rules, step)(st)
    return st


def test_the_happy_path_and_its_events() -> None:
    st = rules.ApplyState(phase="committed", version=7, sha256="a" * 64, newest=7)
    events = []
    st, a = rules.fetched(st, 8, "b" * 64, "{}", "d1")
    events.append(a)
    for fn in (rules.verified, rules.staged):
        st, a = fn(st)
        events.append(a)
    st, a = rules.switched(st, B)
    events.append(a)
    assert st.version == 7 and rules.running(st) == (7, "a" * 64)  # the old one, until trial
    st, a = rules.trial_started(st)
    events.append(a)
    assert rules.running(st) == (8, "b" * 64) and rules.rollback_target(st) == 7
    st, a = rules.committed(st)
    events.append(a)
    assert [e.event for e in events] == [
        "fetched", "verified", "staged", "switched", "trial", "committed"
    ]  # fmt: skip
    assert (st.phase, st.version, st.previous, st.newest, st.candidate) == (
        "committed", 8, 7, 8, None
    )  # fmt: skip
    assert rules.ApplyState.loads(st.dumps()) == st
    assert "attempt:1" in events[4].flags(st) and "version:8" in events[4].flags(st)


def test_a_rollback_marks_the_version_bad_and_keeps_the_old_one() -> None:
    st = _through("fetched", "verified", "staged", "switched", "trial")
    st, a = rules.rolling_back(st, "sensors: 0 of 1 read")
    assert a.event == "rolling_back" and "0 of 1" in (st.last_error or "")
    st, a = rules.rolled_back(st)
    assert (st.phase, st.version, st.bad, st.newest, st.candidate) == (
        "rolled_back", 7, (8,), 8, None
    )  # fmt: skip
    assert rules.arrival(st, 8, "b" * 64, "d1") == "known_bad"
    # The revert (a newer version) under way still says why 8 went; its commit clears it.
    st, _ = rules.fetched(st, 9, "c" * 64, "{}", "d2")
    for fn in (rules.verified, rules.staged):
        st, _ = fn(st)
    assert st.last_error == "release 8 failed its trial: sensors: 0 of 1 read", st
    st, _ = rules.trial_started(rules.switched(st, B)[0])
    st, _ = rules.committed(st)
    assert (st.version, st.last_error) == (9, None), st


def test_arrivals() -> None:
    st = rules.ApplyState(phase="committed", version=7, sha256="a" * 64, newest=7)
    assert rules.arrival(st, 7, "a" * 64, "x") == "running"
    assert rules.arrival(st, 8, "b" * 64, "x") == "new"
    # The newest version in another copy (another config, or current set back by hand):
    # no news, never a refusal (sync/release.py's same-version); an older one is judged.
    assert rules.arrival(st, 7, "e" * 64, "x") == "same_version"
    back = rules.ApplyState(phase="committed", version=6, sha256="f" * 64, newest=7)
    assert rules.arrival(back, 7, "a" * 64, "x") == "same_version"
    assert rules.arrival(back, 5, "a" * 64, "x") == "new"  # refused as old-version by verify
    st2, _ = rules.fetched(st, 8, "b" * 64, "{}", "d1")
    assert rules.arrival(st2, 8, "b" * 64, "d2") == "in_progress"
    assert rules.arrival(st2, 9, "c" * 64, "d3") == "new"  # replaces it before the switch
    st3, _ = rules.refused(st2, "bad-signature", "no")
    assert rules.arrival(st3, 8, "b" * 64, "d1") == "repeat_refusal"
    assert rules.arrival(st3, 8, "b" * 64, "d9") == "new"  # another envelope: judged anew
    assert st3.candidate is None and st3.version == 7
    assert rules.arrival(_through("fetched", "verified", "staged", "switched"), 9, "c", "e") == (
        "busy"
    )
    with pytest.raises(rules.ApplyRuleError):
        rules.fetched(st, 7, "a" * 64, "{}", "x")


def test_a_message_that_is_no_release_leaves_the_candidate_alone() -> None:
    st = _through("fetched", "verified")
    st2, a = rules.refused_unread(st, "dd", "chunk", "truncated")
    assert st2.phase == "verified" and st2.candidate == st.candidate and a.version is None
    st3, _ = rules.refused_unread(rules.ApplyState(), "dd", "malformed", "not JSON")
    assert st3.phase == "refused" and st3.refused == (0, "dd")


@pytest.mark.parametrize("current", [7, 8], ids=["cut before the rename", "after"])
def test_a_start_after_the_switch_finishes_it_and_counts_a_trial(current: int) -> None:
    st = _through("fetched", "verified", "staged", "switched")
    plan = rules.boot(st, current, trial_starts=3)
    assert plan.run == 8 and plan.set_current == (current != 8, 8)
    ((s, a),) = plan.steps
    assert s.phase == "trial" and s.attempts == 1 and a is not None and a.event == "trial"


def test_starts_in_trial_are_counted_and_roll_back_past_the_limit() -> None:
    st = _through("fetched", "verified", "staged", "switched", "trial")
    plan = rules.boot(st, 8, trial_starts=3)
    assert plan.run == 8 and plan.steps[0][0].attempts == 2
    st = plan.steps[0][0]
    st = rules.boot(st, 8, trial_starts=3).steps[0][0]
    assert st.attempts == 3
    plan = rules.boot(st, 8, trial_starts=3)  # a fourth start: it crashed three times
    assert plan.run == 7 and plan.set_current_then == (True, 7)
    assert [a.event for _, a in (*plan.steps, *plan.then) if a] == ["rolling_back", "rolled_back"]
    assert plan.then[0][0].bad == (8,)


@pytest.mark.parametrize("current", [8, 7], ids=["cut before the rename back", "after"])
def test_a_start_while_rolling_back_finishes_it(current: int) -> None:
    st, _ = rules.rolling_back(_through("fetched", "verified", "staged", "switched", "trial"), "x")
    plan = rules.boot(st, current, trial_starts=3)
    assert plan.run == 7 and plan.set_current == (current != 7, 7)
    ((s, a),) = plan.steps
    assert s.phase == "rolled_back" and a is not None and a.event == "rolled_back"


def test_a_candidate_whose_files_do_not_verify_is_rolled_back_at_start() -> None:
    st = _through("fetched", "verified", "staged", "switched")
    plan = rules.boot(st, 8, trial_starts=3, candidate_ok=False)
    assert plan.run == 7 and plan.set_current == (True, 7)
    assert [a.event for _, a in plan.steps if a] == ["rolling_back", "rolled_back"]


@pytest.mark.parametrize("phase", ["committed", "fetched", "verified", "staged", "refused"])
def test_other_phases_run_what_current_names(phase: str) -> None:
    steps = {"fetched": ["fetched"], "verified": ["fetched", "verified"]}
    steps["staged"] = ["fetched", "verified", "staged"]
    st = _through(*steps.get(phase, []))
    if phase == "refused":
        st, _ = rules.refused(_through("fetched"), "expired", "x")
    plan = rules.boot(st, 7, trial_starts=3)
    assert plan.run == 7 and not plan.steps and plan.set_current == (False, None)


POLICY = rules.TrialPolicy(trial_s=10, sensors_share=1.0, nodes_share=1.0)


def _facts(**over: object) -> rules.TrialFacts:
    base: dict[str, object] = {
        "elapsed_s": 1.0,
        "ready": True,
        "healthy": True,
        "problems": (),
        "uplink_connected": True,
        "delivered": True,
        "sensors_reading": frozenset({"t", "new"}),
        "sensors": frozenset({"t", "new", "dead"}),
        "nodes_connected": frozenset({"n1"}),
        "nodes": frozenset({"n1"}),
    }
    return rules.TrialFacts(**(base | over))  # type: ignore[arg-type]


def test_the_trial_passes_when_every_gate_does() -> None:
    # "dead" was silent before the switch: not the release's to mend.
    assert rules.judge_trial(_facts(), B, POLICY)[0] == "pass"


@pytest.mark.parametrize(
    "over,gate",
    [
        ({"uplink_connected": False}, "uplink"),
        ({"delivered": False}, "uplink"),
        ({"sensors_reading": frozenset({"t"})}, "sensors"),  # a new sensor that never reads
        ({"nodes_connected": frozenset()}, "nodes"),
        ({"ready": False}, "ready"),
    ],
)
def test_silence_is_a_failure_when_the_bound_passes(over: dict[str, object], gate: str) -> None:
    verdict, why = rules.judge_trial(_facts(**over), B, POLICY)
    assert verdict == "wait" and gate in why
    verdict, why = rules.judge_trial(_facts(elapsed_s=10.0, **over), B, POLICY)
    assert verdict == "fail" and gate in why and "within 10 s" in why


def test_an_unhealthy_gateway_fails_at_once_and_shares_are_shares() -> None:
    verdict, why = rules.judge_trial(_facts(healthy=False, problems=("uplink task ended",)), B,
                                     POLICY)  # fmt: skip
    assert verdict == "fail" and "uplink task ended" in why
    half = rules.TrialPolicy(trial_s=10, sensors_share=0.5, nodes_share=0.0)
    facts = _facts(sensors_reading=frozenset({"t"}), nodes_connected=frozenset())
    assert rules.judge_trial(facts, B, half)[0] == "pass"


def test_the_release_directory(tmp_path: Path) -> None:
    d = ReleaseDir(tmp_path / "rel")
    assert d.current() is None and d.previous() is None
    d.stage(8, "fleet: x\n", b"{}")
    assert d.verified(8, "0" * 64) is False
    import hashlib

    assert d.verified(8, hashlib.sha256(b"fleet: x\n").hexdigest())
    d.stage(8, "fleet: y\n", b"{}")  # an earlier try, cut short: staged again whole
    assert d.config_text(8) == "fleet: y\n"
    d.set_previous(None)
    d.set_current(8)
    assert (d.current(), d.previous()) == (8, None)
    assert (d.root / "previous").read_text() == "config\n"
    d.set_current(None)
    assert d.current() is None and not (d.root / "current").exists()
    for v in range(1, 8):
        d.stage(v, f"v{v}", b"{}")
    assert d.prune({8, 2}) == [1, 3, 4]  # the newest three others stay
    assert sorted(int(p.name) for p in d.releases.iterdir()) == [2, 5, 6, 7, 8]
    assert not list(d.releases.glob(".staging-*")) and not list(d.root.glob(".*.tmp"))


def test_current_changed_by_hand_while_stopped_is_adopted_and_said() -> None:
    st = rules.ApplyState(phase="committed", version=7, sha256="a" * 64, previous=6, newest=7)
    plan = rules.boot(st, 6, trial_starts=3, current_sha256="c" * 64)
    assert plan.run == 6
    ((s, a),) = plan.steps
    assert (s.phase, s.version, s.sha256, s.previous, s.newest) == ("committed", 6, "c" * 64, 7, 7)
    assert a is not None and a.event == "set_by_hand" and "by hand" in (s.last_error or "")
    back = rules.boot(st, None, trial_starts=3)  # current removed: the --config file
    assert back.run is None and back.steps[0][0].phase == "idle"
    assert rules.boot(st, 7, trial_starts=3).steps == ()
    # A candidate staged but not yet switched to stays under way; only what runs changes.
    cand = rules.Candidate(8, "b" * 64, "{}", "d")
    staged = rules.ApplyState(phase="staged", version=7, sha256="a" * 64, newest=7, candidate=cand)
    ((s2, _),) = rules.boot(staged, 6, trial_starts=3, current_sha256="c" * 64).steps
    assert (s2.phase, s2.version, s2.candidate) == ("staged", 6, cand)
