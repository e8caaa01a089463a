"""What ``pubcomp fleet plan``, ``pubcomp fleet rollout`` and ``pubcomp fleet keys`` do
(issue 28; imported only when one runs). The release itself is made by
``pubcomp fleet release`` (gateway/release_render.py: rendering is the fleet file's
part); these read what it kept (sync/releasedir.py) and what the gateways say.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import re
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pubcomp.sync import release as rel
from pubcomp.sync import releaselink as link
from pubcomp.sync.exitcodes import EXIT_ROLLOUT_HALTED, EXIT_USAGE
from pubcomp.sync.releasedir import Entry, History, KeyDir, ReleaseDirError, load_signing_key
from pubcomp.sync.releaselink import FleetSeen, Seen
from pubcomp.sync.tables import text_table

from . import rollout as ro


def _fail(command: str, text: str) -> int:
    print(f"pubcomp fleet {command}: {text}", file=sys.stderr)
    return EXIT_USAGE


def _history(args: argparse.Namespace) -> History:
    if args.state_dir:
        return History(args.state_dir)
    if args.config:
        return History.beside(args.config)
    raise ReleaseDirError("--state-dir DIR or --config FLEET.yaml: where the releases are kept")


def _entry(history: History, version: int | None) -> Entry:
    if version is None:
        latest = history.latest()
        if latest is None:
            raise ReleaseDirError(f"{history.path}: no release yet (pubcomp fleet release)")
        return latest
    return history.entry(version)


# Keys whose values are secrets; a release carries them only as !secret or ${VAR}
# (gateway/release_render.py refuses them in clear), and a diff masks anything else.
_SECRET_LINE = re.compile(
    r"^(?P<head>[ +-]?\s*(?:password|landed_key|[\w.]*(?:secret|token)[\w.]*)\s*:\s*)"
    r"(?P<value>(?!!secret\b)(?!.*\$\{)\S.*)$"
)


def redact(text: str) -> str:
    return "\n".join(
        _SECRET_LINE.sub(lambda m: m.group("head") + "'********'", line)
        for line in text.split("\n")
    )


def _diff(old: str, new: str, old_name: str, new_name: str) -> str:
    lines = difflib.unified_diff(
        redact(old).splitlines(keepends=True),
        redact(new).splitlines(keepends=True),
        old_name,
        new_name,
    )
    return "".join(lines).rstrip("\n")


async def _seen(args: argparse.Namespace, entry: Entry, role: str) -> FleetSeen:
    fleet = FleetSeen({t.status_topic: g for g, t in entry.targets.items()})
    async with link.client(args, role) as c:
        await link.gather(c, fleet, {t.prefix for t in entry.targets.values()}, wait=args.wait)
    return fleet


def _waves(args: argparse.Namespace, entry: Entry) -> tuple[list[list[str]], bool]:
    canaries = [c.strip() for c in (args.canary or "").split(",") if c.strip()]
    shares = ro.parse_shares(args.waves)
    return ro.plan_waves(list(entry.targets), canaries, shares), bool(canaries)


# ------------------------------------------------------------------ plan


def running(history: History, entry: Entry, gw: str, seen: Seen | None) -> tuple[str, str | None]:
    """What a gateway runs, in words, and its config text when the history has it."""
    if seen is None:
        return "no status seen (never connected to this broker?)", None
    if seen.release is None or seen.version is None:
        return "runs no release yet (its local --config)", None
    state = f", {seen.state}" if seen.state else ""
    where = f"release {seen.version} (config {(seen.sha256 or '?')[:12]}{state})"
    if seen.sha256 is None:
        return where, None
    found = history.find(gw, seen.sha256)
    return where, (found.config if found else None)


def fleet_plan(args: argparse.Namespace) -> int:
    try:
        history = _history(args)
        entry = _entry(history, args.release)
        waves, canary = _waves(args, entry)
    except (ReleaseDirError, ValueError) as exc:
        return _fail("plan", str(exc))
    try:
        fleet = asyncio.run(_seen(args, entry, "plan"))
    except OSError as exc:
        return _fail("plan", f"cannot reach {args.broker}: {exc}")
    except Exception as exc:  # aiomqtt.MqttError, imported lazily
        return _fail("plan", f"{args.broker}: {exc}")
    print(f"release {entry.version} of fleet {entry.fleet!r} (made {entry.created})")
    changes = 0
    for gw, target in entry.targets.items():
        seen = fleet.gateways.get(gw)
        where, old = running(history, entry, gw, seen)
        online = "" if seen is None else (" online" if seen.online else " OFFLINE")
        new = entry.release(history, gw).config
        print(f"\n== {gw}{online}: {where}")
        if seen is not None and seen.sha256 == target.sha256:
            print(f"   no change: it already runs this configuration (release {seen.version})")
            continue
        changes += 1
        if seen is not None and entry.version in seen.bad:
            print(f"   NOTE: release {entry.version} is marked bad on it: it will refuse it")
        if old is None and seen is not None and seen.sha256:
            print(f"   its config {seen.sha256[:12]} is not in {history.path}: the whole new one:")
        print(_diff(old or "", new, f"{gw} running", f"{gw} release {entry.version}"))
    print(f"\n{changes} of {len(entry.targets)} gateway(s) change.")
    for i, w in enumerate(waves):
        name = "canary" if i == 0 and canary else f"wave {i + 1}"
        print(f"{name}: {', '.join(w)}")
    return 0


# ------------------------------------------------------------------ rollout


# The gateway's apply phases between receiving a release and its verdict
# (gateway/release_rules.py).
APPLYING = ("fetched", "verified", "staged", "switched", "trial", "rolling_back")


# Its last online status said it stops to start again (gateway/release_apply.py): the
# connection that then ends is expected to, whatever the broker saw of it.
RESTARTING = ("switched", "rolling_back")


def judge_release(n: int, seen: Seen | None, since: float) -> tuple[ro.State, str]:
    """A gateway's state in the rollout of release ``n``, published to it at ``since``."""
    label = f"release {n}"
    if seen is None:
        return "sent", "no status yet"
    if n in seen.bad:
        return "failed", f"marked {n} bad: {seen.last_error or 'rolled back'}"
    if seen.version == n and seen.state == "committed":
        return "committed", f"committed {n}"
    if seen.at < since:
        return "sent", f"published {label}"
    if not seen.online and seen.state in RESTARTING:
        # Its Will (a DISCONNECT lost, a stop cut short): the new process says more, or
        # the wave's timeout fails it.
        return "applying", f"{seen.state}, starting again (offline meanwhile)"
    if not seen.online:
        return "silent", "went offline during its wave"
    if seen.state == "rolled_back":
        return "failed", f"rolled back: {seen.last_error or '-'}"
    if seen.state == "refused" and f"release {n}" in (seen.last_error or ""):
        return "failed", f"refused: {seen.last_error}"
    runs = f"release {seen.version}" if seen.version else "its local --config"
    if seen.version == n or seen.state in APPLYING:
        return "applying", f"{seen.state or '?'} (runs {runs})"
    return "sent", f"published {label}; runs {runs} ({seen.state})"


