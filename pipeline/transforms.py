"""The pipeline's transforms: named, pure DataFrame -> DataFrame functions with explicit schemas.

No UDFs: everything is Spark SQL functions, so the plan stays in the JVM and
a second engine (DuckDB, tests/) can state the same rules in plain SQL.

Rules, all of them here:
- a landing line that is not a JSON object with a string ``id``, ``origin``,
  ``sensor`` and a parseable ``ts`` is quarantined with the reason; so is a
  reading with an impossible value (NaN, infinite, or 1e15 and beyond, which
  DECIMAL(18,3) cannot hold) or time (before 2000, or
  more than a day after the ingest received it);
- duplicates are the same ``id``, whatever their ``ts``, across all of history;
  the copy the ingest received first wins (then the smallest gateway name, so
  the choice is total and reruns agree). A batch's first copies are checked
  against the seen index of earlier batches (``against_index``;
  pipeline/seenindex.py): a copy that was received after the kept one is dropped
  and touches nothing; one received before it replaces it (the kept copy is
  ``displaced``: its hour is rewritten without it and its rollups recomputed);
- rollups count, min, max, sum and mean the non-null values; ``sum`` is
  DECIMAL(38,3) of the values rounded to 3 decimals, so re-aggregating minutes
  into hours and hours into days is exact and reruns are bit-identical;
  ``mean`` is one division of that sum; ``first``/``last`` are the values at
  the earliest/latest ``ts`` (ties broken by ``id``); ``unit`` is the largest
  unit string seen (one per sensor in practice);
- data quality per batch, origin and sensor: valid lines in, readings kept,
  duplicates removed (in minus kept), and of the kept readings the late ones
  (received more than ``LATE_AFTER_S`` after their ``ts``) and the
  clock-flagged ones (``clock_unsynced`` or ``clock_corrected``).
"""

from __future__ import annotations

from datetime import UTC, datetime

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ..sync.wire import GAUGE, KINDS

CORRUPT = "_corrupt_record"

LANDING_SCHEMA = StructType(
    [
        StructField("id", StringType()),
        StructField("origin", StringType()),
        StructField("sensor", StringType()),
        StructField("ts", StringType()),
        StructField("value", DoubleType()),
        StructField("unit", StringType()),
        StructField("flags", ArrayType(StringType())),
        StructField("kind", StringType()),
        StructField("gateway", StringType()),
        StructField("received", StringType()),
        # A record's body ($ledger: pipeline/completeness.py), as JSON text.
        StructField("record", StringType()),
        # The receive record's span of the gateway's store (the message's last line).
        StructField(
            "_mqtt",
            StructType(
                [
                    StructField(
                        "outbox",
                        StructType(
                            [
                                StructField("epoch", StringType()),
                                StructField("first", LongType()),
                                StructField("last", LongType()),
                            ]
                        ),
                    )
                ]
            ),
        ),
        StructField(CORRUPT, StringType()),
    ]
)
# What a quarantined line is shown as when it parsed (its fields, as the wire has them).
LINE_FIELDS = ["id", "origin", "sensor", "ts", "value", "unit", "flags", "kind", "gateway",
               "received"]  # fmt: skip

READINGS_SCHEMA = StructType(
    [
        StructField("id", StringType(), False),
        StructField("origin", StringType(), False),
        StructField("sensor", StringType(), False),
        StructField("ts", TimestampType(), False),
        StructField("value", DoubleType()),
        StructField("unit", StringType()),
        StructField("flags", ArrayType(StringType())),
        StructField("kind", StringType()),  # null in readings written before kinds: gauge
        StructField("gateway", StringType()),
        StructField("received", TimestampType()),
        StructField("date", StringType(), False),
        StructField("hour", IntegerType(), False),
        StructField("batch", LongType(), False),
    ]
)

