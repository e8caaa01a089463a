"""The rules of applying a signed release on the gateway, without I/O.

Theory of operation
-------------------
A release (sync/release.py) is a signed fleet file for this one gateway. Applying it
must survive a power cut at any instant and leave the gateway running the old
release or the new one, never neither. Two things are durable, and each changes by
one atomic step:

- the **apply state** (``ApplyState``), a JSON value in the store's ``state`` table,
  changed by one op of the group commit, in the same transaction as the audit
  reading (``$release``) that tells the cloud of the change: the change and its
  report are one commit, so the cloud hears of each change exactly once;
- the **release directory** (gateway/release_disk.py): ``releases/<version>/`` (staged
  and fsynced before anything names them) and ``current``, the running version,
  replaced by write-temp, fsync, rename, fsync the folder.

The state is the authority; ``current`` follows it. Every step first makes its
decision durable in the state, then does the file-system work, and a start repairs
the disk to what the state says (``boot``). So a cut between the two is finished
by the next start; no cut can leave ``current`` naming a release that is not
whole on disk, because a release is staged (fsynced) before the state may say
``switched``.

Phases and their transitions (each arrow is one commit with one audit event)::

    idle | committed | rolled_back | refused       (resting: a version runs)
      --an envelope not seen before-------------> fetched     (the envelope is kept in the state)
    fetched  --signature, gateway, version, expiry,
               config, drivers in check mode------> verified
    fetched  --any check fails-------------------> refused     (a reason; nothing applied)
    verified --files written and fsynced----------> staged
    staged   --baseline taken---------------------> switched    (then: previous, current renamed;
                                                                  the gateway re-executes itself)
    switched --the new process starts (boot)------> trial       (attempt 1)
    trial    --the process starts again (boot)----> trial       (attempt n+1)
    trial    --gates pass within trial_s-----------> committed
    trial    --a gate fails, the bound passes, or
               trial_starts starts without passing-> rolling_back
    rolling_back --current renamed back (boot)----> rolled_back (the version marked bad)
    resting  --current names another version (boot)-> committed  (set by hand while stopped:
                                                                  it runs, the state follows)

A newer envelope that arrives before ``switched`` replaces the candidate (the
gateway catches up on the newest, skipping those in between); one arriving from
``switched`` on waits in memory until the trial ends (it is retained at the broker:
a restart fetches it again).

Rollback protection: ``newest`` is the highest version applied or marked bad; a
release whose version is not above it is refused (a replay), so a version rolled
back here comes back only as a newer release. What the broker keeps retained comes
again at every reconnection, so a repeat of the running release, of a version
marked bad, of the newest version in another copy (``same-version``: no news) or of
the last refusal is ignored quietly (counted as ``ignored``, never as a refusal).

Trial gates (``judge_trial``): the gateway is ready and healthy; the uplink is
connected and has delivered a reading in this process (there is always one: the
trial's own audit reading, committed at the start, so a gateway without sensors
proves its path to the broker too; a backlog from before need not drain); of the
sensors that read before the switch and are still configured,
``trial_sensors_share`` read; of the nodes connected before the switch and still
configured, ``trial_nodes_share`` connected again. Every gate
must be seen passing: silence (no reading, no connection) is a failure when
``trial_s`` ends. A start in trial counts an attempt *before* anything of the new
release is built, so a release that crashes the gateway is rolled back after
``trial_starts`` starts, by the old release's code path (``boot``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

STATE_KEY = "release/apply"  # the apply state, in the store's ``state`` table
KEYS_KEY = "release/keys"  # the newest release-keys document accepted (its envelope)
AUDIT_SENSOR = "$release"  # the audit reading's sensor (docs/wire-format.md)
AUDIT_FLAG = "release"

Phase = Literal[
    "idle",
    "committed",
    "rolled_back",
    "refused",
    "fetched",
    "verified",
    "staged",
    "switched",
    "trial",
    "rolling_back",
]
RESTING: tuple[Phase, ...] = ("idle", "committed", "rolled_back", "refused")
# Before the switch a newer release may replace the candidate; from it on, not.
REPLACEABLE: tuple[Phase, ...] = (*RESTING, "fetched", "verified", "staged")
Event = Literal[
    "fetched",
    "verified",
    "refused",
    "staged",
    "switched",
    "trial",
    "committed",
    "rolling_back",
    "rolled_back",
    "set_by_hand",
]
# Why a release was refused: a code for counting (metrics, the audit reading), and a
# sentence for people (the status's last_error, the log). sync/release.py's reasons (the
# signature, the addressee, the version, the expiry, the hash, the config's validation,
# the chunks), and the gateway's own:
GATEWAY_REASONS = (
    "no-root-key",  # this gateway holds no root key (release.root_key): it trusts nothing
    "driver-check",  # a sensor's driver cannot be built (check mode)
    "not-movable",  # it would move the store or rename the gateway: a visit, not a release
    "stage-failed",  # its files could not be written
)
Reason = str


class ApplyRuleError(Exception):
    """A transition the rules do not allow from this phase (a bug, never bad input)."""


@dataclass(frozen=True)
class Candidate:
    version: int
    sha256: str  # the configuration's (config_sha256)
    envelope: str | None = None  # kept until switched (then it is on disk)
    digest: str = ""  # the envelope's bytes' SHA-256 (a repeat of a refusal is known by it)


@dataclass(frozen=True)
class Baseline:
    """What ran well before the switch: the trial compares against it."""

    sensors_reading: tuple[str, ...] = ()
    sensors_silent: tuple[str, ...] = ()
    nodes_connected: tuple[str, ...] = ()


@dataclass(frozen=True)
class ApplyState:
    phase: Phase = "idle"
    # The release committed last (None: the --config file): what runs while nothing is
    # in trial, and what a rollback returns to while something is.
    version: int | None = None
    sha256: str | None = None
    previous: int | None = None  # the one committed before it
    previous_sha256: str | None = None
    candidate: Candidate | None = None
    newest: int = 0  # the newest version applied or marked bad (rollback protection)
    bad: tuple[int, ...] = ()
    # Why the last release was refused or rolled back: kept while the next one is under
    # way (an operator watching a revert still sees why), cleared when one commits.
    last_error: str | None = None
    refused: tuple[int, str] | None = None  # (version, envelope digest) of the last refusal
    attempts: int = 0  # starts in trial
    baseline: Baseline = field(default_factory=Baseline)

    # ------------------------------------------------------------ encoding

    def dumps(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def loads(cls, text: str | None) -> ApplyState:
        if not text:
            return cls()
        d: dict[str, Any] = json.loads(text)
        cand = d.pop("candidate", None)
        base = d.pop("baseline", None) or {}
        refused = d.pop("refused", None)
        return cls(
            phase=d.get("phase", "idle"),
            version=d.get("version"),
            sha256=d.get("sha256"),
            previous=d.get("previous"),
            previous_sha256=d.get("previous_sha256"),
            candidate=Candidate(**cand) if cand else None,
            newest=int(d.get("newest", 0)),
            bad=tuple(d.get("bad", ())),
            last_error=d.get("last_error"),
            refused=(int(refused[0]), str(refused[1])) if refused else None,
            attempts=int(d.get("attempts", 0)),
            baseline=Baseline(**{k: tuple(v) for k, v in base.items()}),
        )

    @property
    def resting(self) -> bool:
        return self.phase in RESTING


@dataclass(frozen=True)
class Audit:
    """One state change as the cloud hears of it (a ``$release`` reading)."""

    event: Event
    version: int | None
    reason: Reason | None = None
    detail: str | None = None
    attempt: int | None = None

    def flags(self, state: ApplyState) -> tuple[str, ...]:
        """The reading's flags (docs/wire-format.md, "Release audit readings")."""
        out = [AUDIT_FLAG, f"event:{self.event}"]
        if self.version is not None:
            out.append(f"version:{self.version}")
        if state.version is not None:
            out.append(f"running:{state.version}")
        if self.attempt is not None:
            out.append(f"attempt:{self.attempt}")
        if self.reason is not None:
            out.append(f"reason:{self.reason}")
        if self.detail:
            out.append(f"detail:{self.detail[:300]}")
        return tuple(out)


