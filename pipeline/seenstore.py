"""Where the seen index lives: its two tables in buckets and generations, and the
one-time conversion of a warehouse written before it.

``seen_ranges`` (pipeline/seenindex.py: a stream's kept positions as runs, by
``bucket`` of the stream) and ``seen_exceptions`` (one row per id: ids that are no
stream position, and the kept and the displaced copy of every id whose first
kept copy was displaced; ``transforms.SEEN_SCHEMA``, by ``bucket`` of the id)
share one layout: ``{table}/bucket=B/gen=G``, a generation being what batch ``G``
wrote in the bucket: its own rows, and when it compacted the bucket, the older
generations' rows too (merged, for the ranges). A batch reads every generation
of the buckets it touches, without its own rows (a replay decides as its first
attempt did), and deletes the generations it compacted last.

A warehouse written before the ranges has ``seen_ids``: one row per kept copy
(``transforms.SEEN_SCHEMA``). ``migrate`` converts it once, before any batch: the
ids that are stream positions become runs (the first row of each id; the rows
of the last batch ``B`` in runs of their own, so that a replay of ``B`` left
unfinished by the old version still sees the index without them; a position is
in the run of the batch that kept it first), the others,
and every row of an id with more than one (a displacement), exceptions; both
written as generation ``B``, then ``seen_ids`` is deleted. Killed before the
delete, the next run converts again and overwrites the same partitions.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from . import seenindex, transforms
from .generations import Generations
from .sparkenv import delete_path, hadoop_path

RANGES = "seen_ranges"
EXCEPTIONS = "seen_exceptions"
LEGACY = "seen_ids"
_SCHEMAS = {RANGES: seenindex.RANGES_SCHEMA, EXCEPTIONS: transforms.SEEN_SCHEMA}


class SeenStore:
    def __init__(self, spark: SparkSession, warehouse: str) -> None:
        self.spark = spark
        self.wh = warehouse.rstrip("/")

    def path(self, table: str) -> str:
        return f"{self.wh}/{table}"

    def _gens(self, table: str) -> Generations:
        return Generations(self.spark, self.path(table))

    def generations(self, table: str) -> dict[int, list[int]]:
        """Bucket -> its generations on disk (the batches that wrote them), oldest first."""
        return self._gens(table).on_disk()

    def _read(self, table: str, paths: list[str]) -> DataFrame:
        return (
            self.spark.read.schema(_SCHEMAS[table])
            .option("basePath", self.path(table))
            .parquet(*paths)
        )

    def read(
        self, table: str, index: dict[int, list[int]], buckets: list[int], batch_id: int
    ) -> DataFrame | None:
        """Every generation of the given buckets, without this batch's own rows."""
        paths = [f"{self.path(table)}/bucket={b}" for b in buckets if b in index]
        if not paths:
            return None
        df = self._read(table, paths)
        if table == RANGES:  # a compaction in batch k merges only runs of earlier batches
            return df.where(F.col("batch_hi") < batch_id).select(*seenindex.RANGE_COLUMNS)
        return df.where(F.col("batch") != batch_id).select(*transforms.SEEN_COLUMNS)

    @staticmethod
    def to_compact(
        index: dict[int, list[int]], buckets: list[int], batch_id: int, limit: int
    ) -> list[int]:
        """The batch's buckets it rewrites whole: those with ``limit`` generations already,
        and on a replay those it wrote before it was killed (a whole bucket is never
        overwritten with the batch's rows alone: the older generations may be gone)."""
        return [
            b for b in buckets if b in index and (len(index[b]) >= limit or batch_id in index[b])
        ]

    def compacted(
        self,
        table: str,
        prior: DataFrame | None,
        index: dict[int, list[int]],
        compact: list[int],
        batch_id: int,
    ) -> DataFrame | None:
        """The rows of the generations a batch compacts, as the compacted generation holds
        them (without the batch's own). ``prior``: what ``read`` gave for the exceptions
        (the ranges are read here: on a replay, not every generation is a source)."""
        if not compact:
            return None
        if table == EXCEPTIONS:
            if prior is None:
                return None
            # After a kill a compacted generation and the ones it replaced may both be
            # there: an id is kept at most once per batch, so (id, batch) names a row.
            return prior.where(F.col("bucket").isin(compact)).dropDuplicates(["id", "batch"])
        root = self.path(table)
        merged_here: set[int] = set()
        replayed = [b for b in compact if batch_id in index[b]]
        if replayed:
            # A replay whose first attempt compacted: its generation holds every older
            # one's runs (written whole before any was deleted), and some of those may be
            # gone or not; it alone is the source, or a run would be counted twice.
            mine = self._read(table, [f"{root}/bucket={b}/gen={batch_id}" for b in replayed])
            merged_here = {
                int(r.bucket)
                for r in mine.where(F.col("batch_hi") < batch_id)
                .select("bucket")
                .distinct()
                .collect()
            }
        paths = []
        for b in compact:
            if b in merged_here:
                paths.append(f"{root}/bucket={b}/gen={batch_id}")
            else:
                paths += [f"{root}/bucket={b}/gen={g}" for g in index[b] if g != batch_id]
        if not paths:
            return None
        old = self._read(table, paths).where(F.col("batch_hi") < batch_id)
        return seenindex.merge_runs(old.select(*seenindex.RANGE_COLUMNS))

    def write(self, table: str, rows: DataFrame, batch_id: int, replay: bool) -> None:
        """Generation ``batch_id`` of each bucket in ``rows`` (``replay``: the batch wrote
        some before it was killed; they are replaced)."""
        self._gens(table).write(rows, batch_id, replay)

    def drop(
        self, table: str, index: dict[int, list[int]], compact: list[int], batch_id: int
    ) -> None:
        """Delete the generations a batch compacted (at its end: nothing reads them now)."""
        self._gens(table).drop(index, compact, batch_id)

    # ------------------------------------------------------------ the old index

    def migrate(self) -> int:
        """Convert ``seen_ids`` (before issue 27) into the two tables; the rows read."""
        fs, p = hadoop_path(self.spark, self.path(LEGACY))
        if not fs.exists(p):
            return 0
        old = self.spark.read.schema(transforms.SEEN_SCHEMA).parquet(self.path(LEGACY))
        old = old.select(*transforms.SEEN_COLUMNS).localCheckpoint(eager=True)
        top = old.agg(F.max("batch"), F.count(F.lit(1))).first()
        if top is None or top[0] is None:
            delete_path(self.spark, self.path(LEGACY))
            return 0
        last, n = int(top[0]), int(top[1])
        # A position stays in the run of the batch that kept it first: a displacement is
        # an exception, and a replay of the last batch must still find the position
        # claimed when it leaves that batch's runs out.
        per_id = old.groupBy("id").agg(
            F.min_by(F.struct(*[c for c in transforms.SEEN_COLUMNS if c != "id"]), "batch").alias(
                "k"
            ),
            F.count(F.lit(1)).alias("copies"),
        )
        with_pos = per_id.select("id", "k", "copies", *seenindex.stream_position(F.col("id")))
        kept = with_pos.where(F.col("pos").isNotNull()).select(
            *seenindex.KEY,
            "pos",
            F.col("k.received").alias("received"),
            F.col("k.gateway").alias("gateway"),
            # seen_ids has no ts: its hour bounds it
            F.timestamp_seconds(
                F.unix_timestamp(F.to_timestamp(F.col("k.date"))) + F.col("k.hour") * 3600
            ).alias("ts"),
            F.col("k.date").alias("date"),
            F.col("k.batch").alias("batch"),
        )
        runs = None
        for part in (kept.where(F.col("batch") < last), kept.where(F.col("batch") == last)):
            built = seenindex.build_runs(seenindex.position_segments(part))
            runs = built if runs is None else runs.unionByName(built)
        exceptions = old.join(
            with_pos.where(F.col("pos").isNull() | (F.col("copies") > 1)).select("id"),
            on="id",
            how="left_semi",
        )
        if runs is not None:
            self.write(RANGES, _hour_bounds(runs), last, replay=True)
        self.write(EXCEPTIONS, exceptions, last, replay=True)
        delete_path(self.spark, self.path(LEGACY))
        return n


def _hour_bounds(runs: DataFrame) -> DataFrame:
    """A converted run's ``ts_hi``: the end of its last hour (its ``ts_lo`` is the start of
    its first: seen_ids kept the hour, not the time)."""
    return runs.withColumn("ts_hi", F.col("ts_hi") + F.expr("INTERVAL 3599.999999 SECONDS"))