class ReleaseSubject:
    """A gateway configuration release as a rollout's subject (pipeline/rollout.py)."""

    def __init__(
        self,
        client: Any,
        history: History,
        entry: Entry,
        key: Any,
        expires: Any,
        fleet: FleetSeen,
    ) -> None:
        self.c = client
        self.history = history
        self.entry = entry
        self.key = key
        self.expires = expires
        self.label = f"release {entry.version}"
        # What each gateway ran before: the revert's configuration (by its hash).
        self.before = {g: s.sha256 for g, s in fleet.gateways.items() if s.sha256}
        self.revert_version: int | None = None

    async def publish(self, gateway: str) -> None:
        t = self.entry.targets[gateway]
        await link.publish_release(
            self.c, t.prefix, gateway, self.entry.envelope(self.history, gateway)
        )

    def judge(self, seen: Seen | None, since: float) -> tuple[ro.State, str]:
        return judge_release(self.entry.version, seen, since)

    async def revert(self, gateways: Sequence[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        old: dict[str, rel.Release] = {}
        for g in gateways:
            sha = self.before.get(g)
            if sha is None:
                continue
            if sha == self.entry.targets[g].sha256:
                out[g] = "ran this configuration before the rollout: nothing to revert"
                continue
            found = self.history.find(g, sha, below=self.entry.version)
            if found is not None:
                old[g] = found
        now = datetime.now(UTC)

        def sign(version: int, t: Any) -> bytes:
            prev = old[t.gateway]
            doc = rel.release_document(
                fleet=prev.fleet,
                gateway=t.gateway,
                version=version,
                config=prev.config,
                created=now,
                expires=now + self.expires,
            )
            return rel.encode(rel.sign(doc, [self.key]))

        if old:
            targets = [self.entry.targets[g] for g in old]
            targets = [
                type(t)(t.gateway, t.prefix, t.status_topic, old[t.gateway].config_sha256)
                for t in targets
            ]
            rev = self.history.add(
                self.entry.fleet,
                rel.time_text(now),
                targets,
                sign,
                at_least=self.entry.version,
                reverts=self.entry.version,
                note=f"automatic revert of release {self.entry.version}",
            )
            self.revert_version = rev.version
            for g in old:
                t = rev.targets[g]
                await link.publish_release(self.c, t.prefix, g, rev.envelope(self.history, g))
                out[g] = (
                    f"published release {rev.version}: the configuration of release "
                    f"{old[g].version}"
                )
        for g in gateways:
            if g in out:
                continue
            # No earlier release of it is known (it ran its local --config): take the
            # failed release off its topic, so that it does not fetch it later.
            t = self.entry.targets[g]
            await self.c.publish(rel.release_topic(t.prefix, g), b"", qos=1, retain=True)
            out[g] = f"no earlier release known: {self.label} withdrawn from its topic"
        return out

    def reverted(self, gateway: str, seen: Seen | None) -> bool:
        # Only the revert committed counts: a gateway that rolled back by itself runs
        # its previous configuration already, but its topic held the failed release
        # until the revert replaced it, and the revert is what it must take.
        return (
            seen is not None
            and self.revert_version is not None
            and seen.version == self.revert_version
            and seen.state == "committed"
        )


async def run_rollout(
    args: argparse.Namespace,
    history: History,
    entry: Entry,
    key: Any,
    keys_doc: rel.KeysDoc,
    waves: list[list[str]],
    canary: bool,
    rules: ro.Rules,
    emit: ro.Emit,
) -> ro.Result:
    """One rollout over one connection: callable from code as well as the command."""
    fleet = FleetSeen({t.status_topic: g for g, t in entry.targets.items()})
    prefixes = {t.prefix for t in entry.targets.values()}
    async with link.client(args, "rollout") as c:
        await link.gather(c, fleet, prefixes, wait=args.wait)
        for prefix in sorted(prefixes):  # a release key rotated since the release was made
            await link.publish_keys(c, prefix, rel.encode(keys_doc.envelope))
        it = c.messages.__aiter__()

        async def pump(timeout: float) -> None:
            try:
                m = await asyncio.wait_for(it.__anext__(), timeout)
            except TimeoutError:
                return
            fleet.add(str(m.topic), bytes(m.payload), bool(m.retain), time.monotonic())

        subject = ReleaseSubject(c, history, entry, key, rel.parse_span(args.expires), fleet)
        return await ro.roll_out(subject, waves, fleet, pump, rules, emit, canary=canary)


def fleet_rollout(args: argparse.Namespace) -> int:
    try:
        history = _history(args)
        entry = _entry(history, args.release)
        if entry.reverts is not None:
            raise ReleaseDirError(
                f"release {entry.version} is an automatic revert of {entry.reverts}: "
                "it is already out"
            )
        waves, canary = _waves(args, entry)
        key, keys_doc = load_signing_key(args.signing_key)
        rel.parse_span(args.expires)
        rules = ro.Rules(
            timeout_s=args.gate_timeout,
            max_failures=args.max_failures,
            readings_share=args.readings_share,
            settle_s=args.settle,
            revert_timeout_s=args.revert_timeout,
        )
    except (ReleaseDirError, ValueError) as exc:
        return _fail("rollout", str(exc))

    def emit(line: str) -> None:
        print(line, flush=True)

    emit(
        f"rollout of release {entry.version} of fleet {entry.fleet!r}: "
        f"{len(waves)} wave(s); gates: commit within {rules.timeout_s:g} s, at most "
        f"{rules.max_failures} failure(s) a wave, readings at least "
        f"{rules.readings_share:.0%} of before after {rules.settle_s:g} s"
    )
    try:
        result = asyncio.run(
            run_rollout(args, history, entry, key, keys_doc, waves, canary, rules, emit)
        )
    except OSError as exc:
        return _fail("rollout", f"cannot reach {args.broker}: {exc}")
    print()
    print(ro.render(result))
    return 0 if result.complete else EXIT_ROLLOUT_HALTED


# ------------------------------------------------------------------ keys


def fleet_keys(args: argparse.Namespace) -> int:
    keys = KeyDir(args.keys)
    try:
        expires = datetime.now(UTC) + rel.parse_span(args.expires)
        if args.keys_command == "init":
            key, path = keys.init(expires)
            print(f"root key: {keys.path / 'root.key'} (keep it offline: it signs the keys)")
            print(
                f"root public key: {keys.path / 'root.pub'}: install it on every gateway as "
                "/etc/pubcomp/release-root.pub (release.root_key)"
            )
            print(f"release key {rel.keyid(key)[:12]}: {path} (--signing-key)")
        elif args.keys_command == "rotate":
            key, path = keys.rotate(expires, keep=args.keep_old)
            print(f"release key {rel.keyid(key)[:12]}: {path} (--signing-key)")
        elif args.keys_command == "renew":
            keys.renew(expires)
        doc = keys.keys_doc()
    except (ReleaseDirError, ValueError, rel.ReleaseRefused) as exc:
        return _fail("keys", str(exc))
    rows = [[k[:12], k] for k in doc.keys]
    print(
        f"keys document version {doc.version}, expires {rel.time_text(doc.expires)} "
        f"({keys.doc_path}); published with the next `pubcomp fleet release`"
    )
    print(text_table(["key", "keyid"], rows))
    return 0
