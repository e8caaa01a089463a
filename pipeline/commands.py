"""What the pipeline commands do (imported only when one runs)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from pubcomp.sync.commands import uplink_options

log = logging.getLogger(__name__)


def ingest_run(args: argparse.Namespace) -> int:
    from .ingest import Ingest, run

    opts = uplink_options(args)  # the same connection arguments as `pubcomp uplink run`
    ingest = Ingest(
        args.broker,
        opts,
        args.topic,
        Path(args.landing),
        shared_group=args.shared_group,
        connections=args.connections,
        max_file_bytes=int(args.roll_mb * (1 << 20)),
        max_file_age_s=args.roll_s,
    )
    print(json.dumps(run(ingest)), flush=True)
    return 0


def pipeline_run(args: argparse.Namespace) -> int:
    from .job import run

    summary = run(args.landing, args.warehouse, args.master)
    print(summary.line(), flush=True)
    return 0


def pipeline_report(args: argparse.Namespace) -> int:
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
    return 0
