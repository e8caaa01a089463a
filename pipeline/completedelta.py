"""What a batch can change of the completeness tables, so that it judges and writes
again only that (pipeline/completejob.py writes; the rules are pipeline/completeness.py's).

A stream's landed positions only grow, and so do its ``top`` and ``told``; a batch's
ledger rows bring new reasons, and a gateway's new latest ledger new ``held`` ranges and
a new time for its trailing hole. So for each stream there is a first position ``m`` the
batch can change the judgement of:

- the least position of the batch's ranges (they fill holes, or move positions to an
  earlier copy's hour, which changes the hour of the hole before them);
- the least position of the batch's ledger rows' ranges (a reason told);
- for a gateway that sent a ledger (a new latest one): its held and unreported holes of
  before (the old held are held no more; an unreported position may now be told), and
  the trailing holes of its streams told past their last landed position (a trailing
  hole's hour is the latest ledger's window end: ``trailing``);

and every hole below the last landed position before ``m`` (``a``) keeps its gap rows: its
bounds, reasons and the part after it are unchanged. The positions above ``a`` are
judged again from the ranges that reach above it (``tail``): ``owned_ranges`` is exact
for every position above ``a``, because every range holding one does.

``completeness`` (by bucket and day) is written again on the days a batch changes: the
days of its ranges and of the earlier ranges they overlap (their positions may move to
an earlier copy), the days of the ranges holding a seq newly told skipped, and the days
of the gap rows that changed. An hour's row is its owned parts' and gaps' sums; the
parts of a set of days are owned exactly from the ranges that overlap, per stream, the
positions the ranges of those days span (``day_parts``).
"""

from __future__ import annotations

from datetime import date, timedelta

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import LongType

from . import completeness as C
from .sparkenv import broadcast_if_small

KEY = ["gateway", "stream"]
_TOP = 2**63 - 1  # "past every position": the trailing hole
_BOTTOM = -(2**63)  # ``a`` of a stream with nothing below ``m``
_JUDGED = ("held", "evicted", "dead_letter", "refused", "node_dropped", "skipped")


def days(df: DataFrame, hour: Column) -> DataFrame:
    """The (``_b``, ``_day``) pairs of ``df``'s rows (with ``gateway``)."""
    return df.select(C.bucket(F.col("gateway")).alias("_b"), C.day_of(hour).alias("_day"))


def overlapping(rows: DataFrame, ranges: DataFrame) -> DataFrame:
    """The rows of ``rows`` that share a position with one of ``ranges`` (a batch's, a
    hull's: broadcast when small, so ``rows`` are scanned, not shuffled)."""
    r = ranges.select(
        F.col("gateway").alias("r_gateway"),
        F.col("stream").alias("r_stream"),
        F.col("lo").alias("rlo"),
        F.col("hi").alias("rhi"),
    ).localCheckpoint(eager=True)
    on = (
        (F.col("gateway") == F.col("r_gateway"))
        & (F.col("stream") == F.col("r_stream"))
        & (F.col("lo") <= F.col("rhi"))
        & (F.col("hi") >= F.col("rlo"))
    )
    return rows.join(broadcast_if_small(r), on=on, how="left_semi")


def landed_days(rows: DataFrame, ranges: DataFrame) -> DataFrame:
    """The days whose landed counts ``ranges`` (a batch's, among ``rows``) may change:
    those of the ranges they overlap, theirs included (a position landed again moves to
    the earlier copy's hour). ``rows`` may be a ``tail``: each range overlapping one of
    the batch's reaches at or above its first position, so above ``a``."""
    return days(overlapping(rows, ranges), F.col("t"))


def skipped_days(rows: DataFrame, ledger: DataFrame) -> DataFrame:
    """The days of the landed ``rows`` holding a seq the batch's ``ledger`` rows newly
    call skipped (their hour's landed count drops by it). ``rows`` may be a ``tail``:
    a skipped range told is one of the firsts ``m`` is the least of."""
    skipped = ledger.where(F.col("what") == "skipped").select(*C.LANDED_COLUMNS[:4])
    return days(overlapping(rows, skipped), F.col("t"))


