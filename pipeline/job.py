"""``pubcomp pipeline run``: only what is new since the last run, idempotent.

Spark's file stream source with ``trigger(availableNow=True)`` and a checkpoint
tracks which landing files are new; each run is one job. In
``foreachBatch(df, batch_id)``, with dynamic partition overwrite on every
write:

- ``readings`` (Parquet, by date/hour/batch): one row per id over all of
  history. The batch's first copy of each id is checked against ``seen_ids``
  (the index of ids kept so far, bucketed by the id's origin/epoch): a copy
  received after the kept one is dropped; one received before it displaces it
  (its partition is rewritten without it). The batch's own rows go to
  ``batch=batch_id``, so a replayed batch (a run killed after writing, before
  the checkpoint committed) rewrites only itself and what it displaced;
- ``seen_ids`` (by bucket/gen): a generation per batch of each bucket it kept
  copies in, holding its own rows; a bucket with ``seen_max_generations`` is
  compacted into one when next touched;
- ``rollup_1m`` recomputed from ``readings`` for the hours the batch changed
  (its kept copies' and its displaced copies'); ``rollup_1h`` of those dates
  from those minutes and the dates' other hours in ``rollup_1h``; ``rollup_1d``
  from those hours (nothing written is read back);
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

from pubcomp.sync import faults
from pubcomp.sync.faults import crash_point

from . import transforms
from .health import update as update_health
from .sparkenv import hadoop_path, path_exists, spark_session

log = logging.getLogger(__name__)

# Crash points (sync/faults.py) of a batch: pipeline_seen_written (its seen-id index
# written, its readings not yet), pipeline_readings_written (its readings written, its
# rollups and checkpoint not yet), pipeline_displaced_removed (the copies it displaced
# removed from earlier partitions, rollups not yet).
faults.register("pipeline_seen_written", "pipeline_readings_written", "pipeline_displaced_removed")


@dataclass
class RunSummary:
    started: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    batches: list[int] = field(default_factory=list)
    files: int = 0
    lines_in: int = 0
    readings_in: int = 0
    duplicates_removed: int = 0
    readings_written: int = 0
    displaced: int = 0  # kept copies replaced by a copy of the same id received before them
    quarantined: int = 0
    partitions_rewritten: dict[str, int] = field(
        default_factory=lambda: {"readings": 0, "rollup_1m": 0, "rollup_1h": 0, "rollup_1d": 0}
    )
    seconds: float = 0.0
    gateway_health: str = ""  # what the gateway_health update did (pipeline/health.py)

    def line(self) -> str:
        p = self.partitions_rewritten
        return (
            f"{self.files} files, {self.readings_in:,} readings in, "
            f"{self.duplicates_removed:,} duplicates removed, {self.quarantined:,} quarantined, "
            f"{self.readings_written:,} written, {self.displaced:,} displaced; "
            f"partitions rewritten: {p['readings']} readings, "
            f"{p['rollup_1m']} rollup_1m, {p['rollup_1h']} rollup_1h, {p['rollup_1d']} rollup_1d; "
            f"{self.seconds:.1f} s"
        )


class Pipeline:
    # A bucket of the seen-id index gets a generation (a file) per batch that keeps
    # copies in it; one that has this many is rewritten whole when next touched.
    seen_max_generations = 8

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
            self.spark.readStream.schema(transforms.LANDING_SCHEMA)
            .option("columnNameOfCorruptRecord", transforms.CORRUPT)
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
        # One cache: the lines parsed once (every later step reads this, not the JSON).
        parsed = transforms.parse_landing(lines).withColumn("_file", F.input_file_name()).persist()
        try:
            good_bucket = F.when(F.col("reason").isNull(), transforms.id_bucket(F.col("id")))
            counts = parsed.agg(
                F.count(F.lit(1)),
                F.countDistinct("_file"),
                F.count_if(F.col("reason").isNull()),
                F.collect_set(good_bucket),
            ).first()
            if counts is None or not counts[0]:  # (a global aggregate always has one row)
                return
            n_lines, n_files, n_good = (int(c) for c in counts[:3])
            s.batches.append(batch_id)
            s.lines_in += n_lines
            s.files += n_files
            s.quarantined += n_lines - n_good
            # A batch with nothing to quarantine writes no partition: skip the pass,
            # once the table exists (the report reads it).
            if n_lines > n_good or not self._exists("quarantine"):
                bad = transforms.quarantined(parsed, batch_id)
                bad.write.mode("overwrite").partitionBy("batch").parquet(self.path("quarantine"))
            buckets = sorted(int(b) for b in counts[3])
            self._readings(transforms.valid_readings(parsed, batch_id), n_good, buckets, batch_id)
        finally:
            parsed.unpersist()

    def _readings(self, good: DataFrame, n_good: int, buckets: list[int], batch_id: int) -> None:
        s = self.summary
        s.readings_in += n_good
        candidates = transforms.first_copy_per_id(good)
        index = self._seen_generations()
        prior = self._seen(index, buckets, batch_id)
        compact = self._to_compact(index, buckets, batch_id)
        displaced: DataFrame | None = None
        if prior is None:
            new = candidates.persist()
            kept = new
        else:
            # Checkpointed, not cached: writing seen_ids (read by this plan) would drop
            # a cache, and every later step would read the index and join again.
            kept = transforms.against_seen(candidates, prior).localCheckpoint(eager=False)
            new = transforms.winners(kept)
            displaced = transforms.displaced(kept)
        try:
            # One pass for what the batch keeps and where: its hours, and the
            # (date, hour, batch) partitions of the copies it displaces.
            n_new, n_displaced = 0, 0
            hours: set[tuple[str, int]] = set()
            moved: set[tuple[str, int, int]] = set()
            for r in _placement(kept if prior is not None else new, prior is not None):
                n_new += r["n"]
                hours.add((r["date"], r["hour"]))
                if r["kept_date"] is not None:
                    n_displaced += r["n"]
                    moved.add((r["kept_date"], r["kept_hour"], r["kept_batch"]))
            hours |= {(d, h) for d, h, _ in moved}
            s.readings_written += n_new
            s.displaced += n_displaced
            # A displaced copy is a duplicate removed too: the id's count stays one.
            s.duplicates_removed += n_good - n_new + n_displaced
            # 1. The index first: a replay of this batch reads the index without its own rows.
            if n_new or compact:
                self._write_seen(prior, new, compact, index, batch_id)
            crash_point("pipeline_seen_written")
            # 2. This batch's readings, and its quality row (displaced copies taken off).
            # One file per hour (a task per hour), not one per hour and task: on this
            # kind of job the files cost more than the rows.
            new.repartition("date", "hour").write.mode("overwrite").partitionBy(
                "date", "hour", "batch"
            ).parquet(self.path("readings"))
            transforms.quality(good, new, batch_id, displaced).coalesce(1).write.mode(
                "overwrite"
            ).partitionBy("batch").parquet(self.path("quality"))
            s.partitions_rewritten["readings"] += len(hours)
            crash_point("pipeline_readings_written")
            # 3. Copies received after the one this batch brought leave their hours.
            if moved and displaced is not None:
                self._remove_displaced(displaced, sorted(moved))
            crash_point("pipeline_displaced_removed")
            self._rollups(sorted(hours), new, batch_id, emptied=bool(moved))
            self._drop_compacted(index, compact, batch_id)
        finally:
            if prior is None:
                new.unpersist()

    def _rollups(
        self, hours: list[tuple[str, int]], new: DataFrame, batch_id: int, emptied: bool
    ) -> None:
        """Rollups of every hour the batch changed, from all of those hours' readings.

        ``rollup_1m`` of those hours from their readings; ``rollup_1h`` of their dates
        from those minutes, plus the dates' other hours as ``rollup_1h`` holds them (an
        hour's minutes change only when the hour is touched, so its row is what its
        minutes would give); ``rollup_1d`` from those hours. Nothing written is read
        back. ``emptied``: the batch displaced copies, so an hour (or a day) may have
        lost its last reading; its rollup partitions are deleted.
        """
        if not hours:
            return
        s = self.summary
        readings = new.select(*transforms.READINGS_SCHEMA.names)
        if self._exists("readings"):
            earlier = self._table("readings", transforms.READINGS_SCHEMA, hours)
            readings = earlier.where(F.col("batch") != batch_id).unionByName(readings)
        dates = sorted({d for d, _ in hours})
        # By hour, so the minutes are aggregated in place and written a file per hour.
        minutes = transforms.rollup_minutes(readings.repartition("date", "hour")).persist()
        by_hour = transforms.rollup_up(minutes, "hour")
        try:
            minutes.write.mode("overwrite").partitionBy("date", "hour").parquet(
                self.path("rollup_1m")
            )
            if self._exists("rollup_1h"):
                hourly = self._table("rollup_1h", transforms.ROLLUP_DAY_SCHEMA, dates=dates)
                by_hour = transforms.other_hours(hourly, hours).unionByName(by_hour)
            by_hour = by_hour.persist()
            present: set[tuple[str, int]] = set()
            if emptied:
                present = {
                    (r.date, r.hour)
                    for r in by_hour.select("date", F.hour("window_start").alias("hour"))
                    .distinct()
                    .collect()
                }
            # The days first: the cache reads rollup_1h, which the next write replaces.
            transforms.rollup_up(by_hour, "day").write.mode("overwrite").partitionBy(
                "date"
            ).parquet(self.path("rollup_1d"))
            by_hour.write.mode("overwrite").partitionBy("date").parquet(self.path("rollup_1h"))
        finally:
            minutes.unpersist()
            by_hour.unpersist()
        if emptied:  # an hour or a day with nothing left: no rows to overwrite it with
            for d, h in sorted(set(hours) - present):
                self._delete(f"{self.path('rollup_1m')}/date={d}/hour={h}")
            for d in sorted(set(dates) - {d for d, _ in present}):
                self._delete(f"{self.path('rollup_1h')}/date={d}")
                self._delete(f"{self.path('rollup_1d')}/date={d}")
        s.partitions_rewritten["rollup_1m"] += len(hours)
        s.partitions_rewritten["rollup_1h"] += len(dates)
        s.partitions_rewritten["rollup_1d"] += len(dates)

    # ------------------------------------------------------------ seen-id index

    def _seen_generations(self) -> dict[int, list[int]]:
        """Bucket -> its generations on disk (the batches that wrote them), oldest first."""
        fs, pattern = hadoop_path(self.spark, self.path("seen_ids") + "/bucket=*/gen=*")
        found = fs.globStatus(pattern) or []
        gens: dict[int, list[int]] = {}
        for st in found:
            if st.isDirectory():
                p = st.getPath()
                gen = int(p.getName().removeprefix("gen="))
                gens.setdefault(int(p.getParent().getName().removeprefix("bucket=")), []).append(
                    gen
                )
        return {b: sorted(g) for b, g in gens.items()}

    def _seen(
        self, index: dict[int, list[int]], buckets: list[int], batch_id: int
    ) -> DataFrame | None:
        """The index of the buckets the batch's ids fall in: every generation of each."""
        root = self.path("seen_ids")
        paths = [f"{root}/bucket={b}" for b in buckets if b in index]
        if not paths:
            return None
        seen = (
            self.spark.read.schema(transforms.SEEN_SCHEMA).option("basePath", root).parquet(*paths)
        )
        # Without this batch's own rows: a replay decides as its first attempt did.
        return seen.where(F.col("batch") != batch_id).select(*transforms.SEEN_COLUMNS)

    def _to_compact(
        self, index: dict[int, list[int]], buckets: list[int], batch_id: int
    ) -> list[int]:
        """The batch's buckets it rewrites whole: those with ``seen_max_generations`` already,
        and on a replay those it wrote before it was killed (a whole bucket is never
        overwritten with the batch's rows alone: the older generations may be gone)."""
        limit = self.seen_max_generations
        return [
            b for b in buckets if b in index and (len(index[b]) >= limit or batch_id in index[b])
        ]

    def _write_seen(
        self,
        prior: DataFrame | None,
        new: DataFrame,
        compact: list[int],
        index: dict[int, list[int]],
        batch_id: int,
    ) -> None:
        """Generation ``batch_id`` of each bucket the batch kept copies in: its own rows, and
        for a bucket it compacts every older generation's rows as well.

        Written whole before anything else, and an older generation is deleted only at
        the end of the batch, once the compacted one holds its rows. Displaced rows
        stay (the earliest copy per id is the kept one): a replay must see what the
        first attempt saw.
        """
        rows = transforms.seen_rows(new, batch_id)
        replay = any(batch_id in index[b] for b in compact)
        if prior is not None and compact:
            old = prior.where(F.col("bucket").isin(compact))
            if replay:
                # A compacted generation and the ones it replaced may both be there, so
                # a row may be read twice. An id is kept once per batch.
                old = old.dropDuplicates(["id", "batch"])
            rows = old.unionByName(rows)
        write = (
            rows.withColumn("gen", F.lit(batch_id).cast("long"))
            .repartition("bucket")
            .write.partitionBy("bucket", "gen")
        )
        if replay:  # generation batch_id is there: replaced, partition by partition
            write.mode("overwrite").parquet(self.path("seen_ids"))
            return
        # No generation batch_id anywhere yet, so nothing to replace: appended, which
        # spares the dynamic overwrite's staging and a rename per bucket in the driver
        # (4 to 10 s of a first batch's 256 buckets here). What a killed append left
        # half-committed is a generation batch_id: its replay takes the branch above.
        # What it left uncommitted under _temporary must not join this job's output.
        self._delete(f"{self.path('seen_ids')}/_temporary")
        write.mode("append").parquet(self.path("seen_ids"))

    def _drop_compacted(
        self, index: dict[int, list[int]], compact: list[int], batch_id: int
    ) -> None:
        """Delete the generations the batch compacted (at the end: nothing reads them now)."""
        for b in compact:
            for g in index[b]:
                if g != batch_id:
                    self._delete(f"{self.path('seen_ids')}/bucket={b}/gen={g}")

    def _remove_displaced(self, displaced: DataFrame, where: list[tuple[str, int, int]]) -> None:
        """Rewrite each (date, hour, batch) partition that holds a displaced copy without it."""
        parts = self.spark.createDataFrame(where, "date string, hour int, batch long")
        old = (
            self.spark.read.schema(transforms.READINGS_SCHEMA)
            .parquet(self.path("readings"))
            .where(F.col("date").isin(sorted({d for d, _, _ in where})))
            .join(F.broadcast(parts), on=["date", "hour", "batch"], how="left_semi")
        )
        left = old.join(displaced.select("id"), on="id", how="left_anti").localCheckpoint(
            eager=True
        )
        remaining = {
            (r.date, r.hour, r.batch) for r in left.select(*parts.columns).distinct().collect()
        }
        left.write.mode("overwrite").partitionBy("date", "hour", "batch").parquet(
            self.path("readings")
        )
        for d, h, b in where:
            if (d, h, b) not in remaining:  # every copy in it was displaced: the partition goes
                self._delete(f"{self.path('readings')}/date={d}/hour={h}/batch={b}")

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
            # On the partition columns only: the other hours' files are pruned, not read.
            df = df.where(transforms.in_hours(F.col("date"), F.col("hour"), hours))
        elif dates is not None:
            df = df.where(F.col("date").isin(dates))
        return df

    def _delete(self, path: str) -> None:
        """Delete a directory through Hadoop's file system (nothing if it is not there)."""
        fs, p = hadoop_path(self.spark, path)
        fs.delete(p, True)

    def _exists(self, name: str) -> bool:
        return path_exists(self.spark, self.path(name))

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


def _placement(df: DataFrame, decided: bool) -> list[Any]:
    """Rows kept per (date, hour), and per partition of the copy each displaces (if any)."""
    if not decided:
        none = F.lit(None)
        return (
            df.groupBy("date", "hour")
            .agg(F.count(F.lit(1)).alias("n"))
            .select("*", none.alias("kept_date"), none.alias("kept_hour"), none.alias("kept_batch"))
            .collect()
        )
    return (
        df.where(F.col("wins"))
        .groupBy(
            "date",
            "hour",
            F.col("kept.date").alias("kept_date"),
            F.col("kept.hour").alias("kept_hour"),
            F.col("kept.batch").alias("kept_batch"),
        )
        .agg(F.count(F.lit(1)).alias("n"))
        .collect()
    )


def run(landing: str, warehouse: str, master: str | None = None) -> RunSummary:
    spark = spark_session(master)
    summary = Pipeline(spark, landing, warehouse).run()
    # The gateways' status messages: gateway_health (issue 15).
    summary.gateway_health = update_health(spark, landing, warehouse).line()
    return summary
