"""The Spark pipeline against DuckDB, and its idempotency, on real local Spark."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pubcomp.pipeline.job import Pipeline
from pubcomp.pipeline.synth import write_landing

from . import duckdb_reference as ref

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
]
REASONS = {
    "malformed_line": 1,
    "bad_ts": 1,
    "ts_before_2000": 1,
    "ts_in_future": 1,
    "value_not_finite": 1,
    "missing_id": 1,
    "value_out_of_range": 1,
}


def _run(spark: Any, landing: Path, wh: Path) -> dict[str, Any]:
    return Pipeline(spark, str(landing), str(wh)).run().__dict__


def _snapshot(wh: Path) -> dict[str, bytes]:
    """Every data file of every table, by path: what a rerun must not change."""
    return {
        str(p.relative_to(wh)): p.read_bytes()
        for t in ("readings", "rollup_1m", "rollup_1h", "rollup_1d")
        for p in sorted((wh / t).rglob("*.parquet"))
    }


def _agrees(landing: Path, wh: Path) -> dict[str, tuple[int, int, int]]:
    res = ref.compare(ref.build(landing), wh)
    for table, (rows, only_spark, only_duck) in res.items():
        assert rows > 0 and only_spark == 0 and only_duck == 0, (table, res)
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


def test_rerun_with_nothing_new_and_redelivered_files_change_nothing(
    spark: Any, tmp_path: Path
) -> None:
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    write_landing(landing, 5_000, origins=3, sensors=6, seed=4)
    _run(spark, landing, wh)
    before = _snapshot(wh)
    s = _run(spark, landing, wh)
    assert s["files"] == 0 and s["readings_in"] == 0 and _snapshot(wh) == before
    # The same files delivered again under new names: read, and every reading dropped.
    day = landing / "date=2026-11-20"
    for f in list(day.iterdir()):
        shutil.copy(f, day / f"again-{f.name}")
    s = _run(spark, landing, wh)
    assert s["readings_in"] > 0 and s["readings_written"] == 0
    assert s["duplicates_removed"] == s["readings_in"]
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
    cmd = [sys.executable, "-m", "pubcomp", "pipeline", "run", "--landing", str(landing)]
    cmd += ["--warehouse", str(wh), "--master", "local[1]"]
    env = {**os.environ, "PUBCOMP_CRASH_AT": "pipeline_readings_written"}
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert list((wh / "readings").rglob("*.parquet")), "the kill came after readings were written"
    assert not (wh / "rollup_1d").exists()
    s = _run(spark, landing, wh)  # replays the batch: rewrites only its own partitions
    assert s["readings_written"] == 3_000 and s["duplicates_removed"] > 0
    _agrees(landing, wh)
