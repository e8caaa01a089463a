"""Commands of the gateway part: ``pubcomp config ...`` (more to come: gateway run, status)."""

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


def _run(name: str) -> Any:
    def handler(args: argparse.Namespace) -> int:
        from . import commands

        return getattr(commands, name)(args)

    return handler