SUM = DecimalType(38, 3)
ROLLUP_FIELDS = [
    StructField("origin", StringType(), False),
    StructField("sensor", StringType(), False),
    StructField("window_start", TimestampType(), False),
    StructField("count", LongType(), False),
    StructField("min", DoubleType()),
    StructField("max", DoubleType()),
    StructField("sum", SUM),
    StructField("mean", DoubleType()),
    StructField("first_value", DoubleType()),
    StructField("first_ts", TimestampType()),
    StructField("last_value", DoubleType()),
    StructField("last_ts", TimestampType()),
    StructField("unit", StringType()),
    StructField("kind", StringType()),  # null in rollups written before kinds: gauge
]
ROLLUP_1M_SCHEMA = StructType(
    [*ROLLUP_FIELDS, StructField("date", StringType()), StructField("hour", IntegerType())]
)
ROLLUP_DAY_SCHEMA = StructType([*ROLLUP_FIELDS, StructField("date", StringType())])

QUARANTINE_SCHEMA = StructType(
    [
        StructField("reason", StringType(), False),
        StructField("line", StringType()),
        StructField("id", StringType()),
        StructField("origin", StringType()),
        StructField("sensor", StringType()),
        StructField("batch", LongType(), False),
    ]
)

# The seen index's exceptions (``seen_exceptions``; before issue 27 the whole index,
# ``seen_ids``): a row per kept copy of an id that is no stream position, and per kept
# and displaced copy of an id whose first kept copy was displaced, in the bucket of
# its id's ``{origin}/{epoch}`` prefix (256 buckets), in generations (``gen``: the batch
# that wrote it). ``late`` and ``clock`` let a later batch that displaces the copy
# correct the quality counts without reading ``readings``.
SEEN_BUCKETS = 256
SEEN_SCHEMA = StructType(
    [
        StructField("id", StringType(), False),
        StructField("received", TimestampType()),
        StructField("gateway", StringType()),
        StructField("origin", StringType(), False),
        StructField("sensor", StringType(), False),
        StructField("late", BooleanType(), False),
        StructField("clock", BooleanType(), False),
        StructField("date", StringType(), False),
        StructField("hour", IntegerType(), False),
        StructField("batch", LongType(), False),
        StructField("bucket", IntegerType(), False),
        StructField("gen", LongType(), False),
    ]
)
SEEN_COLUMNS = [f.name for f in SEEN_SCHEMA.fields[:-1]]  # gen is the writer's batch
_KEPT_TYPE = StructType([f for f in SEEN_SCHEMA.fields[1:-1]])

QUALITY_SCHEMA = StructType(
    [
        StructField("origin", StringType(), False),
        StructField("sensor", StringType(), False),
        StructField("lines_in", LongType(), False),
        StructField("kept", LongType(), False),
        StructField("duplicates_removed", LongType(), False),
        StructField("late", LongType(), False),
        StructField("clock_flagged", LongType(), False),
        StructField("max_delay_s", DoubleType()),
        StructField("batch", LongType(), False),
    ]
)

TS_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSX"
MAX_ABS = 1e15  # DECIMAL(18,3) holds 15 integer digits
EARLIEST = "2000-01-01 00:00:00"
# A reading is late when it reaches the cloud more than this after it was taken:
# longer than the pipeline timer's period, so its minute was likely rolled up already.
LATE_AFTER_S = 600
CLOCK_FLAGS = ("clock_unsynced", "clock_corrected")
ROLLUP_COLUMNS = [f.name for f in ROLLUP_FIELDS]


