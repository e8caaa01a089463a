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
}
FAILED = ("rolled_back", "refused", "failed", "timed_out")

Status = Callable[[], dict[str, Any]]
Progress = Callable[[str], None]


@dataclass
class NodeResult:
    node: str
    outcome: str
    running: int | None = None  # the version it said it runs
    detail: str = ""


@dataclass
class Rollout:
    version: int
    label: str
    results: dict[str, NodeResult] = field(default_factory=dict)
    halted: str | None = None  # why the rollout stopped before its last wave

    @property
    def failed(self) -> list[str]:
        return [n for n, r in self.results.items() if r.outcome in FAILED]

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
    return None, f"runs {sw.get('version')}, {sw.get('state')}"


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
) -> Rollout:
    """Offer ``software`` to ``nodes`` wave by wave; the outcome per node.

    ``status()`` is the running gateway's status (``/status.json``). With ``wait``
    false the offers are all written at once and every node is left "offline"
    in the result (no one has answered yet)."""
    known = {n.id for n in cfg.nodes}
    unknown = [n for n in nodes if n not in known]
    if unknown:
        raise UpdateError(f"gateway {cfg.id} has no node {', '.join(unknown)} in the fleet file")
    keys = {n: read_key(fleet, cfg.id, n) for n in nodes}  # all of them before any offer
    root = state_dir(cfg)
    say = progress or (lambda _: None)
    result = Rollout(software.version, software.label)
    sizes = waves or [len(nodes)]
    at = 0
    for w, size in enumerate(sizes, 1):
        wave = nodes[at : at + size]
        at += size
        for n in wave:
            write_offer(root, n, make_offer(keys[n], n, software, chunk))
        say(f"wave {w}/{len(sizes)}: version {software.version} offered to {', '.join(wave)}")
        if not wait:
            result.results.update({n: NodeResult(n, "offline", None, "offered") for n in wave})
            continue
        result.results.update(
            _watch(wave, software.version, software.format, timeout_s, status, say, poll_s)
        )
        failed = [n for n in wave if result.results[n].outcome in FAILED]
        if len(failed) > max_failures:
            result.halted = (
                f"wave {w}: {len(failed)} failed ({', '.join(failed)}), more than "
                f"--max-failures {max_failures}"
            )
            for n in nodes[at:]:
                result.results[n] = NodeResult(n, "not_offered", None, "the rollout halted")
            say(f"halted: {result.halted}")
            break
    return result


def _watch(
    wave: list[str],
    version: int,
    fmt: str,
    timeout_s: float,
    status: Status,
    say: Progress,
    poll_s: float,
) -> dict[str, NodeResult]:
    """Poll the gateway's status until each node of the wave is done or failed, or time is up."""
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
        for n in wave:
            if n in out:
                continue
            ns = (snap.get("nodes") or {}).get(n) or {}
            if ns.get("connected"):
                seen_connected.add(n)
            sw = ns.get("software")
            got, detail = outcome(sw, version, kind)
            if got is not None:
                out[n] = NodeResult(n, got, (sw or {}).get(runs), detail)
                say(f"{n}: {got}: {detail}")
            elif said.get(n) != detail and n in seen_connected:
                said[n] = detail
                say(f"{n}: {detail}")
        if len(out) == len(wave) or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    for n in wave:
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


EXIT_FAILED = 1
EXIT_OFFLINE = 3
EXIT_USAGE = 2


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
    if rollout.failed:
        return EXIT_FAILED
    return 0 if rollout.ok else EXIT_OFFLINE
