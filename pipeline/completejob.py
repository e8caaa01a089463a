"""A batch's records and completeness written to the warehouse (pipeline/completeness.py's
rules; called by pipeline/job.py for each batch, after its readings).

Tables (Parquet, dynamic partition overwrite, so a replayed batch rewrites only itself):

- ``records`` and ``ledger`` (by batch): the batch's records whose id no earlier batch
  kept (a replay reads the earlier batches only, and writes the same rows again);
- ``landed`` (by batch): the positions the batch landed, as ranges;
- ``completeness`` and ``completeness_gaps`` (by bucket of the gateway): recomputed for
  every gateway in the buckets the batch touched, from ``landed`` and ``ledger``.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from . import completeness as C
from .sparkenv import hadoop_path, path_exists

TABLES = ("records", "ledger", "landed", "completeness", "completeness_gaps")


class CompletenessTables:
    def __init__(self, spark: SparkSession, warehouse: str) -> None:
        self.spark = spark
        self.wh = warehouse.rstrip("/")

    def path(self, table: str) -> str:
        return f"{self.wh}/{table}"

    def _earlier(self, table: str, schema: object, batch_id: int) -> DataFrame | None:
        if not path_exists(self.spark, self.path(table)):
            return None
        df = self.spark.read.schema(schema).parquet(self.path(table))  # type: ignore[arg-type]
        return df.where(F.col("batch") != batch_id)

    def batch(self, parsed: DataFrame, batch_id: int, n_records: int, buckets: list[int]) -> None:
        """``parsed``: the batch's lines (``transforms.parse_landing``, cached by the job);
        ``n_records``: how many of them are good records; ``buckets``: the buckets of
        their gateways (``completeness.bucket``)."""
        if n_records:
            self._records(parsed, batch_id)
        C.landed_ranges(parsed, batch_id).write.mode("overwrite").partitionBy("batch").parquet(
            self.path("landed")
        )
        if buckets:
            self._recompute(buckets)

    def _records(self, parsed: DataFrame, batch_id: int) -> None:
        kept = C.kept_records(parsed, batch_id).localCheckpoint(eager=True)
        for table, schema in (("records", C.RECORDS_SCHEMA), ("ledger", C.LEDGER_SCHEMA)):
            earlier = self._earlier(table, schema, batch_id)
            new = kept if earlier is None else kept.join(earlier.select("id"), "id", "left_anti")
            if table == "ledger":
                ledger = C.ledger_records(new).localCheckpoint(eager=True)
                rows = C.ledger_rows(ledger)
            else:
                rows = new.where(F.col("sensor") != C.LEDGER_SENSOR)
                rows = rows.select(*C.RECORDS_SCHEMA.names)
            # A batch with none writes nothing (an overwrite with no rows leaves the
            # partition of a replay as it was: the same rows).
            rows.coalesce(1).write.mode("overwrite").partitionBy("batch").parquet(self.path(table))

    def _recompute(self, buckets: list[int]) -> None:
        """Every stream of the gateways in ``buckets``: both tables' partitions of them."""
        spark = self.spark
        mine = C.bucket(F.col("gateway")).isin(buckets)
        landed = spark.read.schema(C.LANDED_SCHEMA).parquet(self.path("landed")).where(mine)
        ledger = self._earlier("ledger", C.LEDGER_SCHEMA, -1)
        if ledger is None:
            ledger = spark.createDataFrame([], C.LEDGER_SCHEMA)
        ledger = ledger.where(mine)
        # Materialised once: the table below is built from them, not from their plan
        # (joins and windows over every stream of the buckets) again.
        gaps = C.missing_ranges(landed, ledger).localCheckpoint(eager=True)
        table = C.hourly(landed, ledger, gaps)
        # The buckets' old gaps go first: a bucket with none left would keep them (an
        # overwrite with no rows writes nothing). A crash before the write is replayed.
        for b in buckets:
            fs, p = hadoop_path(spark, f"{self.path('completeness_gaps')}/bucket={b}")
            fs.delete(p, True)
        gaps.repartition("bucket").write.mode("overwrite").partitionBy("bucket").parquet(
            self.path("completeness_gaps")
        )
        table.repartition("bucket").write.mode("overwrite").partitionBy("bucket").parquet(
            self.path("completeness")
        )
