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
        [("g1", "g1/e1", 1, 10, t(0), 0), ("g1", "g1/e1", big + 11, big + 20, t(2), 0),
         ("g1", "n1/1", 0, 5, t(0), 0), ("g1", "n1/1", 50, 60, t(0, 10), 0)],
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
        [("g1", "g1/e1", 1, 10, t(0), 0), ("g1", "n1/1", 0, 1, t(0), 0)], C.LANDED_SCHEMA
    )
    assert rows(C.missing_ranges(landed, at_once)) == rows(C.missing_ranges(landed, twice))


@pytest.mark.timeout(900)
def test_a_run_killed_after_the_ledger_state_is_written_converges(
    spark: Any, tmp_path: Path
) -> None:
    """The kill comes after a batch appended its buckets' state and before it deleted the
    generations it replaces: the replay reads both, compacts them again, and the tables
    are DuckDB's; once it has run, a generation per bucket is left."""
    import os
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

    land(files[:half])
    _run(spark, landing, wh)
    land(files[half:])
    cmd = hooked.command("pipeline", "run", "--landing", str(landing))
    cmd += ["--warehouse", str(wh), "--master", "local[1]"]
    env = {**os.environ, "PUBCOMP_CRASH_AT": "pipeline_ledger_state_written"}
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    gens = {b.name: sorted(g.name for g in b.glob("gen=*")) for b in
            (wh / "ledger_state").glob("bucket=*")}  # fmt: skip
    assert any(len(g) == 2 for g in gens.values()), gens  # the old and the new, both there
    s = _run(spark, landing, wh)  # replays the batch
    assert s["batches"] == [1]
    con = ref.build(landing)
    res = ref.compare(con, wh)
    for table, (_, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (table, res)
    gens = {b.name: sorted(g.name for g in b.glob("gen=*")) for b in
            (wh / "ledger_state").glob("bucket=*")}  # fmt: skip
    assert gens and all(len(g) == 1 for g in gens.values()), gens


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
