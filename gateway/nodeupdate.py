"""``pubcomp node update``: a gateway's nodes get new software, in waves.

Run on the gateway (it writes beside the gateway's store, as `pubcomp status`
reads the gateway's health port): the set is made (``--files DIR``: compiled
with mpy-cross, or ``--files VERSION``: one made before), then offered wave by
wave: an offer per node, signed with its update key (gateway/nodesets.py); the
running gateway's ingress serves it (gateway/nodeoffer.py) and shows what each
node says of its software in its status (``nodes.*.software``), which is what
this module watches. Per node the outcome is one of ``OUTCOMES``; a wave whose
failures exceed ``max_failures`` halts the rollout, and the nodes after it are
not offered anything.

A halt reverts, automatically (issue 28: the rule of ``pubcomp fleet rollout``),
the nodes the rollout updated: each node's version before its wave (what its
status said as the wave began) comes back as a NEW set, one version above any
this gateway made, carrying the files of the set that version was. A node never
takes a version at or below the one it runs, nor one it rolled back
(firmware/lib/pubnode/update.py), so the old number itself could not come back;
a new number with the old files is taken like any update, and tried, committed or
rolled back the same way. A node that ran its factory set (version 0: the files
deploy.sh put in /lib, which the gateway never had) gets a set of kind
"factory": no files, a new number, and the node runs /lib under it. The revert
is watched to the end like a wave; ``revert=False`` (``--no-revert``) only halts.

``update_nodes`` is the function a rollout calls; ``node_update`` is the command.
An offline node keeps its offer: it takes it when it comes back.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pubcomp.sync.exitcodes import (
    EXIT_FAILED,
    EXIT_OFFLINE,
    EXIT_REVERT_FAILED,
    EXIT_ROLLOUT_HALTED,
    EXIT_USAGE,
)

from .config import Fleet, GatewayConfig
from .errors import ConfigError
from .nodesets import (
    DEFAULT_CHUNK,
    Format,
    SoftwareSet,
    UpdateError,
    compile_dir,
    load_set,
    make_offer,
    read_key,
    save_set,
    set_versions,
    state_dir,
    withdraw,
    write_offer,
)

OUTCOMES = {
    "done": "runs the new version (committed: it connected and delivered)",
    "rolled_back": "tried it and went back to the version before (failed)",
    "refused": "would not take the offer (failed)",
    "failed": "gave the offer up: bad chunks or files that did not verify (failed)",
    "timed_out": "connected, but not done in time (failed)",
    "offline": "not connected during its wave: the offer waits for it",
    "not_offered": "after a halted wave: offered nothing",
    "reverted": "after a halt: runs the software it ran before again (under a new version)",
    "revert_failed": "after a halt: could not be taken back to the software it ran before",
}
FAILED = ("rolled_back", "refused", "failed", "timed_out")
# After a halt: these may run the version that failed (or take it later), so they get
# the revert; the others run the version they ran before (they refused it, gave it up
# or rolled it back), and only lose the offer.
REVERT = ("done", "timed_out", "offline")

Status = Callable[[], dict[str, Any]]
Progress = Callable[[str], None]


@dataclass
class NodeResult:
    node: str
    outcome: str
    running: int | None = None  # the version it said it runs
    detail: str = ""
    update: str | None = None  # after a revert: the update's outcome it reverted


@dataclass
class Rollout:
    version: int
    label: str
    results: dict[str, NodeResult] = field(default_factory=dict)
    halted: str | None = None  # why the rollout stopped before its last wave
    reverts: dict[int, int] = field(default_factory=dict)  # revert set -> version it brings back
    reverting: bool = False  # a halt was followed by a revert

    @property
    def failed(self) -> list[str]:
        return [n for n, r in self.results.items() if r.outcome in FAILED]

    @property
    def revert_failed(self) -> list[str]:
        return [n for n, r in self.results.items() if r.outcome == "revert_failed"]

    @property
    def ok(self) -> bool:
        return all(r.outcome == "done" for r in self.results.values())


def parse_waves(spec: str, n: int) -> list[int]:
    """Wave sizes for ``n`` nodes from "1,25%,100%" (cumulative counts or shares)."""
    marks: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            mark = math.ceil(n * float(part[:-1]) / 100) if part.endswith("%") else int(part)
        except ValueError:
            raise UpdateError(f"--waves {spec}: {part!r} is not a count or a share") from None
        if mark <= 0:
            raise UpdateError(f"--waves {spec}: {part!r}: a wave must take at least one node")
        marks.append(min(mark, n))
    if marks != sorted(marks):
        raise UpdateError(f"--waves {spec}: cumulative, so each must be at least the one before")
    if not marks or marks[-1] < n:
        marks.append(n)
    sizes, at = [], 0
    for m in marks:
        if m > at:
            sizes.append(m - at)
            at = m
    return sizes


def outcome(sw: dict[str, Any] | None, version: int, kind: str = "files") -> tuple[str | None, str]:
    """(outcome, detail) from what a node said of its software; None while it is under way.
    ``kind`` "image": a whole firmware image (ESP32), whose versions the node keeps apart."""
    if not sw:
        return None, "no word from it yet"
    last = sw.get("last") or [None, None, ""]
    runs, bad = ("image", "image_bad") if kind == "image" else ("version", "bad")
    what = "image" if kind == "image" else "version"
    if sw.get(runs) == version and sw.get("state") == "running":
        return "done", f"runs {what} {version}"
    if isinstance(sw.get(bad), int) and sw[bad] >= version:
        return "rolled_back", f"{what} {version} did not commit on its try; runs {sw.get(runs)}"
    if last[0] == version and last[1] in ("refused", "failed"):
        return str(last[1]), str(last[2])
    if sw.get("state") == "trial" and sw.get(runs) == version:
        return None, "trying it"
    if sw.get("offer") == version and sw.get("total"):
        return None, f"fetching: {sw.get('served', 0):,} of {sw['total']:,} bytes"
    return None, f"runs {'image ' if kind == 'image' else ''}{sw.get(runs)}, {sw.get('state')}"


def prepare_set(
    cfg: GatewayConfig, files: str, fmt: Format, label: str | None = None
) -> SoftwareSet:
    """``files``: a library directory to compile, or the version of a set made before."""
    root = state_dir(cfg)
    if files.isdigit():
        if int(files) not in set_versions(root):
            raise UpdateError(f"--files {files}: no set {files} on this gateway ({root}/sets)")
        return load_set(root, int(files))
    source = Path(files)
    made = compile_dir(source, fmt)
    return save_set(root, made, label or f"{source.resolve()} ({fmt})", fmt)


def update_nodes(
    cfg: GatewayConfig,
    fleet: Path,
    nodes: list[str],
    software: SoftwareSet,
    *,
    waves: list[int] | None = None,
    timeout_s: float = 600.0,
    max_failures: int = 0,
    chunk: int = DEFAULT_CHUNK,
    status: Status,
    progress: Progress | None = None,
    poll_s: float = 1.0,
    wait: bool = True,
    revert: bool = True,
) -> Rollout:
    """Offer ``software`` to ``nodes`` wave by wave; the outcome per node.

    ``status()`` is the running gateway's status (``/status.json``). With ``wait``
    false the offers are all written at once and every node is left "offline"
    in the result (no one has answered yet). With ``revert`` a halt takes the nodes
    already offered back to what they ran before (``_revert``)."""
    known = {n.id for n in cfg.nodes}
    unknown = [n for n in nodes if n not in known]
    if unknown:
        raise UpdateError(f"gateway {cfg.id} has no node {', '.join(unknown)} in the fleet file")
    keys = {n: read_key(fleet, cfg.id, n) for n in nodes}  # all of them before any offer
    root = state_dir(cfg)
    say = progress or (lambda _: None)
    result = Rollout(software.version, software.label)
    sizes = waves or [len(nodes)]
    runs = "image" if software.format == "image" else "version"
    before: dict[str, int | None] = {}  # what each node ran as its wave began
    at = 0
    for w, size in enumerate(sizes, 1):
        wave = nodes[at : at + size]
        at += size
        if wait:
            before.update(_running(wave, runs, status))
        for n in wave:
            write_offer(root, n, make_offer(keys[n], n, software, chunk))
        say(f"wave {w}/{len(sizes)}: version {software.version} offered to {', '.join(wave)}")
        if not wait:
            result.results.update({n: NodeResult(n, "offline", None, "offered") for n in wave})
            continue
        want = {n: software.version for n in wave}
        result.results.update(_watch(want, software.format, timeout_s, status, say, poll_s))
        failed = [n for n in wave if result.results[n].outcome in FAILED]
        if len(failed) > max_failures:
            result.halted = (
                f"wave {w}: {len(failed)} failed ({', '.join(failed)}), more than "
                f"--max-failures {max_failures}"
            )
            for n in nodes[at:]:
                result.results[n] = NodeResult(n, "not_offered", None, "the rollout halted")
            say(f"halted: {result.halted}")
            if revert:
                _revert(root, keys, nodes[:at], before, software, result, chunk, timeout_s,
                        status, say, poll_s)  # fmt: skip
            break
    return result


def _running(wave: list[str], runs: str, status: Status) -> dict[str, int | None]:
    """The version each node of ``wave`` says it runs (None: no word from it)."""
    try:
        snap = status()
    except (OSError, ValueError):
        snap = {}
    out: dict[str, int | None] = {}
    for n in wave:
        sw = ((snap.get("nodes") or {}).get(n) or {}).get("software") or {}
        v = sw.get(runs)
        out[n] = v if isinstance(v, int) and not isinstance(v, bool) else None
    return out


@dataclass
class RevertPlan:
    groups: dict[int, list[str]]  # the version they ran before -> nodes to take back to it
    cannot: dict[str, str]  # node -> why it cannot be taken back
    keep: list[str]  # nodes that run what they ran before (refused, gave up, rolled back)


def plan_revert(
    outcomes: dict[str, str],
    before: dict[str, int | None],
    held: list[int],
    software: SoftwareSet,
) -> RevertPlan:
    """Who is taken back to what after a halt: ``outcomes`` of the nodes offered
    ``software``, the version each ran as its wave began, the sets this gateway holds."""
    image = software.format == "image"
    what = "image" if image else "version"
    plan = RevertPlan({}, {}, [])
    for n, got in outcomes.items():
        if got not in REVERT:
            plan.keep.append(n)
            continue
        prev = before.get(n)
        if prev is None:
            why = f"what it ran before {what} {software.version} is not known (no word from it)"
        elif prev == 0 and image:
            why = "it ran the image flashed by cable (image 0), which this gateway does not hold"
        elif prev and prev not in held:
            why = f"it ran {what} {prev}, and this gateway holds no set {prev} (deleted?)"
        else:
            plan.groups.setdefault(prev, []).append(n)
            continue
        plan.cannot[n] = why
    return plan


def _revert(
    root: Path,
    keys: dict[str, bytes],
    offered: list[str],
    before: dict[str, int | None],
    software: SoftwareSet,
    result: Rollout,
    chunk: int,
    timeout_s: float,
    status: Status,
    say: Progress,
    poll_s: float,
) -> None:
    """After a halt: each node offered ``software`` that may run it (or take it later) is
    offered what it ran before as a new set; the others lose their offer."""
    result.reverting = True
    what = "image" if software.format == "image" else "version"
    outcomes = {n: result.results[n].outcome for n in offered}
    plan = plan_revert(outcomes, before, set_versions(root), software)
    for n in plan.keep:
        withdraw(root, n)  # it runs what it ran before: only the failed offer goes
    for n, why in plan.cannot.items():
        _not_reverted(root, result, n, why, say)
    targets: dict[str, int] = {}  # node -> the revert set it is offered
    for prev, group in sorted(plan.groups.items()):
        try:
            if prev == 0:  # its factory set, in its /lib: the node has the files
                label = f"revert of {software.version}: the factory set"
                rev = save_set(root, [], label, "factory", new=True)
            else:
                old = load_set(root, prev)
                label = f"revert of {software.version}: the files of set {prev} ({old.label})"
                rev = save_set(root, list(old.files), label, old.format, new=True)
        except UpdateError as exc:
            for n in group:
                _not_reverted(root, result, n, f"set {prev}: {exc}", say)
            continue
        result.reverts[rev.version] = prev
        for n in group:
            write_offer(root, n, make_offer(keys[n], n, rev, chunk))
            targets[n] = rev.version
        say(f"revert: {what} {rev.version} ({_files_of(what, prev)}) offered to {', '.join(group)}")
    if not targets:
        return
    got = _watch(targets, software.format, timeout_s, status, say, poll_s, tag="revert: ")
    for n, r in got.items():
        rev_v = targets[n]
        prev = result.reverts[rev_v]
        was = result.results[n].outcome
        if r.outcome == "done":
            out, detail = "reverted", f"runs {what} {rev_v}: {_files_of(what, prev)} again"
        elif r.outcome == "offline":
            out = "offline"
            detail = f"not connected while the revert ran: {what} {rev_v} waits for it"
        else:
            out, detail = "revert_failed", f"{what} {rev_v} (the revert) {r.outcome}: {r.detail}"
        result.results[n] = NodeResult(n, out, r.running, detail, was)


def _files_of(what: str, prev: int) -> str:
    return "the factory set" if prev == 0 else f"the files of {what} {prev}"


def _not_reverted(root: Path, result: Rollout, n: str, why: str, say: Progress) -> None:
    withdraw(root, n)  # whatever it runs, it must not take the failed version later
    r = result.results[n]
    if r.outcome == "offline":
        r.detail = f"the rollout halted: its offer withdrawn ({why})"
        return
    result.results[n] = NodeResult(n, "revert_failed", r.running, why, r.outcome)
    say(f"revert: {n}: not reverted: {why}")


def _watch(
    want: dict[str, int],
    fmt: str,
    timeout_s: float,
    status: Status,
    say: Progress,
    poll_s: float,
    tag: str = "",
) -> dict[str, NodeResult]:
    """Poll the gateway's status until each node is done or failed with the version
    ``want`` gives it, or time is up."""
    kind = "image" if fmt == "image" else "files"
    runs = "image" if kind == "image" else "version"
    deadline = time.monotonic() + timeout_s
    seen_connected: set[str] = set()
    out: dict[str, NodeResult] = {}
    said: dict[str, str] = {}
    snap: dict[str, Any] = {}
    while True:
        try:
            snap = status()
        except (OSError, ValueError) as exc:
            say(f"gateway status: {exc} (trying again)")
            snap = {}
        for n, version in want.items():
            if n in out:
                continue
            ns = (snap.get("nodes") or {}).get(n) or {}
            if ns.get("connected"):
                seen_connected.add(n)
            sw = ns.get("software")
            got, detail = outcome(sw, version, kind)
            if got is not None:
                out[n] = NodeResult(n, got, (sw or {}).get(runs), detail)
                say(f"{tag}{n}: {got}: {detail}")
            elif said.get(n) != detail and n in seen_connected:
                said[n] = detail
                say(f"{tag}{n}: {detail}")
        if len(out) == len(want) or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    for n, version in want.items():
        if n not in out:
            sw = ((snap.get("nodes") or {}).get(n) or {}).get("software") or {}
            if n in seen_connected:
                why = f"{timeout_s:g} s and not done: {outcome(sw, version, kind)[1]}"
                out[n] = NodeResult(n, "timed_out", sw.get(runs), why)
            else:
                why = "not connected while its wave ran; its offer stays for when it returns"
                out[n] = NodeResult(n, "offline", sw.get(runs), why)
    return out


# ------------------------------------------------------------------ the command


def table(rollout: Rollout) -> str:
    rows = [["node", "outcome", "runs", "detail"]]
    for r in rollout.results.values():
        rows.append([r.node, r.outcome, "-" if r.running is None else str(r.running), r.detail])
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in rows
    ).rstrip()


def node_update(args: argparse.Namespace) -> int:
    from .status import fetch

    try:
        fleet = Fleet(args.config)
        cfg = fleet.gateway(fleet.pick(args.gateway))
    except ConfigError as exc:
        for p in exc.problems:
            print(p, file=sys.stderr)
        return EXIT_USAGE
    nodes = [n.id for n in cfg.nodes] if args.all else args.node
    if not nodes:
        print(f"pubcomp node update: gateway {cfg.id} has no nodes", file=sys.stderr)
        return EXIT_USAGE

    def status() -> dict[str, Any]:
        return fetch(cfg.health.host, cfg.health.port, timeout=5.0)

    try:
        waves = parse_waves(args.waves, len(nodes))
        software = prepare_set(cfg, args.files, args.format, args.label)
        print(
            f"set {software.version}: {len(software.files)} files, {software.size:,} bytes "
            f"({software.format}; {software.label})"
        )
        rollout = update_nodes(
            cfg,
            Path(args.config),
            nodes,
            software,
            waves=waves,
            timeout_s=args.timeout,
            max_failures=args.max_failures,
            chunk=args.chunk,
            status=status,
            progress=print,
            wait=not args.no_wait,
            revert=not args.no_revert,
        )
    except UpdateError as exc:
        print(f"pubcomp node update: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.no_wait:
        print(f"offered; `pubcomp status --config {args.config}` shows each node's software")
        return 0
    print()
    print(table(rollout))
    if rollout.halted:
        print(f"halted: {rollout.halted}")
    if rollout.reverting:
        back = [n for n, r in rollout.results.items() if r.outcome == "reverted"]
        if rollout.reverts or rollout.revert_failed:
            line = f"reverted: {len(back)} node(s) run what they ran before"
            if rollout.revert_failed:
                line += f"; revert_failed: {', '.join(rollout.revert_failed)}"
            print(line)
        else:
            print(f"nothing to revert: no node runs version {rollout.version}")
        return EXIT_REVERT_FAILED if rollout.revert_failed else EXIT_ROLLOUT_HALTED
    if rollout.failed:
        return EXIT_FAILED
    return 0 if rollout.ok else EXIT_OFFLINE