def parse_landing(lines: DataFrame) -> DataFrame:
    """Each line typed, with the first reason (if any) it cannot be kept.

    Only what the later steps read: a keepable line's fields with typed times
    (``ts_t``, ``received_t``), and for a line that is not kept its ``reason``
    and its text (``line``: the raw line when it did not parse, else the fields
    as JSON, made for these lines only). The raw ``ts`` and ``received`` strings
    are left out: a batch caches this, and on clean data they would be most of it.
    """
    # The times parsed once, in a projection of their own: inlined, each reference in
    # the reasons' conditions parsed the text again (Spark's subexpression elimination
    # looks only into a CASE's first condition), and a batch's cache of 2.25M lines took
    # 14.2 s, not 8.8.
    typed = lines.select(
        "*",
        F.try_to_timestamp("ts", F.lit(TS_FORMAT)).alias("ts_t"),
        F.try_to_timestamp("received", F.lit(TS_FORMAT)).alias("received_t"),
        F.coalesce(F.col("kind"), F.lit(GAUGE)).alias("_kind"),
    )
    ts, received, kind = F.col("ts_t"), F.col("received_t"), F.col("_kind")
    reason = (
        F.when(F.col(CORRUPT).isNotNull(), F.lit("malformed_line"))
        .when(F.col("id").isNull() | (F.col("id") == ""), F.lit("missing_id"))
        .when(F.col("origin").isNull(), F.lit("missing_origin"))
        .when(F.col("sensor").isNull(), F.lit("missing_sensor"))
        .when(ts.isNull(), F.lit("bad_ts"))
        .when(F.isnan("value") | (F.abs("value") == F.lit(float("inf"))), F.lit("value_not_finite"))
        .when(F.abs("value") >= F.lit(MAX_ABS), F.lit("value_out_of_range"))
        .when(~kind.isin(*KINDS), F.lit("bad_kind"))
        .when(ts < F.lit(EARLIEST).cast(TimestampType()), F.lit("ts_before_2000"))
        .when(
            received.isNotNull() & (ts > received + F.expr("INTERVAL 1 DAY")),
            F.lit("ts_in_future"),
        )
    )
    judged = typed.select("*", reason.alias("reason"))
    line = F.coalesce(F.col(CORRUPT), F.to_json(F.struct(*LINE_FIELDS)))
    return judged.select(
        "id",
        "origin",
        "sensor",
        "value",
        "unit",
        "flags",
        kind.alias("kind"),
        "gateway",
        "ts_t",
        "received_t",
        "reason",
        F.when(F.col("reason").isNotNull(), line).alias("line"),
        "record",
        F.col("_mqtt.outbox").alias("outbox"),
    )


def is_record(sensor: Column) -> Column:
    """A line that is the gateway's record, not a reading: its sensor starts with ``$``."""
    return F.coalesce(sensor.startswith("$"), F.lit(False))


def quarantined(parsed: DataFrame, batch: int) -> DataFrame:
    return parsed.where(F.col("reason").isNotNull()).select(
        "reason",
        "line",
        "id",
        "origin",
        "sensor",
        F.lit(batch).cast(LongType()).alias("batch"),
    )


def valid_readings(parsed: DataFrame, batch: int) -> DataFrame:
    """The keepable lines that are readings (not records: pipeline/completeness.py) as the
    ``readings`` table's rows (duplicates still in)."""
    return parsed.where(F.col("reason").isNull() & ~is_record(F.col("sensor"))).select(
        "id",
        "origin",
        "sensor",
        F.col("ts_t").alias("ts"),
        "value",
        "unit",
        "flags",
        "kind",
        "gateway",
        F.col("received_t").alias("received"),
        F.date_format("ts_t", "yyyy-MM-dd").alias("date"),
        F.hour("ts_t").alias("hour"),
        F.lit(batch).cast(LongType()).alias("batch"),
    )


def copy_order(received: Column, gateway: Column) -> Column:
    """Which copy of an id wins: the smallest (received first, then the smallest gateway)."""
    return F.struct(
        F.coalesce(received, F.lit("9999-12-31").cast(TimestampType())),
        F.coalesce(gateway, F.lit("")),
    )


def first_copy_per_id(readings: DataFrame) -> DataFrame:
    """One row per id: the copy received first (then the smallest gateway)."""
    cols = [c for c in readings.columns if c != "id"]
    best = F.min_by(F.struct(*cols), copy_order(F.col("received"), F.col("gateway")))
    return readings.groupBy("id").agg(best.alias("r")).select("id", "r.*")


def id_bucket(id_col: Column) -> Column:
    """The exceptions' bucket of an id: a hash of its ``{origin}/{epoch}`` prefix.

    Ids are ``{origin}/{epoch}/{seq}`` (``{node}/{boot}/{seq}.{i}`` from nodes; an
    origin never holds a ``/``, it is an MQTT topic level), so one origin's epoch
    lands in one bucket and a batch touches the buckets of the epochs it carries,
    not all of history. The prefix is the first two levels (an id with fewer
    hashes whole): ``substring_index``, not a regular expression, on every row.
    """
    prefix = F.substring_index(id_col, "/", 2)
    return F.pmod(F.xxhash64(prefix), F.lit(SEEN_BUCKETS)).cast(IntegerType())


