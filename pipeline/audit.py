"""What the warehouse holds, counted for an audit against a witness (node acks, commit logs).

The demo and the power-cut tests compare these counts with what was
acknowledged or committed at the edge: each should be exactly 1.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import functions as F


@dataclass
class Delivered:
    by_id: collections.Counter[str]
    # (origin, sensor, ts in µs since the epoch, UTC): how a sensor reading is known before
    # the store gives it an id.
    by_key: collections.Counter[tuple[str, str, int]]


def delivered(spark: SparkSession, warehouse: str | Path) -> Delivered:
    rows = (
        spark.read.parquet(str(Path(warehouse) / "readings"))
        .select("id", "origin", "sensor", F.unix_micros("ts").alias("us"))
        .collect()
    )
    return Delivered(
        collections.Counter(r["id"] for r in rows),
        collections.Counter((r["origin"], r["sensor"], r["us"]) for r in rows),
    )


def landed(landing: Path, rolled_only: bool = True) -> collections.Counter[str]:
    """Reading ids in the landing zone's rolled files (what Spark would see), and with
    ``rolled_only`` false in the files still open too (their complete lines: the ingest
    may be writing the last one)."""
    counts: collections.Counter[str] = collections.Counter()
    files = [(f, False) for f in landing.glob("date=*/*.jsonl")]
    if not rolled_only:
        files += [(f, True) for f in (landing / "_incoming" / "readings").glob("*.jsonl")]
    for f, still_open in files:
        try:
            text = f.read_text()
        except FileNotFoundError:  # rolled away between the listing and the read
            continue
        lines = text.split("\n")
        if still_open or lines[-1] == "":
            lines.pop()  # the line being written, or the empty end after the last newline
        for line in lines:
            counts[json.loads(line)["id"]] += 1
    return counts
