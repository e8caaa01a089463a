"""Records and the completeness table (issue 27): the gateway's ``$`` records kept out of
``readings``, its ``$ledger`` in ``ledger``; per stream and hour what landed and what is
missing and why, on real local Spark, equal to DuckDB's (devkit/duckdb_reference.py)."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F

from devkit import duckdb_reference as ref
from devkit.fleetsim import FleetSpec, simulate
from devkit.sparkconf import JUDGE_AGAIN, conf_env, interpreted_env
from pubcomp.pipeline.job import Pipeline

T = "2026-11-20T10:{:02d}:00.000Z"


def _run(spark: Any, landing: Path, wh: Path) -> dict[str, Any]:
    return Pipeline(spark, str(landing), str(wh)).run().__dict__


def _land(landing: Path, name: str, lines: list[dict[str, Any]]) -> None:
    day = landing / "date=2026-11-20"
    day.mkdir(parents=True, exist_ok=True)
    (day / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _reading(rid: str, sensor: str, minute: int, value: float | None = 1.0, **kw: Any) -> dict:
    origin = rid.split("/")[0]
    return {"id": rid, "origin": origin, "sensor": sensor, "ts": T.format(minute),
            "value": value, "unit": "C" if value is not None else None, "flags": [],
            "gateway": "gw1", "received": T.format(minute + 1), **kw}  # fmt: skip


LEDGER = {
    "v": 1,
    "window": [T.format(0), T.format(5)],
    "top": 6,
    "streams": {"gw1/e1": {"held": [[5, 6]]}, "n1/0": {"stored": [[0, 1]]}},
}


def _records_batch() -> list[dict[str, Any]]:
    return [
        _reading("gw1/e1/1", "t", 1),
        _reading("n1/0/0.0", "t", 1),
        _reading("n1/0/1.0", "t", 2),
        _reading("gw1/e1/3", "$release", 3, None, flags=["release", "event:applied"]),
        _reading("gw1/e1/4", "$ledger", 4, None, record=LEDGER),
    ]


@pytest.mark.timeout(600)
def test_records_stay_out_of_readings_and_rollups_and_land_once_in_their_tables(
    spark: Any, tmp_path: Path
) -> None:
    """A ``$ledger`` and a ``$release`` record, each landed twice in two runs: neither is a
    reading (readings, rollups, quality), the ledger is in ``ledger`` once, the audit
    record in ``records`` once; the readings beside them are kept as before."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    _land(landing, "a", _records_batch())
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 3 and s["quarantined"] == 0
    _land(landing, "b", _records_batch()[3:])  # the records again (a resend)
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 0
    readings = spark.read.parquet(str(wh / "readings"))
    assert sorted(r.sensor for r in readings.collect()) == ["t", "t", "t"]
    for table in ("rollup_1m", "quality"):
        sensors = {r.sensor for r in spark.read.parquet(str(wh / table)).collect()}
        assert sensors == {"t"}, table
    ledger = spark.read.parquet(str(wh / "ledger"))
    assert {r.id for r in ledger.collect()} == {"gw1/e1/4"}
    held = ledger.where("what = 'held'").collect()
    assert [(r.stream, r.lo, r.hi) for r in held] == [("gw1/e1", 5, 6)]
    records = spark.read.parquet(str(wh / "records")).collect()
    assert [(r.id, r.sensor) for r in records] == [("gw1/e1/3", "$release")]
    assert "event:applied" in records[0].flags
    res = ref.compare(ref.build(landing), wh)
    for table, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (table, res)


# ------------------------------------------------------------ a position landed twice


def _span(seqs: range, minutes: dict[int, int], first_hour: int = 10) -> list[dict[str, Any]]:
    """A gateway's message of its own readings ``seqs``, its last line naming the span."""

    def at(m: int) -> str:
        return f"2026-11-20T{first_hour + m // 60:02d}:{m % 60:02d}:00.000Z"

    lines = [{"id": f"gw1/e1/{q}", "origin": "gw1", "sensor": "t", "ts": at(minutes[q]),
              "value": 1.0, "unit": "C", "flags": [], "gateway": "gw1",
              "received": at(minutes[q] + 10)} for q in seqs]  # fmt: skip
    lines[-1]["_mqtt"] = {"outbox": {"epoch": "e1", "first": seqs[0], "last": seqs[-1]}}
    return lines


def test_a_position_landed_in_two_hours_belongs_to_its_earliest_copy(
    spark: Any, tmp_path: Path
) -> None:
    """A span's positions take its last line's time. A gateway that sends again a part of
    a span (its landing acknowledgement late) in a message of its own gives those
    positions an earlier time than the first span did: 5..6 landed at 11:01 with 1..10,
    then again at 10:58 alone. They belong to the earliest copy's hour (10), as in
    DuckDB's reference, whichever batch brought it; the hours' counts are 10: 2 and 11:
    8. Seen failing when the parts were ordered by their first position (the 1..10
    span took 5..6 into hour 11)."""
    minutes = {q: 50 + 2 * q for q in range(1, 11)}  # 10:52 .. 11:10; seq 6: 11:02
    minutes[6] = 58  # (a clock step: 6 is stamped 10:58, 10 at 11:10)
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    _land(landing, "a", _span(range(1, 11), minutes))
    _run(spark, landing, wh)
    _land(landing, "b", _span(range(5, 7), minutes))
    _run(spark, landing, wh)
    table = spark.read.parquet(str(wh / "completeness")).where("stream = 'gw1/e1'")
    got = {(r.hour.hour, r.landed, r.missing) for r in table.collect()}
    assert got == {(10, 2, 0), (11, 8, 0)}
    res = ref.compare(ref.build(landing), wh)
    for name, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (name, res)


