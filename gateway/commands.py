"""What the gateway commands do (imported only when one runs)."""

from __future__ import annotations

import argparse
import errno
import getpass
import json
import logging
import re
import sys
from pathlib import Path

import yaml

from pubcomp.sync.exitcodes import EXIT_NOT_RUNNING, EXIT_STORE_UNWRITABLE, EXIT_USAGE

from .config import Fleet, GatewayConfig
from .credentials import hash_password as _hash
from .errors import ConfigError, IngressConfigError


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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _port_in_use(exc: OSError) -> int | None:
    """The port of an "address already in use" error from a listener's bind, if it is one."""
    if exc.errno != errno.EADDRINUSE:
        return None
    m = re.search(r"\('[^']*', (\d+)", str(exc))
    return int(m.group(1)) if m else None


def _listeners(cfg: GatewayConfig) -> dict[int, str]:
    ports = {cfg.health.port: "health"}
    if cfg.ingress.enabled and cfg.nodes:
        ports[cfg.ingress.port] = "ingress"
        if cfg.ingress.tls_port:
            ports[cfg.ingress.tls_port] = "ingress TLS"
    return ports


def gateway_run(args: argparse.Namespace) -> int:
    level = args.log_level.upper()
    if level not in LOG_LEVELS:
        print(
            f"pubcomp gateway run: --log-level {args.log_level}: not a level; "
            f"use one of {', '.join(LOG_LEVELS)} (or -v / -vv for the other commands)",
            file=sys.stderr,
        )
        return 2
    logging.getLogger().setLevel(level)
    cfg = _load(args)
    if cfg is None:
        return 1
    from ..sync.store import StoreUnwritable
    from .service import run
    from .status import fetch

    again = f"another gateway {cfg.id} is probably running with this fleet file"
    see = f"`pubcomp status --config {args.config}`, `systemctl status pubcomp-gateway`"
    try:
        # Before the store is opened: a second gateway must not touch the first one's store.
        running = fetch(cfg.health.host, cfg.health.port, timeout=2.0)
    except (OSError, ValueError):
        running = None
    if running is not None:
        print(
            f"pubcomp gateway run: gateway {running.get('gateway')} already answers on health "
            f"port {cfg.health.port}: {again} (see {see})",
            file=sys.stderr,
        )
        return 1
    try:
        return run(cfg)
    except StoreUnwritable as exc:
        # systemd starts it again (Restart=always): each start is a probe of the card.
        print(
            f"pubcomp gateway run: {exc}. The card is failing or was remounted read-only "
            "(see `dmesg`, `findmnt -o TARGET,OPTIONS`); what the store holds is kept for "
            "when it can be written again, or copied off for recovery",
            file=sys.stderr,
        )
        return EXIT_STORE_UNWRITABLE
    except IngressConfigError as exc:
        print(f"pubcomp gateway run: {args.config}: gateways.{cfg.id}.{exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        port = _port_in_use(exc)
        if port is None:
            raise
        what = _listeners(cfg).get(port, "a listener")
        print(
            f"pubcomp gateway run: port {port} ({what}) is already in use: {again}, "
            f"or another program holds the port (see {see}; `ss -ltnp sport = :{port}`)",
            file=sys.stderr,
        )
        return 1


def status(args: argparse.Namespace) -> int:
    from .status import fetch, not_running_hint, render, verdict

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
