"""Commands of the sync part: ``pubcomp store ...`` and ``pubcomp uplink run``.

Only argument declarations live at module level; the work is imported when a
command runs.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    store = sub.add_parser("store", help="the durable session store")
    ssub = store.add_subparsers(dest="store_command", metavar="ACTION", required=True)

    imp = ssub.add_parser("import", help="append readings from a JSON-lines file")
    _store_args(imp)
    imp.add_argument("file", help="JSON lines: sensor, ts, value, unit; optional origin, flags")
    imp.set_defaults(handler=_run("store_import"))

    stats = ssub.add_parser("stats", help="backlog, oldest age, in-flight, size, epoch")
    _store_args(stats)
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(handler=_run("store_stats"))

    up = sub.add_parser("uplink", help="store and forward to the cloud broker")
    usub = up.add_subparsers(dest="uplink_command", metavar="ACTION", required=True)
    run = usub.add_parser("run", help="drain the store to a broker, exactly once")
    _store_args(run)
    add_connection_args(run)
    run.add_argument("--client-id", required=True)
    run.add_argument(
        "--qos", type=int, choices=(1, 2), default=2, help="1 for clouds without QoS 2"
    )
    run.add_argument("--topic-prefix", default="telemetry")
    run.add_argument("--batch", type=int, default=100, help="readings per message")
    run.add_argument("--max-bytes", type=int, default=128 * 1024, help="payload bytes per message")
    run.add_argument("--keepalive", type=int, default=30)
    run.add_argument(
        "--exit-when-drained",
        action="store_true",
        help="exit once everything is delivered (and, end to end, landed)",
    )
    run.add_argument(
        "--no-end-to-end",
        dest="end_to_end",
        action="store_false",
        help="let readings go at the broker's PUBCOMP (a cloud without pubcomp's ingest)",
    )
    run.add_argument(
        "--landed-timeout",
        type=float,
        default=120.0,
        help="seconds a delivered message may wait for its landing before it is sent again",
    )
    run.add_argument(
        "--landed-key-file",
        help="file holding this gateway's acknowledgement key, hex (pubcomp ingest landed-key)",
    )
    run.set_defaults(handler=_run("uplink_run"))


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help="store file (created on first use)")
    p.add_argument("--gateway-id", help="gateway id for a new store (default: host name)")


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """How a command reaches an MQTT broker: every command that connects takes these."""
    p.add_argument("--broker", required=True, help="mqtt://host:port or mqtts://host:port")
    p.add_argument("--protocol", choices=("5", "3.1.1"), default="5")
    p.add_argument("--username")
    p.add_argument("--password-file", help="file holding the password (never on the command line)")
    p.add_argument("--ca-file", help="CA certificate(s) to verify the broker with (mqtts)")
    p.add_argument("--cert-file", help="client certificate (mqtts)")
    p.add_argument("--key-file", help="client key (mqtts)")


def _run(name: str) -> str:
    return f"{__package__}.commands:{name}"
