"""``landed_hull``: per stream and day, the span of the positions its ranges of that day
hold (the least ``lo``, the greatest ``hi``), so that a batch reads of ``landed`` only
the days that can matter to it (pipeline/completedelta.py says which), not its history.

A row per stream and day is a twenty-fourth of ``landed``'s (a range per stream and
hour). It is kept by bucket and generation (pipeline/generations.py): batch ``G``
appends the spans of what it landed as generation ``G`` of its buckets *before* it
appends the ranges to ``landed``, so the spans are never narrower than the ranges on
disk. They must not be wider either when a batch judges from them (a span's last
position stands for a landed one: ``completedelta.floors``): a batch killed between
the two leaves its spans without its ranges, and its replay (the same files, from the
stream's offset log) lands the same ranges, which it reads with the spans; a
bucket with ``max_generations`` is compacted (spans of spans) when a batch next lands
in it. Spans of spans are the spans: a row read twice, or compacted in steps, changes
nothing. Until ``_built`` is in it, the table is built from every range of ``landed``.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from . import completeness as C
from .generations import Generations
from .sparkenv import path_exists, touch

HULL_SCHEMA = StructType(
    [
        StructField("gateway", StringType(), False),
        StructField("stream", StringType(), False),
        StructField("day", StringType(), False),
        StructField("lo", LongType(), False),
        StructField("hi", LongType(), False),
    ]
)
HULL_COLUMNS = HULL_SCHEMA.names
BUILT = "_built"


def spans(rows: DataFrame) -> DataFrame:
    """Per (gateway, stream, day) the span of ``rows``: ranges (``LANDED_SCHEMA``, their day
    ``completeness.day_of`` of ``t``) or spans (``HULL_SCHEMA``), with ``bucket``."""
    if "day" not in rows.columns:
        rows = rows.withColumn("day", C.day_of(F.col("t")))
    out = rows.groupBy("gateway", "stream", "day").agg(
        F.min("lo").alias("lo"), F.max("hi").alias("hi")
    )
    return out.withColumn("bucket", C.bucket(F.col("gateway")))


class LandedHull:
    # A bucket gets a generation per batch that lands in it; one that has this many is
    # compacted into one when a batch next lands in it.
    max_generations = 8

    def __init__(self, spark: SparkSession, root: str) -> None:
        self.spark = spark
        self.root = root.rstrip("/")
        self.gens = Generations(spark, self.root)

    def built(self) -> bool:
        return path_exists(self.spark, f"{self.root}/{BUILT}")

    def read(self, on_disk: dict[int, list[int]], buckets: list[int]) -> DataFrame | None:
        paths = [self.gens.path(b, g) for b in sorted(buckets) for g in on_disk.get(b, [])]
        if not paths:
            return None
        read = self.spark.read.schema(HULL_SCHEMA).option("basePath", self.root)
        return read.parquet(*paths).select(*HULL_COLUMNS)

    def current(
        self, on_disk: dict[int, list[int]], buckets: list[int], mine: DataFrame
    ) -> DataFrame:
        """Every span of ``buckets``: those on disk and those of ``mine`` (spans)."""
        every = mine.select(*HULL_COLUMNS)
        old = self.read(on_disk, buckets)
        if old is not None:
            every = old.unionByName(every)
        return spans(every)

    def append(
        self,
        mine: DataFrame,
        every: DataFrame,
        on_disk: dict[int, list[int]],
        buckets: set[int],
        batch_id: int,
    ) -> set[int]:
        """Append ``mine`` (the batch's spans, with ``bucket``; ``buckets``: theirs) as
        generation ``batch_id`` of their buckets, those with ``max_generations`` compacted
        (``every``: their spans, ``current``'s). The buckets compacted (their older
        generations are for ``drop`` after the batch)."""
        compact = {b for b in buckets if len(on_disk.get(b, [])) >= self.max_generations}
        out = mine
        if compact:
            out = every.where(F.col("bucket").isin(*compact)).unionByName(
                mine.where(~F.col("bucket").isin(*compact))
            )
        self.gens.write(out, batch_id, replay=False)
        return compact

    def build(self, landed: DataFrame, batch_id: int) -> DataFrame:
        """Every span of ``landed`` (every range of every bucket, the batch's included),
        written as generation ``batch_id``, then ``_built``."""
        every = spans(landed).localCheckpoint(eager=True)
        self.gens.write(every, batch_id, replay=False)
        touch(self.spark, f"{self.root}/{BUILT}")
        return every

    def drop(self, on_disk: dict[int, list[int]], compacted: set[int], keep: int) -> None:
        self.gens.drop(on_disk, compacted, keep)
