"""Commands of the fleet: ``pubcomp fleet status|watch|completeness`` (the fleet view) and
``pubcomp fleet release|plan|rollout|keys`` (signed configuration releases, issue 28)."""

from __future__ import annotations

import argparse
from typing import Any

from ..sync.cli import add_connection_args

# An online gateway with no status for this long is silent (pipeline/fleet.py judges it
# offline). Here, not in fleet.py, so that building the command line imports no pydantic.
STALE_S = 1800.0


def register(sub: Any) -> None:
    fleet = sub.add_parser("fleet", help="every gateway's health, seen from the cloud")
    fsub = fleet.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    st = fsub.add_parser(
        "status",
        help="the gateways worst first, from the warehouse's gateway_health (exit code for alerts)",
    )
    st.add_argument("--warehouse", required=True, help="warehouse directory (or URL)")
    st.add_argument("--master", help="Spark master (default: local[*])")
    st.add_argument("--json", action="store_true", help="print the rows as JSON")
    _stale(st)
    st.set_defaults(handler=_run("fleet_status"))

    w = fsub.add_parser("watch", help="the gateways live, from their retained status messages")
    add_connection_args(w)
    w.add_argument("--topic", default="telemetry/+/status", help="the status topics")
    w.add_argument(
        "--once",
        action="store_true",
        help="print the fleet once the retained statuses have arrived, exit with its code",
    )
    w.add_argument(
        "--wait",
        type=float,
        default=5.0,
        help="with --once: at most this long for the retained statuses (default 5 s)",
    )
    _stale(w)
    w.set_defaults(handler=_run("fleet_watch"))
    c = fsub.add_parser(
        "completeness",
        help="each stream with missing readings and why, from the warehouse "
        "(exit code 9 when some are unexplained)",
    )
    c.add_argument("--warehouse", required=True, help="warehouse directory (or URL)")
    c.add_argument("--since", metavar="T", help="hours from T on: 24h, 7d, or an ISO time")
    c.add_argument("--gateway", metavar="ID", help="only this gateway's streams")
    c.add_argument("--master", help="Spark master (default: local[*])")
    c.add_argument(
        "--textfile",
        metavar="FILE.prom",
        help="also write the figures as Prometheus metrics (node_exporter's textfile collector)",
    )
    c.set_defaults(handler=_run_in("completeview", "fleet_completeness"))
    _releases(fsub)


def _releases(fsub: Any) -> None:
    """Signed configuration releases (issue 28). ``release`` renders the fleet file, so
    its code is the gateway part's; this module only names it (a string: nothing of
    gateway/ is imported here)."""
    rel = fsub.add_parser(
        "release",
        help="render each gateway's configuration, give it a new version, sign it, keep it",
    )
    rel.add_argument("--config", required=True, metavar="FLEET.yaml", help="the fleet file")
    rel.add_argument(
        "--gateway", action="append", metavar="ID", help="only this gateway (repeatable)"
    )
    rel.add_argument("--signing-key", required=True, metavar="KEY", help="a release key")
    rel.add_argument("--expires", default="30d", help="how long it may be taken (default 30d)")
    rel.add_argument("--note", help="a line kept with the release in the history")
    rel.add_argument(
        "--publish",
        action="store_true",
        help="publish it to every gateway now, at once (default: `fleet rollout` does, in waves)",
    )
    rel.add_argument("--force", action="store_true", help="a new version even when nothing changed")
    _history(rel)
    add_connection_args(rel)
    _wait(rel)
    rel.set_defaults(handler="pubcomp.gateway.release_render:fleet_release")

    plan = fsub.add_parser(
        "plan", help="per gateway: what it runs against the release (a diff), and the waves"
    )
    _release_args(plan)
    plan.set_defaults(handler=_run_in("releasecmd", "fleet_plan"))

    ro = fsub.add_parser(
        "rollout", help="publish a release in gated waves; halt and revert on a failed gate"
    )
    _release_args(ro)
    ro.add_argument("--signing-key", required=True, metavar="KEY", help="signs the reverts")
    ro.add_argument("--expires", default="30d", help="a revert's validity (default 30d)")
    ro.add_argument(
        "--gate-timeout",
        type=float,
        default=600.0,
        help="seconds a wave has to commit and show its readings (default 600)",
    )
    ro.add_argument(
        "--max-failures", type=int, default=0, help="failures a wave may have (default 0)"
    )
    ro.add_argument(
        "--readings-share",
        type=float,
        default=0.5,
        help="after the switch a gateway delivers at least this share of before (default 0.5)",
    )
    ro.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="seconds after a commit before its readings are measured (default 60)",
    )
    ro.add_argument(
        "--revert-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the reverted gateways to confirm (default 300)",
    )
    ro.set_defaults(handler=_run_in("releasecmd", "fleet_rollout"))

    keys = fsub.add_parser("keys", help="the release keys: a root key, release keys, rotation")
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    for name, text in (
        ("init", "a new root key, a first release key and the keys document"),
        ("rotate", "a new release key; the old one retired (--keep-old: kept)"),
        ("renew", "the same keys, a later expiry"),
        ("show", "the keys document"),
    ):
        k = ksub.add_parser(name, help=text)
        k.add_argument("--keys", required=True, metavar="DIR", help="the keys folder")
        k.add_argument(
            "--expires", default="365d", help="the keys document's validity (default 365d)"
        )
        if name == "rotate":
            k.add_argument("--keep-old", action="store_true", help="keep the old keys listed")
        k.set_defaults(handler=_run_in("releasecmd", "fleet_keys"))


def _release_args(p: argparse.ArgumentParser) -> None:
    _history(p)
    p.add_argument("--config", metavar="FLEET.yaml", help="the fleet file (its history beside it)")
    p.add_argument("--release", type=int, metavar="N", help="the release (default: the newest)")
    p.add_argument("--canary", metavar="GW,GW", help="gateways that take it first, alone (pinned)")
    p.add_argument(
        "--waves",
        default="10%,50%,100%",
        help="then waves by share of the fleet (default 10%%,50%%,100%%)",
    )
    add_connection_args(p)
    _wait(p)


def _history(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="the release history (default: FLEET.releases beside the fleet file)",
    )


def _wait(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait",
        type=float,
        default=5.0,
        help="at most this long for the retained statuses at the start (default 5 s)",
    )


def _stale(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stale-s",
        type=float,
        default=STALE_S,
        help=f"an online gateway with no status for this long is silent (default {STALE_S:g})",
    )


def _run(name: str) -> str:
    return _run_in("fleetcmd", name)


def _run_in(module: str, name: str) -> str:
    return f"{__package__}.{module}:{name}"
