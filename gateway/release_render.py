"""A gateway's effective configuration as a release carries it (issue 28), and
``pubcomp fleet release``.

The fleet file is this part's (gateway/config.py), so rendering lives here: the
defaults merged into the gateway's own section, written back as a fleet file with
exactly that one gateway. Secrets stay what the file wrote: ``!secret PATH`` (a file
local to the gateway, resolved there against its configuration folder) or
``${VAR}`` (its environment); their values never enter a release. A secret written
in clear in the fleet file is refused: it would travel in the release.

Validation is ``pubcomp config check``'s (``Fleet.gateway``: file, line, key path),
with one difference: a secret file or environment variable missing on the
operator's machine is not an error here (it is the gateway's; the gateway checks it
when it verifies the release) but a note.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import typing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr

from pubcomp.sync import release as rel
from pubcomp.sync.exitcodes import EXIT_USAGE
from pubcomp.sync.releasedir import History, ReleaseDirError, Target, load_signing_key

from .config import SECTIONS, Fleet, GatewayConfig, _SecretRef, load_yaml
from .errors import ConfigError

# What config.py says of a missing secret file or variable: here a note, not an error.
_MISSING_SECRET = re.compile(r": secret file \S.*: No such file or directory$")
_MISSING_ENV = re.compile(r": environment variable \w+ is not set$")


@dataclass
class Rendered:
    gateway: str
    fleet: str
    config: str  # the fleet-file YAML of this one gateway
    sha256: str
    prefix: str
    status_topic: str
    notes: list[str] = field(default_factory=list)


class _Dumper(yaml.SafeDumper):
    pass


def _secret(dumper: yaml.SafeDumper, ref: _SecretRef) -> yaml.Node:
    return dumper.represent_scalar("!secret", ref.path)


_Dumper.add_representer(_SecretRef, _secret)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _secret_paths(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The key paths of every SecretStr field (nested sections; not sensors)."""
    out = []
    for name, f in model.model_fields.items():
        args = typing.get_args(f.annotation) or (f.annotation,)
        if SecretStr in args or f.annotation is SecretStr:
            out.append((*path, name))
        for a in args:
            if isinstance(a, type) and issubclass(a, BaseModel):
                out += _secret_paths(a, (*path, name))
    return out


SECRET_PATHS = _secret_paths(GatewayConfig)