def firsts(
    ranges: DataFrame, ledger: DataFrame | None, old_gaps: DataFrame
) -> tuple[DataFrame, DataFrame | None]:
    """Per stream the batch changes, its first changed position (``gateway``, ``stream``,
    ``_m``), and the gateways that sent a ledger (``gateway``, ``_new``; ``None``: none).
    ``ranges``: the batch's; ``ledger``: its ledger rows (``None``: none); ``old_gaps``:
    the gap rows written before it. Both materialised."""
    first = ranges.select(*KEY, "lo")
    told_by = None
    if ledger is not None:
        first = first.unionByName(ledger.where(F.col("what").isin(*_JUDGED)).select(*KEY, "lo"))
        told_by = ledger.select("gateway").distinct().withColumn("_new", F.lit(True))
        told_by = broadcast_if_small(told_by.localCheckpoint(eager=True))
        old = old_gaps.where(F.col("reason").isin("held", "unreported"))
        first = first.unionByName(old.join(told_by, "gateway", "left_semi").select(*KEY, "lo"))
    m = first.groupBy(*KEY).agg(F.min("lo").alias("_m")).localCheckpoint(eager=True)
    return broadcast_if_small(m), told_by


def trailing(told_by: DataFrame | None, state: DataFrame, spans: DataFrame) -> DataFrame | None:
    """The streams whose trailing hole a gateway's new latest ledger moves to its window
    end's hour (``gateway``, ``stream``, ``_new``; ``None``: no ledger): those of
    ``told_by``'s gateways told (``state``, the batch's ledger rows compacted in) past
    their last landed position (``spans``), or told and never landed. A stream landed
    up to what it was told has no trailing hole, and a new ledger changes nothing of it
    (a dead epoch, an old node boot: reading their last day at every ledger would grow
    with the fleet's turnover)."""
    if told_by is None:
        return None
    told = state.where(F.col("what") == "told").join(told_by, "gateway", "left_semi")
    told = told.groupBy(*KEY).agg(F.max("hi").alias("_told"))
    ends = (
        spans.join(told.select(*KEY), KEY, "left_semi").groupBy(*KEY).agg(F.max("hi").alias("_end"))
    )
    past = told.join(ends, KEY, "left").where(
        F.col("_end").isNull() | (F.col("_told") > F.col("_end"))
    )
    out = past.select(*KEY, F.lit(True).alias("_new")).localCheckpoint(eager=True)
    return broadcast_if_small(out)


def _least(rows: DataFrame, m: DataFrame, trailing: DataFrame | None) -> DataFrame:
    """``rows`` of the changed streams, with their first changed position ``_least``
    (past every position for a stream whose trailing hole is all a new ledger changed)."""
    joined = rows.join(m, KEY, "left")
    least = F.col("_m")
    if trailing is not None:
        joined = joined.join(trailing, KEY, "left")
        # (least skips nulls)
        least = F.least("_m", F.when(F.col("_new"), F.lit(_TOP).cast(LongType())))
    return joined.withColumn("_least", least).where(F.col("_least").isNotNull())


def floors(spans: DataFrame, m: DataFrame, trailing: DataFrame | None) -> DataFrame:
    """Per changed stream, the greatest position of its days whose every position is
    below its first changed one (``_floor``; null: no such day), from ``spans`` (a row
    per stream and day: pipeline/landedhull.py). Its ``a`` is at least that, and only
    the days reaching above it hold ranges its ``a`` and ``tail`` come from."""
    below = F.when(F.col("hi") < F.col("_least"), F.col("hi"))
    return _least(spans, m, trailing).groupBy(*KEY).agg(F.max(below).alias("_floor"))


def reach_days(spans: DataFrame, floors: DataFrame) -> list[tuple[int, str]]:
    """The (bucket, day) pairs holding a range of a changed stream that reaches its floor:
    every range its ``a`` and ``tail`` are found from is on one of them (the tail's
    first, which ends at ``a``, may be the floor's)."""
    j = spans.join(broadcast_if_small(floors), KEY)
    j = j.where(F.col("_floor").isNull() | (F.col("hi") >= F.col("_floor")))
    return sorted((int(r[0]), str(r[1])) for r in j.select("bucket", "day").distinct().collect())


def span_days(spans: DataFrame, on: DataFrame) -> list[tuple[int, str]]:
    """The (bucket, day) pairs holding a range that shares a position with, per stream,
    the span of its ranges on the days ``on`` (``_b``, ``_day``): every range
    ``day_parts`` owns those days' parts from is on one of them."""
    of = spans.join(F.broadcast(on.withColumnRenamed("_b", "bucket").withColumnRenamed(
        "_day", "day")), ["bucket", "day"], "left_semi")  # fmt: skip
    hull = of.groupBy(*KEY).agg(F.min("lo").alias("lo"), F.max("hi").alias("hi"))
    near = overlapping(spans, hull.localCheckpoint(eager=True))
    return sorted((int(r[0]), str(r[1])) for r in near.select("bucket", "day").distinct().collect())


