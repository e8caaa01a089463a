"""devkit/sparktrace.py: each action charged to the line that asked for it, and the
stages its jobs ran read back from the driver's UI by that line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from devkit import sparktrace


def test_each_line_gets_its_own_stages_with_their_rows(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    spark.range(1000).write.parquet(str(tmp_path / "t"))  # outside the trace: not counted
    with sparktrace.trace() as calls:
        table = spark.read.parquet(str(tmp_path / "t"))
        groups = table.groupBy((F.col("id") % 7).alias("k")).count().collect()
        odd = table.where(F.col("id") % 2 == 1).count()
    assert len(groups) == 7 and odd == 500
    sites = {c.action: c.site for c in calls}
    assert sites["collect"].startswith("tests/test_sparktrace.py:")
    assert sites["collect"] != sites["count"]
    found = sparktrace.stages(spark, calls)
    by_site: dict[str, list[sparktrace.Stage]] = {}
    for st in found:
        by_site.setdefault(st.site, []).append(st)
    assert set(by_site) == {sites["collect"], sites["count"]}, by_site
    for site in by_site.values():  # each scanned the thousand rows once
        assert sum(s.input_rows for s in site) == 1000, site
    # the grouped collect shuffled its partial counts: one row per key and task at most
    shuffled = sum(s.shuffle_read_rows for s in by_site[sites["collect"]])
    assert 7 <= shuffled <= 7 * 1000, by_site[sites["collect"]]
    report = sparktrace.stage_report(found)
    assert sites["collect"] in report and report.splitlines()[-1].startswith("total ")
    # a second trace in the same session sees only its own stages
    with sparktrace.trace() as again:
        spark.read.parquet(str(tmp_path / "t")).count()
    assert {s.site for s in sparktrace.stages(spark, again)} == {again[0].site}