def _get(d: Any, path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def render(fleet_file: str, gateways: list[str] | None = None) -> list[Rendered]:
    """Each gateway's release config (all of the fleet's when ``gateways`` is None);
    ``ConfigError`` with every problem, as ``pubcomp config check`` prints them."""
    fleet = Fleet(fleet_file)
    ids = fleet.gateway_ids()
    wanted = gateways or ids
    problems: list[str] = []
    for g in wanted:
        if g not in ids:
            problems.append(
                f"{fleet_file}: no gateway {g!r} under gateways (known: {', '.join(ids)})"
            )
    if problems:
        raise ConfigError(problems)
    raw, _pos = load_yaml(fleet.path)
    defaults = {k: v for k, v in (raw.get("defaults") or {}).items() if k in SECTIONS}
    out: list[Rendered] = []
    for g in wanted:
        notes: list[str] = []
        try:
            cfg: GatewayConfig | None = fleet.gateway(g)
        except ConfigError as exc:
            cfg = None
            for p in exc.problems:
                if _MISSING_SECRET.search(p) or _MISSING_ENV.search(p):
                    notes.append(f"{p} (here; the gateway resolves it)")
                else:
                    problems.append(p)
        own = raw["gateways"].get(g) or {}
        merged = _merge(defaults, own)
        for sp in SECRET_PATHS:
            v = _get(merged, sp)
            if (
                v is not None
                and not isinstance(v, _SecretRef)
                and not (isinstance(v, str) and "${" in v)
            ):
                problems.append(
                    f"{fleet_file}: gateways.{g}.{'.'.join(sp)}: a secret in clear would travel "
                    "in the release: write it as !secret FILE (local to the gateway) or ${VAR}"
                )
        text = yaml.dump(
            {"fleet": fleet.name, "gateways": {g: merged}},
            Dumper=_Dumper,
            sort_keys=False,
            allow_unicode=True,
            default_flow_style=False,
        )
        prefix = _get(merged, ("uplink", "topic_prefix")) or "telemetry"
        status = _get(merged, ("status", "topic")) or f"{prefix}/{g}/status"
        if cfg is not None:
            prefix, status = cfg.uplink.topic_prefix, cfg.status_topic()
        out.append(Rendered(g, str(fleet.name), text, rel.sha256_hex(text), prefix, status, notes))
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    return out


# ------------------------------------------------------------------ the command


def fleet_release(args: argparse.Namespace) -> int:
    """``pubcomp fleet release``: render, version, sign, keep; with --publish, publish."""
    try:
        rendered = render(args.config, args.gateway)
    except ConfigError as exc:
        for p in exc.problems:
            print(p, file=sys.stderr)
        print(f"{len(exc.problems)} problem(s): no release made", file=sys.stderr)
        return 1
    try:
        key, keys_doc = load_signing_key(args.signing_key)
        span = rel.parse_span(args.expires)
    except (ReleaseDirError, ValueError) as exc:
        print(f"pubcomp fleet release: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for r in rendered:
        for n in r.notes:
            print(f"note: {n}", file=sys.stderr)
    history = History(args.state_dir) if args.state_dir else History.beside(args.config)
    latest = history.latest()
    if latest is not None and not args.force:
        same = all(
            latest.targets.get(r.gateway) is not None
            and latest.targets[r.gateway].sha256 == r.sha256
            for r in rendered
        )
        if same and latest.reverts is None:
            print(
                f"release {latest.version} already carries this configuration for "
                f"{', '.join(r.gateway for r in rendered)}: nothing new (--force to make one)"
            )
            return 0
    try:
        return asyncio.run(_release(args, rendered, history, key, keys_doc, span))
    except OSError as exc:
        print(f"pubcomp fleet release: cannot reach {args.broker}: {exc}", file=sys.stderr)
        return EXIT_USAGE


async def _release(
    args: argparse.Namespace,
    rendered: list[Rendered],
    history: History,
    key: Any,
    keys_doc: rel.KeysDoc,
    span: Any,
) -> int:
    import aiomqtt

    from pubcomp.sync import releaselink as link

    now = datetime.now(UTC)
    by_gw = {r.gateway: r for r in rendered}

    def sign(version: int, t: Target) -> bytes:
        r = by_gw[t.gateway]
        doc = rel.release_document(
            fleet=r.fleet,
            gateway=r.gateway,
            version=version,
            config=r.config,
            created=now,
            expires=now + span,
        )
        return rel.encode(rel.sign(doc, [key]))

    targets = [Target(r.gateway, r.prefix, r.status_topic, r.sha256) for r in rendered]
    seen = link.FleetSeen({r.status_topic: r.gateway for r in rendered})
    try:
        async with link.client(args, "release") as c:
            # What the broker and the gateways already know: a version at or below it
            # would be refused everywhere (a history lost or copied from elsewhere).
            await link.gather(c, seen, {r.prefix for r in rendered}, wait=args.wait)
            entry = history.add(
                rendered[0].fleet,
                rel.time_text(now),
                targets,
                sign,
                at_least=seen.newest_version(),
                note=args.note,
            )
            for prefix in sorted({r.prefix for r in rendered}):
                await link.publish_keys(c, prefix, rel.encode(keys_doc.envelope))
            published = 0
            if args.publish:
                for t in targets:
                    published += await link.publish_release(
                        c, t.prefix, t.gateway, entry.envelope(history, t.gateway)
                    )
    except aiomqtt.MqttError as exc:
        print(f"pubcomp fleet release: {args.broker}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(
        f"release {entry.version} of fleet {entry.fleet!r}: {len(targets)} gateway(s), "
        f"signed by {rel.keyid(key)[:12]} (keys document version {keys_doc.version}), "
        f"expires {rel.time_text(now + span)}; kept in {history.path / str(entry.version)}"
    )
    for r in rendered:
        size = len(entry.envelope(history, r.gateway))
        print(f"  {r.gateway:<20} config sha256 {r.sha256[:12]}  {size:>7} bytes")
    if args.publish:
        print(f"published to every gateway at once ({published} retained message(s))")
    else:
        print(
            f"not yet published: `pubcomp fleet plan --release {entry.version}`, then "
            f"`pubcomp fleet rollout --release {entry.version}`"
        )
    return 0
