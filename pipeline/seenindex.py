"""The seen index: which reading ids the warehouse has kept, per stream, as ranges.

Every reading id is a position in a stream (docs/wire-format.md, the design's
reading id):

- ``{origin}/{epoch}/{seq}``: a gateway's own sensors; the stream is
  (origin, epoch, plain), its position ``seq * 1000``;
- ``{node}/{boot}/{seq}.{i}``: a node's; the stream is (node, boot, dotted), its
  position ``seq * 1000 + i``. A node message has at most 500 readings
  (sync/schemas/node-readings.v1.json: ``maxItems``), so ``i`` < 1000 always
  (``POS_SCALE``); ``seq`` up to 2^53 - 1 (the schemas' bound), so a position fits
  a long. The stream key is what a gateway computes too: its own
  (gateway id, store epoch), a node's (node id, boot).

An id is a stream position only in that exact form: three ``/``-separated levels,
non-empty origin and epoch, ``seq`` (and ``i``) digits without a leading zero
(``7``, not ``07``: those are other ids). Any other id (a test's ``gw/e/0.air``)
is kept in the index's exceptions, one row per id, as before.

**A run** is one row of ``seen_ranges``: a stream's positions from ``lo`` to
``hi`` whose index ``i`` is below ``width`` (``pos % 1000 < width``). A gateway's
own readings have ``width`` 1 (every seq from ``lo`` to ``hi``); a node's, the
number of readings its messages hold, so a node sending three readings a message
is one run ``width`` 3 however many messages it sends; a message of another
size starts another run. Each run claims exactly the positions kept, never one
more: a reading that a run's width leaves out (a bigger message, split across
batches) is not claimed and is another run. ``n`` is how many positions it
claims.

Beside the positions, what the dedup needs of the copies kept there (the copy
received first wins, docs/pipeline.md): ``last_received``/``last_gateway``, the
largest copy order (``transforms.copy_order``) of any copy kept in the run, an
upper bound of each one's: a copy of one of its ids ordered at or after it loses
without looking further; and where the kept copies are (``date_lo``..``date_hi``,
``batch_lo``..``batch_hi``, ``ts_lo``..``ts_hi``: bounds), for the rare copy
that is ordered before it: the kept copy is then read from ``readings`` to decide.

**Building runs** (``build_runs``): positions (or the pieces of older runs,
``explode_runs``) are first merged into pieces, contiguous indexes within one
message; then pieces are chained over consecutive messages: piece ``x`` continues
its predecessor ``p`` when ``x`` is the next message, starts at index 0, and fits
``p``'s width (as the last message, ``x.b <= p.b``; within a run, ``x.b == p.b``),
and ``p`` itself was not the shorter last message of a run before it. A run's
width is its first piece's ``b + 1``. The same rule, stated in SQL, makes
DuckDB's reference runs (devkit/duckdb_reference.py: ``kept_ranges``).
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

POS_SCALE = 1000  # position = seq * POS_SCALE + i; a node message's i < 500 < POS_SCALE
MAX_SEQ = 2**53 - 1  # the wire schemas' bound (every JSON reader holds it exactly)
RANGE_BUCKETS = 16
# A stream kept in more runs than this (in a batch's rows, or after a compaction) is
# kept as one envelope instead: a gateway's own seqs interleave with its nodes'.
MAX_EXACT = 8
_BROADCAST = 1_000_000  # messages with a hole a join broadcasts (a checkpoint has no size)
_SPLIT_MAX = 100_000  # messages of a run split into one segment each, at most
KEY = ["origin", "epoch", "dotted"]

RANGES_SCHEMA = StructType(
    [
        StructField("origin", StringType(), False),
        StructField("epoch", StringType(), False),  # a gateway's store epoch, a node's boot
        StructField("dotted", BooleanType(), False),  # a node's ids: {seq}.{i}
        StructField("lo", LongType(), False),
        StructField("hi", LongType(), False),
        StructField("width", IntegerType(), False),
        StructField("exact", BooleanType(), False),  # false: an envelope (MAX_EXACT)
        StructField("n", LongType(), False),
        StructField("last_received", TimestampType(), False),  # coalesced as copy_order does
        StructField("last_gateway", StringType(), False),
        StructField("ts_lo", TimestampType()),
        StructField("ts_hi", TimestampType()),
        StructField("date_lo", StringType(), False),
        StructField("date_hi", StringType(), False),
        StructField("batch_lo", LongType(), False),
        StructField("batch_hi", LongType(), False),
        StructField("bucket", IntegerType(), False),
        StructField("gen", LongType(), False),
    ]
)
RANGE_COLUMNS = [f.name for f in RANGES_SCHEMA.fields[:-1]]  # gen is the writer's batch
_META = ["last", "ts_lo", "ts_hi", "date_lo", "date_hi", "batch_lo", "batch_hi"]
NEVER = "9999-12-31"  # copy_order's received for a copy without one


def stream_position(id_col: Column) -> list[Column]:
    """``origin``, ``epoch``, ``dotted`` and ``pos`` of an id (``pos`` null: not a stream
    position). String functions only, no regular expression on every row; a number is
    canonical when it prints back as written."""
    slashes = F.length(id_col) - F.length(F.replace(id_col, F.lit("/"), F.lit("")))
    origin = F.substring_index(id_col, "/", 1)
    epoch = F.substring_index(F.substring_index(id_col, "/", 2), "/", -1)
    tail = F.substring_index(id_col, "/", -1)
    dots = F.length(tail) - F.length(F.replace(tail, F.lit("."), F.lit("")))
    seq_s = F.substring_index(tail, ".", 1)
    i_s = F.substring_index(tail, ".", -1)
    seq = seq_s.try_cast(LongType())
    i = F.when(dots == 1, i_s.try_cast(LongType())).otherwise(F.lit(0).cast(LongType()))
    ok = (
        (slashes == 2)
        & (F.length(origin) > 0)
        & (F.length(epoch) > 0)
        & (F.length(seq_s) <= 16)
        & (seq.cast(StringType()) == seq_s)
        & (seq <= F.lit(MAX_SEQ))
        & (
            (dots == 0)
            | (
                (dots == 1)
                & (F.length(i_s) <= 3)
                & (i.cast(StringType()) == i_s)
                & (i < F.lit(POS_SCALE))
            )
        )
    )
    pos = F.when(ok, F.try_add(F.try_multiply(seq, F.lit(POS_SCALE)), i))
    return [
        origin.alias("origin"),
        epoch.alias("epoch"),
        (dots == 1).alias("dotted"),
        pos.alias("pos"),
    ]


def range_bucket(id_col: Column) -> Column:
    """A stream's bucket of ``seen_ranges``: a hash of the id's ``{origin}/{epoch}``."""
    prefix = F.substring_index(id_col, "/", 2)
    return F.pmod(F.xxhash64(prefix), F.lit(RANGE_BUCKETS)).cast(IntegerType())


def _stream_bucket() -> Column:
    prefix = F.concat_ws("/", F.col("origin"), F.col("epoch"))
    return F.pmod(F.xxhash64(prefix), F.lit(RANGE_BUCKETS)).cast(IntegerType())


def last_copy(received: Column, gateway: Column) -> Column:
    """A copy's order as ``copy_order`` makes it, with named fields (``received``,
    ``gateway``): the runs keep the largest."""
    return F.struct(
        F.coalesce(received, F.lit(NEVER).cast(TimestampType())).alias("received"),
        F.coalesce(gateway, F.lit("")).alias("gateway"),
    )


def position_segments(kept: DataFrame) -> DataFrame:
    """One segment per kept position (``kept``: the stream key, ``pos``, and the copy's
    ``received``, ``gateway``, ``ts``, ``date``, ``batch``), the input of ``build_runs``."""
    s = F.expr(f"pos div {POS_SCALE}")
    i = (F.col("pos") % F.lit(POS_SCALE)).cast(IntegerType())
    return kept.select(
        *KEY,
        s.alias("s_lo"),
        i.alias("a"),
        s.alias("s_hi"),
        i.alias("b"),
        (i + 1).alias("w"),
        F.lit(1).cast(LongType()).alias("n"),
        last_copy(F.col("received"), F.col("gateway")).alias("last"),
        F.col("ts").alias("ts_lo"),
        F.col("ts").alias("ts_hi"),
        F.col("date").alias("date_lo"),
        F.col("date").alias("date_hi"),
        F.col("batch").cast(LongType()).alias("batch_lo"),
        F.col("batch").cast(LongType()).alias("batch_hi"),
    )


def explode_runs(runs: DataFrame) -> DataFrame:
    """Runs as segments again: the first message's piece, the second message (a piece
    of its own, so that chaining decides on it as on any piece), the full messages
    between as one segment, the last message's piece. Each carries its run's bounds."""
    k = F.lit(POS_SCALE)
    s1, s2 = F.expr(f"lo div {POS_SCALE}"), F.expr(f"hi div {POS_SCALE}")
    a1, b2 = (F.col("lo") % k).cast(IntegerType()), (F.col("hi") % k).cast(IntegerType())
    w = F.col("width")
    meta = [
        last_copy(F.col("last_received"), F.col("last_gateway")).alias("last"),
        *[F.col(c) for c in _META[1:]],
    ]
    r = runs.where(F.col("exact")).select(
        *KEY, s1.alias("s1"), s2.alias("s2"), a1.alias("a1"), b2.alias("b2"), w, *meta
    )

    def seg(
        where: Column, s_lo: Column, a: Column, s_hi: Column, b: Column, w: Column
    ) -> DataFrame:
        n = (s_hi - s_lo) * w.cast(LongType()) + (b - a + 1).cast(LongType())
        return r.where(where).select(
            *KEY,
            s_lo.cast(LongType()).alias("s_lo"),
            a.cast(IntegerType()).alias("a"),
            s_hi.cast(LongType()).alias("s_hi"),
            b.cast(IntegerType()).alias("b"),
            w.cast(IntegerType()).alias("w"),
            n.alias("n"),
            *_META,
        )

    s1c, s2c, wc = F.col("s1"), F.col("s2"), F.col("width")
    zero, full = F.lit(0), wc - 1
    segs = (
        seg(s1c == s2c, s1c, F.col("a1"), s1c, F.col("b2"), F.col("b2") + 1)
        .unionByName(seg(s1c < s2c, s1c, F.col("a1"), s1c, full, wc))
        .unionByName(seg(s1c + 1 < s2c, s1c + 1, zero, s1c + 1, full, wc))
        .unionByName(seg(s1c + 2 < s2c, s1c + 2, zero, s2c - 1, full, wc))
        .unionByName(seg(s1c < s2c, s2c, zero, s2c, F.col("b2"), F.col("b2") + 1))
    )
    return _split_intruded(segs)


def _split_intruded(segs: DataFrame) -> DataFrame:
    """Full messages (a segment of several) that another segment has readings of (a
    message bigger than the run's width, its rest kept by another batch) split into one
    segment each, so that chaining sees them as it sees any message. Bounded: a longer
    stretch stays whole (the runs stay exact, only not as few as they could be)."""
    body = (F.col("s_lo") < F.col("s_hi")) & (F.col("s_hi") - F.col("s_lo") <= F.lit(_SPLIT_MAX))
    bodies = segs.where(body).select(*KEY, "s_lo", "s_hi")
    starts = segs.select(*KEY, F.col("s_lo").alias("x"))
    hit = (
        bodies.join(starts, on=KEY)
        .where((F.col("x") > F.col("s_lo")) & (F.col("x") <= F.col("s_hi")))
        .select(*KEY, "s_lo", "s_hi")
        .distinct()
        .withColumn("_hit", F.lit(True))
    )
    marked = segs.join(hit, on=[*KEY, "s_lo", "s_hi"], how="left")
    whole = marked.where(F.col("_hit").isNull()).drop("_hit")
    split = marked.where(F.col("_hit")).select(
        *KEY,
        F.explode(F.sequence("s_lo", "s_hi")).alias("s"),
        "w",
        *_META,
    )
    return whole.unionByName(
        split.select(
            *KEY,
            F.col("s").alias("s_lo"),
            F.lit(0).alias("a"),
            F.col("s").alias("s_hi"),
            (F.col("w") - 1).alias("b"),
            "w",
            F.col("w").cast(LongType()).alias("n"),
            *_META,
        )
    )


def _meta_aggs() -> list[Column]:
    return [
        F.max("last").alias("last"),
        F.min("ts_lo").alias("ts_lo"),
        F.max("ts_hi").alias("ts_hi"),
        F.min("date_lo").alias("date_lo"),
        F.max("date_hi").alias("date_hi"),
        F.min("batch_lo").alias("batch_lo"),
        F.max("batch_hi").alias("batch_hi"),
    ]


def build_runs(segments: DataFrame) -> DataFrame:
    """Segments (``position_segments``, ``explode_runs``) of disjoint positions as runs
    (``RANGE_COLUMNS``): pieces within a message merged, then pieces chained over
    messages (the module's docstring has the rule)."""
    return _chain(_pieces(segments))


def _pieces(segments: DataFrame) -> DataFrame:
    """Contiguous indexes of one message: one piece (``build_runs``' first step)."""
    order = Window.partitionBy(*KEY).orderBy("s_lo", "a")
    running = order.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    single = F.col("s_lo") == F.col("s_hi")
    joined = (
        F.lag(single, 1).over(order)
        & single
        & (F.lag("s_hi", 1).over(order) == F.col("s_lo"))
        & (F.lag("b", 1).over(order) + 1 == F.col("a"))
    )
    return (
        segments.withColumn(
            "g", F.sum((~F.coalesce(joined, F.lit(False))).cast("int")).over(running)
        )
        .groupBy(*KEY, "g")
        .agg(
            F.min("s_lo").alias("s_lo"),
            F.min("a").alias("a"),
            F.max("s_hi").alias("s_hi"),
            F.max("b").alias("b"),
            F.max("w").alias("w_body"),
            F.sum("n").alias("n"),
            *_meta_aggs(),
        )
        .withColumn(
            "w",
            F.when(F.col("s_lo") == F.col("s_hi"), F.col("b") + 1).otherwise(F.col("w_body")),
        )
        .drop("g", "w_body")
    )


def _chain(pieces: DataFrame) -> DataFrame:
    """Pieces chained over consecutive messages (``build_runs``' second step)."""
    order = Window.partitionBy(*KEY).orderBy("s_lo", "a")
    running = order.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    single = F.col("s_lo") == F.col("s_hi")
    p_b = F.lag("b", 1).over(order)
    fits = (
        (F.col("s_lo") == F.lag("s_hi", 1).over(order) + 1)
        & (F.col("a") == 0)
        & F.when(single, F.col("b") <= p_b).otherwise(F.col("b") == p_b)
    )
    linked = pieces.withColumn("fits", F.coalesce(fits, F.lit(False)))
    start = ~F.col("fits") | (
        F.coalesce(F.lag("fits", 1).over(order), F.lit(False))
        & (F.lag("b", 1).over(order) != F.lag("b", 2).over(order))
    )
    first = F.min_by(F.struct("s_lo", "a", "b", "w"), F.col("s_lo"))
    last = F.max_by(F.struct("s_hi", "b"), F.col("s_lo"))
    runs = (
        linked.withColumn("start", start)
        .withColumn("g", F.sum(F.col("start").cast("int")).over(running))
        .groupBy(*KEY, "g")
        .agg(
            first.alias("f"),
            last.alias("l"),
            F.count(F.lit(1)).alias("pieces"),
            F.sum("n").alias("n"),
            *_meta_aggs(),
        )
    )
    k = F.lit(POS_SCALE).cast(LongType())
    return runs.select(
        *KEY,
        (F.col("f.s_lo") * k + F.col("f.a")).alias("lo"),
        (F.col("l.s_hi") * k + F.col("l.b")).alias("hi"),
        F.when(F.col("pieces") == 1, F.col("f.w"))
        .otherwise(F.col("f.b") + 1)
        .cast(IntegerType())
        .alias("width"),
        F.lit(True).alias("exact"),
        F.col("n").cast(LongType()).alias("n"),
        F.col("last.received").alias("last_received"),
        F.col("last.gateway").alias("last_gateway"),
        "ts_lo",
        "ts_hi",
        "date_lo",
        "date_hi",
        "batch_lo",
        "batch_hi",
        _stream_bucket().alias("bucket"),
    )


def bounded(runs: DataFrame) -> DataFrame:
    """Each stream in at most ``MAX_EXACT`` exact runs, or else in one envelope.

    An envelope (``exact`` false, ``width`` ``POS_SCALE``) claims every position from
    ``lo`` to ``hi`` as *maybe* kept: ``n`` is still how many are, but which ones only
    ``readings`` says, so a copy of an id inside it is always decided by reading its
    kept copy back (``claims``). A gateway's own readings need it: their seqs are the
    store's, which every node reading takes one of too, so a gateway's own stream is a
    run per stretch between its nodes' messages (the landing files do not say which
    seqs carried node readings)."""
    per = Window.partitionBy(*KEY)
    wide = (F.count(F.lit(1)).over(per) > F.lit(MAX_EXACT)) | (
        F.min(F.col("exact").cast("int")).over(per) == 0
    )
    # One aggregate over the window's output, not a union of two filters of it: the
    # runs' plan (build_runs: its windows and aggregates) would run once per branch.
    # A wide stream's runs fall in one group; every other run is a group of its own.
    run = F.when(~F.col("_wide"), F.struct("lo", "hi", "width"))
    return (
        runs.withColumn("_wide", wide)
        .groupBy(*KEY, run.alias("_run"))
        .agg(
            F.first("_wide").alias("_wide"),
            F.min("lo").alias("lo"),
            F.max("hi").alias("hi"),
            F.max("width").alias("_width"),
            F.sum("n").alias("n"),
            F.max(F.struct("last_received", "last_gateway")).alias("last"),
            F.min("ts_lo").alias("ts_lo"),
            F.max("ts_hi").alias("ts_hi"),
            F.min("date_lo").alias("date_lo"),
            F.max("date_hi").alias("date_hi"),
            F.min("batch_lo").alias("batch_lo"),
            F.max("batch_hi").alias("batch_hi"),
            F.first("bucket").alias("bucket"),
        )
        .select(
            *KEY,
            "lo",
            "hi",
            F.when(F.col("_wide"), F.lit(POS_SCALE))
            .otherwise(F.col("_width"))
            .cast(IntegerType())
            .alias("width"),
            F.coalesce(~F.col("_wide"), F.lit(False)).alias("exact"),
            F.col("n").cast(LongType()).alias("n"),
            F.col("last.last_received").alias("last_received"),
            F.col("last.last_gateway").alias("last_gateway"),
            "ts_lo",
            "ts_hi",
            "date_lo",
            "date_hi",
            "batch_lo",
            "batch_hi",
            "bucket",
        )
    )


def kept_runs(kept: DataFrame) -> DataFrame:
    """``bounded(build_runs(position_segments(kept)))``, with the windows over messages,
    not readings, and none for a stream that cannot be ``MAX_EXACT`` runs or fewer.

    First one aggregate per message (``_messages``): a message whose kept indexes are
    contiguous is one piece already (the windows' first step merges nothing else into
    it), so only the positions of a message with a hole inside go through that step.
    Then, over the messages: a run chains consecutive messages only, so a stream has at
    least as many runs as messages that start a stretch (their predecessor has no
    position kept). Those are counted by hashed aggregates, where a predecessor lies in
    the same block of 64 messages: a bit per message, ``bits & ~(bits << 1)`` (a lower
    bound, never more than the runs). A stream with more than ``MAX_EXACT`` (in a batch,
    most: the messages that arrive out of order across a batch's edge leave holes at
    both ends) becomes the envelope ``bounded`` would make of its runs, from the same
    aggregates; only the other streams are chained through the windows. ``kept``: as for
    ``position_segments``."""
    msgs = _messages(kept).localCheckpoint(eager=True)
    last = F.col("last")
    blocks = msgs.groupBy(*KEY, F.expr("s div 64").alias("_block")).agg(
        F.bit_or(F.expr("shiftleft(1L, cast(s % 64 as int))")).alias("_bits"),
        F.min(F.col("s") * F.lit(POS_SCALE) + F.col("a")).alias("lo"),
        F.max(F.col("s") * F.lit(POS_SCALE) + F.col("b")).alias("hi"),
        F.sum("n").alias("n"),
        F.max(last.received).alias("last_received"),
        F.min("ts_lo").alias("ts_lo"),
        F.max("ts_hi").alias("ts_hi"),
        F.min(F.to_date("date_lo")).alias("day_lo"),
        F.max(F.to_date("date_hi")).alias("day_hi"),
        F.min("batch_lo").alias("batch_lo"),
        F.max("batch_hi").alias("batch_hi"),
    )
    bits = F.col("_bits")
    starts = F.bit_count(bits.bitwiseAND(F.bitwise_not(F.shiftleft(bits, 1))).bitwiseAND(-2))
    wide = (
        blocks.groupBy(*KEY)
        .agg(
            F.sum(starts).alias("_starts"),
            F.min("lo").alias("lo"),
            F.max("hi").alias("hi"),
            F.sum("n").alias("n"),
            F.max("last_received").alias("last_received"),
            F.min("ts_lo").alias("ts_lo"),
            F.max("ts_hi").alias("ts_hi"),
            F.min("day_lo").alias("day_lo"),
            F.max("day_hi").alias("day_hi"),
            F.min("batch_lo").alias("batch_lo"),
            F.max("batch_hi").alias("batch_hi"),
        )
        .where(F.col("_starts") > F.lit(MAX_EXACT))
        .localCheckpoint(eager=True)
    )
    if not wide.count():
        return bounded(_chain(_message_pieces(msgs, kept)))
    at = F.broadcast(wide.select(*KEY, F.col("last_received").alias("_at")))
    few = msgs.join(at, on=KEY, how="left_anti")
    # The largest gateway among the copies received last: each message's ``last`` is
    # its own largest (time, gateway), so its gateway where its time is the stream's.
    gateway = (
        msgs.join(at, on=KEY)
        .where(last.received == F.col("_at"))
        .groupBy(*KEY)
        .agg(F.max(last.gateway).alias("last_gateway"))
    )
    envelopes = wide.join(gateway, on=KEY).select(
        *KEY,
        "lo",
        "hi",
        F.lit(POS_SCALE).cast(IntegerType()).alias("width"),
        F.lit(False).alias("exact"),
        F.col("n").cast(LongType()).alias("n"),
        "last_received",
        "last_gateway",
        "ts_lo",
        "ts_hi",
        F.date_format("day_lo", "yyyy-MM-dd").alias("date_lo"),
        F.date_format("day_hi", "yyyy-MM-dd").alias("date_hi"),
        F.col("batch_lo").cast(LongType()).alias("batch_lo"),
        F.col("batch_hi").cast(LongType()).alias("batch_hi"),
        _stream_bucket().alias("bucket"),
    )
    return bounded(_chain(_message_pieces(few, kept))).unionByName(envelopes)


def _messages(kept: DataFrame) -> DataFrame:
    """Per stream and message (``s``): the smallest and largest index kept (``a``,
    ``b``), how many (``n``) and the copies' bounds (``_META``).

    Hashed first, per message and copy order (a message's readings share theirs), with
    numbers only: a string's or a struct's minimum makes Spark sort every row (twice:
    before and after the exchange). Only what is left, about a row per message, is
    sorted for the largest copy order. One exchange, by stream, serves both."""
    s = F.expr(f"pos div {POS_SCALE}").alias("s")
    i = (F.col("pos") % F.lit(POS_SCALE)).cast(IntegerType())
    copies = (
        kept.repartition(*KEY)
        .groupBy(
            *KEY,
            s,
            F.coalesce(F.col("received"), F.lit(NEVER).cast(TimestampType())).alias("_r"),
            F.coalesce(F.col("gateway"), F.lit("")).alias("_g"),
        )
        .agg(
            F.min(i).alias("a"),
            F.max(i).alias("b"),
            F.count(F.lit(1)).alias("n"),
            F.min("ts").alias("ts_lo"),
            F.max("ts").alias("ts_hi"),
            F.min(F.to_date("date")).alias("day_lo"),
            F.max(F.to_date("date")).alias("day_hi"),
            F.min("batch").alias("batch_lo"),
            F.max("batch").alias("batch_hi"),
        )
    )
    return (
        copies.groupBy(*KEY, "s")
        .agg(
            F.min("a").alias("a"),
            F.max("b").alias("b"),
            F.sum("n").alias("n"),
            F.max(F.struct(F.col("_r").alias("received"), F.col("_g").alias("gateway"))).alias(
                "last"
            ),
            F.min("ts_lo").alias("ts_lo"),
            F.max("ts_hi").alias("ts_hi"),
            F.min("day_lo").alias("day_lo"),
            F.max("day_hi").alias("day_hi"),
            F.min("batch_lo").cast(LongType()).alias("batch_lo"),
            F.max("batch_hi").cast(LongType()).alias("batch_hi"),
        )
        .select(
            *KEY,
            "s",
            "a",
            "b",
            "n",
            "last",
            "ts_lo",
            "ts_hi",
            F.date_format("day_lo", "yyyy-MM-dd").alias("date_lo"),
            F.date_format("day_hi", "yyyy-MM-dd").alias("date_hi"),
            "batch_lo",
            "batch_hi",
        )
    )


def _message_pieces(msgs: DataFrame, kept: DataFrame) -> DataFrame:
    """``_pieces(position_segments(...))`` of the messages ``msgs`` names: one piece per
    message whose kept indexes are contiguous; the positions of the others (a hole
    inside: rare) through the window."""
    whole = F.col("n") == (F.col("b") - F.col("a") + 1).cast(LongType())
    pieces = msgs.where(whole).select(
        *KEY,
        F.col("s").alias("s_lo"),
        "a",
        F.col("s").alias("s_hi"),
        "b",
        (F.col("b") + 1).alias("w"),
        F.col("n").cast(LongType()).alias("n"),
        *_META,
    )
    holes = msgs.where(~whole).select(*KEY, "s")
    n_holes = holes.count()
    if not n_holes:
        return pieces
    if n_holes < _BROADCAST:
        holes = F.broadcast(holes)
    s = F.expr(f"pos div {POS_SCALE}").alias("s")
    inside = kept.withColumn("s", s).join(holes, on=[*KEY, "s"], how="left_semi")
    return pieces.unionByName(_pieces(position_segments(inside.drop("s"))))


def merge_runs(runs: DataFrame) -> DataFrame:
    """Runs of earlier batches merged into as few as the rule allows (a compaction);
    envelopes absorb the rest of their stream."""
    exact = build_runs(explode_runs(runs))
    return bounded(exact.unionByName(runs.where(~F.col("exact")).select(*RANGE_COLUMNS)))


def claims(candidates: DataFrame, runs: DataFrame) -> DataFrame:
    """Per candidate id whose position a run claims: ``bound``, the smallest ``last`` of
    the exact runs claiming it (an upper bound of the kept copy's order; null when only
    an envelope does), ``envelope`` (one does), and where to look for the kept copy
    (the union of the claiming runs' date and batch bounds).

    ``candidates``: ``id``, the stream key and ``pos``. Only candidates inside a stream's
    span are joined with its runs: a stream's new readings lie beyond it, and a gateway
    whose own seqs interleave with its nodes' has a run per stretch of them."""
    span = runs.groupBy(*KEY).agg(F.min("lo").alias("span_lo"), F.max("hi").alias("span_hi"))
    inside = (
        candidates.where(F.col("pos").isNotNull())
        .join(span, on=KEY, how="inner")
        .where(F.col("pos").between(F.col("span_lo"), F.col("span_hi")))
        .select("id", *KEY, "pos")
    )
    r = runs.select(*KEY, "lo", "hi", "width", "exact", "last_received", "last_gateway", *_META[1:])
    hit = inside.join(r, on=KEY, how="inner").where(
        F.col("pos").between(F.col("lo"), F.col("hi"))
        & ((F.col("pos") % F.lit(POS_SCALE)) < F.col("width"))
    )
    exact_bound = F.when(F.col("exact"), last_copy(F.col("last_received"), F.col("last_gateway")))
    return hit.groupBy("id").agg(
        F.min(exact_bound).alias("bound"),
        F.max(~F.col("exact")).alias("envelope"),
        F.min("date_lo").alias("look_date_lo"),
        F.max("date_hi").alias("look_date_hi"),
        F.min("batch_lo").alias("look_batch_lo"),
        F.max("batch_hi").alias("look_batch_hi"),
    )
