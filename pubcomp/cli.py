"""The ``pubcomp`` command: one entry point that dispatches to each part's commands.

Each part's ``cli`` module only declares its arguments, and names the code
behind each command as ``"module:function"`` (``handler``); that module is
imported when the command runs, so a gateway never imports pyspark and the
cloud side never imports GPIO libraries.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import __version__

# Parts that contribute commands: each module defines register(subparsers).
PARTS = (
    "pubcomp.sync.cli",
    "pubcomp.sensors.cli",
    "pubcomp.gateway.cli",
    "pubcomp.pipeline.cli",
    "pubcomp.pipeline.fleetcli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pubcomp", description="Exactly-once sensor telemetry from field gateways to Spark."
    )
    parser.add_argument("--version", action="version", version=f"pubcomp {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for part in PARTS:
        importlib.import_module(part).register(sub)
    return parser


def resolve(handler: str) -> Callable[..., Any]:
    """A command's function from its ``"module:function"`` name (imported now)."""
    module, _, name = handler.partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        return int(resolve(args.handler)(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
