"""What the gateway commands do (imported only when one runs)."""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

import yaml

from .config import ConfigError, Fleet
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
