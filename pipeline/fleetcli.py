"""Commands of the fleet view: ``pubcomp fleet status`` and ``pubcomp fleet watch``."""

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


def _stale(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stale-s",
        type=float,
        default=STALE_S,
        help=f"an online gateway with no status for this long is silent (default {STALE_S:g})",
    )


def _run(name: str) -> str:
    return f"{__package__}.fleetcmd:{name}"