def _span_on(seqs: range, day: int, hour: int) -> list[dict[str, Any]]:
    """``_span``'s message with every line stamped on 2026-11-``day`` at ``hour``."""
    at = f"2026-11-{day:02d}T{hour:02d}:{{:02d}}:00.000Z"
    lines = [{"id": f"gw1/e1/{q}", "origin": "gw1", "sensor": "t", "ts": at.format(i),
              "value": 1.0, "unit": "C", "flags": [], "gateway": "gw1",
              "received": at.format(i + 1)} for i, q in enumerate(seqs)]  # fmt: skip
    lines[-1]["_mqtt"] = {"outbox": {"epoch": "e1", "first": seqs[0], "last": seqs[-1]}}
    return lines


def _day_files(wh: Path) -> dict[str, set[str]]:
    return {d.name: {f.name for f in d.glob("*.parquet")}
            for d in (wh / "completeness").glob("bucket=*/day=*")}  # fmt: skip


def test_a_batch_rewrites_only_the_days_of_the_table_it_changes(spark: Any, tmp_path: Path) -> None:
    """``completeness`` is kept by bucket and day, and a batch writes again only the days
    it can change: gw1/e1 landed on the 17th to the 20th, with a hole on the 19th; then
    a batch brings each kind of change to an old day, one day each: a ledger calls seq
    13 skipped (the 18th's landed count drops), a resend of 45..46 stamped on the 19th
    (they move from the 20th), the ledger's eviction of the hole at a time on the 16th
    (its gap moves there from the 19th). The 17th's files are left as they were, the
    other days' written again, and the tables are DuckDB's. Seen failing with each of
    the three ways to find a changed day left out."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    _land(landing, "a", _span_on(range(1, 11), 17, 10) + _span_on(range(11, 21), 18, 10)
          + _span_on(range(31, 41), 19, 10) + _span_on(range(41, 51), 20, 9))  # fmt: skip
    _run(spark, landing, wh)
    before = _day_files(wh)
    assert set(before) == {f"day=2026-11-{d}" for d in (17, 18, 19, 20)}, before
    ledger = {"v": 1, "window": [T.format(0), T.format(5)], "top": 50,
              "streams": {"gw1/e1": {"skipped": [[13, 13]], "evicted": [
                  {"at": "2026-11-16T10:30:00.000Z", "ranges": [[21, 30]]}]}}}  # fmt: skip
    resend = _span_on(range(45, 47), 19, 23)
    _land(landing, "b", [*resend, _reading("gw1/e1/51", "$ledger", 6, None, record=ledger)])
    _run(spark, landing, wh)
    after = _day_files(wh)
    assert after["day=2026-11-17"] == before["day=2026-11-17"]
    for d in (18, 19, 20):
        assert not after[f"day=2026-11-{d}"] & before[f"day=2026-11-{d}"], d
    table = spark.read.parquet(str(wh / "completeness")).where("stream = 'gw1/e1'")
    got = {(r.hour.day, r.hour.hour): (r.landed, r.skipped, r.evicted) for r in table.collect()}
    assert got == {(16, 10): (0, 0, 10), (17, 10): (10, 0, 0), (18, 10): (9, 1, 0),
                   (19, 10): (10, 0, 0), (19, 23): (2, 0, 0), (20, 9): (8, 0, 0)}  # fmt: skip
    res = ref.compare(ref.build(landing), wh)
    for name, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (name, res)


@pytest.mark.timeout(600)
def test_a_young_warehouse_is_judged_whole_and_an_older_one_only_where_a_batch_changes_it(
    spark: Any, tmp_path: Path
) -> None:
    """By default (``completejob.WHOLE_DAYS``: 2) a batch whose buckets hold two days of
    ``landed`` or fewer judges their streams whole, and one over more judges again only
    what it can change (``judged_whole`` in the run's summary says which): gw1/e1 lands
    on the 18th and 19th (a first batch: whole), then on the 20th (two days on disk:
    whole), then 36..40 on the 21st (three days: again, from the 20th), leaving 31..35
    missing. The hole is found, and the tables are DuckDB's after each batch. Seen
    failing with the limit exclusive (the second batch judged again)."""
    from pubcomp.pipeline.completejob import WHOLE_DAYS, WHOLE_UP_TO_DAYS

    landing, wh = tmp_path / "landing", tmp_path / "wh"
    batches = [
        _span_on(range(1, 11), 18, 10) + _span_on(range(11, 21), 19, 10),
        _span_on(range(21, 31), 20, 10),
        _span_on(range(36, 41), 21, 10),
    ]
    spark.conf.set(WHOLE_UP_TO_DAYS, str(WHOLE_DAYS))
    try:
        whole = []
        for k, lines in enumerate(batches):
            _land(landing, f"b{k}", lines)
            whole.append(_run(spark, landing, wh)["judged_whole"])
            res = ref.compare(ref.build(landing), wh)
            for name, (_, only_spark, only_duck) in res.items():
                assert only_spark == 0 and only_duck == 0, (k, name, res)
    finally:
        spark.conf.set(WHOLE_UP_TO_DAYS, JUDGE_AGAIN[WHOLE_UP_TO_DAYS])
    assert whole == [[0], [1], []], whole
    rows = spark.read.parquet(str(wh / "completeness_gaps")).collect()
    assert {(r.lo, r.hi, r.reason) for r in rows} == {(31, 35, "unreported")}


@pytest.mark.timeout(600)
def test_a_batch_killed_after_clearing_the_days_it_judges_whole_is_judged_whole_again(
    spark: Any, tmp_path: Path
) -> None:
    """A batch that judges whole deletes every day of its buckets' ``completeness``
    before it writes them again. gw1/e1 landed on the 19th and 20th (two days: young);
    a batch lands 21..30 on the 21st and is killed right after the deletes (crash point
    ``pipeline_completeness_cleared``), its ranges already on disk: three days, so its
    replay, by the same limit, would judge again and write back only the days it
    changes. ``_writing``, touched before the deletes, makes it judge whole: every day
    is back and the tables are DuckDB's. Seen failing with ``_writing`` touched after
    the deletes (the replay judged again and wrote back only the 21st: the 19th's and
    20th's rows lost)."""
    import subprocess

    from devkit import hooked
    from pubcomp.pipeline.completejob import WHOLE_DAYS, WHOLE_UP_TO_DAYS

    landing, wh = tmp_path / "landing", tmp_path / "wh"
    _land(landing, "a", _span_on(range(1, 11), 19, 10) + _span_on(range(11, 21), 20, 10))
    _run(spark, landing, wh)
    _land(landing, "b", _span_on(range(21, 31), 21, 10))
    cmd = hooked.command("pipeline", "run", "--landing", str(landing))
    cmd += ["--warehouse", str(wh), "--master", "local[1]"]
    env = {**interpreted_env(), "PUBCOMP_CRASH_AT": "pipeline_completeness_cleared"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == -9, run.stderr[-2000:]
    assert not list((wh / "completeness").glob("bucket=*/day=*")), "the days not cleared"
    assert (wh / "completeness_gaps" / "_writing").exists()
    spark.conf.set(WHOLE_UP_TO_DAYS, str(WHOLE_DAYS))
    try:
        s = _run(spark, landing, wh)  # replays the batch
    finally:
        spark.conf.set(WHOLE_UP_TO_DAYS, JUDGE_AGAIN[WHOLE_UP_TO_DAYS])
    assert s["batches"] == [1], s
    assert {d.name for d in (wh / "completeness").glob("bucket=*/day=*")} == {
        f"day=2026-11-{d}" for d in (19, 20, 21)
    }
    res = ref.compare(ref.build(landing), wh)
    for name, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (name, res)
    assert s["judged_whole"] == [1], s


def test_a_batch_reads_of_landed_only_the_days_that_can_matter(
    spark: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """``landed`` is kept by day, with a span per stream and day (``landed_hull``), and a
    batch reads only the days its judgement can come from: gw1/e1 landed 1..10 on the
    17th, 11..20 on the 18th, 21..30 on the 19th and 41..50 on the 20th; a batch lands
    36..40 on the 20th. Its last landed position below 36 is 30, the 19th's last, so it
    reads the 19th and the 20th, never the 17th or the 18th; the hole left, 31..35, is
    found (unreported: no ledger came; it needs the 19th's range that ends at 30), and
    the tables are DuckDB's. Seen failing with the day that ends at that position left
    out (the hole is lost)."""
    from pubcomp.pipeline.landedstore import LandedStore

    landing, wh = tmp_path / "landing", tmp_path / "wh"
    _land(landing, "a", _span_on(range(1, 11), 17, 10) + _span_on(range(11, 21), 18, 10)
          + _span_on(range(21, 31), 19, 10) + _span_on(range(41, 51), 20, 12))  # fmt: skip
    _run(spark, landing, wh)
    read: list[str] = []
    real = LandedStore.read_days

    def spy(self: LandedStore, on_disk: Any, days: list[tuple[int, str]]) -> Any:
        read.extend(d for _, d in days)
        return real(self, on_disk, days)

    monkeypatch.setattr(LandedStore, "read_days", spy)
    _land(landing, "b", _span_on(range(36, 41), 20, 11))
    _run(spark, landing, wh)
    assert set(read) == {"2026-11-19", "2026-11-20"}, read
    rows = spark.read.parquet(str(wh / "completeness_gaps")).collect()
    assert {(r.lo, r.hi, r.reason) for r in rows} == {(31, 35, "unreported")}
    res = ref.compare(ref.build(landing), wh)
    for name, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (name, res)


def test_a_ledger_alone_judges_again_the_holes_it_can_change(spark: Any, tmp_path: Path) -> None:
    """A batch that lands nothing but a ledger changes old holes of its gateway's streams,
    which are judged again though no position of theirs landed: its latest ledger no
    longer holds 5..6 (held before: now unexplained), tells a top past the last landed
    seq (a new trailing hole, in the hour of its window end), names node n1's seqs up
    to 3 (its hole at 2, unreported before: now unexplained) and n2's up to 4 (it had
    no hole: now 3..4 is one); n3's trailing hole (told up to 4 by the first, landed to
    2), which the second does not name, moves to the hour of its window end. Seen
    failing with the old held and unreported holes not judged again, and with no
    trailing hole judged again. (Without its trailing holes a gateway's streams are judged whole:
    right, and slow; the growth bench shows that.)"""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    first = {"v": 1, "window": [T.format(0), T.format(5)], "top": 10,
             "streams": {"gw1/e1": {"held": [[5, 6]]}, "n2/0": {"stored": [[0, 2]]},
                         "n3/0": {"stored": [[0, 4]]}}}  # fmt: skip
    nodes = [_reading(f"n1/0/{q}.0", "t", q + 1) for q in (0, 1, 3)]
    nodes += [_reading(f"n{n}/0/{q}.0", "t", q + 1) for n in (2, 3) for q in (0, 1, 2)]
    ledger = _reading("gw1/e1/11", "$ledger", 5, None, record=first)
    _land(landing, "a", [*_span_on(range(1, 5), 20, 10), *_span_on(range(7, 11), 20, 10),
                         *nodes, ledger])  # fmt: skip
    _run(spark, landing, wh)

    def gaps() -> set[tuple[Any, ...]]:
        rows = spark.read.parquet(str(wh / "completeness_gaps")).collect()
        return {(r.stream, r.lo, r.hi, r.reason, r.hour.hour) for r in rows}

    assert gaps() == {("gw1/e1", 5, 6, "held", 10), ("n1/0", 2, 2, "unreported", 10),
                      ("n3/0", 3, 4, "unexplained", 10)}  # fmt: skip
    second = {"v": 1, "window": ["2026-11-20T11:00:00.000Z", "2026-11-20T11:05:00.000Z"],
              "top": 14, "streams": {"gw1/e1": {}, "n1/0": {"stored": [[0, 3]]},
                                     "n2/0": {"stored": [[0, 4]]}}}  # fmt: skip
    _land(landing, "b", [_reading("gw1/e1/12", "$ledger", 59, None, record=second)])
    _run(spark, landing, wh)
    assert gaps() == {("gw1/e1", 5, 6, "unexplained", 10),
                      ("gw1/e1", 11, 14, "unexplained", 11),
                      ("n1/0", 2, 2, "unexplained", 10),
                      ("n2/0", 3, 4, "unexplained", 11),
                      ("n3/0", 3, 4, "unexplained", 11)}  # fmt: skip
    res = ref.compare(ref.build(landing), wh)
    for name, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (name, res)


def test_owned_ranges_give_each_position_its_earliest_hour_however_they_were_grouped(
    spark: Any,
) -> None:
    """``owned_ranges`` against a position-by-position count of random ranges (three
    streams, overlaps within and across hours, copies): each position in the hour of its
    earliest copy, each row with the position after the row before it. Compacted in two steps (the
    state so far, then a batch's ranges), or with every range twice (a killed append read
    back), the same rows: what the ``landed`` table's generations rely on."""
    import random
    from datetime import datetime, timedelta

    from pubcomp.pipeline import completeness as C

    rng = random.Random(27)
    base = datetime(2026, 11, 20, 10)
    ranges = []
    for stream in ("g1/e1", "n1/1", "n2/3"):
        for _ in range(40):
            lo = rng.randrange(0, 300)
            t = base + timedelta(minutes=rng.randrange(0, 240))
            ranges.append(("g1", stream, lo, lo + rng.randrange(0, 25), t))
    ranges += ranges[:15]  # copies landed again, the same time

    def hours(df: Any) -> dict[tuple[str, int], datetime]:
        """Each position's hour; the rows disjoint, each with the position after the row
        before it (``_after``)."""
        out: dict[tuple[str, int], datetime] = {}
        last: dict[str, int] = {}
        for r in sorted(df.collect(), key=lambda r: (r.stream, r.lo)):
            assert r._after == (last[r.stream] + 1 if r.stream in last else None), r
            last[r.stream] = r.hi
            for p in range(r.lo, r.hi + 1):
                assert (r.stream, p) not in out, r
                out[r.stream, p] = r.t.replace(minute=0, second=0)
        return out

    earliest: dict[tuple[str, int], datetime] = {}
    for _, stream, lo, hi, t in ranges:
        for p in range(lo, hi + 1):
            earliest[stream, p] = min(t, earliest.get((stream, p), t))
    want = {k: t.replace(minute=0) for k, t in earliest.items()}

    def df(rows: list[Any]) -> Any:
        return spark.createDataFrame(rows, C.LANDED_SCHEMA)

    at_once = C.owned_ranges(df(ranges))
    assert hours(at_once) == want
    state = C.owned_ranges(df(ranges[:70])).drop("_after").localCheckpoint(eager=True)
    in_steps = C.owned_ranges(state.unionByName(df(ranges[70:])))
    twice = C.owned_ranges(at_once.drop("_after").unionByName(df(ranges)))
    assert hours(in_steps) == hours(twice) == want
    assert at_once.count() < len(ranges)
    # Ranges of one hour that continue each other are one row; another hour's are not.
    row = [("g1", "n9/0", 1, 5, base), ("g1", "n9/0", 6, 9, base + timedelta(minutes=20)),
           ("g1", "n9/0", 10, 12, base + timedelta(minutes=65))]  # fmt: skip
    got = {(r.lo, r.hi, r.t.hour, r._after) for r in C.owned_ranges(df(row)).collect()}
    assert got == {(1, 9, 10, None), (10, 12, 11, 10)}


# ------------------------------------------------------------ gaps judged in pieces


def test_a_gap_is_judged_in_pieces_cut_at_each_reason_and_at_what_was_told(spark: Any) -> None:
    """``missing_ranges`` over hand-made ``landed`` and ``ledger`` rows: a store stream with
    a hole of a trillion positions crossed by overlapping reasons (held inside evicted: held
    wins), a refusal, a skipped seq; a node stream whose ledger told only up to 12 (past
    it: unreported). Each range comes out with its reason, detail and hour. The hole is
    judged as pieces: seen failing when each missing position was a row (Spark refused the
    array of positions)."""
    from datetime import datetime

    from pubcomp.pipeline import completeness as C

    def t(hh: int, mm: int = 0) -> datetime:
        return datetime(2026, 11, 20, hh, mm)

    big = 10**12  # a hole no one could list position by position
    landed = spark.createDataFrame(
        [("g1", "g1/e1", 1, 10, t(0)), ("g1", "g1/e1", big + 11, big + 20, t(2)),
         ("g1", "n1/1", 0, 5, t(0)), ("g1", "n1/1", 50, 60, t(0, 10))],
        C.LANDED_SCHEMA,
    )  # fmt: skip
    head = ("g1/e1/900", "g1", "e1", 900, t(1, 30), t(1), t(1, 30))

    def row(stream: str, what: str, lo: int, hi: int, reason: str | None = None,
            at: datetime | None = None) -> tuple[Any, ...]:  # fmt: skip
        return (*head, stream, what, reason, at, lo, hi, 0)

    ledger = spark.createDataFrame(
        [row("g1/e1", "top", big + 30, big + 30), row("g1/e1", "evicted", 100, 200, at=t(0, 30)),
         row("g1/e1", "held", 150, 160), row("g1/e1", "refused", 500, 600, "bad_ts"),
         row("g1/e1", "skipped", 700, 700), row("n1/1", "node_dropped", 10, 12, "ring_overflow")],
        C.LEDGER_SCHEMA,
    )  # fmt: skip
    got = {
        (r.stream, r.lo, r.hi, r.reason, r.detail, r.hour)
        for r in C.missing_ranges(landed, C.ledger_state(ledger)).collect()
    }
    assert got == {
        ("g1/e1", 11, 99, "unexplained", None, t(2)),
        ("g1/e1", 100, 149, "evicted", None, t(0)),
        ("g1/e1", 150, 160, "held", None, t(1)),
        ("g1/e1", 161, 200, "evicted", None, t(0)),
        ("g1/e1", 201, 499, "unexplained", None, t(2)),
        ("g1/e1", 500, 600, "refused", "bad_ts", t(1)),
        ("g1/e1", 601, 699, "unexplained", None, t(2)),
        ("g1/e1", 700, 700, "skipped", None, t(1)),
        ("g1/e1", 701, big + 10, "unexplained", None, t(2)),
        ("g1/e1", big + 21, big + 30, "unexplained", None, t(1)),
        ("n1/1", 6, 9, "unexplained", None, t(0, 10).replace(minute=0)),
        ("n1/1", 10, 12, "node_dropped", "ring_overflow", t(1)),
        ("n1/1", 13, 49, "unreported", None, t(0)),
    }


def test_the_ledgers_state_is_one_row_a_stream_and_the_same_however_it_was_built(
    spark: Any,
) -> None:
    """``ledger_state``: ledgers that tell the same streams again compact to a told row per
    stream, the latest ledger's held ranges and each reason's range once at its earliest
    time; compacted in one go, ledger by ledger, or with every row written twice (a
    killed append read back), the same rows and the same gaps."""
    from datetime import datetime

    from pubcomp.pipeline import completeness as C

    def t(hh: int, mm: int = 0) -> datetime:
        return datetime(2026, 11, 20, hh, mm)

    def ledger(seq: int, end: datetime, held: tuple[int, int], top: int) -> list[tuple[Any, ...]]:
        head = (f"g1/e1/{seq}", "g1", "e1", seq, end, end.replace(minute=0), end)
        return [(*head, s, w, r, at, lo, hi, seq) for s, w, r, at, lo, hi in [
            ("g1/e1", "top", None, None, top, top),
            ("g1/e1", "stored", None, None, 1, top),
            ("g1/e1", "held", None, None, *held),
            ("g1/e1", "refused", "bad_ts", None, 40, 45),
            ("g1/e1", "evicted", None, t(0, 5), 20, 25),
            ("n1/1", "node_dropped", "ring_overflow", None, 3, 4),
        ]]  # fmt: skip

    ledgers = [ledger(100, t(1), (50, 60), 100), ledger(200, t(2), (90, 120), 200),
               ledger(150, t(1, 30), (70, 80), 150)]  # fmt: skip
    raw = [spark.createDataFrame(rows, C.LEDGER_SCHEMA) for rows in ledgers]
    everything = raw[0].unionByName(raw[1]).unionByName(raw[2])

    def rows(df: Any) -> set[tuple[Any, ...]]:
        return {tuple(r) for r in df.collect()}

    at_once = C.ledger_state(everything)
    state = None
    for r in raw:  # as batches do: the state so far and the batch's new rows
        new = r.drop("batch")
        state = C.ledger_state(new if state is None else state.drop("bucket").unionByName(new))
        state = state.localCheckpoint(eager=True)  # as the job does (a plan a batch, not nested)
    assert state is not None
    twice = C.ledger_state(
        state.unionByName(state).drop("bucket").unionByName(raw[0].drop("batch"))
    )
    assert rows(at_once) == rows(state) == rows(twice)
    got = {(r.what, r.stream, r.lo, r.hi, r.reason, r.id, r.window_start, r.at) for r in
           at_once.collect()}  # fmt: skip
    assert got == {
        ("told", "g1/e1", 200, 200, None, "", None, None),
        ("told", "n1/1", 4, 4, None, "", None, None),
        ("head", "", 0, 0, None, "g1/e1/200", t(2), None),
        ("held", "g1/e1", 90, 120, None, "g1/e1/200", t(2), None),  # the latest's only
        ("refused", "g1/e1", 40, 45, "bad_ts", "", t(1), None),  # told first at t(1)
        ("evicted", "g1/e1", 20, 25, None, "", t(1), t(0, 5)),
        ("node_dropped", "n1/1", 3, 4, "ring_overflow", "", t(1), None),
    }
    landed = spark.createDataFrame(
        [("g1", "g1/e1", 1, 10, t(0)), ("g1", "n1/1", 0, 1, t(0))], C.LANDED_SCHEMA
    )
    assert rows(C.missing_ranges(landed, at_once)) == rows(C.missing_ranges(landed, twice))


@pytest.mark.timeout(900)
def test_a_batch_killed_at_each_of_its_points_converges(spark: Any, tmp_path: Path) -> None:
    """A batch killed after it appended its buckets' ledger state, its replay killed
    after it appended its landed ranges, and that replay's replay killed after it wrote
    the days of ``completeness`` it changed but not yet the gaps: each kill comes before
    the generations the batch replaces are deleted. The last replay reads them all,
    compacts them again, finds the same days changed (the gaps on disk are the old
    ones), and the tables are DuckDB's; once it has run, a generation of the ledgers'
    state per bucket is left, and of ``landed`` the history's and the batch's (the
    replays' ranges appended to its own again: read three times, counted once).

    One chain rather than a batch killed afresh at each point: each point is reached
    with what the kills before it left on disk, which is what a gateway's cloud sees
    when a VM is restarted more than once, and it runs the history batch once."""
    import subprocess

    from devkit import hooked

    gen, landing, wh = tmp_path / "gen", tmp_path / "landing", tmp_path / "wh"
    spec = FleetSpec(gateways=2, nodes=1, readings=900, roll_minutes=10, seed=11,
                     node_drops=1, refusals=1, held=1, unexplained=1)  # fmt: skip
    files = simulate(gen, spec)["files"]
    half = len(files) // 2

    def land(part: list[dict[str, Any]]) -> None:
        for f in part:
            (landing / f["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(gen / f["file"], landing / f["file"])

    def killed_at(crash: str) -> None:
        cmd = hooked.command("pipeline", "run", "--landing", str(landing))
        cmd += ["--warehouse", str(wh), "--master", "local[1]"]
        env = {**conf_env(JUDGE_AGAIN, interpreted_env()), "PUBCOMP_CRASH_AT": crash}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == -9, (crash, run.stderr[-2000:])

    land(files[:half])
    _run(spark, landing, wh)
    table = wh / "completeness"
    before = {p: p.stat().st_mtime_ns for p in table.rglob("*.parquet")}
    land(files[half:])
    killed_at("pipeline_ledger_state_written")
    gens = _generations(wh / "ledger_state")
    assert any(len(g) == 2 for g in gens.values()), gens  # the old and the new, both there
    assert all(g == ["gen=0"] for g in _landed_generations(wh).values())
    killed_at("pipeline_landed_written")
    assert any("gen=1" in g for g in _landed_generations(wh).values())
    assert {p: p.stat().st_mtime_ns for p in table.rglob("*.parquet")} == before
    killed_at("pipeline_completeness_written")
    assert {p: p.stat().st_mtime_ns for p in table.rglob("*.parquet")} != before
    assert not (wh / "completeness_gaps" / "_writing").exists()  # the gaps not begun
    s = _run(spark, landing, wh)  # replays the batch
    assert s["batches"] == [1]
    con = ref.build(landing)
    res = ref.compare(con, wh)
    for name, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (name, res)
    gens = _generations(wh / "ledger_state")
    assert gens and all(len(g) == 1 for g in gens.values()), gens
    landed = _landed_generations(wh)  # a day's, the history's or the batch's or both
    assert landed and all(g in (["gen=0"], ["gen=1"], ["gen=0", "gen=1"]) for g in
                          landed.values()), landed  # fmt: skip
    assert any(g == ["gen=0", "gen=1"] for g in landed.values()), landed


def _generations(table: Path) -> dict[str, list[str]]:
    return {b.name: sorted(g.name for g in b.glob("gen=*")) for b in table.glob("bucket=*")}


def _landed_generations(wh: Path) -> dict[str, list[str]]:
    """``landed``'s generations by bucket and day."""
    days = (wh / "landed").glob("bucket=*/day=*")
    return {f"{d.parent.name}/{d.name}": sorted(g.name for g in d.glob("gen=*")) for d in days}


@pytest.mark.timeout(900)
def test_landed_is_kept_in_generations_compacted_and_converted_from_older_layouts(
    spark: Any, tmp_path: Path
) -> None:
    """``landed`` (by bucket, day and generation): a warehouse written by an older
    version (``batch=N``, then ``bucket=B/gen=G``) is converted by the next batch, and
    with ``max_generations`` 2 a day that has two is compacted into one when a batch
    next lands in it; over four runs the tables are DuckDB's, and ``landed`` holds fewer
    rows than the batches landed ranges."""
    from pubcomp.pipeline import completeness as C

    gen, landing, wh = tmp_path / "gen", tmp_path / "landing", tmp_path / "wh"
    spec = FleetSpec(gateways=3, nodes=1, readings=1_200, roll_minutes=10, seed=5,
                     dup_rate=0.1, late_file_rate=0.2, node_drops=1, unexplained=1)  # fmt: skip
    files = simulate(gen, spec)["files"]
    quarter = -(-len(files) // 4)
    table = wh / "landed"
    ranges = 0

    def as_older(layout: list[str], batch: int) -> int:
        """``landed`` rewritten as an older version kept it; its rows."""
        old = spark.read.parquet(str(table)).select(*C.LANDED_COLUMNS)
        old = old.withColumn("bucket", C.bucket(F.col("gateway")))
        old = old.withColumn("batch", F.lit(batch)).withColumn("gen", F.lit(batch))
        old = old.localCheckpoint(eager=True)
        shutil.rmtree(table)
        old.select(*C.LANDED_COLUMNS, *layout).write.partitionBy(*layout).parquet(str(table))
        return old.count()

    for i in range(4):
        part = files[i * quarter : (i + 1) * quarter]
        for f in part:
            (landing / f["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(gen / f["file"], landing / f["file"])
        p = Pipeline(spark, str(landing), str(wh))
        p.complete.landed.max_generations = 2
        p.run()
        if i == 0:  # as the version before the generations wrote it: by batch
            ranges = as_older(["batch"], 0)
            continue
        assert not list(table.glob("batch=*")) and not list(table.glob("bucket=*/gen=*"))
        gens = _landed_generations(wh)
        # converted (the old batches' generation and the run's), compacted, converted
        # again (from the bucket's generations) and one more
        assert gens and {len(g) for g in gens.values()} == {[2, 1, 2][i - 1]}, (i, gens)
        # (its messages that name a store span: what landed would be, a row a message)
        batch = spark.read.json([str(landing / f["file"]) for f in part])
        ranges += batch.where(F.col("_mqtt").isNotNull()).count()
        if i == 2:  # as the version before the days wrote it: by bucket and generation
            as_older(["bucket", "gen"], 2)
    kept = spark.read.parquet(str(table)).count()
    assert 0 < kept < ranges, (kept, ranges)
    res = ref.compare(ref.build(landing), wh)
    for name, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (name, res)


# ------------------------------------------------------------ a fleet's planted holes


def _positions(gaps: list[tuple[Any, ...]]) -> dict[tuple[str, str, int], str]:
    """(gateway, stream, position) -> reason, from (gateway, stream, lo, hi, reason) rows."""
    return {(g, s, p): r for g, s, lo, hi, r in gaps for p in range(lo, hi + 1)}


@pytest.mark.timeout(1200)
def test_a_fleet_s_planted_holes_are_found_with_their_reasons_in_spark_and_duckdb(
    spark: Any, tmp_path: Path, capsys: Any
) -> None:
    """devkit/fleetsim's landing files with a hole of every reason (held, evicted, dead
    letter, refused, node dropped, skipped blocks after restarts, unexplained), each
    gateway's $ledger records among them, in two runs: the completeness table names every
    planted position with its reason and nothing else, in Spark and in DuckDB, which
    agree row for row; its hourly counts add up to what the ground truth committed; and
    it is shown: the command's table and exit code, the metrics, the report, the fleet
    page in chromium."""
    gen, landing, wh = tmp_path / "gen", tmp_path / "landing", tmp_path / "wh"
    spec = FleetSpec(gateways=2, nodes=2, readings=2_500, roll_minutes=10, seed=7,
                     dup_rate=0.1, late_file_rate=0.2, node_drops=2, refusals=2,
                     dead_letters=1, held=1, unexplained=2)  # fmt: skip
    truth = simulate(gen, spec)
    files = truth["files"]
    for part in (files[: len(files) // 2], files[len(files) // 2 :]):
        for f in part:
            (landing / f["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(gen / f["file"], landing / f["file"])
        _run(spark, landing, wh)
    want = _positions(
        [(g["gateway"], g["stream"], g["lo"], g["hi"], g["reason"]) for g in truth["gaps"]]
    )
    assert set(want.values()) == {"held", "evicted", "dead_letter", "refused", "node_dropped",
                                  "skipped", "unexplained"}  # fmt: skip
    con = ref.build(landing)
    res = ref.compare(con, wh)
    for table, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (table, res)
    gaps = spark.read.parquet(str(wh / "completeness_gaps"))
    got = _positions([tuple(r) for r in gaps.select("gateway", "stream", "lo", "hi", "reason")
                      .collect()])  # fmt: skip
    assert got == want
    duck = con.execute("SELECT gateway, stream, lo, hi, reason FROM completeness_gaps").fetchall()
    assert _positions(duck) == want
    # The hours add up: every node message and store seq the fleet committed is landed
    # or missing, once; the skipped seqs are neither.
    table = spark.read.parquet(str(wh / "completeness"))
    sums = table.groupBy("kind").agg(*[F.sum(c).alias(c) for c in ("expected", "landed",
                                       "missing", "unexplained", "skipped")])  # fmt: skip
    by = {r["kind"]: r for r in sums.collect()}
    n_missing = {k: sum(1 for (g, s, _), r in want.items()
                        if r != "skipped" and (s.split("/")[0] == g) == (k == "store"))
                 for k in ("store", "node")}  # fmt: skip
    for kind in ("store", "node"):
        assert by[kind]["missing"] == n_missing[kind]
        assert by[kind]["expected"] == by[kind]["landed"] + by[kind]["missing"]
    per_message = spec.readings_per_message
    node_messages = sum(s["count"] for s in truth["streams"] if s["kind"] == "node")
    assert by["node"]["expected"] == node_messages // per_message
    assert by["store"]["unexplained"] + by["node"]["unexplained"] == sum(
        1 for r in want.values() if r == "unexplained"
    )
    assert by["store"]["skipped"] == sum(s["last"] - s["first"] + 1 for s in truth["skips"])
    _shown(spark, wh, tmp_path, want, capsys)


def _shown(
    spark: Any, wh: Path, tmp: Path, want: dict[tuple[str, str, int], str], capsys: Any
) -> None:
    """The same warehouse as an operator sees it: ``pubcomp fleet completeness`` (its table,
    its exit code, its metrics file), the report's section and the fleet page in chromium."""
    from pubcomp.pipeline import completeview, report
    from pubcomp.sync.exitcodes import EXIT_UNEXPLAINED

    from .test_gateway_status_page import Browser

    unexplained = sum(1 for r in want.values() if r == "unexplained")
    bad = {(g, s) for (g, s, _), r in want.items() if r == "unexplained"}
    prom = tmp / "completeness.prom"
    args = argparse.Namespace(warehouse=str(wh), since=None, gateway=None, master=None,
                              textfile=str(prom))  # fmt: skip
    capsys.readouterr()
    assert completeview.fleet_completeness(args) == EXIT_UNEXPLAINED
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("GATEWAY")
    listed = {tuple(ln.split()[:2]) for ln in lines[1:-1]}
    assert bad <= listed
    assert listed == {(g, s) for (g, s, _), r in want.items() if r != "skipped"}
    assert f"{unexplained:,} unexplained" in lines[-1]
    metrics = prom.read_text()
    gauges = [ln for ln in metrics.splitlines() if ln.startswith("pubcomp_completeness_missing{")]
    total = sum(int(ln.rsplit(" ", 1)[1]) for ln in gauges if "unexplained" in ln)
    assert total == unexplained
    # One gateway, clean or not: its own code.
    clean = sorted({g for g, _, _ in want} - {g for g, _ in bad})
    for gw in clean[:1]:
        args.gateway, args.textfile = gw, None
        assert completeview.fleet_completeness(args) == 0
        assert "nothing unexplained" in capsys.readouterr().out
    # The report's section (its picture and table) and the fleet page, as chromium shows it.
    page = tmp / "report.html"
    facts = report.write(spark, str(wh), page)
    assert facts.completeness is not None and facts.completeness_chart
    body = page.read_text()
    assert 'id="completeness"' in body and f"{unexplained:,} positions missing" in body
    fleet = page.with_name("report-fleet.html")
    browser = Browser(tmp)
    dom = browser.dom(fleet.as_uri())
    assert f"{unexplained:,} positions missing" in dom.text("completeness-verdict")
    rows = re.findall(r'data-gateway="([^"]+)"[^>]*>(.*?)</tr>', dom.source)
    marked = {g for g, row in rows if 'data-unexplained="0"' not in row}
    assert marked == {g for g, _ in bad}
    shot = browser.shots / "completeness-fleet-desktop.png"
    browser._run(fleet.as_uri(), (1280, 720), f"--screenshot={shot}")
    assert shot.stat().st_size > 10_000


# ------------------------------------------------------------ shown where people look


def _view() -> Any:
    from pubcomp.pipeline.completeview import Completeness, StreamGaps

    gaps = [("unexplained", None, 201, 300, 100), ("held", None, 981, 1000, 20)]
    bad = StreamGaps("gw-a", "gw-a/3f9c", "store", 1000, 880, 120, 0,
                     {"held": 20, "unexplained": 100}, gaps)  # fmt: skip
    ok = StreamGaps("gw-b", "n1/4", "node", 50, 47, 3, 0, {"node_dropped": 3},
                    [("node_dropped", "ring_overflow", 10, 12, 3)])  # fmt: skip
    clean = StreamGaps("gw-b", "gw-b/77", "store", 400, 400, 0, 10_000)
    return Completeness([bad, ok, clean], {}, True)


def test_the_text_table_names_each_stream_missing_readings_and_why() -> None:
    from pubcomp.pipeline.completeview import code, render
    from pubcomp.sync.exitcodes import EXIT_OK, EXIT_UNEXPLAINED

    c = _view()
    text = render(c, "wh")
    lines = text.splitlines()
    assert lines[0].split() == ["GATEWAY", "STREAM", "KIND", "EXPECTED", "LANDED", "MISSING",
                                "WHY", "(positions)"]  # fmt: skip
    assert "held 981-1000 (20)" in lines[1] and "unexplained 201-300 (100)" in lines[1]
    assert lines[1].index("held") < lines[1].index("unexplained")  # the design's order
    assert "node_dropped 10-12 ring_overflow (3)" in lines[2]
    assert "gw-b/77" not in text  # nothing missing: not listed
    assert "100 unexplained" in lines[-1]
    assert code(c) == EXIT_UNEXPLAINED != EXIT_OK
    c.streams = c.streams[1:]
    assert code(c) == EXIT_OK and "nothing unexplained" in render(c, "wh")


def test_the_metrics_the_cloud_alert_reads_are_written() -> None:
    """pubcomp-alerts.yml's cloud group names only metrics ``--textfile`` writes, and its
    unexplained gauge is what the table counts."""
    from pubcomp.pipeline.completeview import prometheus

    from .test_grafana_dashboard import CLOUD_METRICS, metric_names
    from .test_prometheus_rules import alert_rules

    text = prometheus(_view())
    assert 'pubcomp_completeness_missing{gateway="gw-a",reason="unexplained"} 100' in text
    assert 'pubcomp_completeness_missing{gateway="gw-b",reason="unexplained"} 0' in text
    assert 'pubcomp_completeness_expected{gateway="gw-b"} 450' in text
    exported = {ln.split("{")[0] for ln in text.splitlines() if not ln.startswith("#")}
    cloud = [r for r in alert_rules() if r["expr"].startswith(CLOUD_METRICS)]
    assert [r["alert"] for r in cloud] == ["PubcompReadingsMissingUnexplained"]
    for r in cloud:
        assert metric_names(r["expr"]) <= exported, r
