"""Spark as the pipeline's commands use it: the session with the pipeline's settings,
and the warehouse's and landing zone's files through Hadoop's file system (so a
cluster URL, hdfs:// or s3a://, works as a local path does).

Apart from pipeline/job.py so that the jobs beside it (pipeline/health.py, the
report) use them without importing the readings job, which runs them.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

SMALL = 2_000_000  # rows a join hint broadcasts (a checkpoint's size is not known to Spark)


def broadcast_if_small(df: DataFrame) -> DataFrame:
    """``df`` (checkpointed: counting it is cheap) hinted for a broadcast join if it is small."""
    return F.broadcast(df) if df.count() < SMALL else df


def path_exists(spark: SparkSession, path: str) -> bool:
    """Through Hadoop's file system, so a cluster URL (hdfs://, s3a://) works as a local path."""
    fs, p = hadoop_path(spark, path)
    return bool(fs.exists(p))


def delete_path(spark: SparkSession, path: str) -> None:
    """Delete a file or folder (recursively) through Hadoop's file system; nothing if absent."""
    fs, p = hadoop_path(spark, path)
    fs.delete(p, True)


def touch(spark: SparkSession, path: str) -> None:
    """An empty file at ``path`` (a marker), through Hadoop's file system."""
    fs, p = hadoop_path(spark, path)
    fs.create(p, True).close()


def hadoop_path(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """Hadoop's file system for ``path``, and the path as Hadoop's ``Path`` (py4j objects)."""
    jvm: Any = spark._jvm
    conf = spark._jsc.hadoopConfiguration()
    p = jvm.org.apache.hadoop.fs.Path(path)
    return p.getFileSystem(conf), p


def spark_session(
    master: str | None = None,
    app: str = "pubcomp-pipeline",
    driver_memory: str | None = None,
    java_options: str | None = None,
) -> SparkSession:
    """``driver_memory`` (e.g. ``4g``): the driver's heap, which in local mode is every
    task's too. Spark's 1 GB default runs out on a backlog of several million lines
    landing on an existing warehouse. ``java_options``: the driver JVM's (the demo's
    short run stops at the first compiler: devkit/sparkconf.py). Both shape the JVM, so
    they count only when this process starts one (the first session)."""
    builder = SparkSession.builder.appName(app)
    if master:
        builder = builder.master(master)
    if driver_memory:
        builder = builder.config("spark.driver.memory", driver_memory)
    if java_options:
        builder = builder.config("spark.driver.extraJavaOptions", java_options)
    return (
        builder.config("spark.sql.session.timeZone", "UTC")
        # PySpark 4 records the Python call site of every column function for its error
        # messages: an inspected stack and five JVM round trips each. A batch builds
        # thousands of columns; off, F.col took 0.3 ms instead of 1.0 and six pipeline
        # tests 215 s instead of 234 (2026-12-01). Errors still name the unresolved column
        # and print the plan.
        .config("spark.python.sql.dataFrameDebugging.enabled", "false")
        .config("spark.sql.sources.partitionOverwriteMode", "dynamic")
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
