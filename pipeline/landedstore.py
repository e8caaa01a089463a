"""``landed``: the positions each batch landed, as ranges (``completeness.LANDED_SCHEMA``),
kept as ``{root}/bucket=B/day=D/gen=G`` (``D``: ``completeness.day_of`` of the range's
hour). Batch ``G`` appends what it landed as generation ``G`` of each bucket and day it
landed in; a bucket's day with ``max_generations`` is compacted when a batch next lands
in it (``completeness.owned_ranges`` of all of them and the batch's, appended as ``G``,
the older generations deleted after the batch), so a day's files and rows follow its
streams and hours, and a day no batch lands in again is never rewritten: what a batch
writes follows the days it lands in, not the history.

Only each position's hour counts, and it is the least over every range holding it, so
owning is idempotent and associative: ranges owned within a day, a killed append read
back beside the older generations, a replay that appends its ranges to its own again,
or a compaction in steps give the same positions and hours once owned together.

Two layouts before this one are converted by the first batch that finds them (both are
owned and appended as the newest generation they held, then deleted; killed before the
delete, converted again: the same ranges twice): ``landed/batch=N`` (until session 25)
and ``landed/bucket=B/gen=G`` (sessions 25 to 27).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from . import completeness as C
from .sparkenv import delete_path, hadoop_path

# A bucket's days -> each one's generations (the batches that wrote them), oldest first.
OnDisk = dict[int, dict[str, list[int]]]


class LandedStore:
    # A bucket's day gets a generation per batch that lands anything in it; one that has
    # this many is compacted into one when a batch next lands in it.
    max_generations = 8

    def __init__(self, spark: SparkSession, root: str) -> None:
        self.spark = spark
        self.root = root.rstrip("/")

    def path(self, bucket: int, day: str, gen: int) -> str:
        return f"{self.root}/bucket={bucket}/day={day}/gen={gen}"

    def on_disk(self) -> OnDisk:
        gens: OnDisk = {}
        for p in self._dirs("/bucket=*/day=*/gen=*"):
            day_dir = p.getParent()
            b = int(day_dir.getParent().getName().removeprefix("bucket="))
            day = day_dir.getName().removeprefix("day=")
            gens.setdefault(b, {}).setdefault(day, []).append(int(p.getName().removeprefix("gen=")))
        for days in gens.values():
            for gen_list in days.values():
                gen_list.sort()
        return gens

    def read(self, on_disk: OnDisk, buckets: list[int]) -> DataFrame | None:
        """Every range of ``buckets`` on disk (``None``: none)."""
        paths = [
            self.path(b, day, g)
            for b in buckets
            for day, gens in sorted(on_disk.get(b, {}).items())
            for g in gens
        ]
        return self._read(paths)

    def read_days(self, on_disk: OnDisk, days: list[tuple[int, str]]) -> DataFrame | None:
        """Every range of the (bucket, day) pairs ``days`` on disk (``None``: none)."""
        paths = [self.path(b, d, g) for b, d in days for g in on_disk.get(b, {}).get(d, [])]
        return self._read(paths)

    def append(
        self, mine: DataFrame, landed_in: set[tuple[int, str]], on_disk: OnDisk, batch_id: int
    ) -> set[tuple[int, str]]:
        """Append the batch's ranges (``mine``: with ``bucket`` and ``day``; ``landed_in``:
        their (bucket, day) pairs) as generation ``batch_id``, each bucket's day that has
        ``max_generations`` compacted with them (read again: a day's, not the bucket's
        history). The bucket days compacted (their older generations are for ``drop``
        after the batch)."""
        limit = self.max_generations
        compact = {(b, d) for b, d in landed_in if len(on_disk.get(b, {}).get(d, [])) >= limit}
        out = mine
        if compact:
            due = self.spark.createDataFrame(sorted(compact), "bucket int, day string")
            pairs = F.broadcast(due)
            paths = [self.path(b, d, g) for b, d in sorted(compact) for g in on_disk[b][d]]
            days = self._read(paths)
            assert days is not None
            new = mine.join(pairs, ["bucket", "day"], "left_semi").select(*C.LANDED_COLUMNS)
            owned = by_day(C.owned_ranges(days.unionByName(new)).drop("_after"))
            out = owned.unionByName(mine.join(pairs, ["bucket", "day"], "left_anti"))
        # Appended, a replay's too: an overwrite deletes a partition before it renames
        # the new one in, and a kill between would lose a day's only ranges.
        self._write(out, batch_id)
        return compact

    def drop(self, on_disk: OnDisk, compacted: set[tuple[int, str]], keep: int) -> None:
        """Delete the generations of the ``compacted`` bucket days other than ``keep``."""
        for b, day in sorted(compacted):
            for g in on_disk.get(b, {}).get(day, []):
                if g != keep:
                    delete_path(self.spark, self.path(b, day, g))

    def convert(self) -> None:
        """The layouts before this one, owned and appended as their newest generation."""
        for pattern, name in (("/batch=*", "batch="), ("/bucket=*/gen=*", "gen=")):
            old = self._dirs(pattern)
            if not old:
                continue
            rows = self._read([p.toString() for p in old])
            assert rows is not None
            last = max(int(p.getName().removeprefix(name)) for p in old)
            self._write(by_day(C.owned_ranges(rows).drop("_after")), last)
            for p in old:
                delete_path(self.spark, p.toString())

    def _dirs(self, pattern: str) -> list[Any]:
        fs, glob = hadoop_path(self.spark, self.root + pattern)
        return [st.getPath() for st in fs.globStatus(glob) or [] if st.isDirectory()]

    def _read(self, paths: list[str]) -> DataFrame | None:
        if not paths:
            return None
        read = self.spark.read.schema(C.LANDED_SCHEMA).option("basePath", self.root)
        return read.parquet(*paths).select(*C.LANDED_COLUMNS)

    def _write(self, rows: DataFrame, gen: int) -> None:
        # What a killed append left uncommitted under _temporary must not join this one.
        delete_path(self.spark, f"{self.root}/_temporary")
        out = rows.withColumn("gen", F.lit(gen).cast("long")).repartition("bucket", "day")
        out.write.mode("append").partitionBy("bucket", "day", "gen").parquet(self.root)


def by_day(ranges: DataFrame) -> DataFrame:
    """``ranges`` (``LANDED_SCHEMA``) with the ``bucket`` and ``day`` they are kept under."""
    keyed = ranges.withColumn("bucket", C.bucket(F.col("gateway")))
    return keyed.withColumn("day", C.day_of(F.col("t")))


@dataclass(frozen=True)
class View:
    """What a batch reads of ``landed``: the ranges on disk when it began (``on_disk``)
    of ``buckets``, and its own (``mine``, ``LANDED_SCHEMA``); ``spans``: a row per
    stream and day of all of them (pipeline/landedhull.py; ``None``: not read)."""

    store: LandedStore
    on_disk: OnDisk
    buckets: list[int]
    mine: DataFrame
    spans: DataFrame | None = None
    compacted: set[tuple[int, str]] = field(default_factory=set)  # for ``drop`` at the end

    def all(self) -> DataFrame:
        return self._with_mine(self.store.read(self.on_disk, self.buckets))

    def on(self, days: list[tuple[int, str]]) -> DataFrame:
        """The ranges of the (bucket, day) pairs ``days`` (and every one of the batch's)."""
        return self._with_mine(self.store.read_days(self.on_disk, days))

    def _with_mine(self, old: DataFrame | None) -> DataFrame:
        return self.mine if old is None else old.unionByName(self.mine)