def starts(
    rows: DataFrame,
    m: DataFrame,
    trailing: DataFrame | None,
    floors: DataFrame | None = None,
) -> DataFrame:
    """Per stream the batch can change (``gateway``, ``stream``, ``a``): ``a`` the last
    landed position below its first changed one (``_BOTTOM``: none). ``rows``: the
    landed ranges of the buckets (the batch's too): every one, or (with ``floors``)
    those of the days ``reach_days`` names, the days below each stream's floor standing
    for theirs; ``m``: ``firsts``'; ``trailing``: ``trailing``'s."""
    below = F.when(F.col("lo") < F.col("_least"), F.least("hi", F.col("_least") - 1))
    a = _least(rows, m, trailing).groupBy(*KEY).agg(F.max(below).alias("a"))
    if floors is not None:
        a = a.unionByName(floors.select(*KEY, F.col("_floor").alias("a")))
    # Streams with nothing landed yet: the batch's first, or told by a ledger.
    bare = m.select(*KEY)
    if trailing is not None:
        bare = bare.unionByName(trailing.select(*KEY))
    none = F.lit(None).cast(LongType())
    out = a.unionByName(bare.select(*KEY, none.alias("a"))).groupBy(*KEY).agg(F.max("a").alias("a"))
    return out.select(*KEY, F.coalesce("a", F.lit(_BOTTOM).cast(LongType())).alias("a"))


# ``tail``, ``judged_again``, ``kept`` and ``their_state`` take ``starts`` materialised and
# hinted once (``sparkenv.broadcast_if_small``): each is joined to rows of the buckets.


def tail(rows: DataFrame, starts: DataFrame) -> DataFrame:
    """The ranges of the changed streams that reach above their ``a``."""
    return rows.join(starts, KEY).where(F.col("hi") >= F.col("a")).select(*C.LANDED_COLUMNS)


def judged_again(gaps: DataFrame, starts: DataFrame) -> DataFrame:
    """The gap rows of the changed streams above their ``a`` (of ``missing_ranges`` of a
    ``tail``: what it says below ``a`` is not the stream's)."""
    return gaps.join(starts, KEY).where(F.col("lo") > F.col("a")).drop("a")


def kept(old_gaps: DataFrame, starts: DataFrame) -> DataFrame:
    """The gap rows written before that the batch cannot change."""
    a = old_gaps.join(starts, KEY, "left")
    return a.where(F.col("a").isNull() | (F.col("lo") < F.col("a"))).drop("a")


def their_state(state: DataFrame, starts: DataFrame) -> DataFrame:
    """The ledgers' state of the changed streams, and every gateway's head."""
    mine = state.join(starts.select(*KEY), KEY, "left_semi")
    return mine.unionByName(state.where(F.col("what") == "head"))


def day_parts(rows: DataFrame, on: DataFrame, days: list[tuple[int, str]]) -> DataFrame:
    """The owned parts (``owned_ranges``) of ``days`` (``on``: them as ``_b``, ``_day``
    rows), owned from every range overlapping, per stream, the span of the ranges of
    those days (so exactly: every range holding one of their positions is there)."""
    of_days = C.on_days(rows.where(_between(F.col("t"), days)), F.col("t"), on)
    hull = of_days.groupBy(*KEY).agg(F.min("lo").alias("lo"), F.max("hi").alias("hi"))
    # (every part of those days, and parts of others: ``hourly`` keeps the days' own)
    return C.owned_ranges(overlapping(rows, hull).select(*C.LANDED_COLUMNS))


def _between(t: Column, days: list[tuple[int, str]]) -> Column:
    """``t`` from the first of ``days`` to the end of the last (or null, for ``none``):
    a cheap test that spares most rows the exact one (a hash and a date each)."""
    dated = sorted({d for _, d in days if d != "none"})
    near = F.lit(False)
    if dated:
        end = date.fromisoformat(dated[-1]) + timedelta(days=1)
        near = (t >= F.to_timestamp(F.lit(dated[0]))) & (t < F.to_timestamp(F.lit(end.isoformat())))
    if any(d == "none" for _, d in days):
        near = near | t.isNull()
    return near
