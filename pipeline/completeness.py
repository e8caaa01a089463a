"""Records and the completeness table (issue 27): named transforms, explicit schemas.

A landing line whose ``sensor`` starts with ``$`` is the gateway's **record**, not a
reading (docs/wire-format.md): it never reaches ``readings``, the rollups or
``quality``. A ``$ledger`` record (docs/pipeline.md, "Completeness") becomes rows of
``ledger``, one per range it tells, a ``top`` row first; any other (``$release``, the
release apply's audit) a row of ``records``. Both are kept once per id, as readings are
(the copies of a record are the same bytes from the same gateway: which one is kept
does not show).

**Streams and positions.** The gateway's store stream ``{gateway}/{epoch}``: its seqs;
landed is the union of the ``outbox`` spans the ingest writes in each message's receive
record (``_mqtt.outbox``). A node stream ``{node}/{boot}``: its message seqs, landed
from the reading ids ``{node}/{boot}/{seq}.{i}``. A position's time is its line's
``ts`` (else ``received``): the last line of the span's message, the earliest of the
node message's readings, of its earliest copy when it landed more than once. What
landed is kept as ranges (``landed``, by bucket and generation: pipeline/completejob.py):
consecutive positions of one stream and hour, one row.

**The table** (``completeness`` per gateway, stream and hour; ``completeness_gaps`` per
missing range), for a stream of gateway ``g``:

- expected: store ``[1 .. T]``, node ``[0 .. T]``, ``T`` the largest position landed or
  told by a ledger (store: the ledger's ``top``; node: any range it names), less the
  seqs the store skipped;
- told: up to where ``g``'s ledgers have spoken of the stream (the largest ``top`` of
  the epoch's ledgers; a node stream's largest range). A missing position is judged
  only up to there; past it, the gateway has not told yet (``unreported``: not an alarm);
- each missing position's reason, the first that applies: ``held`` (in the ``held`` of
  ``g``'s latest ledger, by window end then seq), ``evicted``, ``dead_letter``,
  ``refused``, ``node_dropped``, ``skipped`` (a seq the store never gave: not counted
  expected nor missing), else ``unexplained`` (told, and no reason: the alarm) or
  ``unreported``;
- its hour: the reason's time (an eviction's or dead letter's ``at``; the telling
  ledger's window start for refused, dropped and skipped; the latest ledger's window
  end for held), else the first landed position after it, else the latest ledger's
  window end. A landed position's hour is its earliest copy's (``owned_ranges``).

Judged from ranges, not merged row by row: a batch judges the streams of the gateways
in the buckets its lines touch (``BUCKETS`` by gateway) from ``landed`` and the ledgers
compacted (``ledger_state``: a row per stream, the latest ledger's held ranges, each
reason's range once), which hold ranges, not readings. A later batch can change an old
hour of a stream (a late copy fills a gap, a ledger explains one), but only above a
point of each stream: pipeline/completedelta.py finds it, and these transforms judge
what is above it (or, for a batch that cannot start from what was written, all). A
gap is judged in pieces, cut where a reason's range begins or ends inside it: never
position by position (a hole of a million positions costs what a hole of one does).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from . import transforms

LEDGER_SENSOR = "$ledger"
BUCKETS = 16  # completeness's partitions: a hash of the gateway

# A $ledger record's ``record`` (docs/wire-format.md). Times are wire times (numbers of
# seconds are read too); a range is ``[lo, hi]``.
_RANGES = ArrayType(ArrayType(LongType()))
_EVENTS = ArrayType(StructType([StructField("at", StringType()), StructField("ranges", _RANGES)]))
_BY_REASON = MapType(StringType(), _RANGES)
LEDGER_RECORD = StructType(
    [
        StructField("v", IntegerType()),
        StructField("window", ArrayType(StringType())),
        StructField("top", LongType()),
        StructField(
            "streams",
            MapType(
                StringType(),
                StructType(
                    [
                        StructField("held", _RANGES),
                        StructField("skipped", _RANGES),
                        StructField("stored", _RANGES),
                        StructField("evicted", _EVENTS),
                        StructField("dead_letter", _EVENTS),
                        StructField("refused", _BY_REASON),
                        StructField("node_dropped", _BY_REASON),
                    ]
                ),
            ),
        ),
    ]
)

# ``ledger``: one row per range a kept $ledger record tells; ``what`` is top (``lo`` =
# ``hi`` = the store's top), held, skipped, stored, evicted, dead_letter, refused or
# node_dropped; ``reason`` the refusal's or the drop's; ``at`` an event's time.
LEDGER_SCHEMA = StructType(
    [
        StructField("id", StringType(), False),
        StructField("gateway", StringType(), False),
        StructField("epoch", StringType(), False),
        StructField("seq", LongType(), False),
        StructField("ts", TimestampType()),
        StructField("window_start", TimestampType()),
        StructField("window_end", TimestampType()),
        StructField("stream", StringType(), False),
        StructField("what", StringType(), False),
        StructField("reason", StringType()),
        StructField("at", TimestampType()),
        StructField("lo", LongType(), False),
        StructField("hi", LongType(), False),
        StructField("batch", LongType(), False),
    ]
)
LEDGER_COLUMNS = LEDGER_SCHEMA.names

# ``ledger_state`` (``ledger_state``'s rows, by bucket of the gateway): what the rules
# read of a gateway's ledgers, whatever their number. ``what`` is ``told`` (a stream's
# largest position any ledger named: ``lo`` = ``hi``), ``head`` (the gateway's latest
# ledger: its id, seq, ts and window), ``held`` (that ledger's), or a reason's range
# (``_REASON_ROWS``). Rows that are no one ledger's (told, reasons) have id "", seq -1.
STATE_SCHEMA = StructType(
    [f for f in LEDGER_SCHEMA.fields if f.name != "batch"]
    + [StructField("bucket", IntegerType(), False)]
)
STATE_COLUMNS = STATE_SCHEMA.names
_REASON_ROWS = ("evicted", "dead_letter", "refused", "node_dropped", "skipped")

RECORDS_SCHEMA = StructType(
    [
        StructField("id", StringType(), False),
        StructField("origin", StringType(), False),
        StructField("sensor", StringType(), False),
        StructField("ts", TimestampType()),
        StructField("flags", ArrayType(StringType())),
        StructField("record", StringType()),
        StructField("gateway", StringType()),
        StructField("received", TimestampType()),
        StructField("batch", LongType(), False),
    ]
)

# ``landed``'s ranges: a run of consecutive positions of one stream in one hour (``t``:
# a time in that hour, the earliest of the batch's copies). What a batch landed
# (``landed_ranges``) may overlap what others did; ``owned_ranges`` makes them disjoint.
# The table keeps them by bucket of the gateway and generation (pipeline/completejob.py).
LANDED_SCHEMA = StructType(
    [
        StructField("gateway", StringType(), False),
        StructField("stream", StringType(), False),
        StructField("lo", LongType(), False),
        StructField("hi", LongType(), False),
        StructField("t", TimestampType()),
    ]
)
LANDED_COLUMNS = LANDED_SCHEMA.names

COUNTS = ("held", "evicted", "dead_letter", "refused", "node_dropped", "unexplained", "unreported")
REASONS = (*COUNTS[:5], "skipped", *COUNTS[5:])  # the order a missing position is judged in
COMPLETENESS_SCHEMA = StructType(
    [
        StructField("gateway", StringType(), False),
        StructField("stream", StringType(), False),
        StructField("kind", StringType(), False),
        StructField("hour", TimestampType()),
        StructField("expected", LongType(), False),
        StructField("landed", LongType(), False),
        StructField("missing", LongType(), False),
        *[StructField(c, LongType(), False) for c in COUNTS],
        StructField("skipped", LongType(), False),
        StructField("bucket", IntegerType(), False),
        StructField("day", StringType(), False),
    ]
)
GAPS_SCHEMA = StructType(
    [
        StructField("gateway", StringType(), False),
        StructField("stream", StringType(), False),
        StructField("kind", StringType(), False),
        StructField("lo", LongType(), False),
        StructField("hi", LongType(), False),
        StructField("n", LongType(), False),
        StructField("reason", StringType(), False),
        StructField("detail", StringType()),
        StructField("hour", TimestampType()),
        StructField("bucket", IntegerType(), False),
    ]
)

TS_FORMAT = transforms.TS_FORMAT
is_record = transforms.is_record
_UNBOUNDED = Window.unboundedPreceding


# ------------------------------------------------------------------ records


def bucket(gateway: Column) -> Column:
    return F.pmod(F.xxhash64(gateway), F.lit(BUCKETS)).cast(IntegerType())


def day_of(hour: Column) -> Column:
    """``completeness``'s second partition: the hour's date (UTC, the session's zone), or
    ``none`` for a gap with no time (a partition value must not be null)."""
    return F.coalesce(F.date_format(hour, "yyyy-MM-dd"), F.lit("none"))


def on_days(df: DataFrame, hour: Column, days: DataFrame) -> DataFrame:
    """The rows of ``df`` (with ``gateway``) whose bucket and ``day_of(hour)`` are a row
    of ``days`` (``_b``, ``_day``: a few, broadcast)."""
    keyed = df.withColumn("_b", bucket(F.col("gateway"))).withColumn("_day", day_of(hour))
    return keyed.join(F.broadcast(days), on=["_b", "_day"], how="left_semi").drop("_b", "_day")


def wire_ts(text: Column) -> Column:
    """A wire time (or a number of seconds) as a timestamp; null if it is neither."""
    return F.coalesce(
        F.try_to_timestamp(text, F.lit(TS_FORMAT)),
        F.timestamp_seconds(text.try_cast("double")),
    )


def kept_records(parsed: DataFrame, batch: int) -> DataFrame:
    """The batch's records (its good lines with a ``$`` sensor), one per id: the copy
    received first. ``parsed``: ``transforms.parse_landing``'s rows."""
    good = parsed.where(F.col("reason").isNull() & is_record(F.col("sensor")))
    best = F.min_by(
        F.struct("origin", "sensor", "ts_t", "flags", "record", "gateway", "received_t"),
        F.struct(F.coalesce("received_t", F.lit("9999-12-31").cast(TimestampType())),
                 F.coalesce("gateway", F.lit(""))),
    )  # fmt: skip
    one = good.groupBy("id").agg(best.alias("r"))
    return one.select(
        "id",
        "r.origin",
        "r.sensor",
        F.col("r.ts_t").alias("ts"),
        "r.flags",
        "r.record",
        "r.gateway",
        F.col("r.received_t").alias("received"),
        F.lit(batch).cast(LongType()).alias("batch"),
    )


def ledger_records(records: DataFrame) -> DataFrame:
    """The ``$ledger`` records among ``kept_records``' rows, their record parsed (``r``):
    ``ledger_rows``' input. Its eight branches each read this: materialise it first, or
    each parses every record's JSON again."""
    rec = F.from_json("record", LEDGER_RECORD)
    parts = F.split("id", "/")
    base = records.where(F.col("sensor") == LEDGER_SENSOR).select(
        "id",
        F.coalesce("gateway", "origin").alias("gateway"),
        parts.getItem(1).alias("epoch"),
        parts.getItem(2).try_cast(LongType()).alias("seq"),
        "ts",
        rec.alias("r"),
        "batch",
    )
    return base.where(F.col("seq").isNotNull()).select(
        "*",
        wire_ts(F.col("r.window").getItem(0)).alias("window_start"),
        wire_ts(F.col("r.window").getItem(1)).alias("window_end"),
    )


def ledger_rows(base: DataFrame) -> DataFrame:
    """The ``ledger`` rows of ``ledger_records``' records."""
    head = ["id", "gateway", "epoch", "seq", "ts", "window_start", "window_end"]
    none_s, none_t = F.lit(None).cast(StringType()), F.lit(None).cast(TimestampType())

    def rows(df: DataFrame, what: str, ranges: str, reason: Column, at: Column) -> DataFrame:
        out = df.select(*head, "stream", reason.alias("reason"), at.alias("at"),
                        F.explode(ranges).alias("rg"), "batch")  # fmt: skip
        return out.select(*head, "stream", F.lit(what).alias("what"), "reason", "at",
                          F.col("rg").getItem(0).alias("lo"), F.col("rg").getItem(1).alias("hi"),
                          "batch")  # fmt: skip

    top = base.where(F.col("r.top").isNotNull()).select(
        *head,
        F.concat_ws("/", "gateway", "epoch").alias("stream"),
        F.lit("top").alias("what"),
        none_s.alias("reason"),
        none_t.alias("at"),
        F.col("r.top").alias("lo"),
        F.col("r.top").alias("hi"),
        "batch",
    )
    streams = base.select(*head, F.explode("r.streams").alias("stream", "s"), "batch")
    out = top
    for what in ("held", "skipped", "stored"):
        out = out.unionByName(rows(streams, what, f"s.{what}", none_s, none_t))
    for what in ("evicted", "dead_letter"):
        ev = streams.select(*head, "stream", F.explode(f"s.{what}").alias("e"), "batch")
        out = out.unionByName(rows(ev, what, "e.ranges", none_s, wire_ts(F.col("e.at"))))
    for what in ("refused", "node_dropped"):
        by = streams.select(*head, "stream", F.explode(f"s.{what}").alias("why", "rgs"), "batch")
        out = out.unionByName(rows(by, what, "rgs", F.col("why"), none_t))
    ok = F.col("lo").isNotNull() & F.col("hi").isNotNull() & (F.col("lo") <= F.col("hi"))
    return out.where(ok & (F.col("lo") >= 0)).select(*LEDGER_COLUMNS)


def ledger_state(rows: DataFrame) -> DataFrame:
    """The compacted ledger (``STATE_SCHEMA``) of ``ledger`` rows, of state rows, or of
    both: a ``told`` row per stream (the largest position named), a ``head`` row per
    gateway (its latest ledger, by ``_latest_order``), that ledger's ``held`` rows, and
    each reason's range once per stream, reason, detail and bounds, at its earliest time
    (a piece takes the reason of least priority, then time: a later telling of the same
    range changes nothing). The rules read nothing else, so the table is the same from
    the state as from every ledger. Compacting is idempotent and associative: the state
    and a batch's new rows compact to the state of all of them, and a row written twice
    (a killed write, replayed) changes nothing."""
    rows = rows.select(*STATE_COLUMNS[:-1])
    none_s, none_t = F.lit(None).cast(StringType()), F.lit(None).cast(TimestampType())
    # (told and reason rows are no one ledger's: they hold no ledger's identity)
    anon = {"id": F.lit(""), "epoch": F.lit(""), "seq": F.lit(-1).cast(LongType()),
            "ts": none_t, "window_end": none_t}  # fmt: skip

    def as_state(df: DataFrame, **cols: Column) -> DataFrame:
        return df.select(*[cols.get(c, F.col(c)).alias(c) for c in STATE_COLUMNS[:-1]])

    named = rows.where(F.col("what") != "head").groupBy("gateway", "stream")
    told = as_state(
        named.agg(F.max("hi").alias("hi")),
        **anon, window_start=none_t, what=F.lit("told"), reason=none_s, at=none_t,
        lo=F.col("hi"),
    )  # fmt: skip
    order = F.struct(_latest_order(), "epoch", "ts", "window_start", "window_end")
    latest = rows.where(F.col("id") != "").groupBy("gateway").agg(F.max(order).alias("h"))
    head = as_state(
        latest, id=F.col("h.o.id"), epoch=F.col("h.epoch"), seq=F.col("h.o.seq"),
        ts=F.col("h.ts"), window_start=F.col("h.window_start"),
        window_end=F.col("h.window_end"), stream=F.lit(""), what=F.lit("head"), reason=none_s,
        at=none_t, lo=F.lit(0).cast(LongType()), hi=F.lit(0).cast(LongType()),
    )  # fmt: skip
    held = (
        rows.where(F.col("what") == "held")
        .join(head.select("gateway", "id"), on=["gateway", "id"], how="left_semi")
        .distinct()
    )
    reasons = as_state(
        rows.where(F.col("what").isin(*_REASON_ROWS))
        .groupBy("gateway", "stream", "what", "reason", "lo", "hi")
        .agg(F.min("window_start").alias("window_start"), F.min("at").alias("at")),
        **anon,
    )
    out = told.unionByName(head).unionByName(held).unionByName(reasons)
    return out.withColumn("bucket", bucket(F.col("gateway")))


# ------------------------------------------------------------------ landed positions


def merge_ranges(ranges: DataFrame, keys: list[str]) -> DataFrame:
    """Overlapping or adjacent ranges (``lo``, ``hi``, ``t``) of the same ``keys`` merged
    (``t``: the earliest)."""
    w = Window.partitionBy(*keys).orderBy("lo", "hi")
    prev = F.max("hi").over(w.rowsBetween(_UNBOUNDED, -1))
    start = prev.isNull() | (F.col("lo") > prev + 1)
    runs = ranges.withColumn("_start", start.cast(LongType())).withColumn(
        "_run", F.sum("_start").over(w.rowsBetween(_UNBOUNDED, 0))
    )
    return runs.groupBy(*keys, "_run").agg(
        F.min("lo").alias("lo"), F.max("hi").alias("hi"), F.min("t").alias("t")
    )


def _pos_time() -> Column:
    return F.coalesce("ts_t", "received_t")


def landed_ranges(parsed: DataFrame) -> DataFrame:
    """What a batch landed (``LANDED_SCHEMA``), from every line that parsed (kept or
    quarantined: it reached the landing zone): the store spans its messages' receive
    records name, and the node messages its reading ids name."""
    have = parsed.where(F.col("gateway").isNotNull())
    box = F.col("outbox")
    tail = F.substring_index("id", "/", -1)
    seq_s = F.substring_index(tail, ".", 1)
    i_s = F.substring_index(tail, ".", -1)
    slashes = F.length("id") - F.length(F.replace(F.col("id"), F.lit("/"), F.lit("")))
    dots = F.length(tail) - F.length(F.replace(tail, F.lit("."), F.lit("")))
    seq = seq_s.try_cast(LongType())
    node = (
        F.col("id").isNotNull()
        & (slashes == 2)
        & (dots == 1)
        & (seq.cast(StringType()) == seq_s)
        & (i_s.try_cast(LongType()).cast(StringType()) == i_s)
    )
    # A line names up to two ranges: its message's store span (every line of a message
    # names it) and, for a node's reading, its message. Two selects of the lines, one
    # aggregate: 0.7 s less on 2.25M lines (2.8-3.1 s against 3.6-3.9) than one pass
    # exploding a filtered array of both, the same rows.
    t = _pos_time().alias("t")
    spans = have.where(box.isNotNull() & box.epoch.isNotNull() & (box.first <= box.last)).select(
        "gateway",
        F.concat_ws("/", "gateway", box.epoch).alias("stream"),
        box.first.alias("lo"),
        box.last.alias("hi"),
        t,
    )
    messages = have.where(node).select(
        "gateway", F.substring_index("id", "/", 2).alias("stream"), seq.alias("lo"),
        seq.alias("hi"), t,
    )  # fmt: skip
    both = (
        spans.unionByName(messages)
        .groupBy("gateway", "stream", "lo", "hi")
        .agg(F.min("t").alias("t"))
        .withColumn("_hour", F.date_trunc("hour", "t"))
    )
    return merge_ranges(both, ["gateway", "stream", "_hour"]).select(*LANDED_COLUMNS)


def owned_ranges(ranges: DataFrame) -> DataFrame:
    """``LANDED_SCHEMA``'s ranges made disjoint, with ``_after`` (the position after the
    range before it; null for a stream's first): each position in the hour of its
    earliest copy (the earliest ``t`` of the ranges holding it). A span's positions take
    its last line's time, so a part of it sent again alone (its landing acknowledgement
    late) can hold them from an earlier hour.

    Only the hour of each position counts, and it is the least over every range holding
    it, so the result is the same however the ranges were grouped before: compacting
    ``landed`` (the state so far with a batch's ranges) is idempotent and associative,
    as a killed write read back, or a replay, needs.

    One ordered pass over each stream's ranges: a range that overlaps no other is kept,
    merged with the ranges of its hour it continues (consecutive positions of one hour a
    row). Ranges overlap only where a position landed twice: only those are cut into
    pieces at their bounds, each piece taking its owner. At a month of a 10,000-stream
    fleet (7.2M ranges, a stream's hour a range) this takes 16-17 s, where ordering the
    ranges by their first position and cutting off what came before (which gave a
    position landed twice to the wrong hour) took 9-10 s, and cutting every range at
    every bound 33-40 s."""
    key = ["gateway", "stream"]
    w = Window.partitionBy(*key).orderBy("lo", "hi")
    # Every look at a neighbour is taken in one window (one sort, one pass), the running
    # sums in a second over the same order: each window of its own is a pass over every
    # range (7.2M at a month of a 10,000-stream fleet: 19 s with eight, 16-17 s so).
    c = F.col
    looks = {
        "_p1": F.max("hi").over(w.rowsBetween(_UNBOUNDED, -1)),  # before this range
        "_p2": F.max("hi").over(w.rowsBetween(_UNBOUNDED, -2)),  # before the one before
        "_lo_p": F.lag("lo").over(w),
        "_hi_p": F.lag("hi").over(w),
        "_h_p": F.lag("_h").over(w),
        "_lo_n": F.lead("lo").over(w),
        "_hi_n": F.lead("hi").over(w),
        "_lo_n2": F.lead("lo", 2).over(w),
        "_h_n": F.lead("_h").over(w),
    }
    r = ranges.select(*LANDED_COLUMNS, F.date_trunc("hour", "t").alias("_h"))
    r = r.select("*", *[v.alias(k) for k, v in looks.items()])

    def start(lo: Column, before: Column) -> Column:  # overlaps nothing before it
        return F.coalesce(lo > before, F.lit(True))

    def many(lo: Column, hi: Column, before: Column, next_lo: Column) -> Column:
        # overlaps a range before it, or the next overlaps it or one before it
        reach = F.greatest(hi, before)  # (greatest skips a null)
        return ~start(lo, before) | F.coalesce(next_lo <= reach, F.lit(False))

    def new(lo: Column, before: Column, is_many: Column, was_many: Column, cont: Column) -> Column:
        # A group: a run of overlapping ranges, or of kept ranges of one hour that
        # continue each other (consecutive positions).
        cont = F.coalesce(~is_many & ~was_many & cont, F.lit(False))
        return F.when(is_many, start(lo, before)).otherwise(~cont)

    m = many(c("lo"), c("hi"), c("_p1"), c("_lo_n"))
    m_p = many(c("_lo_p"), c("_hi_p"), c("_p2"), c("lo"))
    reach = F.greatest("hi", "_p1")  # what comes before the next range
    m_n = many(c("_lo_n"), c("_hi_n"), reach, c("_lo_n2"))
    follows = (c("_hi_p") + 1 == c("lo")) & (c("_h_p") == c("_h"))
    n_follows = (c("hi") + 1 == c("_lo_n")) & (c("_h") == c("_h_n"))
    r = r.select(
        *LANDED_COLUMNS,
        m.alias("_many"),
        new(c("lo"), c("_p1"), m, m_p, follows).alias("_new"),
        (c("_p1") + 1).alias("_after"),
        # the last of its group: the next range begins a new one
        F.coalesce(
            F.when(c("_lo_n").isNotNull(), new(c("_lo_n"), reach, m_n, m, n_follows)),
            F.lit(True),
        ).alias("_last"),
    )
    upto = w.rowsBetween(_UNBOUNDED, 0)
    first = F.col("_new")
    r = r.select(
        "*",
        F.sum(first.cast(LongType())).over(upto).alias("_g"),
        # A group's first position, and what follows the range before it: its first
        # row's (both grow with the order, so the largest so far is the group's).
        F.max(F.when(first, F.col("lo"))).over(upto).alias("_g_lo"),
        F.max(F.when(first, F.col("_after"))).over(upto).alias("_a"),
    )
    # A group's ranges, where they overlap, on its last row: one row a group, and one
    # plan (no second read of the sorted ranges).
    rs = F.collect_list(F.when(F.col("_many"), F.struct("lo", "hi", "t")))
    groups = (
        r.withColumn("rs", rs.over(Window.partitionBy(*key, "_g")))
        .where(F.col("_last"))
        .select(*key, F.col("_g_lo").alias("lo"), "hi", "t", F.col("_a").alias("a"), "_many", "rs")
    )
    # A run of overlapping ranges covers every position from its first to its last, so
    # each piece between two consecutive bounds lies inside one range at least, and takes
    # the earliest of those; inside the run, what follows a piece is the next piece.
    pieces = F.expr(
        """transform(sequence(0, size(cuts) - 2), i -> named_struct(
            'lo', cuts[i], 'hi', cuts[i + 1] - 1,
            't', array_min(transform(filter(rs, x -> x.lo <= cuts[i] AND x.hi >= cuts[i + 1] - 1),
                                     x -> x.t)),
            '_after', IF(i = 0, a, cuts[i])))"""
    )
    # Pieces of one hour that follow each other are one (a range landed twice in its hour).
    merged = F.expr(
        """aggregate(pieces, slice(pieces, 1, 0), (acc, p) -> IF(
            size(acc) > 0 AND date_trunc('hour', acc[size(acc) - 1].t) = date_trunc('hour', p.t),
            concat(slice(acc, 1, size(acc) - 1), array(named_struct(
                'lo', acc[size(acc) - 1].lo, 'hi', p.hi, 't', least(acc[size(acc) - 1].t, p.t),
                '_after', acc[size(acc) - 1]._after))),
            concat(acc, array(p))))"""
    )
    bounds = F.transform("rs", lambda x: F.array(x.lo, x.hi + 1))
    one = F.array(F.struct("lo", "hi", "t", F.col("a").alias("_after")))
    parts = (
        groups.withColumn("cuts", F.array_sort(F.array_distinct(F.flatten(bounds))))
        .withColumn("pieces", F.when(F.col("_many"), pieces))
        .select(*key, F.explode(F.when(F.col("_many"), merged).otherwise(one)).alias("p"))
    )
    return parts.select(*key, "p.lo", "p.hi", "p.t", "p._after")


# ------------------------------------------------------------------ the table


def _kind() -> Column:
    return F.when(
        F.substring_index("stream", "/", 1) == F.col("gateway"), F.lit("store")
    ).otherwise(F.lit("node"))


def _latest_order() -> Column:
    """Which of a gateway's ledgers is its latest: by window end (else time), then seq."""
    return F.struct(F.coalesce("window_end", "ts").alias("wt"), "seq", "id").alias("o")


def reason_ranges(state: DataFrame) -> DataFrame:
    """Every range a reason covers, with its priority (``REASONS``' order), detail and time:
    the held ranges of each gateway's latest ledger, every ledger's other reasons.
    ``state``: ``ledger_state``'s rows."""
    held = state.where(F.col("what") == "held").select(
        "gateway", "stream", "what", "reason", F.col("window_end").alias("rt"), "lo", "hi"
    )
    timed = F.when(F.col("what").isin("evicted", "dead_letter"), F.col("at")).otherwise(
        F.col("window_start")
    )
    others = state.where(F.col("what").isin(*_REASON_ROWS)).select(
        "gateway", "stream", "what", "reason", timed.alias("rt"), "lo", "hi"
    )
    prio = F.lit(len(REASONS))
    for i, r in enumerate(REASONS):
        prio = F.when(F.col("what") == r, F.lit(i)).otherwise(prio)
    return held.unionByName(others).withColumn("prio", prio)


def streams_of(landed: DataFrame, state: DataFrame) -> DataFrame:
    """Per (gateway, stream): ``kind``, the first position, ``told`` (null: never told),
    ``top`` (the last position expected) and the gateway's latest ledger's window end.
    ``state``: ``ledger_state``'s rows."""
    told = (
        state.where(F.col("what") == "told")
        .groupBy("gateway", "stream")
        .agg(F.max("hi").alias("told"))
    )
    got = landed.groupBy("gateway", "stream").agg(F.max("hi").alias("got"))
    last = state.where(F.col("what") == "head").select(
        "gateway", F.coalesce("window_end", "ts").alias("last_t")
    )
    s = got.join(told, on=["gateway", "stream"], how="full")
    s = s.join(last, on="gateway", how="left")
    kind = _kind()
    return s.select(
        "gateway",
        "stream",
        kind.alias("kind"),
        F.when(kind == "store", F.lit(1)).otherwise(F.lit(0)).cast(LongType()).alias("first"),
        "told",
        F.greatest(F.coalesce("got", F.lit(-1)), F.coalesce("told", F.lit(-1))).alias("top"),
        "last_t",
    )


def _new_parts(landed: DataFrame) -> DataFrame:
    """The landed ranges made disjoint, with ``_after`` (``owned_ranges``), unless they
    are already (the job passes them so: made disjoint once for both tables)."""
    return landed if "_after" in landed.columns else owned_ranges(landed)


def missing_ranges(landed: DataFrame, state: DataFrame) -> DataFrame:
    """``completeness_gaps`` of every stream in ``landed`` and ``state`` (all of their
    gateways' rows; ``landed``: ``LANDED_SCHEMA``'s ranges, or ``owned_ranges``' made
    once for both tables; ``state``: ``ledger_state`` of their ledgers): each stream's
    missing ranges, per reason, detail and hour, by the rules in the module's docstring.
    (A caller that writes both tables materialises these first: ``hourly`` reads them.)"""
    # Both are read by several branches below: materialised (a row per stream, a row
    # per reason's range), not planned again in each.
    streams = streams_of(landed, state).localCheckpoint(eager=True)
    why = (
        reason_ranges(state)
        .select(
            F.col("gateway").alias("w_gateway"),
            F.col("stream").alias("w_stream"),
            F.col("lo").alias("rlo"),
            F.col("hi").alias("rhi"),
            "prio",
            "rt",
            "reason",
        )
        .localCheckpoint(eager=True)
    )
    parts = _new_parts(landed).join(
        streams.select("gateway", "stream", "first", "last_t", "told", "kind"),
        on=["gateway", "stream"],
    )
    # The gaps: before each landed part (from the first position, or after the parts
    # before it), and after the last one (to ``top``), with the time of what follows.
    before = parts.select(
        "gateway",
        "stream",
        F.coalesce("_after", "first").alias("lo"),
        (F.col("lo") - 1).alias("hi"),
        F.col("t").alias("gt"),
        "told",
        "kind",
    )
    ends = landed.groupBy("gateway", "stream").agg(F.max("hi").alias("end"))
    after = streams.join(ends, on=["gateway", "stream"], how="left").select(
        "gateway",
        "stream",
        F.coalesce(F.col("end") + 1, F.col("first")).alias("lo"),
        F.col("top").alias("hi"),
        F.col("last_t").alias("gt"),
        "told",
        "kind",
    )
    gaps = before.unionByName(after).where(F.col("hi") >= F.col("lo"))
    pieces = _pieces(gaps, why)
    same = (F.col("gateway") == F.col("w_gateway")) & (F.col("stream") == F.col("w_stream"))
    # Cut at every reason's bounds, a piece lies wholly inside each reason it meets.
    hit = pieces.join(
        why, on=same & (F.col("rlo") <= F.col("lo")) & (F.col("rhi") >= F.col("hi")), how="left"
    )
    best = hit.groupBy("gateway", "stream", "kind", "told", "lo", "hi", "gt").agg(
        F.min(F.struct("prio", "rt", "reason")).alias("b")
    )
    # (not element_at: given a null index, Spark 4 answers the array's last element)
    reason = F.when(F.col("lo") <= F.col("told"), F.lit("unexplained")).otherwise(
        F.lit("unreported")
    )
    for i, r in reversed(list(enumerate(REASONS))):
        reason = F.when(F.col("b.prio") == i, F.lit(r)).otherwise(reason)
    each = best.select(
        "gateway",
        "stream",
        "kind",
        "lo",
        "hi",
        reason.alias("reason"),
        F.col("b.reason").alias("detail"),
        F.date_trunc("hour", F.coalesce("b.rt", "gt")).alias("hour"),
    )
    # Adjacent pieces of one reason, detail and hour are one range (pieces of two gaps
    # never touch: a landed part lies between them).
    w = Window.partitionBy("gateway", "stream", "reason", "detail", "hour").orderBy("lo")
    follows = F.coalesce(F.lag("hi", 1).over(w) + 1 == F.col("lo"), F.lit(False))
    return (
        each.withColumn("_g", F.sum((~follows).cast(LongType())).over(w.rowsBetween(_UNBOUNDED, 0)))
        .groupBy("gateway", "stream", "kind", "reason", "detail", "hour", "_g")
        .agg(F.min("lo").alias("lo"), F.max("hi").alias("hi"))
        .select(
            "gateway",
            "stream",
            "kind",
            "lo",
            "hi",
            (F.col("hi") - F.col("lo") + 1).alias("n"),
            "reason",
            "detail",
            "hour",
            bucket(F.col("gateway")).alias("bucket"),
        )
    )


def _pieces(gaps: DataFrame, why: DataFrame) -> DataFrame:
    """Each gap (``lo``..``hi``, with ``gt``, ``told``, ``kind``) cut where a reason range
    begins or ends inside it, and after ``told``: pieces that every reason covers whole
    or not at all, judged as one. Their number follows the gaps and the ledgers' ranges,
    not the positions missing (a hole of a million positions is one piece)."""
    key = ["gateway", "stream", "lo"]
    g = gaps.select(*key, F.col("hi").alias("g_hi"), "gt", "told", "kind")
    inside = (F.col("cut") > F.col("lo")) & (F.col("cut") <= F.col("g_hi"))
    ends = why.select(
        "w_gateway", "w_stream", F.explode(F.array("rlo", F.col("rhi") + 1)).alias("cut")
    )
    same = (F.col("gateway") == F.col("w_gateway")) & (F.col("stream") == F.col("w_stream"))
    cols = [*g.columns, "cut"]
    cuts = (
        g.withColumn("cut", F.col("lo"))
        .unionByName(g.withColumn("cut", F.col("told") + 1).where(inside))
        .unionByName(g.join(ends, on=same).where(inside).select(*cols))
        .distinct()
    )
    w = Window.partitionBy(*key).orderBy("cut")
    return cuts.select(
        "gateway",
        "stream",
        "kind",
        "told",
        F.col("cut").alias("lo"),
        F.coalesce(F.lead("cut", 1).over(w) - 1, F.col("g_hi")).alias("hi"),
        "gt",
    )


def hourly(
    landed: DataFrame, state: DataFrame, gap_rows: DataFrame, days: DataFrame | None = None
) -> DataFrame:
    """``completeness``: per stream and hour, expected, landed, missing by reason and
    skipped, from the landed ranges (``owned_ranges``), the ledgers' skipped seqs
    (``state``: ``ledger_state``) and the stream's missing ranges (``missing_ranges``).
    ``days`` (``_b``, ``_day``; ``None``: all): only the rows of those buckets' days,
    built from those days' parts and gaps only (an hour's row is its own parts' and
    gaps' sums, so the rest need not be read)."""
    parts = _new_parts(landed)
    if days is not None:
        parts = on_days(parts, F.date_trunc("hour", "t"), days)
        gap_rows = on_days(gap_rows, F.col("hour"), days)
    # Landed per hour: the disjoint parts, less the skipped seqs inside them (a span may
    # hold seqs the store never gave).
    skipped = merge_ranges(
        state.where(F.col("what") == "skipped").select(
            "gateway", "stream", "lo", "hi", F.lit(None).cast(TimestampType()).alias("t")
        ),
        ["gateway", "stream"],
    ).select("gateway", "stream", F.col("lo").alias("slo"), F.col("hi").alias("shi"))
    skipped = skipped.withColumnRenamed("gateway", "s_gateway").withColumnRenamed(
        "stream", "s_stream"
    )
    lp = (
        parts.join(
            skipped,
            on=(F.col("gateway") == F.col("s_gateway"))
            & (F.col("stream") == F.col("s_stream"))
            & (F.col("slo") <= F.col("hi"))
            & (F.col("shi") >= F.col("lo")),
            how="left",
        )
        .groupBy("gateway", "stream", "lo", "hi", "t")
        # (least and greatest skip nulls: a part with no skipped seqs counts none)
        .agg(
            F.sum(
                F.when(F.col("slo").isNotNull(), F.least("hi", "shi") - F.greatest("lo", "slo") + 1)
            ).alias("sk")
        )
    )
    zero = F.lit(0).cast(LongType())
    landed_h = lp.select(
        "gateway",
        "stream",
        F.date_trunc("hour", "t").alias("hour"),
        (F.col("hi") - F.col("lo") + 1 - F.coalesce("sk", zero)).alias("landed"),
        F.coalesce("sk", zero).alias("skipped"),
        *[zero.alias(c) for c in COUNTS],
    )
    gap_h = gap_rows.select(
        "gateway",
        "stream",
        "hour",
        zero.alias("landed"),
        F.when(F.col("reason") == "skipped", F.col("n")).otherwise(zero).alias("skipped"),
        *[F.when(F.col("reason") == c, F.col("n")).otherwise(zero).alias(c) for c in COUNTS],
    )
    sums = [F.sum(c).cast(LongType()).alias(c) for c in ("landed", "skipped", *COUNTS)]
    per_hour = landed_h.unionByName(gap_h).groupBy("gateway", "stream", "hour").agg(*sums)
    missing_n = sum((F.col(c) for c in COUNTS), zero)
    return per_hour.select(
        "gateway",
        "stream",
        _kind().alias("kind"),
        "hour",
        (F.col("landed") + missing_n).cast(LongType()).alias("expected"),
        "landed",
        missing_n.cast(LongType()).alias("missing"),
        *COUNTS,
        "skipped",
        bucket(F.col("gateway")).alias("bucket"),
        day_of(F.col("hour")).alias("day"),
    )
