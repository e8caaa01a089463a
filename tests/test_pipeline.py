"""The Spark pipeline against DuckDB, and its idempotency, on real local Spark."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F

from devkit import duckdb_reference as ref
from devkit import hooked
from devkit.sparkconf import JUDGE_AGAIN, conf_env, interpreted_env
from pubcomp.pipeline import job, transforms
from pubcomp.pipeline.job import Pipeline
from pubcomp.pipeline.synth import write_landing
from pubcomp.sync.wire import wire_time

BAD_LINES = [
    "not json at all",
    '{"id": "gw/e/bad1", "origin": "gw", "sensor": "s", "ts": "yesterday", "value": 1}',
    '{"id": "gw/e/bad2", "origin": "gw", "sensor": "s", "ts": "1999-12-31T23:59:59.000Z",'
    ' "value": 1, "received": "2026-11-21T00:00:00.000Z"}',
    '{"id": "gw/e/bad3", "origin": "gw", "sensor": "s", "ts": "2026-11-25T00:00:00.000Z",'
    ' "value": 1, "received": "2026-11-21T00:00:00.000Z"}',
    '{"id": "gw/e/bad4", "origin": "gw", "sensor": "s", "ts": "2026-11-21T00:00:00.000Z",'
    ' "value": NaN, "received": "2026-11-21T00:00:00.000Z"}',
    '{"origin": "gw", "sensor": "s", "ts": "2026-11-21T00:00:00.000Z", "value": 1}',
    '{"id": "gw/e/bad5", "origin": "gw", "sensor": "s", "ts": "2026-11-21T00:00:00.000Z",'
    ' "value": 1e300}',
    '{"id": "gw/e/bad6", "origin": "gw", "sensor": "s", "ts": "2026-11-21T00:00:00.000Z",'
    ' "value": 1, "kind": "rate"}',
]
INDEX = ("seen_ranges/", "seen_exceptions/")
# What each batch writes of completeness (issue 27): its landed ranges, and the buckets of
# the gateways its lines came from, recomputed (pipeline/completejob.py).
INDEX += ("landed/", "completeness/", "completeness_gaps/")
REASONS = {
    "malformed_line": 1,
    "bad_ts": 1,
    "ts_before_2000": 1,
    "ts_in_future": 1,
    "value_not_finite": 1,
    "missing_id": 1,
    "value_out_of_range": 1,
    "bad_kind": 1,
}


def _run(spark: Any, landing: Path, wh: Path) -> dict[str, Any]:
    return Pipeline(spark, str(landing), str(wh)).run().__dict__


def _partitions(wh: Path) -> dict[str, str]:
    """Every partition of every table: its directory and a digest of its files' names and bytes."""
    out: dict[str, hashlib._Hash] = {}
    for f in sorted(wh.glob("[!_]*/**/*.parquet")):
        part = str(f.parent.relative_to(wh))
        h = out.setdefault(part, hashlib.sha256())
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return {p: h.hexdigest() for p, h in out.items()}


