"""Applying signed releases on the gateway: the I/O around gateway/release_rules.py.

Two halves, one state (the rules' ``ApplyState``, in the store's ``state`` table):

- ``prepare`` runs at every start of ``pubcomp gateway run --release-dir``, before
  anything of a release is built: it reads the state and ``current``, repairs the disk
  to what the state says (a switch or a rollback cut short), counts a start in trial
  (so a release that crashes the gateway is rolled back after ``trial_starts``
  starts), and says which configuration runs. It commits with ``Store.commit`` (the
  store's write path for a group of one): the gateway's group commit does not exist
  yet, and these changes must be durable before the release's code runs.
- ``ReleaseApply`` is a task of the running gateway: it takes the release and keys
  messages the status link receives (gateway/fleetstatus.py), moves a candidate
  through fetched, verified, staged and switched (each change one op of the group
  commit with its ``$release`` audit reading), then has the gateway re-execute
  itself into the new release; in the new process it watches the trial's gates and
  commits the release or rolls it back.

Why the gateway re-executes itself (``os.execv``) rather than exit for systemd to
restart it: the same path then runs under systemd, in a container and in the tests;
it costs no ``RestartSec`` and no start of the unit's ``StartLimitBurst`` (ten
releases in five minutes would otherwise stop the unit); the PID stays the unit's
main PID (``NotifyAccess=main``), and systemd is told ``RELOADING=1`` then
``READY=1`` (sd_notify's reload protocol), so ``systemctl status`` says reloading,
not failed. systemd's ``Restart=always`` stays the net for crashes: a crash in trial
starts the gateway again, and ``prepare`` counts the start.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pubcomp.sync import faults, release
from pubcomp.sync.errors import ReleaseRefused, StoreError
from pubcomp.sync.faults import crash_point
from pubcomp.sync.groupcommit import GroupCommit
from pubcomp.sync.store import DbOp, Reading, Store
from pubcomp.sync.store.base import bump

from . import release_rules as rules
from .clock import ClockWatch
from .config import Fleet, GatewayConfig
from .errors import ConfigError
from .release_check import check_drivers, parse_release_config, unmovable
from .release_disk import ReleaseDir

if TYPE_CHECKING:
    from .service import Gateway

log = logging.getLogger(__name__)

# Crash points (sync/faults.py): each right after the step's commit (or disk change).
faults.register(
    "release_fetched",
    "release_verified",
    "release_staged",
    "release_switched",
    "release_current",
    "release_trial",
    "release_committed",
    "release_rolling_back",
    "release_rolled_back",
)

TRIAL_POLL_S = 0.5
BASELINE_SETTLE_S = 5.0  # the switch waits until the gateway has run this long
KEYS_GRACE_S = 10.0  # a release that comes before the keys document waits this long for it
GRACE = ""  # the queue's topic for "the grace is over"
REFUSED = "release_refused:"  # durable counters: release_refused:<reason>, release_<event>


# ------------------------------------------------------------------ the state's one write


def load_state(store: Store) -> rules.ApplyState:
    return rules.ApplyState.loads(store.get_state(rules.STATE_KEY))


def audit_reading(audit: rules.Audit, state: rules.ApplyState, clock: ClockWatch) -> Reading:
    """The ``$release`` reading that tells the cloud of a change (docs/wire-format.md)."""
    ts, clock_flags = clock.stamp(time.monotonic())
    return Reading(rules.AUDIT_SENSOR, None, ts, None, None, (*clock_flags, *audit.flags(state)))


def step_op(
    store: Store, state: rules.ApplyState, audit: rules.Audit | None, clock: ClockWatch
) -> DbOp:
    """One change of the apply state and its audit reading, in one transaction: the cloud
    hears of a change exactly when it is durable, and once (the reading's id is given
    with it; the pipeline's dedup removes a resent copy)."""
    reading = audit_reading(audit, state, clock) if audit is not None else None
    value = state.dumps()

    def op(db: Any) -> None:
        if reading is not None:
            store.append_batches_in(db, [(None, [reading])], {rules.STATE_KEY: value})
            assert audit is not None
            bump(db, f"release_{audit.event}", 1)
            if audit.reason:
                bump(db, REFUSED + audit.reason, 1)
        else:
            db.execute("INSERT OR REPLACE INTO state VALUES (?, ?)", (rules.STATE_KEY, value))

    return op


def keys_op(text: str) -> DbOp:
    def op(db: Any) -> None:
        db.execute("INSERT OR REPLACE INTO state VALUES (?, ?)", (rules.KEYS_KEY, text))
        bump(db, "release_keys_accepted", 1)

    return op


# ------------------------------------------------------------------ a start


@dataclass
class Boot:
    """What a start decided (``prepare``), for the gateway it then builds."""

    cfg: GatewayConfig
    store: Store
    clock: ClockWatch
    state: rules.ApplyState
    first_new_seq: int  # readings above it were stamped by this process (clock correction)
    config_file: Path  # the running configuration's file
    secrets_dir: Path
    fallback: GatewayConfig  # the --config file's
    rdir: ReleaseDir | None = None
    problems: list[str] = field(default_factory=list)


def release_config(
    rdir: ReleaseDir, version: int, gateway: str, secrets_dir: Path
) -> GatewayConfig:
    text = rdir.config_text(version)
    if text is None:
        raise ConfigError([f"{rdir.config_path(version)}: cannot read"])
    return parse_release_config(text, rdir.config_path(version), gateway, secrets_dir)[1]


def prepare(
    config: str,
    gateway: str | None,
    release_dir: str | None,
    *,
    clock: ClockWatch,
) -> Boot:
    """Decide what runs (module docstring). Raises ConfigError if the --config file is
    not valid, and what opening the store raises."""
    fleet = Fleet(config)
    fallback = fleet.gateway(fleet.pick(gateway))
    secrets_dir = Path(config).resolve().parent
    quota = int(fallback.store.quota_mb * 1e6) if fallback.store.quota_mb else None
    store = Store(
        fallback.store.path,
        gateway_id=fallback.id,
        quota_bytes=quota,
        policy=fallback.store.policy,
        hold_if_unwritable=True,
    )
    first_new_seq = store.given_seq()
    state = load_state(store)
    boot = Boot(fallback, store, clock, state, first_new_seq, Path(config), secrets_dir, fallback)
    if release_dir is None:
        if not state.resting or state.version is not None:
            boot.problems.append(
                f"releases were applied here (state {state.phase}, version {state.version}) but "
                "no --release-dir was given: running the --config file"
            )
        return boot
    rdir = boot.rdir = ReleaseDir(release_dir)
    current = rdir.current()
    cand = state.candidate
    policy_cfg = fallback
    cand_ok = True
    if cand is not None and state.phase in ("switched", "trial"):
        try:
            if not rdir.verified(cand.version, cand.sha256):
                raise ConfigError([f"{rdir.config_path(cand.version)}: missing or altered"])
            policy_cfg = release_config(rdir, cand.version, fallback.id, secrets_dir)
        except ConfigError as exc:
            cand_ok = False
            boot.problems.append(f"release {cand.version} cannot run: {'; '.join(exc.problems)}")
    current_text = rdir.config_text(current) if current is not None else None
    plan = rules.boot(
        state,
        current,
        trial_starts=policy_cfg.release.trial_starts,
        candidate_ok=cand_ok,
        current_sha256=release.sha256_hex(current_text) if current_text is not None else None,
    )
    if plan.set_current[0]:
        rdir.set_current(plan.set_current[1])
        if state.phase == "rolling_back":
            crash_point("release_rolled_back", str(cand.version if cand else ""))
    for s, a in plan.steps:
        _commit_now(store, s, a, clock)
        state = s
    if state.phase == "trial":
        crash_point("release_trial", str(cand.version if cand else ""))
    if plan.set_current_then[0]:
        rdir.set_current(plan.set_current_then[1])
        crash_point("release_rolled_back", str(cand.version if cand else ""))
    for s, a in plan.then:
        _commit_now(store, s, a, clock)
        state = s
    boot.state = state
    if plan.run is not None:
        try:
            boot.cfg = release_config(rdir, plan.run, fallback.id, secrets_dir)
            boot.config_file = rdir.config_path(plan.run)
        except ConfigError as exc:
            # A committed release that no longer loads (its files altered by hand): run
            # the --config file, and say so.
            boot.problems.append(
                f"release {plan.run} cannot run ({'; '.join(exc.problems)}): running "
                f"{config} instead"
            )
    if boot.cfg.store.quota_mb != fallback.store.quota_mb or boot.cfg.store.policy != (
        fallback.store.policy
    ):
        store.quota_bytes = int(boot.cfg.store.quota_mb * 1e6) if boot.cfg.store.quota_mb else None
        store.policy = boot.cfg.store.policy
    for p in boot.problems:
        log.error("release: %s", p)
    return boot


def _commit_now(
    store: Store, state: rules.ApplyState, audit: rules.Audit | None, clock: ClockWatch
) -> None:
    store.commit(step_op(store, state, audit, clock))
    log.info(
        "release: %s%s",
        state.phase,
        f" (version {state.candidate.version})" if state.candidate else "",
    )


# ------------------------------------------------------------------ the running gateway's task


@dataclass
class Refusals:
    by_reason: collections.Counter[str] = field(default_factory=collections.Counter)
    ignored: int = 0  # repeats of what runs, is under way, or was refused already


class ReleaseApply:
    """The release task of a running gateway (module docstring)."""

    def __init__(self, boot: Boot, gateway: Gateway, commits: GroupCommit) -> None:
        assert boot.rdir is not None
        self.boot = boot
        self.cfg = boot.cfg
        self.gw = gateway
        self.commits = commits
        self.store = boot.store
        self.rdir = boot.rdir
        self.clock = boot.clock
        self.state = boot.state
        self.prefix = self.cfg.uplink.topic_prefix
        self.refusals = Refusals()
        self.trial_wait: str | None = None  # while in trial: what the gates wait for
        self.trial_started = time.monotonic()
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._assembly = release.Reassembly()
        self._last_release: bytes | None = None  # to take again when new keys come
        self._waiting: bytes | None = None  # came while one was in trial
        self._refused_keys: set[str] = set()
        self._refused_unread: set[str] = set()  # (this process: a chunk's retained copies)
        self._grace: asyncio.TimerHandle | None = None
        self.trust: release.Trust | None = None
        self.trust_error: str | None = None
        self._load_trust()

    # ------------------------------------------------------------ trust

    def _load_trust(self) -> None:
        path = Path(self.cfg.release.root_key)
        try:
            root = release.load_public(path.read_bytes())
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            self.trust_error = (
                f"no release root key at {path} ({why}): every release is refused until "
                "it is provisioned (release.root_key)"
            )
            log.warning("release: %s", self.trust_error)
            return
        self.trust = release.Trust(root)
        held = self.store.get_state(rules.KEYS_KEY)
        if held:
            try:
                self.trust.accept_keys(held, datetime.now(UTC), stored=True)
            except ReleaseRefused as exc:  # a new root key: the old keys do not verify
                log.warning("release: the keys document held is not taken: %s", exc)

    # ------------------------------------------------------------ intake

    def topics(self) -> list[str]:
        gid = self.cfg.id
        return [
            release.release_topic(self.prefix, gid),
            release.release_topic(self.prefix, gid) + "/chunk/+",
            release.keys_topic(self.prefix),
        ]

    def on_message(self, topic: str, payload: bytes) -> None:
        """A message of the status link's subscriptions (called on the event loop)."""
        self._queue.put_nowait((topic, payload))

    # ------------------------------------------------------------ the task

    async def run(self) -> None:
        await self._go_on()
        while True:
            topic, payload = await self._queue.get()
            try:
                await self._message(topic, payload)
            except StoreError as exc:  # a full or dying store: the retained message comes again
                log.error("release: the store refused a step (%s): waiting for the next try", exc)

    async def _go_on(self) -> None:
        """Carry on from where the state is (a start after a cut, or after the switch)."""
        if self.state.phase == "trial":
            await self._trial()
        elif self.state.phase in ("fetched", "verified", "staged"):
            await self._advance()
        if self._waiting is not None:
            payload, self._waiting = self._waiting, None
            await self._release_bytes(payload)

    async def _message(self, topic: str, payload: bytes) -> None:
        rel_topic = release.release_topic(self.prefix, self.cfg.id)
        if topic == GRACE:
            self._grace = None
            if self._last_release is not None:
                await self._release_bytes(self._last_release, again=True)
            return
        if not payload:  # a retained message cleared: nothing to take, nothing to refuse
            return
        if topic == release.keys_topic(self.prefix):
            await self._keys(payload)
            return
        try:
            if topic == rel_topic:
                whole = self._assembly.on_release(payload)
            elif topic.startswith(rel_topic + "/chunk/"):
                index = topic.rpartition("/")[2]
                if not index.isdigit():
                    raise ReleaseRefused("chunk", f"release chunk topic {topic}: no index")
                whole = self._assembly.on_chunk(int(index), payload)
            else:
                return
        except ReleaseRefused as exc:
            await self._refuse_unread(release.sha256_hex(payload), exc)
            return
        if whole is not None:
            await self._release_bytes(whole)

    async def _keys(self, payload: bytes) -> None:
        if self.trust is None:
            return
        try:
            changed = self.trust.accept_keys(payload, datetime.now(UTC))
        except ReleaseRefused as exc:
            digest = release.sha256_hex(payload)
            if digest not in self._refused_keys:
                self._refused_keys.add(digest)
                reason = exc.reason
                self.refusals.by_reason[reason] += 1
                log.error("release: keys document refused (%s): %s", reason, exc)
                await self.commits.submit(lambda db: bump(db, REFUSED + reason, 1), within=1)
            return
        if not changed:
            return
        assert self.trust.keys is not None
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        await self.commits.submit(keys_op(payload.decode("utf-8")), within=0)
        log.info("release: keys document version %d taken", self.trust.keys.version)
        if self._last_release is not None:  # refused for want of these keys, perhaps
            await self._release_bytes(self._last_release, again=True)

    async def _release_bytes(self, payload: bytes, *, again: bool = False) -> None:
        self._last_release = payload
        digest = release.sha256_hex(payload)
        try:
            unverified = release.read_release(payload)
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            await self._refuse_unread(digest, ReleaseRefused("malformed", "release: not UTF-8"))
            return
        except ReleaseRefused as exc:
            await self._refuse_unread(digest, exc)
            return
        kind = rules.arrival(self.state, unverified.version, unverified.config_sha256, digest)
        if kind == "repeat_refusal" and again:  # refused for want of keys: try once more
            kind = "new"
        if kind == "busy":
            self._waiting = payload
            log.info("release %d waits for the trial under way", unverified.version)
            return
        if kind != "new":
            self.refusals.ignored += 1
            log.debug("release %d: %s, nothing to do", unverified.version, kind)
            return
        if self.trust is not None and self.trust.keys is None and not again:
            # Retained messages come in no promised order: the keys document may be on its
            # way. Taken again when it comes (``_keys``), or after a grace without it.
            if self._grace is None:
                self._grace = asyncio.get_running_loop().call_later(
                    KEYS_GRACE_S, lambda: self._queue.put_nowait((GRACE, b""))
                )
            return
        v, sha = unverified.version, unverified.config_sha256
        await self._step(*rules.fetched(self.state, v, sha, text, digest))
        crash_point("release_fetched", str(unverified.version))
        await self._advance()

    async def _refuse_unread(self, digest: str, exc: ReleaseRefused) -> None:
        if self.state.refused == (0, digest) or digest in self._refused_unread:
            self.refusals.ignored += 1
            return
        self._refused_unread.add(digest)
        self.refusals.by_reason[exc.reason] += 1
        log.error("release: refused (%s): %s", exc.reason, exc)
        await self._step(*rules.refused_unread(self.state, digest, exc.reason, str(exc)))

    # ------------------------------------------------------------ fetched .. switched

    async def _advance(self) -> None:
        while True:
            phase, cand = self.state.phase, self.state.candidate
            if cand is None:
                return
            if phase == "fetched":
                await self._verify(cand)
            elif phase == "verified":
                await self._stage(cand)
            elif phase == "staged":
                await self._switch(cand)
                return
            else:
                return

    async def _verify(self, cand: rules.Candidate) -> None:
        assert cand.envelope is not None
        try:
            await asyncio.to_thread(self.verify, cand.envelope, cand.version)
        except ReleaseRefused as exc:
            self.refusals.by_reason[exc.reason] += 1
            log.error("release %d refused (%s): %s", cand.version, exc.reason, exc)
            await self._step(*rules.refused(self.state, exc.reason, str(exc)))
            return
        await self._step(*rules.verified(self.state))
        crash_point("release_verified", str(cand.version))

    def verify(self, envelope: str, version: int) -> release.Release:
        """Every check (module gateway/release_check.py); ReleaseRefused says which failed."""
        if self.trust is None:
            raise ReleaseRefused("no-root-key", self.trust_error or "no root key")
        path = self.rdir.config_path(version)
        parsed: dict[str, Any] = {}

        def validate(text: str) -> list[str]:
            try:
                parsed["fleet"], parsed["cfg"] = parse_release_config(
                    text, path, self.cfg.id, self.boot.secrets_dir
                )
            except ConfigError as exc:
                return list(exc.problems)
            return []

        newest = self.state.newest or None
        rel = self.trust.verify(
            envelope,
            fleet=self.cfg.fleet,
            gateway=self.cfg.id,
            newest=newest,
            now=datetime.now(UTC),
            validate=validate,
        )
        new: GatewayConfig = parsed["cfg"]
        fixed = unmovable(new, self.boot.fallback)
        if fixed:
            raise ReleaseRefused("not-movable", f"release {version}: " + "; ".join(fixed))
        problems = check_drivers(parsed["fleet"], new, self.cfg.gpio)
        if problems:
            raise ReleaseRefused("driver-check", f"release {version}: " + "; ".join(problems))
        return rel

    async def _stage(self, cand: rules.Candidate) -> None:
        assert cand.envelope is not None
        env = release.decode(cand.envelope)
        config = str(env["signed"]["config"])
        try:
            await asyncio.to_thread(
                self.rdir.stage, cand.version, config, cand.envelope.encode("utf-8")
            )
        except OSError as exc:
            detail = f"release {cand.version}: writing {self.rdir.releases} failed: {exc}"
            self.refusals.by_reason["stage-failed"] += 1
            log.error("%s", detail)
            await self._step(*rules.refused(self.state, "stage-failed", detail))
            return
        await self._step(*rules.staged(self.state))
        crash_point("release_staged", str(cand.version))

    async def _switch(self, cand: rules.Candidate) -> None:
        ok = await asyncio.to_thread(self.rdir.verified, cand.version, cand.sha256)
        if not ok and cand.envelope is not None:  # removed under us: staged again
            env = release.decode(cand.envelope)
            await asyncio.to_thread(
                self.rdir.stage,
                cand.version,
                str(env["signed"]["config"]),
                cand.envelope.encode("utf-8"),
            )
        # The baseline is what ran well before the switch: a gateway that has just started
        # (after a cut at fetched, verified or staged) has no sensor readings and no nodes
        # back yet, which would excuse them all from the trial.
        settle = BASELINE_SETTLE_S - (time.monotonic() - (self.gw.ready_at or time.monotonic()))
        if settle > 0:
            await asyncio.sleep(settle)
        baseline = rules.baseline_of(
            {sid: s.readings for sid, s in self.gw.drivers.status.items()},
            self.gw.nodes_connected(),
        )
        await self._step(*rules.switched(self.state, baseline))
        crash_point("release_switched", str(cand.version))
        await asyncio.to_thread(self._rename, cand.version)
        crash_point("release_current", str(cand.version))
        log.warning(
            "release %d: switched; the gateway starts again into it (trial %g s)",
            cand.version,
            self.cfg.release.trial_s,
        )
        self.gw.restart(f"switching to release {cand.version}")

    def _rename(self, version: int) -> None:
        self.rdir.set_previous(self.state.version)
        self.rdir.set_current(version)

    # ------------------------------------------------------------ trial

    async def _trial(self) -> None:
        cand = self.state.candidate
        assert cand is not None
        policy = rules.TrialPolicy(
            self.cfg.release.trial_s,
            self.cfg.release.trial_sensors_share,
            self.cfg.release.trial_nodes_share,
        )
        self.trial_started = time.monotonic()
        log.info("release %d: in trial (start %d), up to %g s", cand.version,
                 self.state.attempts, policy.trial_s)  # fmt: skip
        while True:
            verdict, why = rules.judge_trial(self.trial_facts(), self.state.baseline, policy)
            if verdict == "pass":
                break
            if verdict == "fail":
                self.trial_wait = None
                await self._roll_back(why)
                return
            self.trial_wait = why
            await asyncio.sleep(TRIAL_POLL_S)
        self.trial_wait = None
        await self._step(*rules.committed(self.state))
        crash_point("release_committed", str(cand.version))
        log.warning("release %d committed (%s)", cand.version, why)
        keep = {self.state.version, self.state.previous}
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.rdir.prune, keep)

    def trial_facts(self) -> rules.TrialFacts:
        gw = self.gw
        ok, problems = gw.healthy()
        return rules.TrialFacts(
            elapsed_s=time.monotonic() - self.trial_started,
            ready=gw.ready,
            healthy=ok,
            problems=problems,
            uplink_connected=gw.uplink.status.state == "connected",
            delivered=gw.uplink.status.delivered > 0,
            sensors_reading=frozenset(s for s, st in gw.drivers.status.items() if st.readings),
            sensors=frozenset(s.id for s in self.cfg.sensors),
            nodes_connected=frozenset(gw.nodes_connected()),
            nodes=frozenset(n.id for n in self.cfg.nodes),
        )

    async def _roll_back(self, why: str) -> None:
        cand = self.state.candidate
        assert cand is not None
        log.error("release %d: %s: rolling back to %s", cand.version, why,
                  self.state.version or "the --config file")  # fmt: skip
        await self._step(*rules.rolling_back(self.state, why))
        crash_point("release_rolling_back", str(cand.version))
        # The start that follows sets ``current`` back and records rolled_back (prepare):
        # one path for this, a crash loop and a cut.
        self.gw.restart(f"rolling back release {cand.version}")

    # ------------------------------------------------------------ commits

    async def _step(self, state: rules.ApplyState, audit: rules.Audit | None) -> None:
        await self.commits.submit(step_op(self.store, state, audit, self.clock), within=0)
        self.state = state

    # ------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """The ``release`` part of the gateway's snapshot (and status message)."""
        st = self.state
        version, sha = rules.running(st)
        cand = st.candidate
        counters = self.store_counters()
        return {
            "version": version,
            "sha256": sha,
            "state": st.phase,
            "previous": rules.rollback_target(st) if cand else st.previous,
            "candidate": cand.version if cand else None,
            "bad": list(st.bad),
            "last_error": st.last_error or self.trust_error,
            "newest": st.newest,
            "keys_version": self.trust.keys.version if self.trust and self.trust.keys else None,
            "attempts": st.attempts,
            "trial_wait": self.trial_wait,
            "refused": {
                k[len(REFUSED) :]: v for k, v in sorted(counters.items()) if k.startswith(REFUSED)
            },
            "events": {
                k[len("release_") :]: v
                for k, v in sorted(counters.items())
                if k.startswith("release_") and not k.startswith(REFUSED)
            },
            "ignored": self.refusals.ignored,
            "config": str(self.boot.config_file),
        }

    def store_counters(self) -> dict[str, int]:
        try:
            return self.store.counters()
        except Exception:  # a read that fails says nothing here: the store's own status does
            return {}


def status_without_releases(boot: Boot) -> dict[str, Any]:
    """The ``release`` part of the snapshot of a gateway run without --release-dir."""
    st = boot.state
    return {
        "version": None,
        "sha256": None,
        "state": "off",
        "previous": None,
        "candidate": None,
        "bad": list(st.bad),
        "last_error": "; ".join(boot.problems) or None,
    }


def reexec() -> None:
    """Replace this process by a new ``pubcomp gateway run`` with the same arguments."""
    argv = list(sys.orig_argv)
    log.warning("re-executing: %s", " ".join(argv))
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
