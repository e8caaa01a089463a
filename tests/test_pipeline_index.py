"""The seen index (issue 27): per stream, the ranges of positions kept, on real local Spark.

Checked against DuckDB stating the same rules from the same landing files
(devkit/duckdb_reference.py): the tables, and that the index claims exactly the
positions kept (``compare_index``), in runs made by the same rule (``kept_ranges``).
"""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest

from devkit import duckdb_reference as ref
from devkit.fleetsim import FleetSpec, simulate
from pubcomp.pipeline import seenindex, transforms
from pubcomp.pipeline.job import Pipeline
from pubcomp.sync.wire import wire_time

T0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)


def _run(spark: Any, landing: Path, wh: Path) -> dict[str, Any]:
    return Pipeline(spark, str(landing), str(wh)).run().__dict__


def _agrees(landing: Path, wh: Path) -> duckdb.DuckDBPyConnection:
    con = ref.build(landing)
    res = ref.compare(con, wh)
    for table, (rows, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (table, res)
        assert rows > 0 or table in ref.MAY_BE_EMPTY, (table, res)
    ref.build_index(con)
    index = ref.compare_index(con, wh)
    assert index == dict.fromkeys(index, 0), index
    return con


def _land(landing: Path, name: str, records: list[dict[str, Any]]) -> None:
    day = landing / "date=2026-11-20"
    day.mkdir(parents=True, exist_ok=True)
    (day / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


# ------------------------------------------------------------ positions and runs


IDS = {
    "gw/3f9c2a1b04de/7": ("gw", "3f9c2a1b04de", False, 7000),
    "n1/3/5.2": ("n1", "3", True, 5002),
    "n1/3/0.0": ("n1", "3", True, 0),
    "n1/3/5.999": ("n1", "3", True, 5999),
    "g/e/9007199254740991": ("g", "e", False, 9007199254740991000),
    "n1/3/05.2": None,  # another id than 5.2: not a position
    "n1/3/5.02": None,
    "n1/3/5.1000": None,
    "n1/3/5.": None,
    "n1/3/5.1.2": None,
    "gw/e/0.air.temp": None,
    "gw/e/+5": None,
    "gw/e/ 5": None,
    "gw/e/9007199254740992": None,
    "a/b/c/1": None,
    "a/b": None,
    "/e/5": None,
    "gw//5": None,
}


def test_an_id_is_a_stream_position_only_in_its_exact_form(spark: Any) -> None:
    """Spark's parse (string functions) and DuckDB's (regular expressions) agree."""
    df = spark.createDataFrame([(i,) for i in IDS], "id string")
    got = {
        r.id: None if r.pos is None else (r.origin, r.epoch, r.dotted, r.pos)
        for r in df.select("id", *seenindex.stream_position(df.id)).collect()
    }
    assert got == IDS
    con = duckdb.connect()
    con.execute("CREATE TABLE readings AS SELECT unnest($ids) AS id", {"ids": list(IDS)})
    con.execute(ref.KEPT_POSITIONS)
    duck = {r[0]: r[1:] for r in con.execute("SELECT * FROM kept_positions").fetchall()}
    assert duck == {i: v for i, v in IDS.items() if v is not None}


def _positions(spec: list[tuple[str, list[tuple[int, int]]]]) -> list[tuple[str, int]]:
    """(stream, [(seq, readings in the message), ...]) -> positions of every reading."""
    return [(s, seq * 1000 + i) for s, msgs in spec for seq, n in msgs for i in range(n)]


def test_runs_follow_the_rule_in_one_go_and_batch_by_batch(spark: Any) -> None:
    """Node streams of 3-reading messages with a gap, a bigger message, a shorter message,
    a message with a hole, a gateway stream with a gap: the runs built from all positions
    at once, and from three batches merged as a compaction does, are DuckDB's, and claim
    exactly them."""
    pos = _positions(
        [
            ("a", [(s, 3) for s in range(0, 40) if s not in (17, 18)]),  # two messages missing
            ("b", [(s, 3) for s in range(10)] + [(10, 7)] + [(s, 3) for s in range(11, 20)]),
            ("c", [(s, 2) for s in range(5)]),
            ("d", [(s, 4) for s in range(6)]),
        ]
    )
    # c's third message lost its last reading; d's fourth one the second of four (a hole
    # inside a message: its readings are pieces of their own).
    holes = (("c", 2001), ("d", 3001))
    pos = [p for p in pos if p not in holes] + [("g", s * 1000) for s in range(1, 30) if s != 12]
    rows = [
        (s, "1", s != "g", p, T0 + timedelta(seconds=k), "gw", T0, "2026-11-20", k % 3)
        for k, (s, p) in enumerate(pos)
    ]
    schema = (
        "origin string, epoch string, dotted boolean, pos long, received timestamp, "
        "gateway string, ts timestamp, date string, batch long"
    )
    df = spark.createDataFrame(rows, schema)
    whole = seenindex.build_runs(seenindex.position_segments(df))
    # Each batch's runs materialised, as a compaction reads them from their generations'
    # files (merged as one plan, Catalyst spent minutes on the tree, not the rows).
    parts = [
        seenindex.build_runs(seenindex.position_segments(df.where(df.batch == b))).localCheckpoint()
        for b in range(3)
    ]
    merged = seenindex.merge_runs(parts[0].unionByName(parts[1]).unionByName(parts[2]))
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE kept_positions AS SELECT * FROM (VALUES "
        + ", ".join(f"('{s}', '1', {str(s != 'g').lower()}, {p})" for s, p in pos)
        + ") AS t(origin, epoch, dotted, pos)"
    )
    con.execute(ref.KEPT_RANGES)
    duck = sorted(con.execute("SELECT * FROM kept_ranges").fetchall())
    for runs in (whole, merged):
        got = sorted(
            tuple(r)
            for r in runs.select("origin", "epoch", "dotted", "lo", "hi", "width", "n").collect()
        )
        assert got == duck
    # The bigger message starts a run of its width, which the next message ends.
    assert ("b", "1", True, 10000, 11002, 7, 10) in duck
    assert len([r for r in duck if r[0] == "a"]) == 2
    assert sum(r[-1] for r in duck) == len(pos)


def test_bounded_keeps_a_few_runs_and_wraps_the_rest_in_one_envelope(spark: Any) -> None:
    """A stream of more than ``MAX_EXACT`` runs, or holding an envelope, becomes one
    envelope: the span of its runs, their count, the largest copy order and the widest
    bounds; a stream of a few exact runs keeps each of them as it was."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType

    k, day = seenindex.POS_SCALE, datetime(2026, 11, 20, tzinfo=UTC)

    def run(o: str, lo: int, hi: int, w: int, exact: bool, n: int, j: int) -> tuple[Any, ...]:
        t, d = day + timedelta(hours=j), f"2026-11-{20 + j % 4}"
        return (o, "1", True, lo, hi, w, exact, n, t, f"gw{j % 3}", t, t, d, d, j, j + 1, 0)

    many = [run("a", s * 10 * k, s * 10 * k + 2 * k + 2, 3, True, 9, s) for s in range(9)]
    few = [run("b", 0, 4 * k + 2, 3, True, 15, 1), run("b", 9 * k, 9 * k, 1, True, 1, 2)]
    mixed = [run("c", 0, 5 * k, k, False, 4, 5), run("c", 7 * k, 8 * k + 1, 2, True, 4, 6)]
    schema = StructType(seenindex.RANGES_SCHEMA.fields[:-1])
    out = seenindex.bounded(spark.createDataFrame(many + few + mixed, schema))
    epoch = [F.unix_seconds(c).alias(c) for c in ("last_received", "ts_lo", "ts_hi")]
    cols = [F.col(c) for c in seenindex.RANGE_COLUMNS]
    cols[8], cols[10], cols[11] = epoch
    got = sorted(tuple(r) for r in out.select(*cols).collect())

    def s(t: datetime) -> int:
        return int(t.timestamp())

    b = [(*r[:8], s(r[8]), r[9], s(r[10]), s(r[11]), *r[12:]) for r in few]
    assert got == sorted(
        [
            # more than MAX_EXACT runs: one envelope, the largest copy order, all bounds
            ("a", "1", True, 0, 82 * k + 2, k, False, 81, s(day) + 8 * 3600, "gw2",
             s(day), s(day) + 8 * 3600, "2026-11-20", "2026-11-23", 0, 9, 0),
            *b,  # a few exact runs: as they were
            ("c", "1", True, 0, 8 * k + 1, k, False, 8, s(day) + 6 * 3600, "gw0",
             s(day) + 5 * 3600, s(day) + 6 * 3600, "2026-11-21", "2026-11-22", 5, 7, 0),
        ]
    )  # fmt: skip


def test_kept_runs_by_aggregate_equal_the_windows_on_every_column(spark: Any) -> None:
    """``kept_runs`` (a stream of many stretches made an envelope by aggregates) gives
    the rows ``bounded(build_runs(...))`` gives, every column: a stream of 12 stretches,
    one of one stretch but more than MAX_EXACT runs (holes inside its messages), one of
    a few runs, a gateway's seqs; copies received at the same time by two gateways, or
    never (a null), over two dates and batches."""
    from pyspark.sql import functions as F

    every_other = [(s, 3) for s in range(0, 24, 2)]  # 12 stretches
    pos = _positions([("w", every_other), ("f", [(s, 3) for s in range(9) if s != 4])])
    pos += [("r", s * 1000 + i) for s in range(12) for i in (0, 2)]  # a hole in each
    pos += [("g", s * 1000) for s in range(50) if s % 5]  # 10 stretches of 4
    rows = []
    for k, (st, p) in enumerate(pos):
        t = T0 + timedelta(minutes=k * 40)
        received = None if k % 7 == 3 else T0 + timedelta(seconds=k % 4)
        rows.append((st, "1", st != "g", p, received, f"gw{k % 3}", t,
                     t.strftime("%Y-%m-%d"), k % 5))  # fmt: skip
    schema = (
        "origin string, epoch string, dotted boolean, pos long, received timestamp, "
        "gateway string, ts timestamp, date string, batch long"
    )
    kept = spark.createDataFrame(rows, schema)
    cols = [
        F.unix_micros(c).alias(c) if c in ("last_received", "ts_lo", "ts_hi") else F.col(c)
        for c in seenindex.RANGE_COLUMNS
    ]
    windows = seenindex.bounded(seenindex.build_runs(seenindex.position_segments(kept)))
    want = sorted(tuple(r) for r in windows.select(*cols).collect())
    got = sorted(tuple(r) for r in seenindex.kept_runs(kept).select(*cols).collect())
    assert got == want
    shapes = {(r[0], r[6]) for r in got}  # (stream, exact)
    assert shapes == {("w", False), ("r", False), ("g", False), ("f", True)}
    assert {r[9] for r in got if not r[6]} <= {"gw0", "gw1", "gw2"}
    assert {r[12] for r in got} != {r[13] for r in got}  # two dates


# ------------------------------------------------------------ a fleet


@pytest.mark.timeout(600)
def test_a_fleet_in_batches_equals_duckdb_and_the_index_follows_its_streams(
    spark: Any, tmp_path: Path
) -> None:
    """devkit/fleetsim's landing files (duplicates, files rolled late, restarts, a store
    replaced, evictions, node drops, unexplained holes) in three runs: every table is
    DuckDB's, the index claims exactly the kept positions with a few rows per stream,
    and what landed is what the ground truth says (all committed readings but its holes)."""
    gen, landing, wh = tmp_path / "gen", tmp_path / "landing", tmp_path / "wh"
    spec = FleetSpec(gateways=3, nodes=3, readings=6_000, roll_minutes=10, seed=5,
                     dup_rate=0.1, late_file_rate=0.2)  # fmt: skip
    truth = simulate(gen, spec)
    files = truth["files"]
    displaced = 0
    for part in (files[: len(files) // 3], files[len(files) // 3 : -2], files[-2:]):
        for f in part:
            (landing / f["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(gen / f["file"], landing / f["file"])
        displaced += _run(spark, landing, wh)["displaced"]
    con = _agrees(landing, wh)
    assert displaced > 0  # a late file's copies were received before the ones kept
    # What landed: every committed reading but the planted holes.
    kept = {r[0] for r in con.execute("SELECT id FROM readings").fetchall()}
    holes = {(h["origin"], h["epoch"]): h for h in truth["holes"]}
    assert len(kept) == truth["readings"] - sum(h["count"] for h in truth["holes"])
    for h in truth["holes"]:
        for end in (h["first"], h["last"]):
            assert f"{h['origin']}/{h['epoch']}/{end}" not in kept, h
    assert {r["reason"] for r in truth["holes"]} >= {"evicted", "dropped_on_node", "unexplained"}
    assert truth["skips"] and truth["replaced"] and holes
    # The index follows the streams, not the readings: a row a generation per stream and
    # gap (a late file leaves one until it lands), and once compacted a row per stream and
    # planted hole.
    runs = spark.read.parquet(str(wh / "seen_ranges"))
    n_streams, n_holes = len(truth["streams"]), len(truth["holes"])
    assert runs.count() < len(kept) / 20
    assert seenindex.merge_runs(runs).count() <= n_streams + n_holes
    assert runs.agg({"n": "sum"}).first()[0] == len(kept)
    # A gateway's own seqs interleave with its nodes': its stream is an envelope.
    envelopes = {(r.origin, r.epoch) for r in runs.where(~runs.exact).collect()}
    assert {o for o, _ in envelopes} >= {f"gw{g:04d}" for g in range(spec.gateways)}
    # The other streams' runs, merged as a compaction would, are DuckDB's runs.
    exact = runs.join(
        spark.createDataFrame(list(envelopes) or [("", "")], "origin string, epoch string"),
        on=["origin", "epoch"],
        how="left_anti",
    )
    merged = seenindex.merge_runs(exact)
    got = sorted(
        tuple(r) for r in merged.select("origin", "epoch", "dotted", "lo", "hi", "width", "n")
        .collect()
    )  # fmt: skip
    duck = sorted(
        r
        for r in con.execute("SELECT * FROM kept_ranges").fetchall()
        if (r[0], r[1]) not in envelopes
    )
    assert got == duck


# ------------------------------------------------------------ envelopes and lookups


def _gateway_copies(
    seqs: list[int],
    *,
    received: datetime,
    ts: datetime | None = None,
    flags: list[str] | None = None,
) -> list[dict[str, Any]]:
    """A gateway's own readings ``gwx/e1/{seq}`` (its nodes' readings sit between them)."""
    return [
        {
            "id": f"gwx/e1/{s}", "origin": "gwx", "sensor": f"s{s % 2}",
            "ts": wire_time((ts or T0) + timedelta(seconds=s)), "value": s / 4, "unit": "C",
            "flags": flags or [], "gateway": "gwx",
            "received": wire_time(received + timedelta(seconds=s)),
        }
        for s in seqs
    ]  # fmt: skip


def test_copies_inside_an_envelope_are_decided_by_their_kept_copy(
    spark: Any, tmp_path: Path
) -> None:
    """A gateway stream in 40 stretches (an envelope). The next batch brings: the stretch
    that was missing (a late file: received earlier, never kept), later copies (they
    lose), an earlier-received copy (it displaces). The one after, alone, an
    earlier-received copy with a corrected clock, whose ts is in another hour than its
    kept copy's: found all the same, in the envelope's dates (alone, so that no other
    candidate's hour is the kept copy's)."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    stretches = [[11 * k + 1, 11 * k + 2] for k in range(40)]
    first = [s for k, st in enumerate(stretches) if k != 20 for s in st]
    _land(landing, "b0", _gateway_copies(first, received=T0 + timedelta(minutes=5)))
    _run(spark, landing, wh)
    runs = spark.read.parquet(str(wh / "seen_ranges")).collect()
    assert [(r.exact, r.n) for r in runs] == [(False, 78)]
    late = _gateway_copies(stretches[20], received=T0)  # received before the others
    again = _gateway_copies(stretches[5], received=T0 + timedelta(hours=1))
    earlier = _gateway_copies(stretches[10], received=T0 + timedelta(minutes=1))
    corrected = _gateway_copies(
        stretches[15], received=T0 + timedelta(minutes=2), ts=T0 - timedelta(hours=3),
        flags=["clock_unsynced", "clock_corrected"],
    )  # fmt: skip
    _land(landing, "b1", late + again + earlier)
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 4 and s["displaced"] == 2
    assert s["duplicates_removed"] == 2 + 2  # the later copies, and the displaced ones
    _land(landing, "b2", corrected)
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 2 and s["displaced"] == 2 and s["duplicates_removed"] == 2
    _agrees(landing, wh)


