"""Commands of the gateway part: ``pubcomp config``, ``pubcomp gateway run``, ``pubcomp status``."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    cfg = sub.add_parser("config", help="the fleet configuration file")
    csub = cfg.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = csub.add_parser("check", help="validate a fleet file; print every problem")
    check.add_argument("fleet", help="fleet YAML file")
    check.set_defaults(handler=_run("config_check"))
    show = csub.add_parser("show", help="one gateway's effective configuration, secrets masked")
    show.add_argument("fleet", help="fleet YAML file")
    show.add_argument("--gateway", help="gateway id (default: this host's name)")
    show.set_defaults(handler=_run("config_show"))
    hp = csub.add_parser("hash-password", help="hash a node password for the fleet file")
    hp.add_argument("--password-file", help="read the password from a file (default: prompt)")
    hp.set_defaults(handler=_run("hash_password"))

    gw = sub.add_parser("gateway", help="the gateway daemon")
    gsub = gw.add_subparsers(dest="gateway_command", metavar="ACTION", required=True)
    run = gsub.add_parser("run", help="run the gateway (the systemd service's command)")
    _fleet_args(run)
    run.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    run.set_defaults(handler=_run("gateway_run"))

    st = sub.add_parser("status", help="the running gateway's state, as a table")
    _fleet_args(st)
    st.add_argument("--json", action="store_true", help="print the raw status JSON")
    st.set_defaults(handler=_run("status"))


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FLEET.yaml", help="the fleet file")
    p.add_argument("--gateway", help="gateway id (default: this host's name)")


def _run(name: str) -> Any:
    def handler(args: argparse.Namespace) -> int:
        from . import commands

        return getattr(commands, name)(args)

    return handler
