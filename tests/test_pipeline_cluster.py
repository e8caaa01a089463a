"""The pipeline on a Spark standalone cluster: a master and a worker (devkit/sparkcluster.py),
the driver in ``pubcomp pipeline run --master spark://…``, executors in the worker's JVMs.

In ``local[*]`` the driver and the executors share one JVM, so a checkpoint, a
broadcast or a file only the driver can see works there by accident; here it does not.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from devkit import duckdb_reference as ref
from devkit import hooked
from devkit.fleetsim import FleetSpec, simulate
from devkit.sparkcluster import SparkStandalone


def _partitions(wh: Path) -> dict[str, str]:
    """Every table's partitions: a digest of their files' names and bytes."""
    out: dict[str, hashlib._Hash] = {}
    for f in sorted(wh.glob("[!_]*/**/*.parquet")):
        h = out.setdefault(str(f.parent.relative_to(wh)), hashlib.sha256())
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return {p: h.hexdigest() for p, h in out.items()}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_pipeline_runs_on_a_standalone_cluster_incrementally_and_idempotently(
    tmp_path: Path,
) -> None:
    """A small fleet's landing files in two runs on the cluster, then a run with nothing
    new: each run is an application the master ran to the end, the last changes no
    partition, and the tables and the seen index are DuckDB's."""
    gen, landing, wh = tmp_path / "gen", tmp_path / "landing", tmp_path / "wh"
    spec = FleetSpec(gateways=2, nodes=2, readings=1_200, roll_minutes=10, seed=11,
                     dup_rate=0.1, late_file_rate=0.2)  # fmt: skip
    files = simulate(gen, spec)["files"]
    with SparkStandalone(tmp_path / "cluster").start() as cluster:
        before: dict[str, str] = {}
        for part in (files[: len(files) // 2], files[len(files) // 2 :], []):
            for f in part:
                (landing / f["file"]).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(gen / f["file"], landing / f["file"])
            before = _partitions(wh) if wh.exists() else {}
            cmd = hooked.command("pipeline", "run", "--landing", str(landing))
            cmd += ["--warehouse", str(wh), "--master", cluster.url]
            run = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, run.stderr[-3000:] + cluster.log_tail()
        assert _partitions(wh) == before  # nothing new: nothing rewritten
        apps = cluster.apps()
        assert [a["state"] for a in apps] == ["FINISHED"] * 3, apps
        assert all(a["name"] == "pubcomp-pipeline" for a in apps), apps
    con = ref.build(landing)
    res = ref.compare(con, wh)
    for table, (rows, only_spark, only_duck) in res.items():
        assert only_spark == 0 and only_duck == 0, (table, res)
        assert rows > 0 or table in ref.MAY_BE_EMPTY, (table, res)
    ref.build_index(con)
    index = ref.compare_index(con, wh)
    assert index == dict.fromkeys(index, 0), index