Step = tuple[ApplyState, Audit]


# ------------------------------------------------------------------ arrival


Arrival = Literal[
    "new", "running", "known_bad", "repeat_refusal", "in_progress", "same_version", "busy"
]


def arrival(state: ApplyState, version: int, sha256: str, digest: str) -> Arrival:
    """What an envelope (parsed, not yet verified) is to this state. Only ``new`` is
    fetched; ``busy``: one is past its switch, this one waits for the trial's end."""
    if state.version == version and state.sha256 == sha256:
        return "running"
    if version in state.bad:  # the retained copy of what was rolled back, at each reconnect
        return "known_bad"
    if state.refused == (version, digest):
        return "repeat_refusal"
    cand = state.candidate
    if cand is not None and (cand.version, cand.sha256) == (version, sha256):
        return "in_progress"
    if state.newest and version == state.newest:
        # The newest applied or marked bad, in another copy (or after ``current`` was set
        # back by hand): no news, not a refusal (sync/release.py's ``same-version``).
        return "same_version"
    if state.phase not in REPLACEABLE:
        return "busy"
    return "new"


# ------------------------------------------------------------------ the steps


def _need(state: ApplyState, *phases: Phase) -> Candidate:
    if state.phase not in phases:
        raise ApplyRuleError(f"phase {state.phase}: expected one of {', '.join(phases)}")
    if phases != RESTING and state.candidate is None and state.phase not in RESTING:
        raise ApplyRuleError(f"phase {state.phase} without a candidate")
    return state.candidate or Candidate(0, "")