def _delay_s() -> Column:
    """Seconds from taking a reading to the ingest receiving it (null without ``received``)."""
    return (F.unix_micros("received") - F.unix_micros("ts")) / F.lit(1e6)


def ts_may_differ() -> Column:
    """A copy whose ``ts`` another copy of the same reading may not share: stamped by a
    gateway on arrival (a node without a clock) or taken on a clock since corrected."""
    return F.coalesce(
        F.arrays_overlap(
            F.coalesce("flags", F.array().cast("array<string>")),
            F.array(*[F.lit(f) for f in (*CLOCK_FLAGS, "ts_from_gateway")]),
        ),
        F.lit(False),
    )


def _clock_flagged() -> Column:
    return F.arrays_overlap(
        F.coalesce("flags", F.array().cast("array<string>")),
        F.array(*[F.lit(f) for f in CLOCK_FLAGS]),
    )


def seen_rows(kept: DataFrame) -> DataFrame:
    """Exception rows (``SEEN_SCHEMA`` without ``gen``) of ``readings`` rows: the copies a
    batch kept, or kept copies read back from ``readings``."""
    return kept.select(
        "id",
        "received",
        "gateway",
        "origin",
        "sensor",
        F.coalesce(_delay_s() > F.lit(LATE_AFTER_S), F.lit(False)).alias("late"),
        F.coalesce(_clock_flagged(), F.lit(False)).alias("clock"),
        "date",
        "hour",
        F.col("batch").cast(LongType()).alias("batch"),
        id_bucket(F.col("id")).alias("bucket"),
    )


def kept_per_id(candidates: DataFrame, rows: DataFrame) -> DataFrame:
    """Per candidate id, the kept copy among index rows (``SEEN_COLUMNS``: exceptions, or
    copies read back from ``readings``): the earliest received (``kept``, a struct)."""
    order = copy_order(F.col("received"), F.col("gateway"))
    hit = rows.join(candidates.select("id"), on="id", how="left_semi")
    return hit.groupBy("id").agg(
        F.min_by(F.struct(*[c for c in SEEN_COLUMNS if c != "id"]), order).alias("kept")
    )


def against_index(
    candidates: DataFrame, kept: DataFrame | None, claimed: DataFrame | None
) -> DataFrame:
    """A batch's first copies against what earlier batches kept.

    ``kept`` (``kept_per_id``): the kept copy of each id the index knows one of exactly
    (an exception, or read back from ``readings``); ``claimed``: the ids a range of
    ``seen_ranges`` claims (``seenindex.claims``), with ``bound``, an upper bound of the
    kept copy's order when an exact run claims it. Each candidate gets ``kept`` (null
    when not known exactly) and ``wins``: never kept, or received before the kept copy.
    An id an exact run claims without an exact kept copy is one whose order is at or
    after ``bound``: it loses (the job reads back every other's). One only an envelope
    claims, with no kept copy found, was never kept. A candidate that does not win
    never reaches ``readings`` or a rollup.
    """
    out = candidates
    if kept is not None:
        out = out.join(kept, on="id", how="left")
    else:
        out = out.withColumn("kept", F.lit(None).cast(_KEPT_TYPE))
    if claimed is not None:
        out = out.join(claimed.select("id", F.col("bound").alias("_claimed")), on="id", how="left")
    else:
        out = out.withColumn("_claimed", F.lit(None).cast(BooleanType()))  # no exact claim
    beats = copy_order(F.col("received"), F.col("gateway")) < copy_order(
        F.col("kept.received"), F.col("kept.gateway")
    )
    wins = (
        F.when(F.col("kept").isNotNull(), beats)
        .when(F.col("_claimed").isNotNull(), F.lit(False))
        .otherwise(F.lit(True))
    )
    return out.withColumn("wins", wins).drop("_claimed")


