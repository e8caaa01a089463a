"""A table kept as ``{root}/bucket=B/gen=G``: a generation is what batch ``G`` wrote in
bucket ``B``. The seen index (pipeline/seenstore.py), the ledgers' state
(pipeline/completejob.py) and the spans of ``landed`` (pipeline/landedhull.py) are kept
so: a batch writes a generation of the buckets it touched, and the generations it
replaced are deleted only after it, so a kill leaves the older rows beside the newer,
never neither.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from .sparkenv import delete_path, hadoop_path


class Generations:
    def __init__(self, spark: SparkSession, root: str) -> None:
        self.spark = spark
        self.root = root.rstrip("/")

    def path(self, bucket: int, gen: int | None = None) -> str:
        where = f"{self.root}/bucket={bucket}"
        return where if gen is None else f"{where}/gen={gen}"

    def on_disk(self) -> dict[int, list[int]]:
        """Bucket -> its generations on disk (the batches that wrote them), oldest first."""
        fs, pattern = hadoop_path(self.spark, self.root + "/bucket=*/gen=*")
        gens: dict[int, list[int]] = {}
        for st in fs.globStatus(pattern) or []:
            if st.isDirectory():
                p = st.getPath()
                bucket = int(p.getParent().getName().removeprefix("bucket="))
                gens.setdefault(bucket, []).append(int(p.getName().removeprefix("gen=")))
        return {b: sorted(g) for b, g in gens.items()}

    def write(self, rows: DataFrame, gen: int, replay: bool) -> None:
        """Generation ``gen`` of each bucket in ``rows`` (a ``bucket`` column)."""
        write = (
            rows.withColumn("gen", F.lit(gen).cast("long"))
            .repartition("bucket")
            .write.partitionBy("bucket", "gen")
        )
        if replay:  # generation gen is there: replaced, partition by partition
            write.mode("overwrite").parquet(self.root)
            return
        # No generation gen anywhere yet, so nothing to replace: appended, which spares
        # the dynamic overwrite's staging and a rename per bucket in the driver (and an
        # overwrite deletes a partition before it renames the new one in). What a killed
        # append left half-committed is a generation gen: its replay takes the branch
        # above, or reads it as one more generation. What it left uncommitted under
        # _temporary must not join this job's output.
        delete_path(self.spark, f"{self.root}/_temporary")
        write.mode("append").parquet(self.root)

    def drop(self, index: dict[int, list[int]], buckets: list[int] | set[int], keep: int) -> None:
        """Delete the generations of ``buckets`` in ``index`` other than ``keep``."""
        for b in sorted(buckets):
            for g in index.get(b, []):
                if g != keep:
                    delete_path(self.spark, self.path(b, g))
