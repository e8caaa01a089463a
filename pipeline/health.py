"""``gateway_health``: the gateways' status messages (``_status/`` in the landing zone).

Two tables beside the readings, updated by ``pubcomp pipeline run`` after them:

- ``gateway_health``: one row per gateway, its newest status (by the time the
  ingest received it; a gateway's own clock may be wrong). When the newest is
  an offline message (a Will carries no figures), the figures are those of
  its newest online status (``facts_ts``, ``facts_received``);
- ``gateway_health_1m`` (by date): per gateway and minute of receipt, the
  highest backlog and oldest-reading age, the lowest disk free, and the state
  at the minute's last status (online, uplink, clock, verdict).

Incremental like the readings (a file stream with its own checkpoint,
``_checkpoint_health``) and idempotent: a replayed batch merges into both
tables to the same rows (maxima, minima and the last status are the same
however often a message is counted). A message landed twice (a retained copy,
a QoS 1 resend) has the same ``id``: within a batch it counts once, across
batches it changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, Row, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from pubcomp.sync.gatewaystatus import OnlineStatus

from .fleet import Facts, GatewayView, fact_paths
from .sparkenv import path_exists
from .sparktypes import struct_of

log = logging.getLogger(__name__)

STATUS_DIR = "_status"
LATEST = "gateway_health"
MINUTES = "gateway_health_1m"
CHECKPOINT = "_checkpoint_health"

# A landed status line: the gateway-status.v1 message (an online one holds every field an
# offline one does) plus ``received``, derived from the message's model.
STATUS_LINE_SCHEMA = StructType(
    [*struct_of(OnlineStatus).fields, StructField("received", StringType())]
)

_TS = TimestampType()
# The figures of an online status (null in an offline message's row): pipeline/fleet.py's
# Facts, each a column, filled from its place in the message (``FACT_PATHS``).
FACTS = struct_of(Facts)
FACT_PATHS = fact_paths()
_S, _L, _D, _B = StringType(), LongType(), DoubleType(), BooleanType()
LATEST_SCHEMA = StructType(
    [
        StructField("gateway", _S, False),
        StructField("fleet", _S),
        StructField("id", _S),
        StructField("online", _B),
        StructField("reason", _S),
        StructField("ts", _TS),
        StructField("received", _TS),
        StructField("version", _S),
        StructField("started", _TS),
        StructField("facts_ts", _TS),
        StructField("facts_received", _TS),
        *FACTS.fields,
    ]
)
MINUTES_SCHEMA = StructType(
    [
        StructField("gateway", _S, False),
        StructField("minute", _TS, False),
        StructField("backlog_max", _L),
        StructField("oldest_age_max_s", _D),
        StructField("disk_free_min", _L),
        StructField("last_received", _TS),
        StructField("last_id", _S),
        StructField("online", _B),
        StructField("uplink_state", _S),
        StructField("backlog_last", _L),
        StructField("clock_synced", _B),
        StructField("level", _S),
        StructField("date", _S, False),
    ]
)


def _time(c: Column) -> Column:
    return F.to_timestamp(c)


def parse_statuses(lines: DataFrame) -> DataFrame:
    """Landed lines as flat rows (``LATEST_SCHEMA``'s columns, facts null when offline),
    one per message ``id`` (its first receipt)."""
    on = F.col("online")

    def fact(c: Column) -> Column:
        return F.when(on, c)

    rows = lines.where(F.col("gateway").isNotNull() & F.col("id").isNotNull()).select(
        "gateway",
        "fleet",
        "id",
        "online",
        "reason",
        _time(F.col("ts")).alias("ts"),
        _time(F.col("received")).alias("received"),
        "version",
        _time(F.col("started")).alias("started"),
        fact(_time(F.col("ts"))).alias("facts_ts"),
        fact(_time(F.col("received"))).alias("facts_received"),
        *(fact(F.col(path)).alias(name) for name, path in FACT_PATHS.items()),
    )
    first = Window.partitionBy("id").orderBy(F.col("received").asc_nulls_last())
    return (
        rows.withColumn("_n", F.row_number().over(first))
        .where(F.col("_n") == 1)
        .drop("_n")
        .select(*LATEST_SCHEMA.names)
    )


def newest_per_gateway(rows: DataFrame) -> DataFrame:
    """One row per gateway: its newest message, with the figures of its newest online one."""
    newest = Window.partitionBy("gateway").orderBy(F.col("received").desc(), F.col("id").desc())
    ranked = rows.withColumn("_n", F.row_number().over(newest))
    head = ranked.where(F.col("_n") == 1).drop(*FACTS.names, "facts_ts", "facts_received", "_n")
    facts = (
        ranked.where(F.col("facts_ts").isNotNull())
        .withColumn("_m", F.row_number().over(newest))
        .where(F.col("_m") == 1)
        .select("gateway", "facts_ts", "facts_received", *FACTS.names)
    )
    return head.join(facts, "gateway", "left").select(*LATEST_SCHEMA.names)


def per_minute(rows: DataFrame) -> DataFrame:
    """Per gateway and minute of receipt: maxima, minima, and the state at its last status."""
    minute = F.date_trunc("minute", F.col("received"))
    order = F.struct(F.col("received"), F.col("id"))
    return (
        rows.where(F.col("received").isNotNull())
        .withColumn("minute", minute)
        .groupBy("gateway", "minute")
        .agg(
            F.max("backlog").alias("backlog_max"),
            F.max("oldest_age_s").alias("oldest_age_max_s"),
            F.min("disk_free_bytes").alias("disk_free_min"),
            F.max("received").alias("last_received"),
            F.max_by("id", order).alias("last_id"),
            F.max_by("online", order).alias("online"),
            F.max_by("uplink_state", order).alias("uplink_state"),
            F.max_by("backlog", order).alias("backlog_last"),
            F.max_by("clock_synced", order).alias("clock_synced"),
            F.max_by("level", order).alias("level"),
        )
        .withColumn("date", F.date_format("minute", "yyyy-MM-dd"))
        .select(*MINUTES_SCHEMA.names)
    )


def merge_minutes(old: DataFrame, new: DataFrame) -> DataFrame:
    """The same minute from two batches: one row (idempotent: a replay changes nothing)."""
    order = F.struct(F.col("last_received"), F.col("last_id"))
    last = [
        F.max_by(c, order).alias(c)
        for c in ("last_id", "online", "uplink_state", "backlog_last", "clock_synced", "level")
    ]
    return (
        old.unionByName(new)
        .groupBy("gateway", "minute", "date")
        .agg(
            F.max("backlog_max").alias("backlog_max"),
            F.max("oldest_age_max_s").alias("oldest_age_max_s"),
            F.min("disk_free_min").alias("disk_free_min"),
            F.max("last_received").alias("last_received"),
            *last,
        )
        .select(*MINUTES_SCHEMA.names)
    )


@dataclass
class HealthRun:
    messages: int = 0
    gateways: int = 0
    minutes: int = 0

    def line(self) -> str:
        return (
            f"gateway status: {self.messages:,} messages, {self.gateways} gateways, "
            f"{self.minutes:,} minutes updated"
        )


class HealthPipeline:
    def __init__(self, spark: SparkSession, landing: str, warehouse: str) -> None:
        self.spark = spark
        self.source = f"{landing.rstrip('/')}/{STATUS_DIR}"
        self.wh = warehouse.rstrip("/")
        self.result = HealthRun()

    def path(self, table: str) -> str:
        return f"{self.wh}/{table}"

    def run(self) -> HealthRun:
        if not path_exists(self.spark, self.source):
            return self.result  # no status landed yet (or an ingest from before issue 15)
        stream = (
            self.spark.readStream.schema(STATUS_LINE_SCHEMA)
            .option("mode", "DROPMALFORMED")
            .option("recursiveFileLookup", "true")
            .json(self.source)
        )
        query = (
            stream.writeStream.trigger(availableNow=True)
            .option("checkpointLocation", self.path(CHECKPOINT))
            .foreachBatch(self.batch)
            .start()
        )
        query.awaitTermination()
        if path_exists(self.spark, self.path(LATEST)):
            self.result.gateways = self.spark.read.parquet(self.path(LATEST)).count()
        return self.result

    def batch(self, lines: DataFrame, batch_id: int) -> None:
        rows = parse_statuses(lines).localCheckpoint(eager=True)
        n = rows.count()
        if n == 0:
            return
        self.result.messages += n
        latest = rows
        if path_exists(self.spark, self.path(LATEST)):
            old = self.spark.read.schema(LATEST_SCHEMA).parquet(self.path(LATEST))
            latest = old.unionByName(rows)
        # Materialised before the table it was read from is overwritten.
        newest = newest_per_gateway(latest).localCheckpoint(eager=True)
        newest.coalesce(1).write.mode("overwrite").parquet(self.path(LATEST))

        minutes = per_minute(rows)
        if path_exists(self.spark, self.path(MINUTES)):
            dates = [r.date for r in minutes.select("date").distinct().collect()]
            old_m = (
                self.spark.read.schema(MINUTES_SCHEMA)
                .parquet(self.path(MINUTES))
                .where(F.col("date").isin(dates))
            )
            minutes = merge_minutes(old_m, minutes)
        minutes = minutes.localCheckpoint(eager=True)
        self.result.minutes += minutes.count()
        minutes.repartition("date").write.mode("overwrite").partitionBy("date").parquet(
            self.path(MINUTES)
        )


def update(spark: SparkSession, landing: str, warehouse: str) -> HealthRun:
    """Bring ``gateway_health`` and ``gateway_health_1m`` up to date with the landed statuses."""
    return HealthPipeline(spark, landing, warehouse).run()


# ------------------------------------------------------------------ reading


def _epoch(t: Any) -> float | None:
    return None if t is None else t.timestamp()


def _plain(v: Any) -> Any:
    """Spark Rows and maps as plain dicts (a map of structs comes back as dict of Rows)."""
    if hasattr(v, "asDict"):
        return {k: _plain(x) for k, x in v.asDict().items()}
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def view_of_row(r: Row) -> GatewayView:
    """A gateway from its row of ``gateway_health`` (``LATEST_SCHEMA``)."""
    # A fact the row has no value for keeps the view's default (None, or empty).
    facts = {n: _plain(r[n]) for n in FACTS.names if r[n] is not None}
    return GatewayView(
        gateway=r.gateway,
        fleet=r.fleet,
        online=bool(r.online),
        reason=r.reason or "",
        ts=_epoch(r.ts),
        seen=_epoch(r.received),
        version=r.version,
        started=_epoch(r.started),
        facts_ts=_epoch(r.facts_received or r.facts_ts),
        **facts,
    )


def views(spark: SparkSession, warehouse: str, history_hours: float = 24.0) -> list[GatewayView]:
    """Every gateway in ``gateway_health``, with its backlog per minute (the last hours)."""
    wh = warehouse.rstrip("/")
    if not path_exists(spark, f"{wh}/{LATEST}"):
        return []
    out: dict[str, GatewayView] = {}
    for r in spark.read.schema(LATEST_SCHEMA).parquet(f"{wh}/{LATEST}").collect():
        v = view_of_row(r)
        out[v.gateway] = v
    if out and history_hours > 0 and path_exists(spark, f"{wh}/{MINUTES}"):
        m = spark.read.schema(MINUTES_SCHEMA).parquet(f"{wh}/{MINUTES}")
        newest = m.agg(F.max("minute")).first()
        if newest is not None and newest[0] is not None:
            since = newest[0].timestamp() - history_hours * 3600
            dates = m.where(F.col("minute") >= F.lit(since).cast("timestamp"))
            for r in dates.select("gateway", "minute", "backlog_max").orderBy("minute").collect():
                if r.gateway in out:
                    out[r.gateway].history.append((r.minute.timestamp(), int(r.backlog_max or 0)))
    return list(out.values())