def winners(decided: DataFrame) -> DataFrame:
    """The copies a batch keeps (``against_index``'s winners, as ``readings`` rows)."""
    return decided.where(F.col("wins")).drop("kept", "wins")


def displaced(decided: DataFrame) -> DataFrame:
    """The index rows of kept copies that a copy received before them replaces."""
    return decided.where(F.col("wins") & F.col("kept").isNotNull()).select("id", "kept.*")


def quality(
    valid: DataFrame, kept: DataFrame, batch: int, displaced: DataFrame | None = None
) -> DataFrame:
    """Per origin and sensor in one batch: what came in, what was kept, and how it looked.

    A copy this batch displaced (kept by an earlier batch, replaced by one received
    before it) is taken off ``kept``, ``late`` and ``clock_flagged`` here, so the
    table summed over batches counts each reading once. ``max_delay_s`` is the
    largest delay of what the batch kept.
    """
    delay = _delay_s()
    came = valid.groupBy("origin", "sensor").agg(F.count(F.lit(1)).alias("lines_in"))
    stayed = kept.select(
        "origin",
        "sensor",
        F.lit(1).alias("n"),
        (delay > F.lit(LATE_AFTER_S)).cast(IntegerType()).alias("is_late"),
        _clock_flagged().cast(IntegerType()).alias("is_clock"),
        delay.alias("delay"),
    )
    if displaced is not None:
        gone = displaced.select(
            "origin",
            "sensor",
            F.lit(-1).alias("n"),
            -F.col("late").cast(IntegerType()),
            -F.col("clock").cast(IntegerType()),
            F.lit(None).cast(DoubleType()),
        )
        stayed = stayed.unionAll(gone)
    stayed = stayed.groupBy("origin", "sensor").agg(
        F.sum("n").alias("kept"),
        F.sum(F.coalesce("is_late", F.lit(0))).alias("late"),
        F.sum(F.coalesce("is_clock", F.lit(0))).alias("clock_flagged"),
        F.max("delay").alias("max_delay_s"),
    )
    zero = F.lit(0).cast(LongType())
    return came.join(stayed, on=["origin", "sensor"], how="full").select(
        "origin",
        "sensor",
        F.coalesce(F.col("lines_in").cast(LongType()), zero).alias("lines_in"),
        F.coalesce(F.col("kept").cast(LongType()), zero).alias("kept"),
        (F.coalesce("lines_in", zero) - F.coalesce("kept", zero))
        .cast(LongType())
        .alias("duplicates_removed"),
        F.coalesce(F.col("late").cast(LongType()), zero).alias("late"),
        F.coalesce(F.col("clock_flagged").cast(LongType()), zero).alias("clock_flagged"),
        F.col("max_delay_s").cast(DoubleType()).alias("max_delay_s"),
        F.lit(batch).cast(LongType()).alias("batch"),
    )


