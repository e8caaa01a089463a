"""What the pipeline commands do (imported only when one runs)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from pubcomp.sync.client import ConnectOptions, TLSOptions
from pubcomp.sync.packets import MQTT_5, MQTT_311

log = logging.getLogger(__name__)


def ingest_run(args: argparse.Namespace) -> int:
    from .ingest import Ingest, run

    opts = ConnectOptions(
        client_id=args.client_id,
        version=MQTT_5 if args.protocol == "5" else MQTT_311,
        keepalive=args.keepalive,
        username=args.username,
        password_file=args.password_file,
        tls=TLSOptions(args.ca_file, args.cert_file, args.key_file),
    )
    ingest = Ingest(
        args.broker,
        opts,
        args.topic,
        Path(args.landing),
        shared_group=args.shared_group,
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
