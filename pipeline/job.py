"""``pubcomp pipeline run``: only what is new since the last run, idempotent.

Spark's file stream source with ``trigger(availableNow=True)`` and a checkpoint
tracks which landing files are new; each run is one job. In
``foreachBatch(df, batch_id)``, with dynamic partition overwrite on every
write:

- ``readings`` (Parquet, by date/hour/batch): the batch deduplicated by id,
  minus ids already in earlier batches of the same hours, written to
  ``batch=batch_id`` — so a replayed batch (a run killed after writing, before
  the checkpoint committed) rewrites only itself;
- ``rollup_1m`` recomputed from ``readings`` for the hours the batch touched;
  ``rollup_1h`` from ``rollup_1m`` and ``rollup_1d`` from ``rollup_1h`` for the
  dates it touched;
- ``quarantine`` (by batch): lines that cannot be kept, with the reason;
- ``quality`` (by batch): per origin and sensor, lines in, kept, duplicates
  removed, late and clock-flagged readings (what ``pubcomp pipeline report``
  shows without scanning all of ``readings``).

No watermark: a reading a week late re-opens its hour and day (docs/pipeline.md).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pubcomp.sync.faults import crash_point

from . import transforms as T

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    started: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    batches: list[int] = field(default_factory=list)
    files: int = 0
    lines_in: int = 0
    readings_in: int = 0
    duplicates_removed: int = 0
    readings_written: int = 0
    quarantined: int = 0
    partitions_rewritten: dict[str, int] = field(
        default_factory=lambda: {"readings": 0, "rollup_1m": 0, "rollup_1h": 0, "rollup_1d": 0}
    )
    seconds: float = 0.0

    def line(self) -> str:
        p = self.partitions_rewritten
        return (
            f"{self.files} files, {self.readings_in:,} readings in, "
            f"{self.duplicates_removed:,} duplicates removed, {self.quarantined:,} quarantined, "
            f"{self.readings_written:,} written; partitions rewritten: {p['readings']} readings, "
            f"{p['rollup_1m']} rollup_1m, {p['rollup_1h']} rollup_1h, {p['rollup_1d']} rollup_1d; "
            f"{self.seconds:.1f} s"
        )


def path_exists(spark: SparkSession, path: str) -> bool:
    """Through Hadoop's file system, so a cluster URL (hdfs://, s3a://) works as a local path."""
    jvm = spark._jvm  # type: ignore[attr-defined]
    conf = spark._jsc.hadoopConfiguration()  # type: ignore[attr-defined]
    p = jvm.org.apache.hadoop.fs.Path(path)
    return bool(p.getFileSystem(conf).exists(p))


def spark_session(master: str | None = None, app: str = "pubcomp-pipeline") -> SparkSession:
    builder = SparkSession.builder.appName(app)
    if master:
        builder = builder.master(master)
    return (
        builder.config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.sources.partitionOverwriteMode", "dynamic")
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )


