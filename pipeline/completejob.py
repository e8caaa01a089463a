"""A batch's records and completeness written to the warehouse (pipeline/completeness.py's
rules; called by pipeline/job.py for each batch, after its readings).

Tables (Parquet, dynamic partition overwrite, so a replayed batch rewrites only itself):

- ``records`` and ``ledger`` (by batch): the batch's records whose id no earlier batch
  kept (a replay reads the earlier batches only, and writes the same rows again);
- ``landed`` (``bucket=B/day=D/gen=G``): the positions landed, as ranges, kept by
  pipeline/landedstore.py: batch ``G`` appends what it landed as generation ``G`` of
  the bucket days it landed in, and compacts a day that has ``max_generations`` when
  it next lands in it;
- ``ledger_state`` (``bucket=B/gen=G``): the ledgers compacted (``completeness.ledger_state``:
  a row per stream, the latest ledger's held ranges, each reason's range once), so that
  what a batch reads of them follows the fleet's streams, not the number of ledgers ever
  sent. Batch ``G`` appends the compacted state of each bucket it brought ledger rows
  to as generation ``G`` and then deletes that bucket's older generations; compacting
  is idempotent, so a killed write read back with its older generations, or written
  twice, changes nothing. Until ``_built`` is in it, the state is built from every batch
  of ``ledger`` (a warehouse written before it, or a first build killed midway);
- ``completeness`` (``bucket=B/day=D``) and ``completeness_gaps`` (``bucket=B``): each
  stream of the buckets the batch touched judged again above the last landed position
  below the first one the batch can change, and the days it changed written again
  (pipeline/completedelta.py); every stream and day when the batch cannot start from
  what was written (a first batch, the ledgers' state being built, a table written
  before it was by day, a killed write of the gaps), and every stream and day of the
  touched buckets while they hold at most ``WHOLE_DAYS`` days of ``landed`` (a young
  warehouse: the batch rewrites about the days it would anyway, without the small jobs
  that find them).
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pubcomp.sync import faults
from pubcomp.sync.faults import crash_point

from . import completedelta as D
from . import completeness as C
from . import landedhull as H
from .generations import Generations
from .landedstore import LandedStore, OnDisk, View, by_day
from .sparkenv import broadcast_if_small, delete_path, path_exists, touch

# Crash points (sync/faults.py): the batch's ledger state appended, or its landed ranges,
# and the generations they replace not yet deleted (both are read back: compacting them
# again changes nothing).
faults.register(
    "pipeline_ledger_state_written",
    "pipeline_landed_written",
    "pipeline_completeness_cleared",
    "pipeline_completeness_written",
)

TABLES = (
    "records",
    "ledger",
    "ledger_state",
    "landed",
    "landed_hull",
    "completeness",
    "completeness_gaps",
)
STATE = "ledger_state"
LANDED = "landed"
HULL = "landed_hull"
BUILT = "_built"  # in ledger_state once it holds every ledger row of every batch before
BY_DAY = "_by_day"  # in completeness once it is kept by bucket and day
GAPS = "completeness_gaps"
# in completeness_gaps while a batch rewrites them (judging whole: and the table's days)
WRITING = "_writing"
# A warehouse whose touched buckets hold at most this many days of ``landed`` judges
# them whole (``CompletenessTables._young``); the Spark setting changes it (the tests set
# 0, so that every batch but a warehouse's first takes the path that judges again).
WHOLE_UP_TO_DAYS = "spark.pubcomp.completeness.wholeUpToDays"
WHOLE_DAYS = 2


class CompletenessTables:
    def __init__(self, spark: SparkSession, warehouse: str) -> None:
        self.spark = spark
        self.wh = warehouse.rstrip("/")
        self.state = Generations(spark, self.path(STATE))
        self.landed = LandedStore(spark, self.path(LANDED))
        self.hull = H.LandedHull(spark, self.path(HULL))

    def path(self, table: str) -> str:
        return f"{self.wh}/{table}"

    def _earlier(self, table: str, schema: object, batch_id: int) -> DataFrame | None:
        if not path_exists(self.spark, self.path(table)):
            return None
        df = self.spark.read.schema(schema).parquet(self.path(table))  # type: ignore[arg-type]
        return df.where(F.col("batch") != batch_id)

    def batch(self, parsed: DataFrame, batch_id: int, n_records: int, buckets: list[int]) -> bool:
        """``parsed``: the batch's lines (``transforms.parse_landing``, cached by the job);
        ``n_records``: how many of them are good records; ``buckets``: the buckets of
        their gateways (``completeness.bucket``). Whether it judged every stream of its
        buckets whole."""
        new = self._records(parsed, batch_id) if n_records else None
        self.landed.convert()
        whole = self._whole()
        if whole:  # every bucket judged again, every day written
            buckets = list(range(C.BUCKETS))
        state, written = self._state(new, buckets, batch_id)
        touched = sorted(set(buckets) | written)
        gens, hull_gens = self.landed.on_disk(), self.hull.gens.on_disk()
        whole = whole or self._young(gens, touched)
        view, hull_compacted = self._landed(
            C.landed_ranges(parsed), gens, hull_gens, touched, batch_id, not whole
        )
        crash_point("pipeline_landed_written")
        if touched:
            self.recompute(touched, state, view, None if whole else Change(view.mine, new))
        self._drop_older_state(written, batch_id)
        self.landed.drop(gens, view.compacted, batch_id)
        self.hull.drop(hull_gens, hull_compacted, batch_id)
        return whole

    def _young(self, gens: OnDisk, touched: list[int]) -> bool:
        """Whether ``landed`` holds so few days in ``touched`` (``WHOLE_UP_TO_DAYS``) that
        judging their streams whole costs less than judging again only what the batch can
        change: the batch writes about the days it would anyway (its own and the one
        before), and spares the thirty small jobs that find them."""
        limit = int(self.spark.conf.get(WHOLE_UP_TO_DAYS, None) or WHOLE_DAYS)
        return max((len(gens.get(b, {})) for b in touched), default=0) <= limit

    def _whole(self) -> bool:
        """Whether the batch must judge every stream and write every day: the ledgers'
        state is not built yet (it is built from every ledger: any reason may be new),
        ``completeness`` is not by day yet (or not there), or a write of the gaps (the
        rows the next batch starts from) was killed, or a batch judging whole was killed
        after it deleted its buckets' days."""
        table, spark = self.path("completeness"), self.spark
        return (
            not path_exists(spark, f"{self.path(STATE)}/{BUILT}")
            or not path_exists(spark, f"{table}/{BY_DAY}")
            or path_exists(spark, f"{self.path(GAPS)}/{WRITING}")
        )

    def _records(self, parsed: DataFrame, batch_id: int) -> DataFrame | None:
        """Write the batch's new records and ledger rows; the ledger rows (``None``: none)."""
        kept = C.kept_records(parsed, batch_id).localCheckpoint(eager=True)
        tables = (("records", C.RECORDS_SCHEMA), ("ledger", C.LEDGER_SCHEMA))
        earlier_of = {table: self._earlier(table, schema, batch_id) for table, schema in tables}
        ids = None  # (a warehouse's first batch has no earlier ids to look them up in)
        if any(e is not None for e in earlier_of.values()):
            ids = broadcast_if_small(kept.select("id").distinct().localCheckpoint(eager=True))
        new_ledger = None
        for table, _ in tables:
            earlier = earlier_of[table]
            new = kept
            if earlier is not None and ids is not None:
                # Every earlier id is read (its column only), but none shuffled: the
                # batch's few thousand ids go to each task, and only the ids found
                # there (a replay's, a resent record's) meet the batch's records.
                again = earlier.select("id").join(ids, "id", "left_semi").distinct()
                new = kept.join(again, "id", "left_anti")
            if table == "ledger":
                ledger = C.ledger_records(new).localCheckpoint(eager=True)
                rows = new_ledger = C.ledger_rows(ledger).localCheckpoint(eager=True)
            else:
                rows = new.where(F.col("sensor") != C.LEDGER_SENSOR)
                rows = rows.select(*C.RECORDS_SCHEMA.names)
            # A batch with none writes nothing (an overwrite with no rows leaves the
            # partition of a replay as it was: the same rows).
            rows.coalesce(1).write.mode("overwrite").partitionBy("batch").parquet(self.path(table))
        return new_ledger

    # ------------------------------------------------------------ the ledgers' state

    def _state(
        self, new: DataFrame | None, buckets: list[int], batch_id: int
    ) -> tuple[DataFrame, set[int]]:
        """The compacted ledgers of ``buckets`` and of the buckets ``new`` (the batch's
        ledger rows) falls in, and the buckets whose state the batch wrote."""
        spark = self.spark
        empty = spark.createDataFrame([], C.STATE_SCHEMA)
        if not path_exists(spark, f"{self.path(STATE)}/{BUILT}"):
            return self._build_state(batch_id, empty)
        told: set[int] = set()  # the buckets the batch's ledger rows fall in
        if new is not None:
            told = {int(r[0]) for r in new.select(C.bucket(F.col("gateway"))).distinct().collect()}
        gens, mine = self.state.on_disk(), set(buckets) | told
        paths = [self.state.path(b, g) for b in sorted(mine) for g in gens.get(b, [])]
        read = spark.read.schema(C.STATE_SCHEMA).option("basePath", self.path(STATE))
        old = read.parquet(*paths).select(*C.STATE_COLUMNS) if paths else empty
        if new is None or not told:
            return old.localCheckpoint(eager=True), set()
        rows = old.drop("bucket").unionByName(new.drop("batch"))
        state = C.ledger_state(rows).localCheckpoint(eager=True)
        self._append_state(state.where(F.col("bucket").isin(*told)), batch_id)
        crash_point("pipeline_ledger_state_written")
        return state, told

    def _build_state(self, batch_id: int, empty: DataFrame) -> tuple[DataFrame, set[int]]:
        """Every bucket's state from every batch of ``ledger`` (this one's included), then
        ``_built``; whatever a killed build left is compacted with it."""
        ledger = self._earlier("ledger", C.LEDGER_SCHEMA, -1)
        if ledger is None:
            state, written = empty, set()
        else:
            state = C.ledger_state(ledger.drop("batch")).localCheckpoint(eager=True)
            written = {int(r[0]) for r in state.select("bucket").distinct().collect()}
            self._append_state(state, batch_id)
        touch(self.spark, f"{self.path(STATE)}/{BUILT}")
        return state, written

    def _append_state(self, state: DataFrame, batch_id: int) -> None:
        # Appended, never overwritten, a replay's too: an overwrite deletes a partition
        # before it renames the new one in, and a kill between would lose a bucket's only
        # state; a replay's second copy of generation batch_id compacts to the same rows.
        self.state.write(state, batch_id, replay=False)

    def _drop_older_state(self, written: set[int], batch_id: int) -> None:
        """The generations the batch's own replaced (at its end: nothing reads them now)."""
        if written:
            self.state.drop(self.state.on_disk(), written, batch_id)

    # ------------------------------------------------------------ what landed

    def _landed(
        self,
        ranges: DataFrame,
        gens: OnDisk,
        hull_gens: dict[int, list[int]],
        touched: list[int],
        batch_id: int,
        spans: bool,
    ) -> tuple[View, set[int]]:
        """Append the batch's ``ranges`` to ``landed_hull`` (as spans) and then to
        ``landed``, compacting what is due. What the batch reads of ``landed`` (with the
        spans of ``touched`` if ``spans``), and the buckets of ``landed_hull`` compacted."""
        mine = by_day(ranges).localCheckpoint(eager=True)
        # Collected once: the hull's append and the store's need them, and each collect
        # is a Spark job.
        days = {(int(r[0]), str(r[1])) for r in mine.select("bucket", "day").distinct().collect()}
        landed_in = {b for b, _ in days}
        my_spans = H.spans(mine.select(*C.LANDED_COLUMNS)).localCheckpoint(eager=True)
        if self.hull.built():
            # (the batch's buckets are among ``touched``; those it landed in must be, or
            # a compaction of one would write its spans without those on disk)
            every = self.hull.current(hull_gens, sorted(set(touched) | landed_in), my_spans)
            if spans:
                every = every.localCheckpoint(eager=True)
            hull_compacted = self.hull.append(my_spans, every, hull_gens, landed_in, batch_id)
        else:  # built from every range on disk and the batch's
            old = self.landed.read(gens, sorted(gens))
            rows = mine.select(*C.LANDED_COLUMNS)
            every = self.hull.build(rows if old is None else old.unionByName(rows), batch_id)
            hull_compacted = set()
        compacted = self.landed.append(mine, days, gens, batch_id)
        view = View(
            self.landed,
            gens,
            touched,
            mine.select(*C.LANDED_COLUMNS),
            every if spans else None,
            compacted,
        )
        return view, hull_compacted

    # ------------------------------------------------------------ the table

    def recompute(
        self,
        buckets: list[int],
        state: DataFrame,
        view: View,
        change: Change | None = None,
    ) -> None:
        """Both tables for every stream of the gateways in ``buckets``, from their landed
        ranges (``view``) and their ledgers' ``state``: judged all again and every day
        written (``change`` ``None``), or only what the batch's ``change`` can change
        (pipeline/completedelta.py), reading only the days of ``landed`` that can
        matter to it."""
        state = state.where(F.col("bucket").isin(buckets))
        if change is None:
            parts = C.owned_ranges(view.all()).localCheckpoint(eager=True)
            # Materialised once: the table below is built from them, not from their plan
            # (joins and windows over every stream of the buckets) again.
            gaps = C.missing_ranges(parts, state).localCheckpoint(eager=True)
            table = C.hourly(parts, state, gaps)
            days = None
        else:
            assert view.spans is not None, "a batch judges again from the days' spans"
            gaps, days, on = self._judge_again(buckets, state, view, change)
            rows = view.on(D.span_days(view.spans, on))
            table = C.hourly(D.day_parts(rows, on, days), state, gaps, on)
        self._write(buckets, gaps, table, days)

    def _judge_again(
        self, buckets: list[int], state: DataFrame, view: View, change: Change
    ) -> tuple[DataFrame, list[tuple[int, str]], DataFrame]:
        """The gaps of ``buckets`` (those written before, judged again where ``change`` can
        change them), and the days to write (as a list and as ``_b``, ``_day`` rows)."""
        assert view.spans is not None
        old = self._old_gaps(buckets)
        m, told_by = D.firsts(change.ranges, change.ledger, old)
        trailing = D.trailing(told_by, state, view.spans)
        floors = D.floors(view.spans, m, trailing).localCheckpoint(eager=True)
        rows = view.on(D.reach_days(view.spans, floors))
        starts = broadcast_if_small(D.starts(rows, m, trailing, floors).localCheckpoint(eager=True))
        # Materialised: the gaps read its parts, and the changed days its ranges (every
        # range holding a position the batch brings, or newly told skipped, is in it).
        reach = D.tail(rows, starts).localCheckpoint(eager=True)
        tail = C.owned_ranges(reach).localCheckpoint(eager=True)
        cols = C.GAPS_SCHEMA.names
        again = C.missing_ranges(tail, D.their_state(state, starts))
        again = D.judged_again(again, starts).select(*cols).localCheckpoint(eager=True)
        gaps = D.kept(old, starts).select(*cols).unionByName(again).localCheckpoint(eager=True)
        before = D.judged_again(old, starts).select(*cols)
        diff = again.exceptAll(before).unionByName(before.exceptAll(again))
        changed = D.landed_days(reach, change.ranges).unionByName(D.days(diff, F.col("hour")))
        ledger = change.ledger
        if ledger is not None and ledger.where(F.col("what") == "skipped").take(1):
            changed = changed.unionByName(D.skipped_days(reach, ledger))
        days = sorted((int(r[0]), str(r[1])) for r in changed.distinct().collect())
        on = self.spark.createDataFrame(days, "_b int, _day string")
        return gaps, days, on

    def _old_gaps(self, buckets: list[int]) -> DataFrame:
        gaps_at = self.path(GAPS)
        paths = [f"{gaps_at}/bucket={b}" for b in buckets]
        paths = [p for p in paths if path_exists(self.spark, p)]
        if not paths:
            return self.spark.createDataFrame([], C.GAPS_SCHEMA)
        read = self.spark.read.schema(C.GAPS_SCHEMA).option("basePath", gaps_at)
        return read.parquet(*paths).select(*C.GAPS_SCHEMA.names).localCheckpoint(eager=True)

    def _write(
        self,
        buckets: list[int],
        gaps: DataFrame,
        table: DataFrame,
        days: list[tuple[int, str]] | None,
    ) -> None:
        """``table``'s ``days`` of ``completeness`` (``None``: every day of ``buckets``),
        then ``buckets``' gaps."""
        spark, at, gaps_at = self.spark, self.path("completeness"), self.path(GAPS)
        # A day left with no rows would keep its old ones (an overwrite with no rows
        # writes nothing): deleted first. Killed before the write, the replay finds the
        # same days (the gaps are the old ones) and writes them.
        if days is None:
            # Every day of the buckets goes, so ``_writing`` comes first: a replay that
            # judged again (the warehouse no longer young with the batch's own ranges
            # on disk) would write back only the days it changes.
            touch(spark, f"{gaps_at}/{WRITING}")
            for b in buckets:
                delete_path(spark, f"{at}/bucket={b}")
            crash_point("pipeline_completeness_cleared")
        else:
            for b, d in days:
                delete_path(spark, f"{at}/bucket={b}/day={d}")
        table = table.repartition("bucket", "day")
        table.write.mode("overwrite").partitionBy("bucket", "day").parquet(at)
        touch(spark, f"{at}/{BY_DAY}")
        crash_point("pipeline_completeness_written")
        # The next batch starts from these rows: while they are rewritten, ``_writing``
        # says they may be short (a killed write), and the next batch judges all again.
        touch(spark, f"{gaps_at}/{WRITING}")
        for b in buckets:
            delete_path(spark, f"{gaps_at}/bucket={b}")
        gaps.repartition("bucket").write.mode("overwrite").partitionBy("bucket").parquet(gaps_at)
        delete_path(spark, f"{gaps_at}/{WRITING}")


@dataclass(frozen=True)
class Change:
    """What a batch brought: its landed ranges (``LANDED_SCHEMA``) and its ledger rows
    (``ledger``'s, ``None``: none)."""

    ranges: DataFrame
    ledger: DataFrame | None