def _agrees(landing: Path, wh: Path) -> dict[str, tuple[int, int, int]]:
    res = ref.compare(ref.build(landing), wh)
    for table, (rows, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (table, res)
        assert rows > 0 or table in ref.MAY_BE_EMPTY, (table, res)
    return res


def test_pipeline_equals_duckdb_and_quarantines_the_impossible(spark: Any, tmp_path: Path) -> None:
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    lines = write_landing(landing, 20_000, origins=5, sensors=20, late_rate=0.05, seed=3)
    (landing / "date=2026-11-20" / "bad.jsonl").write_text("\n".join(BAD_LINES) + "\n")
    s = _run(spark, landing, wh)
    assert s["lines_in"] == lines + len(BAD_LINES)
    assert s["readings_written"] == 20_000 and s["duplicates_removed"] == lines - 20_000
    assert s["quarantined"] == len(BAD_LINES)
    q = spark.read.parquet(str(wh / "quarantine")).groupBy("reason").count().collect()
    assert {r["reason"]: r["count"] for r in q} == REASONS
    res = _agrees(landing, wh)
    assert res["readings"][0] == 20_000
    summary = json.loads(next((wh / "_runs").glob("run-*.json")).read_text())
    assert summary["readings_written"] == 20_000


def test_tasks_per_hour_spread_only_a_large_batch_over_fewer_hours_than_two_per_core() -> None:
    big = job.SPREAD_ROWS
    assert job.tasks_per_hour(2, 2, big) == 2  # the fleet's last hour and the next
    assert job.tasks_per_hour(8, 3, big) == 6
    assert job.tasks_per_hour(2, 4, big) == 1  # enough hours to keep every core busy
    assert job.tasks_per_hour(8, 2, big - 1) == 1  # a small batch: a file per hour
    assert job.tasks_per_hour(8, 0, big) == 1


def test_hour_and_minute_filters_select_exactly_their_literals_and_prune_partitions(
    spark: Any, tmp_path: Path
) -> None:
    """``in_hours`` and ``in_minutes``: one SQL literal list each (a batch's minutes can be
    thousands), the same rows as the (date, hour, minute) triples name, and ``in_hours``
    on partition columns prunes the other partitions' files."""
    t0 = datetime(2026, 11, 20, 22, 0, tzinfo=UTC)
    stamps = [t0 + timedelta(minutes=7 * k, seconds=k % 60) for k in range(60)]  # 22:00-04:53
    rows = [
        (s.strftime("%Y-%m-%d"), s.hour, s.replace(tzinfo=None), k) for k, s in enumerate(stamps)
    ]
    spark.createDataFrame(rows, "date string, hour int, ts timestamp, k int").write.partitionBy(
        "date", "hour"
    ).parquet(str(tmp_path / "t"))
    table = spark.read.schema("ts timestamp, k int, date string, hour int").parquet(
        str(tmp_path / "t")
    )
    hours = [("2026-11-20", 23), ("2026-11-21", 2), ("2026-11-22", 0)]  # the last: no rows
    got = {r.k for r in table.where(transforms.in_hours("date", "hour", hours)).collect()}
    assert got == {k for k, s in enumerate(stamps) if (s.strftime("%Y-%m-%d"), s.hour) in hours}
    assert got  # (both hours hold rows)
    plan = table.where(transforms.in_hours("date", "hour", hours))._jdf.queryExecution()
    assert "PartitionFilters: [named_struct" in plan.executedPlan().toString()
    minutes = [(s.strftime("%Y-%m-%d"), s.hour, s.minute) for s in stamps[::3]]
    minutes += [("2026-11-21", 3, 59), ("1999-12-31", 23, 59)]  # no rows there
    got = {r.k for r in table.where(transforms.in_minutes("ts", minutes)).collect()}
    assert got == set(range(0, 60, 3))
    left = {r.k for r in table.where(~transforms.in_minutes("ts", minutes)).collect()}
    assert left == set(range(60)) - got
    assert table.where(transforms.in_hours("date", "hour", [])).count() == 0
    assert table.where(~transforms.in_minutes("ts", [])).count() == 60


def test_hours_spread_over_tasks_give_the_same_tables_and_a_file_per_part(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch spread over several tasks per hour (here every batch: ``SPREAD_ROWS`` 0)
    writes each hour in parts, an origin and sensor in one, and the tables are DuckDB's,
    over a history and an increment that continues its last hour."""
    monkeypatch.setattr(job, "SPREAD_ROWS", 0)
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    start = datetime(2026, 11, 20, 10, tzinfo=UTC)
    write_landing(landing, 4_000, origins=6, sensors=12, seed=8, start=start, span_s=7000)
    # As a cluster's: more reducers than this session's two, and none merged (AQE would
    # merge these small ones, and an hour's parts with them).
    conf = {
        "spark.sql.shuffle.partitions": "8",
        "spark.sql.adaptive.coalescePartitions.enabled": "false",
    }
    before = {k: spark.conf.get(k) for k in conf}
    try:
        for k, v in conf.items():
            spark.conf.set(k, v)
        _run(spark, landing, wh)
        write_landing(
            landing, 2_000, origins=6, sensors=12, seed=9, start=start + timedelta(minutes=100),
            span_s=3600, id_offset=4_000, name="next",
        )  # fmt: skip
        s = _run(spark, landing, wh)
    finally:
        for k, v in before.items():
            spark.conf.set(k, v)
    assert s["readings_written"] == 2_000
    for table in ("readings/date=2026-11-20/hour=11/batch=1", "rollup_1m/date=2026-11-20/hour=11"):
        assert len(list((wh / table).glob("*.parquet"))) > 1, table
    ones = spark.read.parquet(str(wh / "readings" / "date=2026-11-20" / "hour=11" / "batch=1"))
    # The batch's working columns (an hour's part, each copy's stream position) are never
    # written: a file holds the table's columns, the partition columns aside.
    written = [c for c in transforms.READINGS_SCHEMA.names if c not in {"date", "hour", "batch"}]
    assert ones.columns == written, ones.columns
    files = (
        ones.withColumn("f", F.input_file_name())
        .groupBy("origin", "sensor")
        .agg(F.countDistinct("f").alias("n"))
    )
    assert files.where("n > 1").count() == 0, "an origin and sensor split over parts"
    _agrees(landing, wh)


def test_rerun_with_new_hours_rewrites_only_them_and_redelivered_files_change_nothing(
    spark: Any, tmp_path: Path
) -> None:
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    write_landing(landing, 5_000, origins=3, sensors=6, seed=4)  # 2026-11-20 and 21
    (landing / "date=2026-11-20" / "bad.jsonl").write_text("\n".join(BAD_LINES) + "\n")
    s = _run(spark, landing, wh)
    assert s["files"] == len(list(landing.rglob("*.jsonl"))) > 1  # each file once
    before = _partitions(wh)
    s = _run(spark, landing, wh)  # nothing new: nothing read, nothing written
    assert s["files"] == 0 and s["readings_in"] == 0 and _partitions(wh) == before
    # New readings for two hours of the first day (a gateway's backlog, received now).
    write_landing(
        landing, 400, origins=3, sensors=6, seed=40, start=datetime(2026, 11, 20, 5, tzinfo=UTC),
        span_s=2 * 3600, late_rate=1.0, late_max_s=86400, name="new",
    )  # fmt: skip
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 400
    after = _partitions(wh)
    hours = ("date=2026-11-20/hour=5", "date=2026-11-20/hour=6")
    rewritten = {f"rollup_1m/{h}" for h in hours} | {
        "rollup_1h/date=2026-11-20",
        "rollup_1d/date=2026-11-20",
    }
    for p in rewritten:
        assert after[p] != before[p], p
    added = {p for p in set(after) - set(before) if not p.startswith(INDEX)}
    assert added == {f"readings/{h}/batch=1" for h in hours} | {"quality/batch=1"}
    # Every other partition of every table is byte for byte what it was (the seen index
    # takes a generation in the buckets of the streams the new ids belong to).
    for p, digest in before.items():
        if p not in rewritten and not p.startswith(INDEX):
            assert after.get(p) == digest, p
    # The same files delivered again under new names: read, and every reading dropped.
    before = after
    day = landing / "date=2026-11-20"
    for f in [f for f in day.iterdir() if f.name.startswith("synth-")]:
        shutil.copy(f, day / f"again-{f.name}")
    s = _run(spark, landing, wh)
    assert s["readings_in"] > 0 and s["readings_written"] == 0
    assert s["duplicates_removed"] == s["readings_in"]
    after = _partitions(wh)
    assert {p for p in after if before.get(p) != after[p]} <= {
        p for p in after if p.startswith(("quality/", "quarantine/", *INDEX))
    }
    _agrees(landing, wh)


def _iso(t: datetime) -> str:
    return wire_time(t)


def _clockless_node_copies(
    ids: list[int], arrived: datetime, *, spread_s: float = 60.0, gateway: str = "gw-a"
) -> list[str]:
    """A node without a clock: ``ts`` is the gateway's arrival time, so every copy has its own."""
    out = []
    for k in ids:
        t = arrived + timedelta(seconds=k * spread_s / 200)
        rec = {
            "id": f"node7/{k // 50}/{k % 50}.0", "origin": "node7", "sensor": f"t{k % 3}",
            "ts": _iso(t), "value": k / 8, "unit": "C", "flags": ["ts_from_gateway"],
            "gateway": gateway, "received": _iso(t + timedelta(milliseconds=300)),
        }  # fmt: skip
        out.append(json.dumps(rec))
    return out


def test_each_kind_is_rolled_up_for_what_it_is(spark: Any, tmp_path: Path) -> None:
    """A gauge (no kind: as before kinds), a counter and a total over three minutes: the
    rollups carry each sensor's kind, the counter's sum is its tips, the total's last
    value its running total (a reset included); DuckDB agrees on every column."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    t0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    tips = [1, 0, 2, 3, 0, 1, 2, 2, 0]  # per 20 s
    total, lines = 0.0, []
    for i, n in enumerate(tips):
        t = t0 + timedelta(seconds=20 * i + 5)
        total = 0.0 if i == 6 else total + 0.2 * n  # the gauge restarted at 10:02:05
        for sensor, value, kind in (
            ("air.temp", 4.0 + i / 10, None),
            ("rain.count", round(0.2 * n, 6), "counter"),
            ("rain.total", round(total, 6), "total"),
        ):
            rec = {
                "id": f"gw/e/{i}.{sensor}", "origin": "gw", "sensor": sensor, "ts": _iso(t),
                "value": value, "unit": "mm", "flags": [], "gateway": "gw",
                "received": _iso(t + timedelta(seconds=1)),
            }  # fmt: skip
            if kind:
                rec["kind"] = kind
            lines.append(json.dumps(rec))
    _land(landing, "kinds", lines)
    _run(spark, landing, wh)
    rows = spark.read.parquet(str(wh / "rollup_1m")).orderBy("sensor", "window_start").collect()
    kinds = {r["sensor"]: r["kind"] for r in rows}
    assert kinds == {"air.temp": "gauge", "rain.count": "counter", "rain.total": "total"}
    counts = [float(r["sum"]) for r in rows if r["sensor"] == "rain.count"]
    assert counts == [0.6, 0.8, 0.8]  # tips x 0.2 mm in each minute
    totals = [r["last_value"] for r in rows if r["sensor"] == "rain.total"]
    assert totals == [pytest.approx(0.6), pytest.approx(1.4), pytest.approx(0.4)]
    days = spark.read.parquet(str(wh / "rollup_1d")).collect()
    assert {r["sensor"]: r["kind"] for r in days} == kinds
    _agrees(landing, wh)


def _land(landing: Path, name: str, lines: list[str]) -> None:
    day = landing / "date=2026-11-20"
    day.mkdir(parents=True, exist_ok=True)
    (day / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def _rollup_count(spark: Any, wh: Path, table: str) -> int:
    return int(spark.read.parquet(str(wh / table)).agg({"count": "sum"}).first()[0])


def test_copies_with_other_timestamps_across_hours_days_and_runs_are_kept_once(
    spark: Any, tmp_path: Path
) -> None:
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    t0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    ids = list(range(200))
    _land(landing, "run1", _clockless_node_copies(ids, t0))
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 200
    # A quarter delivered again three hours later (a store that no longer held the key),
    # with a copy of the same id in another hour of the same batch, too.
    again = _clockless_node_copies(ids[:50], t0 + timedelta(hours=3), gateway="gw-b")
    again += _clockless_node_copies([150], t0 + timedelta(hours=5), gateway="gw-b")
    _land(landing, "run2", again)
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 0 and s["duplicates_removed"] == 51
    # A tenth again the next day, and once more two days later, in two more runs.
    _land(landing, "run3", _clockless_node_copies(ids[::10], t0 + timedelta(days=1)))
    _run(spark, landing, wh)
    _land(landing, "run4", _clockless_node_copies(ids[::10], t0 + timedelta(days=2, hours=7)))
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 0 and s["duplicates_removed"] == 20
    readings = spark.read.parquet(str(wh / "readings"))
    assert readings.count() == 200 and readings.select("id").distinct().count() == 200
    assert {r.hour for r in readings.select("hour").distinct().collect()} == {10}
    for table in ("rollup_1m", "rollup_1h", "rollup_1d"):
        assert _rollup_count(spark, wh, table) == 200, table
    assert sorted(p.name for p in (wh / "rollup_1d").glob("date=*")) == ["date=2026-11-20"]
    _agrees(landing, wh)


def test_an_earlier_received_copy_in_a_later_run_replaces_the_kept_one(
    spark: Any, tmp_path: Path
) -> None:
    """First received wins even when it reaches the pipeline last (two ingests, one rolled late)."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    t0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    _land(landing, "run1", _clockless_node_copies(list(range(200)), t0 + timedelta(hours=2)))
    _run(spark, landing, wh)
    # Copies of 30 of them that an ingest received two hours earlier, landed only now.
    _land(landing, "run2", _clockless_node_copies(list(range(30)), t0, gateway="gw-z"))
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 30 and s["duplicates_removed"] == 30
    readings = spark.read.parquet(str(wh / "readings"))
    assert readings.count() == 200
    by_hour = {r.hour: r["count"] for r in readings.groupBy("hour").count().collect()}
    assert by_hour == {10: 30, 12: 170}
    m = spark.read.parquet(str(wh / "rollup_1m"))
    assert {
        r.hour: r.n for r in m.groupBy("hour").agg({"count": "sum"}).toDF("hour", "n").collect()
    } == {10: 30, 12: 170}
    assert _rollup_count(spark, wh, "rollup_1d") == 200
    # The replaced copies' partitions no longer hold them; a copy of the same ids later still loses.
    _land(landing, "run3", _clockless_node_copies(list(range(30)), t0 + timedelta(hours=1)))
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 0
    _agrees(landing, wh)


def test_late_data_reopens_exactly_its_day(spark: Any, tmp_path: Path) -> None:
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    write_landing(landing, 4_000, origins=2, sensors=4, seed=5)  # 2026-11-20 and 21
    _run(spark, landing, wh)
    days_before = {p.name: p.stat().st_mtime_ns for p in (wh / "rollup_1d").glob("date=*")}
    untouched = {str(p): p.read_bytes() for p in (wh / "rollup_1d").rglob("*.parquet")}
    # A gateway back after a week: readings of 2026-11-14, received now.
    write_landing(
        landing, 300, origins=2, sensors=4, seed=6, start=datetime(2026, 11, 14, 3, tzinfo=UTC),
        span_s=3600, late_rate=1.0, late_max_s=7 * 86400, dup_rate=0, name="late",
    )  # fmt: skip
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 300
    assert s["partitions_rewritten"]["rollup_1d"] == 1
    assert s["partitions_rewritten"]["rollup_1m"] == 1  # one hour of data
    days_after = {p.name for p in (wh / "rollup_1d").glob("date=*")}
    assert days_after == set(days_before) | {"date=2026-11-14"}
    for path, data in untouched.items():  # the other days' files were not rewritten
        assert Path(path).read_bytes() == data
    _agrees(landing, wh)


@pytest.mark.slow
def test_a_run_killed_mid_batch_converges_when_rerun(spark: Any, tmp_path: Path) -> None:
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    write_landing(landing, 3_000, origins=2, sensors=4, seed=7)
    cmd = hooked.command("pipeline", "run", "--landing", str(landing))
    cmd += ["--warehouse", str(wh), "--master", "local[1]", "--driver-memory", "768m"]
    env = conf_env(JUDGE_AGAIN, interpreted_env())
    env["PUBCOMP_CRASH_AT"] = "pipeline_readings_written"
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert list((wh / "readings").rglob("*.parquet")), "the kill came after readings were written"
    assert not (wh / "rollup_1d").exists()
    s = _run(spark, landing, wh)  # replays the batch: rewrites only its own partitions
    assert s["readings_written"] == 3_000 and s["duplicates_removed"] > 0
    _agrees(landing, wh)


def test_driver_memory_sizes_the_jvm_a_session_starts() -> None:
    """``--driver-memory`` reaches ``spark_session``, and this is what it does: the JVM it
    starts gets that heap (local mode's tasks run in it). In a process of its own: this
    one's JVM is already running, and a second session would only share it."""
    code = (
        "import sys; from pubcomp.pipeline.sparkenv import spark_session\n"
        "s = spark_session('local[1]', 'heap', sys.argv[1])\n"
        "print(s.sparkContext.getConf().get('spark.driver.memory'),"
        " s._jvm.java.lang.Runtime.getRuntime().maxMemory())\n"
        "s.stop()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "640m"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    conf, heap = out.stdout.split()[-2:]
    assert conf == "640m"
    # Spark's default would be 1 GiB; the JVM reports its heap less a survivor space.
    assert 500 << 20 < int(heap) <= 640 << 20, heap


@pytest.mark.slow
def test_a_run_killed_while_displacing_copies_converges_when_rerun(
    spark: Any, tmp_path: Path
) -> None:
    """Killed after its own readings, before the displaced copies left their hour; its
    replay killed after they left it, before the batch is done; the next replay
    converges. One chain, not two batches killed afresh: the second kill meets what the
    first left on disk, as a VM restarted twice does."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    t0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    _land(landing, "run1", _clockless_node_copies(list(range(200)), t0 + timedelta(hours=2)))
    _run(spark, landing, wh)
    _land(landing, "run2", _clockless_node_copies(list(range(0, 200, 4)), t0, gateway="gw-z"))
    cmd = hooked.command("pipeline", "run", "--landing", str(landing))
    cmd += ["--warehouse", str(wh), "--master", "local[1]"]
    # Hour 12 keeps the 50 displaced copies until they are removed from it.
    for point, in_hour_12 in (
        ("pipeline_readings_written", 200),
        ("pipeline_displaced_removed", 150),
    ):
        env = {**conf_env(JUDGE_AGAIN, interpreted_env()), "PUBCOMP_CRASH_AT": point}
        killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert killed.returncode == -9, (point, killed.stderr[-2000:])
        assert list((wh / "readings").glob("date=*/hour=10/batch=1/*.parquet")), point
        hour_12 = spark.read.parquet(str(wh / "readings")).where(F.col("hour") == 12)
        assert hour_12.count() == in_hour_12, point
    s = _run(spark, landing, wh)  # replays batch 1
    assert s["batches"] == [1] and s["readings_written"] == 50 and s["displaced"] == 50
    readings = spark.read.parquet(str(wh / "readings"))
    assert readings.count() == 200 and readings.select("id").distinct().count() == 200
    assert _rollup_count(spark, wh, "rollup_1d") == 200
    _agrees(landing, wh)


def test_an_hour_whose_every_copy_is_displaced_leaves_the_rollups(
    spark: Any, tmp_path: Path
) -> None:
    """All of an hour's kept copies replaced by copies received earlier, in another hour and day."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    t0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    _land(landing, "run1", _clockless_node_copies(list(range(40)), t0 + timedelta(days=1)))
    _land(landing, "other", _clockless_node_copies(list(range(100, 140)), t0 + timedelta(hours=2)))
    _run(spark, landing, wh)
    _land(landing, "run2", _clockless_node_copies(list(range(40)), t0, gateway="gw-z"))
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 40 and s["displaced"] == 40
    assert not list((wh / "readings").glob("date=2026-11-21/**/*.parquet"))
    for table in ("rollup_1m", "rollup_1h", "rollup_1d"):
        assert _rollup_count(spark, wh, table) == 80, table
        assert not list((wh / table).glob("date=2026-11-21/**/*.parquet")), table
    _agrees(landing, wh)


def _minute_rows(spark: Any, wh: Path, hour: str) -> dict[Any, tuple[Any, ...]]:
    rows = spark.read.parquet(str(wh / "rollup_1m" / hour)).collect()
    return {(r.origin, r.sensor, r.window_start): tuple(r) for r in rows}


def test_a_batch_in_an_hour_rolled_up_before_aggregates_its_minutes_and_keeps_the_rest(
    spark: Any, tmp_path: Path
) -> None:
    """A batch that adds to an hour aggregates the minutes it adds to, from all their
    readings, and keeps the hour's other minutes as ``rollup_1m`` holds them; an hour a
    killed overwrite deleted (an overwrite deletes a partition before it renames the new
    one in) is aggregated whole from ``readings`` again, and a date whose ``rollup_1h``
    partition a killed overwrite deleted takes its other hours from their minutes."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    start = datetime(2026, 11, 20, 5, tzinfo=UTC)
    hour = "date=2026-11-20/hour=5"
    # Four streams, a dozen readings each a minute, over hours 5 and 6.
    write_landing(landing, 6_000, origins=2, sensors=4, seed=8, start=start, span_s=7200)
    _run(spark, landing, wh)
    before = _minute_rows(spark, wh, hour)
    # Minutes 20 to 29 of it, again, late: readings among those of the first run.
    write_landing(
        landing, 200, origins=2, sensors=4, seed=9, start=start + timedelta(minutes=20),
        span_s=600, late_rate=1.0, late_max_s=7200, id_offset=10_000, name="more",
    )  # fmt: skip
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 200 and s["partitions_rewritten"]["rollup_1m"] == 1
    after = _minute_rows(spark, wh, hour)
    changed = {k for k in before if after[k] != before[k]}
    assert set(after) == set(before) and changed, "the batch adds to minutes that held readings"
    assert {k[2].minute for k in changed} <= set(range(20, 30))
    _agrees(landing, wh)
    # A kill between an overwrite's delete and its rename: the hour's minutes are gone,
    # and so are the date's hours (hour 6's row among them, which the batch leaves).
    shutil.rmtree(wh / "rollup_1m" / hour)
    shutil.rmtree(wh / "rollup_1h" / "date=2026-11-20")
    write_landing(
        landing, 100, origins=2, sensors=4, seed=10, start=start + timedelta(minutes=40),
        span_s=300, id_offset=20_000, name="again",
    )  # fmt: skip
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 100
    assert set(_minute_rows(spark, wh, hour)) == set(before)
    hourly = spark.read.parquet(str(wh / "rollup_1h")).where("date = '2026-11-20'")
    assert hourly.count() == 8  # four streams, hours 5 and 6
    _agrees(landing, wh)


def _generations(wh: Path, table: str) -> dict[str, list[str]]:
    return {
        b.name: sorted(g.name for g in b.glob("gen=*"))
        for b in sorted((wh / table).glob("bucket=*"))
    }


def test_index_buckets_are_compacted_and_a_run_killed_while_compacting_converges(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket takes a generation per batch up to the limit, then is rewritten whole.

    The batch that compacts is stopped after deleting only one of the generations it
    replaced (the compacted one and the other both still there): the replay must
    neither lose nor repeat a position of the index, nor a row of its exceptions.
    """
    monkeypatch.setattr(Pipeline, "seen_max_generations", 2)
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    t0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    # One stream (node7/0: ids 0-49), so one bucket: gen 0, then gen 1.
    _land(landing, "run0", _clockless_node_copies(list(range(25)), t0 + timedelta(hours=2)))
    _run(spark, landing, wh)
    _land(landing, "run1", _clockless_node_copies(list(range(25, 50)), t0 + timedelta(hours=3)))
    _run(spark, landing, wh)
    (bucket,) = _generations(wh, "seen_ranges")
    assert _generations(wh, "seen_ranges")[bucket] == ["gen=0", "gen=1"]
    assert not (wh / "seen_exceptions").exists()  # every id a position, nothing displaced
    # Batch 2 brings copies received earlier (they displace ten kept ones) and compacts.
    _land(landing, "run2", _clockless_node_copies(list(range(10)), t0, gateway="gw-z"))
    real_drop = Pipeline._drop_compacted

    def killed_midway(
        self: Pipeline, table: str, index: Any, compact: list[int], batch_id: int
    ) -> None:
        if table == "seen_ranges":
            self._delete(f"{self.path('seen_ranges')}/{bucket}/gen=0")
            raise RuntimeError("killed while deleting the compacted generations")

    monkeypatch.setattr(Pipeline, "_drop_compacted", killed_midway)
    with pytest.raises(Exception, match="killed while deleting"):
        _run(spark, landing, wh)
    assert _generations(wh, "seen_ranges")[bucket] == ["gen=1", "gen=2"]
    monkeypatch.setattr(Pipeline, "_drop_compacted", real_drop)
    s = _run(spark, landing, wh)  # replays batch 2
    assert s["batches"] == [2] and s["readings_written"] == 10 and s["displaced"] == 10
    assert _generations(wh, "seen_ranges")[bucket] == ["gen=2"]
    runs = spark.read.parquet(str(wh / "seen_ranges")).collect()
    assert [(r.lo, r.hi, r.width, r.n, r.exact) for r in runs] == [(0, 49_000, 1, 50, True)]
    exceptions = spark.read.parquet(str(wh / "seen_exceptions"))
    # The ten displaced copies (kept by batch 0) and the ten that displaced them (batch 2).
    assert exceptions.count() == 20 and exceptions.select("id", "batch").distinct().count() == 20
    # Later copies of the same ids lose; another batch adds a generation again.
    _land(landing, "run3", _clockless_node_copies(list(range(20)), t0 + timedelta(hours=5)))
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 0 and s["duplicates_removed"] == 20
    _land(landing, "run4", _clockless_node_copies(list(range(30, 45)), t0, gateway="gw-y"))
    s = _run(spark, landing, wh)
    assert s["readings_written"] == 15 and s["displaced"] == 15
    assert _generations(wh, "seen_ranges")[bucket] == ["gen=2"]  # no new position
    (ebucket,) = _generations(wh, "seen_exceptions")
    assert _generations(wh, "seen_exceptions")[ebucket] == ["gen=2", "gen=4"]
    _agrees(landing, wh)


def test_what_a_killed_index_write_left_uncommitted_is_not_merged_by_the_next(
    spark: Any, tmp_path: Path
) -> None:
    """The index is appended to: a task output a killed job had committed under
    ``_temporary`` (its job never was) must not land in the next batch's generation."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    t0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    _land(landing, "run0", _clockless_node_copies(list(range(25)), t0))
    _run(spark, landing, wh)
    (bucket,) = _generations(wh, "seen_ranges")
    real = next((wh / "seen_ranges" / bucket / "gen=0").glob("*.parquet"))
    stale = wh / "seen_ranges" / "_temporary" / "0" / "task_killed_0000" / bucket / "gen=1"
    stale.mkdir(parents=True)
    shutil.copy(real, stale / "part-00000-killed.c000.snappy.parquet")
    _land(landing, "run1", _clockless_node_copies(list(range(25, 50)), t0))
    s = _run(spark, landing, wh)
    assert s["batches"] == [1] and s["readings_written"] == 25
    assert not list((wh / "seen_ranges").rglob("*killed*"))
    runs = spark.read.parquet(str(wh / "seen_ranges"))
    assert runs.agg({"n": "sum"}).first()[0] == 50
    _agrees(landing, wh)