def fetched(state: ApplyState, version: int, sha256: str, envelope: str, digest: str) -> Step:
    if arrival(state, version, sha256, digest) != "new":
        raise ApplyRuleError(f"version {version} is not new here")
    cand = Candidate(version, sha256, envelope, digest)
    return replace(state, phase="fetched", candidate=cand), Audit("fetched", version)


def verified(state: ApplyState) -> Step:
    cand = _need(state, "fetched")
    return replace(state, phase="verified"), Audit("verified", cand.version)


def refused(state: ApplyState, reason: Reason, detail: str) -> Step:
    """From fetched or verified (staging failed): back to resting, nothing applied."""
    cand = _need(state, "fetched", "verified")
    text = f"release {cand.version} refused ({reason}): {detail}"
    out = replace(
        state,
        phase="refused",
        candidate=None,
        last_error=text,
        refused=(cand.version, cand.digest),
    )
    return out, Audit("refused", cand.version, reason, detail)


def refused_unread(state: ApplyState, digest: str, reason: Reason, detail: str) -> Step:
    """A message that never became a candidate (not an envelope, its chunks do not match):
    refused, and whatever is under way goes on. ``digest``: its bytes' SHA-256, so the
    same message again (at a reconnection) is not refused twice."""
    text = f"a release message was refused ({reason}): {detail}"
    phase: Phase = "refused" if state.resting else state.phase
    out = replace(state, phase=phase, last_error=text, refused=(0, digest))
    return out, Audit("refused", None, reason, detail)


def staged(state: ApplyState) -> Step:
    cand = _need(state, "verified")
    return replace(state, phase="staged"), Audit("staged", cand.version)


def switched(state: ApplyState, baseline: Baseline) -> Step:
    """The candidate is to run; ``version`` stays the running one until the commit, and is
    what a rollback returns to. The envelope is on disk (staged): not kept twice."""
    cand = _need(state, "staged")
    out = replace(
        state,
        phase="switched",
        candidate=replace(cand, envelope=None),
        baseline=baseline,
        attempts=0,
    )
    return out, Audit("switched", cand.version)


def trial_started(state: ApplyState) -> Step:
    """A start of the candidate, counted before anything of it is built; each start is an
    event of its own (``attempt:n``), so the uplink gate always has a reading to deliver."""
    cand = _need(state, "switched", "trial")
    out = replace(state, phase="trial", attempts=state.attempts + 1)
    return out, Audit("trial", cand.version, attempt=out.attempts)


def committed(state: ApplyState) -> Step:
    cand = _need(state, "trial")
    out = replace(
        state,
        phase="committed",
        previous=state.version,
        previous_sha256=state.sha256,
        version=cand.version,
        sha256=cand.sha256,
        candidate=None,
        newest=max(state.newest, cand.version),
        attempts=0,
        last_error=None,
        baseline=Baseline(),
    )
    return out, Audit("committed", cand.version)


def rolling_back(state: ApplyState, why: str) -> Step:
    cand = _need(state, "trial", "switched")
    text = f"release {cand.version} failed its trial: {why}"
    out = replace(state, phase="rolling_back", last_error=text)
    return out, Audit("rolling_back", cand.version, None, why)


