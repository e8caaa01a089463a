"""``pubcomp pipeline run``: only what is new since the last run, idempotent.

Spark's file stream source with ``trigger(availableNow=True)`` and a checkpoint
tracks which landing files are new; each run is one job. In
``foreachBatch(df, batch_id)``, with dynamic partition overwrite on every
write:

- ``readings`` (Parquet, by date/hour/batch): one row per id over all of
  history. The batch's first copy of each id is checked against the seen index
  (per stream, the ranges of ids kept so far: pipeline/seenindex.py): a copy
  received after the kept one is dropped; one received before it displaces it
  (its partition is rewritten without it). The batch's own rows go to
  ``batch=batch_id``, so a replayed batch (a run killed after writing, before
  the checkpoint committed) rewrites only itself and what it displaced;
- ``seen_ranges`` and ``seen_exceptions`` (by bucket/gen; pipeline/seenstore.py):
  a generation per batch of each bucket it kept anything in, holding its own
  rows; a bucket with ``seen_max_generations`` is compacted when next touched;
- ``rollup_1m`` recomputed from ``readings`` for the hours the batch changed
  (its kept copies' and its displaced copies'); ``rollup_1h`` of those dates
  from those minutes and the dates' other hours in ``rollup_1h``; ``rollup_1d``
  from those hours (nothing written is read back);
- ``quarantine`` (by batch): lines that cannot be kept, with the reason;
- ``quality`` (by batch): per origin and sensor, lines in, kept, duplicates
  removed, late and clock-flagged readings (what ``pubcomp pipeline report``
  shows without scanning all of ``readings``).
- ``records``, ``ledger``, ``landed``, ``completeness``, ``completeness_gaps``: the
  gateways' records (never readings) and what landed and what is missing, per stream
  (pipeline/completejob.py, issue 27).

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

from . import completeness, seenindex, transforms
from .completejob import CompletenessTables
from .health import update as update_health
from .seenstore import EXCEPTIONS, RANGES, SeenStore
from .sparkenv import SMALL, broadcast_if_small, delete_path, path_exists, spark_session

log = logging.getLogger(__name__)

# Crash points (sync/faults.py) of a batch: pipeline_seen_written (its seen index
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
    # Batches that judged completeness whole (every stream of their buckets), not again
    # from what they could change (pipeline/completejob.py says when)
    judged_whole: list[int] = field(default_factory=list)

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
    # A bucket of the seen index gets a generation (a file) per batch that keeps
    # copies in it; one that has this many is rewritten whole when next touched.
    seen_max_generations = 8

    def __init__(self, spark: SparkSession, landing: str, warehouse: str) -> None:
        self.spark = spark
        self.landing = landing
        self.wh = warehouse.rstrip("/")
        self.summary = RunSummary()
        self.seen = SeenStore(spark, self.wh)
        self.complete = CompletenessTables(spark, self.wh)

    def path(self, table: str) -> str:
        return f"{self.wh}/{table}"

    def _cores(self) -> int:
        return int(self.spark.sparkContext.defaultParallelism)

    # ------------------------------------------------------------ running

    def run(self) -> RunSummary:
        t0 = time.monotonic()
        self.seen.migrate()  # a warehouse written before the ranges (issue 27), once
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
        # (each line's file as a hash, for the count of files: a number, not its path,
        # on every cached row)
        file_hash = F.xxhash64(F.input_file_name())
        parsed = transforms.parse_landing(lines).withColumn("_file", file_hash).persist()
        try:
            # A record ($ledger, $release) is no reading: completejob keeps it (issue 27).
            good = F.col("reason").isNull() & ~transforms.is_record(F.col("sensor"))
            record = F.col("reason").isNull() & transforms.is_record(F.col("sensor"))
            counts = parsed.agg(
                F.count(F.lit(1)),
                F.count_if(good),
                F.count_if(record),
                # (not countDistinct: beside the sets, it makes Spark copy every row)
                F.size(F.collect_set("_file")),
                F.collect_set(F.when(good, transforms.id_bucket(F.col("id")))),
                F.collect_set(F.when(good, seenindex.range_bucket(F.col("id")))),
                F.collect_set(completeness.bucket(F.col("gateway"))),
            ).first()
            if counts is None or not counts[0]:  # (a global aggregate always has one row)
                return
            n_lines, n_good, n_records, n_files = (int(c) for c in counts[:4])
            s.batches.append(batch_id)
            s.lines_in += n_lines
            s.files += n_files
            s.quarantined += n_lines - n_good - n_records
            # A batch with nothing to quarantine writes no partition: skip the pass,
            # once the table exists (the report reads it).
            if n_lines > n_good + n_records or not self._exists("quarantine"):
                bad = transforms.quarantined(parsed, batch_id)
                bad.write.mode("overwrite").partitionBy("batch").parquet(self.path("quarantine"))
            buckets = (sorted(int(b) for b in counts[4]), sorted(int(b) for b in counts[5]))
            self._readings(transforms.valid_readings(parsed, batch_id), n_good, buckets, batch_id)
            if self.complete.batch(parsed, batch_id, n_records, sorted(counts[6])):
                s.judged_whole.append(batch_id)
        finally:
            parsed.unpersist()

    def _readings(
        self, good: DataFrame, n_good: int, buckets: tuple[list[int], list[int]], batch_id: int
    ) -> None:
        s = self.summary
        s.readings_in += n_good
        id_buckets, stream_buckets = buckets
        # Each first copy's stream position once, on the cached rows: claims, the index's
        # runs and the placement all read it (string functions over every id: 1.3-1.4 s a
        # pass over the lab fleet's million, where it was computed four times).
        candidates = transforms.first_copy_per_id(good).withColumn(
            STREAM, F.struct(*seenindex.stream_position(F.col("id")))
        )
        store, limit = self.seen, self.seen_max_generations
        index = {EXCEPTIONS: store.generations(EXCEPTIONS), RANGES: store.generations(RANGES)}
        exceptions = store.read(EXCEPTIONS, index[EXCEPTIONS], id_buckets, batch_id)
        runs = store.read(RANGES, index[RANGES], stream_buckets, batch_id)
        compact = {
            EXCEPTIONS: store.to_compact(index[EXCEPTIONS], id_buckets, batch_id, limit),
            RANGES: store.to_compact(index[RANGES], stream_buckets, batch_id, limit),
        }
        decided: DataFrame | None = None
        displaced: DataFrame | None = None
        new = candidates.persist()
        if exceptions is not None or runs is not None:
            # Checkpointed, not cached: writing the index (read by this plan) would drop
            # a cache, and every later step would read the index and join again.
            decided = self._decide(new, exceptions, runs, batch_id).localCheckpoint(eager=False)
            new = transforms.winners(decided)
            displaced = transforms.displaced(decided)
        try:
            # One pass for what the batch keeps and where: its hours, and the
            # (date, hour, batch) partitions of the copies it displaces.
            n_new, n_displaced, n_odd = 0, 0, 0
            hours: set[tuple[str, int]] = set()
            moved: set[tuple[str, int, int]] = set()
            touched: dict[tuple[str, int], set[int]] = {}  # the minutes of each hour it adds to
            for r in _placement(decided if decided is not None else new, decided is not None):
                n_new += r["n"]
                n_odd += r["odd"] if r["kept_date"] is None else 0
                hours.add((r["date"], r["hour"]))
                touched.setdefault((r["date"], r["hour"]), set()).add(r["minute"])
                if r["kept_date"] is not None:
                    n_displaced += r["n"]
                    moved.add((r["kept_date"], r["kept_hour"], r["kept_batch"]))
            hours |= {(d, h) for d, h, _ in moved}
            # An hour a displaced copy leaves is aggregated whole: its minute is not known.
            for d, h, _ in moved:
                touched.pop((d, h), None)
            s.readings_written += n_new
            s.displaced += n_displaced
            # A displaced copy is a duplicate removed too: the id's count stays one.
            s.duplicates_removed += n_good - n_new + n_displaced
            # 1. The index first: a replay of this batch reads the index without its own rows.
            # What it writes: runs of the positions it kept first, exception rows of the
            # ids that are none and of the copies it displaced, and what it compacts.
            writes = {
                RANGES: n_new - n_displaced - n_odd > 0 or bool(compact[RANGES]),
                EXCEPTIONS: n_odd + n_displaced > 0 or bool(compact[EXCEPTIONS]),
            }
            self._write_index(decided, new, exceptions, index, compact, writes, batch_id)
            crash_point("pipeline_seen_written")
            # 2. This batch's readings, and its quality row (displaced copies taken off).
            # A file per hour (a task per hour) unless the batch is large and has fewer
            # hours than the cluster has cores (``tasks_per_hour``).
            per_hour = tasks_per_hour(self._cores(), len(hours), n_new)
            spread_hours(new, per_hour).drop(PART, STREAM).write.mode("overwrite").partitionBy(
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
            self._rollups(sorted(hours), new, batch_id, bool(moved), per_hour, touched)
            for table in (EXCEPTIONS, RANGES):
                self._drop_compacted(table, index[table], compact[table], batch_id)
        finally:
            candidates.unpersist()

    # ------------------------------------------------------------ the seen index

    def _decide(
        self,
        candidates: DataFrame,
        exceptions: DataFrame | None,
        runs: DataFrame | None,
        batch_id: int,
    ) -> DataFrame:
        """The batch's first copies against the index: ``transforms.against_index``, with the
        kept copy of every id a range claims and this copy may beat read from ``readings``."""
        claimed: DataFrame | None = None
        rows = exceptions
        if runs is not None:
            positions = candidates.select("id", f"{STREAM}.*")
            claimed = seenindex.claims(positions, runs).localCheckpoint(eager=True)
            claimed = broadcast_if_small(claimed)
            found = self._kept_copies(candidates, claimed, exceptions, batch_id)
            if found is not None:
                rows = found if rows is None else rows.unionByName(found)
        kept = transforms.kept_per_id(candidates, rows) if rows is not None else None
        if kept is not None:
            kept = broadcast_if_small(kept.localCheckpoint(eager=True))
        return transforms.against_index(candidates, kept, claimed)

    def _kept_copies(
        self,
        candidates: DataFrame,
        claimed: DataFrame,
        exceptions: DataFrame | None,
        batch_id: int,
    ) -> DataFrame | None:
        """The kept copies (as exception rows) of the claimed ids whose candidate may win:
        ordered before the exact runs' bound, or claimed by an envelope only. Read from
        ``readings``: first in the candidate's own hour, then, for those not found there,
        in the claiming runs' dates and batches (the ranges' bounds: nothing else of
        ``readings`` is read). Copies of a reading share its ``ts`` unless it was stamped
        by a gateway or its clock corrected (``transforms.ts_may_differ``), so a candidate
        only an envelope claims and not found in its own hour was never kept, unless it
        carries one of those flags; one an exact run claims must be found."""
        mine = seenindex.last_copy(F.col("received"), F.col("gateway"))
        maybe = candidates.join(claimed, on="id").where(
            F.col("bound").isNull() | (mine < F.col("bound"))
        )
        if exceptions is not None:  # an exception says exactly
            maybe = maybe.join(exceptions.select("id"), on="id", how="left_anti")
        maybe = maybe.select(
            "id",
            "date",
            "hour",
            F.col("bound").isNotNull().alias("must"),  # an exact run claims it: it is there
            transforms.ts_may_differ().alias("moved"),
            "look_date_lo",
            "look_date_hi",
            "look_batch_lo",
            "look_batch_hi",
        ).localCheckpoint(eager=True)
        spec = maybe.agg(
            F.count(F.lit(1)),
            F.collect_set(F.struct("date", "hour")),
            F.min("look_batch_lo"),
            F.max("look_batch_hi"),
            F.min("look_date_lo"),
            F.max("look_date_hi"),
        ).first()
        if spec is None or not spec[0]:
            return None
        n, own, b_lo, b_hi, d_lo, d_hi = spec
        readings = self.spark.read.schema(transforms.READINGS_SCHEMA).parquet(self.path("readings"))
        earlier = F.col("batch").between(b_lo, b_hi) & (F.col("batch") != batch_id)
        hours = [(r["date"], r["hour"]) for r in own]
        ids = maybe.select("id")
        ids = F.broadcast(ids) if n < SMALL else ids
        found = transforms.seen_rows(
            readings.where(earlier & transforms.in_hours("date", "hour", hours)).join(
                ids, on="id", how="left_semi"
            )
        ).localCheckpoint(eager=True)
        got = found.count()
        if got < n:  # not in its own hour: a clockless node's copy, or never kept
            rest = maybe.where(F.col("must") | F.col("moved"))
            rest = rest.join(found.select("id"), on="id", how="left_anti").select("id")
            rest = rest.localCheckpoint(eager=True)
            if rest.count():  # else no date range is read at all
                more = transforms.seen_rows(
                    readings.where(earlier & F.col("date").between(d_lo, d_hi)).join(
                        F.broadcast(rest), on="id", how="left_semi"
                    )
                ).localCheckpoint(eager=True)
                found = found.unionByName(more)
                got += more.count()
        if got < n:
            lost = [
                r.id
                for r in maybe.where(F.col("must"))
                .join(found, on="id", how="left_anti")
                .limit(5)
                .collect()
            ]
            if lost:
                raise RuntimeError(
                    f"seen index: ids a run of seen_ranges claims have no copy in readings "
                    f"(e.g. {lost}); the index does not match the warehouse"
                )
        return found

    def _write_index(
        self,
        decided: DataFrame | None,
        new: DataFrame,
        exceptions: DataFrame | None,
        index: dict[str, dict[int, list[int]]],
        compact: dict[str, list[int]],
        writes: dict[str, bool],
        batch_id: int,
    ) -> None:
        """Generation ``batch_id`` of the buckets the batch kept anything in (and of those
        it compacts): the runs of the positions it kept first, and the exception rows of
        the ids that are no position and of the ids it displaced (their new kept copy,
        and the displaced one, which a replay must still see)."""
        kept = decided.where(F.col("wins")) if decided is not None else None
        fresh = kept.where(F.col("kept").isNull()) if kept is not None else new
        with_pos = fresh.select("received", "gateway", "ts", "date", "batch", f"{STREAM}.*")
        runs = seenindex.kept_runs(with_pos.where(F.col("pos").isNotNull()))
        odd = fresh.where(F.col(f"{STREAM}.pos").isNull()).drop("kept", "wins")
        rows = transforms.seen_rows(odd)
        if kept is not None:
            moved = kept.where(F.col("kept").isNotNull())
            rows = rows.unionByName(transforms.seen_rows(moved.drop("kept", "wins")))
            rows = rows.unionByName(moved.select("id", "kept.*"))
        store = self.seen
        for table, mine, prior in ((EXCEPTIONS, rows, exceptions), (RANGES, runs, None)):
            if not writes[table]:
                continue
            old = store.compacted(table, prior, index[table], compact[table], batch_id)
            out = mine if old is None else old.unionByName(mine)
            if table == EXCEPTIONS:  # a displaced row the batch wrote again: (id, batch) names it
                out = out.dropDuplicates(["id", "batch"])
            replay = any(batch_id in index[table][b] for b in compact[table])
            store.write(table, out, batch_id, replay)

    def _rollups(
        self,
        hours: list[tuple[str, int]],
        new: DataFrame,
        batch_id: int,
        emptied: bool,
        per_hour: int,
        touched: dict[tuple[str, int], set[int]],
    ) -> None:
        """Rollups of every hour the batch changed.

        ``rollup_1m`` of those hours: the minutes the batch added readings to (``touched``,
        by hour) from their readings, the hour's other minutes as ``rollup_1m`` holds them
        (a minute changes only when a reading is added to or taken from it); an hour not
        in ``touched``, or whose partition is not there, from all its readings. The batch
        that continues the fleet's last hour aggregates its own minutes, not the hour's
        (the lab fleet's hour 0: 1,732,293 readings, the batch's share 754,144).
        ``rollup_1h`` of their dates
        from those minutes, plus the dates' other hours as ``rollup_1h`` holds them (an
        hour's minutes change only when the hour is touched, so its row is what its
        minutes would give); ``rollup_1d`` from those hours. Nothing written is read
        back. ``emptied``: the batch displaced copies, so an hour (or a day) may have
        lost its last reading; its rollup partitions are deleted. ``per_hour``: the tasks
        an hour's minutes are aggregated in (``tasks_per_hour``).
        """
        if not hours:
            return
        s = self.summary
        readings = new.select(*transforms.READINGS_SCHEMA.names)
        kept: DataFrame | None = None  # the minutes of ``rollup_1m`` the batch leaves as they are
        if self._exists("readings"):
            earlier = self._table("readings", transforms.READINGS_SCHEMA, hours)
            earlier = earlier.where(F.col("batch") != batch_id)
            merged = sorted(
                (d, h) for d, h in hours if (d, h) in touched and self._has("rollup_1m", d, h)
            )
            if merged:
                mine = [(d, h, m) for d, h in merged for m in sorted(touched[(d, h)])]
                earlier = earlier.where(
                    ~transforms.in_hours("date", "hour", merged) | transforms.in_minutes("ts", mine)
                )
                kept = self._table("rollup_1m", transforms.ROLLUP_1M_SCHEMA, merged).where(
                    ~transforms.in_minutes("window_start", mine)
                )
            readings = earlier.unionByName(readings)
        dates = sorted({d for d, _ in hours})
        # By hour (and part, a key of the aggregate too), so the minutes are aggregated
        # where they are and written a file per hour and part.
        minutes = transforms.rollup_minutes(spread_hours(readings, per_hour), PART)
        if kept is not None:
            # Checkpointed, not cached: the write below replaces what ``kept`` reads, and
            # Spark drops a cache that reads a path it writes (the days would then be
            # aggregated from the minutes again).
            minutes = minutes.unionByName(kept.select(*minutes.columns)).localCheckpoint(
                eager=False
            )
        else:
            minutes = minutes.persist()
        by_hour = transforms.rollup_up(minutes, "hour")
        try:
            minutes.write.mode("overwrite").partitionBy("date", "hour").parquet(
                self.path("rollup_1m")
            )
            if self._exists("rollup_1h"):
                hourly = self._table("rollup_1h", transforms.ROLLUP_DAY_SCHEMA, dates=dates)
                by_hour = transforms.other_hours(hourly, hours).unionByName(by_hour)
            lost = [d for d in dates if not self._has("rollup_1h", d) and self._has("rollup_1m", d)]
            if lost:
                # A date a killed overwrite of rollup_1h deleted, or a new one: its other
                # hours from their minutes (rollup_1m's write above replaced only the
                # batch's hours).
                finer = self._table("rollup_1m", transforms.ROLLUP_1M_SCHEMA, dates=lost)
                finer = finer.where(~transforms.in_hours("date", "hour", hours))
                by_hour = transforms.rollup_up(finer, "hour").unionByName(by_hour)
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

    def _drop_compacted(
        self, table: str, index: dict[int, list[int]], compact: list[int], batch_id: int
    ) -> None:
        """Delete the generations the batch compacted (at the end: nothing reads them now)."""
        self.seen.drop(table, index, compact, batch_id)

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
            df = df.where(transforms.in_hours("date", "hour", hours))
        elif dates is not None:
            df = df.where(F.col("date").isin(dates))
        return df

    def _has(self, table: str, date: str, hour: int | None = None) -> bool:
        """Whether a rollup holds the partition of a date (or of an hour of it): a run
        killed while it replaced the partition may have deleted it (an overwrite deletes
        a partition, then renames the new one in), and then its rows are built again
        from the finer table."""
        part = f"{self.path(table)}/date={date}" + ("" if hour is None else f"/hour={hour}")
        return path_exists(self.spark, part)

    def _delete(self, path: str) -> None:
        delete_path(self.spark, path)

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


# A batch this large spreads an hour over several tasks when it has fewer hours than the
# cluster has cores. Below it, a file per hour: on small batches files cost more than rows.
SPREAD_ROWS = 200_000
PART = "_part"  # an hour's part: a column of the origin and sensor, never written
# A first copy's stream position (``seenindex.stream_position``), never written
STREAM = "_stream"


def tasks_per_hour(cores: int, hours: int, rows: int) -> int:
    """Tasks an hour's readings are written and aggregated in.

    A task per hour lets the hours' sizes, not the cores, set the time: a batch that
    continues the fleet's last hour and opens the next one has two hours, one large
    (1.7M readings at 10,000 streams, against 0.3M) and one core idle. Two tasks per
    core in all, so that uneven hours still even out."""
    if rows < SPREAD_ROWS or hours <= 0:
        return 1
    return max(1, -(-2 * cores // hours))


def spread_hours(readings: DataFrame, per_hour: int) -> DataFrame:
    """``readings`` by (``date``, ``hour``, ``PART``): ``per_hour`` parts of an hour, each
    an origin and sensor's readings whole (the rollups group by them)."""
    part = F.pmod(F.xxhash64("origin", "sensor"), F.lit(per_hour)) if per_hour > 1 else F.lit(0)
    return readings.withColumn(PART, part).repartition("date", "hour", PART)