def _sql_string(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def in_hours(date: str, hour: str, hours: list[tuple[str, int]]) -> Column:
    """True for a (``date``, ``hour``) among ``hours``: ``date`` and ``hour`` are SQL
    expressions (column names, say). One literal list, no join; on partition columns it
    prunes partitions.

    Parsed from one SQL string: built from Column objects, each element cost four calls
    into the JVM (a struct, two literals, aliases; 1.6 ms a call on average in the lab,
    2026-12-07), and a small batch whose late copies touched many minutes spent 26 s
    building its filters."""
    if not hours:
        return F.lit(False)
    wanted = ", ".join(f"({_sql_string(d)}, {int(h)})" for d, h in hours)
    return F.expr(f"({date}, {hour}) IN ({wanted})")


def epoch_minute(date: str, hour: int, minute: int) -> int:
    """The minutes since 1970 (UTC) of a (``date``, ``hour``, ``minute``)."""
    day = datetime.strptime(date, "%Y-%m-%d").replace(tzinfo=UTC)
    return int(day.timestamp()) // 60 + hour * 60 + minute


def in_minutes(ts: str, minutes: list[tuple[str, int, int]]) -> Column:
    """True for a timestamp ``ts`` (a SQL expression) in one of the (``date``, ``hour``,
    minute) triples ``minutes`` (UTC, the session's zone: a reading's ``date`` and
    ``hour`` are its ``ts``'s), as one literal list of minutes since 1970 (``in_hours``:
    why one SQL string)."""
    if not minutes:
        return F.lit(False)
    wanted = ", ".join(str(epoch_minute(d, h, m)) for d, h, m in sorted(set(minutes)))
    return F.expr(f"(unix_seconds({ts}) div 60) IN ({wanted})")


def other_hours(hourly: DataFrame, hours: list[tuple[str, int]]) -> DataFrame:
    """The rows of an hourly rollup outside the given (``date``, ``hour``) pairs."""
    return hourly.where(~in_hours("date", "hour(window_start)", hours))


def _first_last(ts: Column, tie: Column, value: Column) -> list[Column]:
    """The value at the smallest and at the largest (``ts``, ``tie``) of a group, with its
    ``ts`` (fields ``v`` and ``t``). The minimum of one struct, not ``min_by`` of one by
    another: a comparison a row, not a comparison and two structs copied."""
    order = F.struct(ts.alias("t"), tie.alias("k"), value.alias("v"))
    return [F.min(order).alias("first"), F.max(order).alias("last")]


def _rollup_select(grouped_cols: list[str], extra: list[Column]) -> list[Column]:
    return [
        *[F.col(c) for c in grouped_cols],
        F.col("count"),
        F.col("min"),
        F.col("max"),
        F.col("sum"),
        (F.col("sum").cast(DoubleType()) / F.col("count")).alias("mean"),
        F.col("first.v").alias("first_value"),
        F.col("first.t").alias("first_ts"),
        F.col("last.v").alias("last_value"),
        F.col("last.t").alias("last_ts"),
        F.col("unit"),
        F.col("kind"),
        *extra,
    ]


def _kind() -> Column:
    """A window's kind: its sensor's (a sensor has one; null, from before kinds, is gauge)."""
    return F.max(F.coalesce(F.col("kind"), F.lit(GAUGE))).alias("kind")


def rollup_minutes(readings: DataFrame, *parts: str) -> DataFrame:
    """Per origin, sensor and minute, from deduplicated readings.

    Grouped by the readings' ``date`` and ``hour`` too (a minute lies in one), and by
    ``parts`` (columns of the origin and sensor alone, so they split no group), so
    readings partitioned by those are aggregated where they are, without a shuffle.
    """
    r = readings.where(F.col("value").isNotNull())
    window = F.date_trunc("minute", "ts").alias("window_start")
    agg = r.groupBy("date", "hour", *parts, "origin", "sensor", window).agg(
        F.count("value").cast(LongType()).alias("count"),
        F.min("value").alias("min"),
        F.max("value").alias("max"),
        F.sum(F.col("value").cast(DecimalType(18, 3))).cast(SUM).alias("sum"),
        *_first_last(F.col("ts"), F.col("id"), F.col("value")),
        F.max("unit").alias("unit"),
        _kind(),
    )
    return agg.select(
        _rollup_select(["origin", "sensor", "window_start"], [F.col("date"), F.col("hour")])
    )


def rollup_up(finer: DataFrame, unit: str) -> DataFrame:
    """Re-aggregate a rollup into hours or days: exact, since sums are decimals."""
    window = F.date_trunc(unit, "window_start").alias("window_start")
    # Ties between windows cannot happen (first_ts lies inside its own window), but
    # the finer window_start makes the order total all the same.
    agg = finer.groupBy("origin", "sensor", window).agg(
        F.sum("count").cast(LongType()).alias("count"),
        F.min("min").alias("min"),
        F.max("max").alias("max"),
        F.sum("sum").cast(SUM).alias("sum"),
        _first_last(F.col("first_ts"), F.col("window_start"), F.col("first_value"))[0],
        _first_last(F.col("last_ts"), F.col("window_start"), F.col("last_value"))[1],
        F.max("unit").alias("unit"),
        _kind(),
    )
    return agg.select(
        _rollup_select(
            ["origin", "sensor", "window_start"],
            [F.date_format("window_start", "yyyy-MM-dd").alias("date")],
        )
    )
