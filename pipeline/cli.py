"""Commands of the pipeline part: ``pubcomp ingest run`` (and the Spark jobs)."""

from __future__ import annotations

from typing import Any

from ..sync.cli import add_connection_args


def register(sub: Any) -> None:
    ing = sub.add_parser("ingest", help="cloud broker -> landing zone, durably")
    isub = ing.add_subparsers(dest="ingest_command", metavar="ACTION", required=True)
    run = isub.add_parser("run", help="receive readings at QoS 2 into landing files")
    add_connection_args(run)
    run.add_argument("--client-id", required=True, help="also names this writer's files")
    run.add_argument("--topic", default="telemetry/+/readings")
    run.add_argument(
        "--status-topic",
        default="telemetry/+/status",
        help="the gateways' status messages, landed in _status/ ('' for none)",
    )
    run.add_argument("--landing", required=True, help="landing directory")
    run.add_argument("--shared-group", help="share the subscription ($share/G/..., MQTT 5)")
    run.add_argument(
        "--connections",
        type=int,
        default=1,
        help="connections in this process (needs --shared-group); one fsync covers them all",
    )
    run.add_argument("--keepalive", type=int, default=30)
    run.add_argument("--roll-mb", type=float, default=64.0, help="roll landing files at this size")
    run.add_argument("--roll-s", type=float, default=60.0, help="roll landing files at this age")
    run.add_argument(
        "--no-landed-acks",
        dest="landed_acks",
        action="store_false",
        help="do not tell gateways what is landed (they then keep it until uplink.landed_timeout)",
    )
    run.add_argument(
        "--landed-key-file",
        help="the fleet's master key, hex: each acknowledgement carries an HMAC under "
        "the gateway's key derived from it (pubcomp ingest landed-key)",
    )
    run.add_argument(
        "--ack-interval",
        type=float,
        default=1.0,
        help="at most one landed acknowledgement per gateway this often (seconds)",
    )
    run.set_defaults(handler=_run("ingest_run"))

    key = isub.add_parser(
        "landed-key", help="a gateway's acknowledgement key, from the fleet's master key"
    )
    key.add_argument("--master-key-file", required=True, help="the master key file (hex)")
    key.add_argument("--gateway", required=True, help="the gateway id")
    key.add_argument(
        "--new-master", action="store_true", help="write a new random master key file first"
    )
    key.set_defaults(handler=_run("ingest_landed_key"))

    pipe = sub.add_parser("pipeline", help="the Spark jobs: dedup and rollups")
    psub = pipe.add_subparsers(dest="pipeline_command", metavar="ACTION", required=True)
    prun = psub.add_parser("run", help="process new landing files into the warehouse")
    prun.add_argument("--landing", required=True, help="landing directory (or URL)")
    prun.add_argument("--warehouse", required=True, help="warehouse directory (or URL)")
    prun.add_argument("--master", help="Spark master (default: local[*], or spark-submit's)")
    prun.add_argument(
        "--driver-memory",
        help="the Spark driver's heap, e.g. 4g (local mode: every task's too; Spark's "
        "default 1g runs short on a backlog of millions of lines)",
    )
    prun.set_defaults(handler=_run("pipeline_run"))
    rep = psub.add_parser("report", help="an HTML page of the fleet: rollup charts, data quality")
    rep.add_argument("--warehouse", required=True, help="warehouse directory (or URL)")
    rep.add_argument("--out", default="report.html", help="the HTML file to write")
    rep.add_argument("--master", help="Spark master (default: local[*])")
    rep.add_argument("--max-origins", type=int, default=40, help="origins charted (all tabled)")
    rep.add_argument("--max-sensors", type=int, default=12, help="sensors charted per origin")
    rep.set_defaults(handler=_run("pipeline_report"))


def _run(name: str) -> str:
    return f"{__package__}.commands:{name}"