class Pipeline:
    def __init__(self, spark: SparkSession, landing: str, warehouse: str) -> None:
        self.spark = spark
        self.landing = landing
        self.wh = warehouse.rstrip("/")
        self.summary = RunSummary()

    def path(self, table: str) -> str:
        return f"{self.wh}/{table}"

    # ------------------------------------------------------------ running

    def run(self) -> RunSummary:
        t0 = time.monotonic()
        stream = (
            self.spark.readStream.schema(T.LANDING_SCHEMA)
            .option("columnNameOfCorruptRecord", T.CORRUPT)
            .option("mode", "PERMISSIVE")
            .option("recursiveFileLookup", "true")
            .json(self.landing)
        )
        query = (
            stream.writeStream.trigger(availableNow=True)
            .option("checkpointLocation", self.path("_checkpoint"))
            .foreachBatch(self.batch)
            .start()
        )
        query.awaitTermination()
        self.summary.seconds = round(time.monotonic() - t0, 2)
        self._write_summary()
        return self.summary

    def batch(self, lines: DataFrame, batch_id: int) -> None:
        s = self.summary
        lines = lines.withColumn("_file", F.input_file_name()).persist()
        try:
            counts = lines.agg(F.count(F.lit(1)), F.countDistinct("_file")).first()
            n_lines, n_files = int(counts[0]), int(counts[1])  # type: ignore[index]
            if n_lines == 0:
                return
            s.batches.append(batch_id)
            s.lines_in += n_lines
            s.files += n_files
            parsed = T.parse_landing(lines.drop("_file"))
            bad = T.quarantined(parsed, batch_id)
            bad.write.mode("overwrite").partitionBy("batch").parquet(self.path("quarantine"))
            good = T.valid_readings(parsed, batch_id).persist()
            try:
                self._readings(good, batch_id)
            finally:
                good.unpersist()
        finally:
            lines.unpersist()

    def _readings(self, good: DataFrame, batch_id: int) -> None:
        s = self.summary
        n_good = good.count()
        s.readings_in += n_good
        hours = [(r.date, r.hour) for r in good.select("date", "hour").distinct().collect()]
        s.quarantined = self._count_quarantined()
        deduped = T.first_copy_per_id(good)
        if self._exists("readings"):
            earlier = self._table("readings", T.READINGS_SCHEMA, hours).where(
                F.col("batch") != batch_id
            )
            deduped = T.not_seen_before(deduped, earlier)
        new = deduped.persist()
        try:
            n_new = new.count()
            s.readings_written += n_new
            s.duplicates_removed += n_good - n_new
            new.write.mode("overwrite").partitionBy("date", "hour", "batch").parquet(
                self.path("readings")
            )
            T.quality(good, new, batch_id).coalesce(1).write.mode("overwrite").partitionBy(
                "batch"
            ).parquet(self.path("quality"))
        finally:
            new.unpersist()
        s.partitions_rewritten["readings"] += len(hours)
        crash_point("pipeline_readings_written")
        # Rollups of every hour the batch touched, from all its readings.
        readings = self._table("readings", T.READINGS_SCHEMA, hours)
        m = T.rollup_minutes(readings)
        m.write.mode("overwrite").partitionBy("date", "hour").parquet(self.path("rollup_1m"))
        s.partitions_rewritten["rollup_1m"] += len(hours)
        dates = sorted({d for d, _ in hours})
        minutes = self._table("rollup_1m", T.ROLLUP_1M_SCHEMA, dates=dates)
        T.rollup_up(minutes, "hour").write.mode("overwrite").partitionBy("date").parquet(
            self.path("rollup_1h")
        )
        hours_t = self._table("rollup_1h", T.ROLLUP_DAY_SCHEMA, dates=dates)
        T.rollup_up(hours_t, "day").write.mode("overwrite").partitionBy("date").parquet(
            self.path("rollup_1d")
        )
        s.partitions_rewritten["rollup_1h"] += len(dates)
        s.partitions_rewritten["rollup_1d"] += len(dates)

    # ------------------------------------------------------------ tables

    def _table(
        self,
        name: str,
        schema: Any,
        hours: list[tuple[str, int]] | None = None,
        dates: list[str] | None = None,
    ) -> DataFrame:
        df = self.spark.read.schema(schema).parquet(self.path(name))
        if hours is not None:
            dates = sorted({d for d, _ in hours})
            wanted = self.spark.createDataFrame(hours, "date string, hour int")
            df = df.where(F.col("date").isin(dates)).join(
                F.broadcast(wanted), ["date", "hour"], "left_semi"
            )
        elif dates is not None:
            df = df.where(F.col("date").isin(dates))
        return df

    def _exists(self, name: str) -> bool:
        return path_exists(self.spark, self.path(name))

    def _count_quarantined(self) -> int:
        if not self._exists("quarantine"):
            return 0
        batches = self.summary.batches
        q = self.spark.read.schema(T.QUARANTINE_SCHEMA).parquet(self.path("quarantine"))
        return int(q.where(F.col("batch").isin(batches)).count())

    def _write_summary(self) -> None:
        runs = Path(self.path("_runs")) if "://" not in self.wh else None
        data = json.dumps(asdict(self.summary), indent=2)
        if runs is None:  # a cluster file system: through Spark
            self.spark.createDataFrame([(data,)], "json string").coalesce(1).write.mode(
                "append"
            ).text(self.path("_runs"))
            return
        runs.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        (runs / f"run-{stamp}.json").write_text(data + "\n")


def run(landing: str, warehouse: str, master: str | None = None) -> RunSummary:
    spark = spark_session(master)
    return Pipeline(spark, landing, warehouse).run()
