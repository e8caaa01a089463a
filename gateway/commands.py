"""What the gateway commands do (imported only when one runs)."""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import sys
from pathlib import Path

import yaml

from .config import ConfigError, Fleet, GatewayConfig
from .credentials import hash_password as _hash


def config_check(args: argparse.Namespace) -> int:
    try:
        fleet = Fleet(args.fleet)
        problems = fleet.check()
    except ConfigError as exc:
        problems = exc.problems
    if problems:
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(problems)} problem(s) in {args.fleet}", file=sys.stderr)
        return 1
    ids = fleet.gateway_ids()
    print(f"{args.fleet}: fleet {fleet.name!r} OK: {len(ids)} gateway(s): {', '.join(ids)}")
    return 0


def config_show(args: argparse.Namespace) -> int:
    try:
        fleet = Fleet(args.fleet)
        cfg = fleet.gateway(fleet.pick(args.gateway))
    except ConfigError as exc:
        for p in exc.problems:
            print(p, file=sys.stderr)
        return 1
    data = cfg.model_dump(mode="json", exclude_none=True)  # SecretStr dumps as '**********'
    print(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), end="")
    return 0


def _load(args: argparse.Namespace) -> GatewayConfig | None:
    try:
        fleet = Fleet(args.config)
        return fleet.gateway(fleet.pick(args.gateway))
    except ConfigError as exc:
        for p in exc.problems:
            print(p, file=sys.stderr)
        return None


def gateway_run(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(args.log_level.upper())
    cfg = _load(args)
    if cfg is None:
        return 1
    from .ingress import IngressConfigError
    from .service import run

    try:
        return run(cfg)
    except IngressConfigError as exc:
        print(f"pubcomp gateway run: {args.config}: gateways.{cfg.id}.{exc}", file=sys.stderr)
        return 1


def status(args: argparse.Namespace) -> int:
    from .status import EXIT_NOT_RUNNING, EXIT_USAGE, fetch, not_running_hint, render, verdict

    cfg = _load(args)
    if cfg is None:
        return EXIT_USAGE

    try:
        snap = fetch(cfg.health.host, cfg.health.port)
    except (OSError, ValueError) as exc:
        print(f"pubcomp status: {cfg.id}: {exc}", file=sys.stderr)
        print(not_running_hint(cfg.store.path), file=sys.stderr)
        return EXIT_NOT_RUNNING  # as `systemctl status` says "not running"
    print(json.dumps(snap, indent=2) if args.json else render(snap))
    return verdict(snap)[2]


def hash_password(args: argparse.Namespace) -> int:
    if args.password_file:
        password = Path(args.password_file).read_text().rstrip("\r\n")
    else:
        password = getpass.getpass("node password: ")
    if not password:
        print("pubcomp config hash-password: empty password", file=sys.stderr)
        return 1
    print(_hash(password))
    return 0
