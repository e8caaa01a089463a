"""Records and the completeness table (issue 27): the gateway's ``$`` records kept out of
``readings``, its ``$ledger`` in ``ledger``; per stream and hour what landed and what is
missing and why, on real local Spark, equal to DuckDB's (devkit/duckdb_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from devkit import duckdb_reference as ref
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
