"""devkit/sparkprofile.py reads a real Spark event log: what each execution wrote and read."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from devkit import sparkprofile, sparktrace

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_each_execution_names_the_table_it_writes_and_the_tables_it_reads(tmp_path: Path) -> None:
    pytest.importorskip("pyspark", reason="pyspark missing: make test installs it")
    logs = tmp_path / "events"
    logs.mkdir()
    # A Spark of its own (the session's has no event log): two writes, the second a
    # window over what the first wrote, then a count that writes nothing.
    job = textwrap.dedent(
        f"""
        from pyspark.sql import SparkSession, Window, functions as F
        s = (SparkSession.builder.master("local[1]")
             .config("spark.eventLog.enabled", "true")
             .config("spark.eventLog.dir", "file://{logs}")
             .config("spark.eventLog.compress", "false")
             .config("spark.ui.enabled", "false").getOrCreate())
        s.range(1000).withColumn("k", F.col("id") % 7).write.parquet("{tmp_path}/first")
        w = Window.partitionBy("k").orderBy("id")
        (s.read.parquet("{tmp_path}/first").withColumn("r", F.row_number().over(w))
         .write.partitionBy("k").parquet("{tmp_path}/second"))
        s.read.parquet("{tmp_path}/second").count()
        s.stop()
        """
    )
    subprocess.run([sys.executable, "-c", job], check=True, cwd=ROOT, timeout=240)
    [log] = [p for p in logs.rglob("events_*") if p.is_file()]
    runs = sparkprofile.executions(log)
    # A rolling log's folder reads as its one part does.
    assert [x.id for x in sparkprofile.executions(log.parent)] == [x.id for x in runs]
    writes = [r for r in runs if r.writes]
    assert [r.writes for r in writes] == [["first"], ["second"]]
    assert writes[0].reads == [] and writes[0].windows == 0
    assert writes[1].reads == ["first"] and writes[1].windows >= 1
    assert any(r.reads == ["second"] and not r.writes for r in runs)  # the count
    assert all(r.end_ms is not None and r.seconds >= 0 for r in runs)
    table = sparkprofile.report(runs)
    assert "second" in table and "first" in table


def _count_twice(df: Any) -> int:
    return int(df.count()) + len(df.collect())


def test_the_tracer_charges_each_action_to_the_line_that_asked_for_it(
    spark: Any, tmp_path: Path
) -> None:
    from pyspark.sql.classic.dataframe import DataFrame

    original = DataFrame.count
    df = spark.range(100)
    with sparktrace.trace() as calls:
        assert _count_twice(df) == 200
        df.write.parquet(str(tmp_path / "out"))
    assert DataFrame.count is original  # put back
    df.count()  # after the block: not recorded
    sites = {(c.action, c.site.split(":")[0], c.site.split(" ")[-1]) for c in calls}
    assert sites == {
        ("count", "tests/test_sparkprofile.py", "_count_twice"),
        ("collect", "tests/test_sparkprofile.py", "_count_twice"),
        ("parquet", "tests/test_sparkprofile.py", sys._getframe().f_code.co_name),
    }, calls
    assert all(c.seconds >= 0 for c in calls)
    table = sparktrace.report(calls)
    assert "_count_twice" in table and table.splitlines()[-1].startswith("total ")
    assert table.splitlines()[-1].endswith("over 3 calls")