def test_a_claimed_id_with_no_copy_in_readings_stops_the_run(spark: Any, tmp_path: Path) -> None:
    """The index and ``readings`` disagree (a partition deleted by hand): the run says so
    rather than keep a second copy or drop a first one."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    _land(landing, "b0", _gateway_copies([1, 2, 3], received=T0 + timedelta(minutes=5)))
    _run(spark, landing, wh)
    for part in (wh / "readings").glob("date=*"):
        shutil.rmtree(part)
    _land(landing, "b1", _gateway_copies([2], received=T0))
    with pytest.raises(Exception, match="no copy in readings"):
        _run(spark, landing, wh)


# ------------------------------------------------------------ a warehouse from before


def _old_index(spark: Any, wh: Path) -> None:
    """Replace the index by what the version before issue 27 kept: ``seen_ids``, a row per
    kept copy (and the displaced copies' rows), bucketed by id, a generation per batch."""
    readings = spark.read.schema(transforms.READINGS_SCHEMA).parquet(str(wh / "readings"))
    rows = transforms.seen_rows(readings)
    if (wh / "seen_exceptions").exists():
        old = spark.read.schema(transforms.SEEN_SCHEMA).parquet(str(wh / "seen_exceptions"))
        rows = rows.unionByName(old.select(*transforms.SEEN_COLUMNS))
    rows = rows.dropDuplicates(["id", "batch"]).withColumn("gen", rows.batch)
    rows.localCheckpoint().write.partitionBy("bucket", "gen").parquet(str(wh / "seen_ids"))
    shutil.rmtree(wh / "seen_ranges")
    shutil.rmtree(wh / "seen_exceptions", ignore_errors=True)


def test_a_warehouse_written_before_the_ranges_is_converted_once_and_dedups_on(
    spark: Any, tmp_path: Path
) -> None:
    """Two batches (the second displacing, and killed before its checkpoint committed)
    leave an index as the old version wrote it. The next run converts it, replays the
    second batch and goes on: later copies lose, earlier ones displace (one of an id
    displaced once already), new readings are kept; the tables are DuckDB's and the
    index claims every kept position once (a displaced one too: before, the conversion
    put it in the replayed batch's runs, which the replay leaves out)."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    _land(landing, "b0", _gateway_copies(list(range(1, 60)), received=T0 + timedelta(hours=1)))
    odd = [{**r, "id": f"gwx/e1/{i}.x"} for i, r in enumerate(_gateway_copies([1, 2], received=T0))]
    _land(landing, "odd", odd)  # ids that are no position
    _run(spark, landing, wh)
    _land(landing, "b1", _gateway_copies([5, 6], received=T0 + timedelta(minutes=30)))
    assert _run(spark, landing, wh)["displaced"] == 2
    _old_index(spark, wh)
    assert (wh / "seen_ids").exists() and not (wh / "seen_ranges").exists()
    for f in ("1", ".1.crc"):  # killed before its commit: replayed
        (wh / "_checkpoint" / "commits" / f).unlink(missing_ok=True)
    _land(
        landing, "b2",
        _gateway_copies([1, 2, 3], received=T0 + timedelta(hours=2))  # later: they lose
        + _gateway_copies([5, 10], received=T0 + timedelta(minutes=10))  # earlier: they win
        + _gateway_copies(list(range(60, 70)), received=T0 + timedelta(hours=2))  # new
        + [{**odd[0], "received": wire_time(T0 + timedelta(hours=3))}],  # a later odd copy
    )  # fmt: skip
    s = _run(spark, landing, wh)
    assert s["batches"] == [1, 2]
    assert s["readings_written"] == 2 + 12 and s["displaced"] == 2 + 2
    assert not (wh / "seen_ids").exists()
    _agrees(landing, wh)