def rolled_back(state: ApplyState) -> Step:
    """``current`` names the running release again (``version``): the candidate is bad."""
    cand = _need(state, "rolling_back")
    out = replace(
        state,
        phase="rolled_back",
        candidate=None,
        newest=max(state.newest, cand.version),
        bad=tuple(sorted({*state.bad, cand.version})),
        attempts=0,
        baseline=Baseline(),
    )
    return out, Audit("rolled_back", cand.version, None, state.last_error)


# ------------------------------------------------------------------ boot


@dataclass(frozen=True)
class BootPlan:
    """What a start does before it builds anything: the steps to commit, in order, each
    after the disk change before it (``current`` set to ``set_current`` first when it is
    not ``None``-sentinel), and the version to run."""

    run: int | None  # the version to run (None: the --config file)
    set_current: tuple[bool, int | None] = (False, None)  # (change?, to)
    steps: tuple[tuple[ApplyState, Audit | None], ...] = ()
    then: tuple[tuple[ApplyState, Audit | None], ...] = ()  # after a second disk change
    set_current_then: tuple[bool, int | None] = (False, None)


def set_by_hand(state: ApplyState, current: int | None, sha256: str | None) -> Step:
    """``current`` names another release than the state (changed by hand while the gateway
    was stopped, or a new store beside an old release directory): what it names runs, and
    the state follows, saying so. A candidate not yet switched to stays under way (its
    phase kept): the running task goes on with it, and a rollback returns to ``current``."""
    phase: Phase = "committed" if current is not None else "idle"
    out = replace(
        state,
        phase=phase if state.resting else state.phase,
        version=current,
        sha256=sha256,
        previous=state.version,
        previous_sha256=state.sha256,
        newest=max(state.newest, current or 0),
        last_error=f"current was set to {current or 'the --config file'} by hand "
        f"(the state said {state.version or 'the --config file'})",
    )
    return out, Audit("set_by_hand", current, None, out.last_error)


def boot(
    state: ApplyState,
    current: int | None,
    *,
    trial_starts: int,
    candidate_ok: bool = True,
    current_sha256: str | None = None,
) -> BootPlan:
    """What to run at a start, given the state and what ``current`` names on disk.

    - resting, fetched, verified, staged: what ``current`` names (the running task goes
      on with a candidate from where it was);
    - switched: ``current`` is set to the candidate if the cut came before the rename,
      then the trial's first start;
    - trial: another start (counted); past ``trial_starts``, a rollback;
    - trial with ``current`` not naming the candidate (changed by hand): a rollback;
    - switched or trial with a candidate whose files do not verify (``candidate_ok``
      False: altered or removed by hand): a rollback;
    - rolling_back: ``current`` set back to the release that ran before (``version``),
      then rolled_back;
    - otherwise, ``current`` naming another release than the state's: set by hand (the
      operator's recovery, docs/operations.md): it runs, and the state follows.
    """
    phase, cand = state.phase, state.candidate
    if phase in ("switched", "trial") and cand is not None and not candidate_ok:
        s1, a1 = rolling_back(state, f"release {cand.version}'s files do not verify")
        s2, a2 = rolled_back(s1)
        fix = (current != state.version, state.version)
        return BootPlan(state.version, set_current=fix, steps=((s1, a1), (s2, a2)))
    if phase == "switched" and cand is not None:
        s, a = trial_started(state)
        fix = (current != cand.version, cand.version)
        return BootPlan(cand.version, set_current=fix, steps=((s, a),))
    if phase == "trial" and cand is not None:
        if current != cand.version:  # set back by hand: a rollback (to the committed one)
            s1, a1 = rolling_back(state, f"current was changed to {current} during the trial")
            s2, a2 = rolled_back(s1)
            fix = (current != state.version, state.version)
            return BootPlan(state.version, set_current=fix, steps=((s1, a1), (s2, a2)))
        if state.attempts >= trial_starts:
            s1, a1 = rolling_back(
                state, f"the gateway started {state.attempts} times in trial without passing"
            )
            s2, a2 = rolled_back(s1)
            return BootPlan(
                state.version,
                steps=((s1, a1),),
                set_current_then=(True, state.version),
                then=((s2, a2),),
            )
        s, a = trial_started(state)
        return BootPlan(cand.version, steps=((s, a),))
    if phase == "rolling_back" and cand is not None:
        s, a = rolled_back(state)
        fix = (current != state.version, state.version)
        return BootPlan(state.version, set_current=fix, steps=((s, a),))
    if current != state.version:
        return BootPlan(current, steps=(set_by_hand(state, current, current_sha256),))
    return BootPlan(current)