def _placement(df: DataFrame, decided: bool) -> list[Any]:
    """Rows kept per (date, hour, minute), and per partition of the copy each displaces (if any);
    ``odd``: how many of them are no stream position (their index rows are exceptions)."""
    odd = F.count_if(F.col(f"{STREAM}.pos").isNull()).alias("odd")
    minute = F.minute("ts").alias("minute")
    if not decided:
        none = F.lit(None)
        return (
            df.groupBy("date", "hour", minute)
            .agg(F.count(F.lit(1)).alias("n"), odd)
            .select("*", none.alias("kept_date"), none.alias("kept_hour"), none.alias("kept_batch"))
            .collect()
        )
    return (
        df.where(F.col("wins"))
        .groupBy(
            "date",
            "hour",
            minute,
            F.col("kept.date").alias("kept_date"),
            F.col("kept.hour").alias("kept_hour"),
            F.col("kept.batch").alias("kept_batch"),
        )
        .agg(F.count(F.lit(1)).alias("n"), odd)
        .collect()
    )


def run(
    landing: str, warehouse: str, master: str | None = None, driver_memory: str | None = None
) -> RunSummary:
    spark = spark_session(master, driver_memory=driver_memory)
    summary = Pipeline(spark, landing, warehouse).run()
    # The gateways' status messages: gateway_health (issue 15).
    summary.gateway_health = update_health(spark, landing, warehouse).line()
    return summary
