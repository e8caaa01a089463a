"""Spark run interpreted, for tests: a test's batch is a few hundred rows in some seventy
small queries, and compiling each query's generated code costs more than running it.
Interpreted, the in-process completeness tests took 20-30 % less (three of them: 93-105 s
against 116-143 s, alone on 2 cores). Spark's own suites run both modes for the same
results. The tests' session and their killed runs take it, and the benchmark's smoke
test (which checks that it runs and agrees, not its figures); the demo, the cluster
test, the wheel's run and ``make bench`` keep the code-generated path every installed
``pubcomp pipeline run`` takes."""

from __future__ import annotations

import os
from collections.abc import Mapping

INTERPRETED = {
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
}


def interpreted_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``env`` for a process whose Spark session (the first it starts) runs interpreted."""
    confs = " ".join(f"--conf {k}={v}" for k, v in INTERPRETED.items())
    given = env.get("PYSPARK_SUBMIT_ARGS", "pyspark-shell")  # (ends with the shell's name)
    return {**env, "PYSPARK_SUBMIT_ARGS": f"{confs} {given}"}