def running(state: ApplyState) -> tuple[int | None, str | None]:
    """The version running now, and its sha256 (the candidate from its trial on)."""
    cand = state.candidate
    if cand is not None and state.phase in ("trial", "rolling_back"):
        return cand.version, cand.sha256
    return state.version, state.sha256


def rollback_target(state: ApplyState) -> int | None:
    """While a candidate is under way: what a rollback returns to (None: --config)."""
    return state.version


# ------------------------------------------------------------------ the trial


@dataclass(frozen=True)
class TrialFacts:
    """What the gateway shows at one instant of its trial."""

    elapsed_s: float
    ready: bool
    healthy: bool
    problems: Sequence[str]
    uplink_connected: bool
    delivered: bool  # the uplink delivered a reading in this process (the broker has it)
    sensors_reading: frozenset[str]  # configured sensors with a reading in this process
    sensors: frozenset[str]  # configured in the new release
    nodes_connected: frozenset[str]
    nodes: frozenset[str]  # configured in the new release


@dataclass(frozen=True)
class TrialPolicy:
    trial_s: float
    sensors_share: float
    nodes_share: float


Verdict = tuple[Literal["pass", "wait", "fail"], str]


def gates(facts: TrialFacts, baseline: Baseline, policy: TrialPolicy) -> dict[str, str | None]:
    """Each gate: None when it passes, else why not (a sentence)."""
    out: dict[str, str | None] = {}
    out["ready"] = None if facts.ready else "not ready"
    out["healthy"] = None if facts.healthy else "; ".join(facts.problems) or "unhealthy"
    if not facts.uplink_connected:
        out["uplink"] = "uplink not connected"
    elif not facts.delivered:
        out["uplink"] = "uplink connected, nothing delivered yet"
    else:
        out["uplink"] = None
    # Sensors that were silent before the switch are not the release's to mend; new
    # sensors (not configured before) are expected to read.
    silent = set(baseline.sensors_silent)
    expected = sorted(s for s in facts.sensors if s not in silent)
    need = math.ceil(policy.sensors_share * len(expected) - 1e-9)
    reading = [s for s in expected if s in facts.sensors_reading]
    out["sensors"] = (
        None
        if len(reading) >= need
        else f"{len(reading)} of {len(expected)} sensors read, {need} needed"
        + f" (silent: {', '.join(s for s in expected if s not in facts.sensors_reading)})"
    )
    before = sorted(n for n in baseline.nodes_connected if n in facts.nodes)
    need_n = math.ceil(policy.nodes_share * len(before) - 1e-9)
    back = [n for n in before if n in facts.nodes_connected]
    out["nodes"] = (
        None
        if len(back) >= need_n
        else f"{len(back)} of {len(before)} nodes connected before the switch are back, "
        f"{need_n} needed"
    )
    return out


def judge_trial(facts: TrialFacts, baseline: Baseline, policy: TrialPolicy) -> Verdict:
    """pass: every gate passes; fail: the bound passed without (silence is failure), or
    the gateway is unhealthy; wait: not yet."""
    result = gates(facts, baseline, policy)
    failing = {k: v for k, v in result.items() if v is not None}
    if not failing:
        return "pass", "every gate passed"
    if facts.ready and not facts.healthy:
        return "fail", f"unhealthy: {failing['healthy']}"
    if facts.elapsed_s >= policy.trial_s:
        why = "; ".join(f"{k}: {v}" for k, v in failing.items())
        return "fail", f"gates not passed within {policy.trial_s:g} s: {why}"
    return "wait", "; ".join(f"{k}: {v}" for k, v in failing.items())


def baseline_of(sensors: Mapping[str, int], nodes_connected: Sequence[str]) -> Baseline:
    """The old process's view before the switch: sensors (readings so far) and nodes."""
    return Baseline(
        sensors_reading=tuple(sorted(s for s, n in sensors.items() if n > 0)),
        sensors_silent=tuple(sorted(s for s, n in sensors.items() if n == 0)),
        nodes_connected=tuple(sorted(nodes_connected)),
    )
