"""What the pipeline commands do (imported only when one runs)."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import secrets
import sys
from pathlib import Path

from pubcomp.sync import wire
from pubcomp.sync.commands import read_landed_key, uplink_options
from pubcomp.sync.exitcodes import EXIT_USAGE

log = logging.getLogger(__name__)


def ingest_run(args: argparse.Namespace) -> int:
    from .errors import IngestOptionsError
    from .ingest import Ingest, run

    opts = uplink_options(args)  # the same connection arguments as `pubcomp uplink run`
    try:
        ingest = Ingest(
            args.broker,
            opts,
            args.topic,
            Path(args.landing),
            shared_group=args.shared_group,
            connections=args.connections,
            max_file_bytes=int(args.roll_mb * (1 << 20)),
            max_file_age_s=args.roll_s,
            landed_acks=args.landed_acks,
            landed_key=read_landed_key(args.landed_key_file) if args.landed_key_file else None,
            ack_interval=args.ack_interval,
        )
    except IngestOptionsError as exc:
        print(f"pubcomp ingest run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    status = None
    if args.status_topic:  # the gateways' status messages, beside the readings
        from .statusland import StatusLanding

        status = StatusLanding(
            args.broker,
            opts,
            args.status_topic,
            Path(args.landing),
            max_file_bytes=int(args.roll_mb * (1 << 20)),
            max_file_age_s=args.roll_s,
        )
    print(json.dumps(run(ingest, status)), flush=True)
    return 0


def ingest_landed_key(args: argparse.Namespace) -> int:
    """Print the gateway's key (hex), for its ``uplink.landed_key`` secret file."""
    master = Path(args.master_key_file)
    if args.new_master:
        if master.exists():
            print(f"{master} exists: not overwritten", file=sys.stderr)
            return 2
        fd = os.open(master, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    print(wire.gateway_key(read_landed_key(str(master)), args.gateway).hex())
    return 0


# Directories a warehouse made by `pubcomp pipeline run` holds (pipeline/job.py).
WAREHOUSE_MARKS = ("readings", "_checkpoint", "_runs")


def _local(location: str) -> Path | None:
    """The local directory a --landing or --warehouse names; None for a cluster URL."""
    if location.startswith("file://"):
        return Path(location.removeprefix("file://"))
    return None if "://" in location else Path(location)


def _fail(command: str, text: str) -> int:
    print(f"pubcomp pipeline {command}: {text}", file=sys.stderr)
    return EXIT_USAGE


def pipeline_run(args: argparse.Namespace) -> int:
    # Checked before Spark starts: a missing directory otherwise ends in 28 lines of Java.
    landing = _local(args.landing)
    if landing is not None and not landing.is_dir():
        what = "is not a directory" if landing.exists() else "does not exist"
        return _fail(
            "run",
            f"landing {args.landing} {what}; pass the directory `pubcomp ingest run "
            f"--landing` writes to",
        )
    from .job import run

    summary = run(args.landing, args.warehouse, args.master, args.driver_memory)
    print(summary.line(), flush=True)
    if summary.gateway_health:
        print(summary.gateway_health, flush=True)
    return 0


def warehouse_problem(location: str) -> str | None:
    """Why a local --warehouse is not one (checked before Spark starts), else None."""
    wh = _local(location)
    if wh is not None and not (wh.is_dir() and any((wh / m).is_dir() for m in WAREHOUSE_MARKS)):
        what = "does not exist" if not wh.exists() else "is not a warehouse (no readings/ in it)"
        near = (
            [p.name for p in wh.parent.glob("*") if p.is_dir() and p != wh]
            if wh.parent.is_dir()
            else []
        )
        close = difflib.get_close_matches(wh.name, near, n=1)
        hint = f" (did you mean {wh.parent / close[0]}?)" if close else ""
        return (
            f"warehouse {location} {what}{hint}; pass the --warehouse "
            "`pubcomp pipeline run` wrote to"
        )
    return None


def pipeline_report(args: argparse.Namespace) -> int:
    problem = warehouse_problem(args.warehouse)
    if problem is not None:
        return _fail("report", problem)
    out_dir = Path(args.out).resolve().parent
    if not out_dir.is_dir():
        return _fail("report", f"--out {args.out}: directory {out_dir} does not exist")
    from .job import spark_session
    from .report import write

    spark = spark_session(args.master, app="pubcomp-report")
    out = Path(args.out)
    facts = write(
        spark, args.warehouse, out, max_origins=args.max_origins, max_sensors=args.max_sensors
    )
    t = facts.totals
    print(
        f"wrote {out.resolve()}: {t['origins']} origins, {t['sensors']} sensors, "
        f"{t['kept']:,} readings, {t['duplicates_removed']:,} duplicates removed, "
        f"{t['late']:,} late, {t['clock_flagged']:,} clock-flagged, "
        f"{t['quarantined']:,} quarantined",
        flush=True,
    )
    if facts.fleet_page:
        print(f"wrote {out.resolve().with_name(facts.fleet_page[0])}: {facts.fleet_page[1]}")
    return 0
