"""Spark settings for tests and the demo: what costs a small run more than its work does.

**Interpreted queries.** A test's batch is a few hundred rows in some seventy small
queries, and compiling each query's generated code costs more than running it.
Interpreted, the in-process completeness tests took 20-30 % less (three of them: 93-105 s
against 116-143 s, alone on 2 cores). Spark's own suites run both modes for the same
results. The tests' session and their killed runs take it, and the two benchmark smoke
tests that run Spark (they check that it runs and agrees, not its figures: with it,
chaos_compare's 35-46 CPU s against 61-70 without, 2026-12-02); the demo, the cluster
test, the wheel's run and ``make bench`` keep the code-generated path every installed
``pubcomp pipeline run`` takes.

**A JVM that lives for one small run** (``SHORT_JVM``): HotSpot's second compiler (C2)
spends a fresh JVM's first minute compiling Spark's own code for runs that are over
before it pays. Stopping at C1 costs no result, only the speed of a long run. Measured
on the 2-core machine, machine-wide CPU seconds from ``/proc/stat``, alone, each
against the same run without it (2026-12-01): a ``pubcomp pipeline run`` of 2,000
readings in a fresh JVM 88-92 → 50-59 s; the two chained kill tests 672 → 516 s; the
cluster test (master, worker, driver and executors) 424 → 210 s; the demo 172 → 114 s;
the benchmark's smoke run 205 → 151 s. Not for the tests' session (one JVM per test
worker for the whole suite: six pipeline tests in it took 286 s of wall time with C1
only, 247 s without, for the same CPU), nor for ``make bench`` or an installed run.

**Fixed plans** (``FIXED_PLANS``: adaptive query execution off). The pipeline cuts its
plans with some forty eager ``localCheckpoint`` calls; under AQE each of their shuffles
runs as a job of its own and the rest of the query is planned again after it. Six
in-process completeness tests in one session, alone on 2 cores, three pairs of runs
(2026-12-01; the machine ran half again slower for the third): 227, 221, 363 s wall and
369, 362, 592 CPU s with AQE; 207, 214, 330 s and 342, 347, 536 without (6-9 % less),
tables unchanged (each test compares with DuckDB). Only the tests' session takes it
(two shuffle partitions): a ``pubcomp pipeline run`` has eight, and AQE merges them into
one task where fixed plans run all eight. The chained kill test, alone, its three runs
with and without it (2026-12-02): 166 and 144 s wall, 246 and 213 CPU s fixed; 139 and
138 s, 213 and 208 CPU s adaptive. A cluster's run keeps AQE too."""

from __future__ import annotations

import os
from collections.abc import Mapping

INTERPRETED = {
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
}

# Adaptive execution re-plans each query at every shuffle, and runs each shuffle of a
# ``localCheckpoint`` as a job of its own: for a test's few hundred rows that planning
# is the work (see above).
FIXED_PLANS = {"spark.sql.adaptive.enabled": "false"}

# From a warehouse's second batch on, completeness judged again from what each batch can
# change: pipeline/completejob.py judges a warehouse that holds two days or less whole,
# and a test's warehouse is that young, but the path that judges again is the one whose
# rules the tests are for. The tests' session and their killed runs take it; the test of
# the choice itself sets it back.
JUDGE_AGAIN = {"spark.pubcomp.completeness.wholeUpToDays": "0"}

SHORT_JVM = "-XX:TieredStopAtLevel=1"


def _submit_args(env: Mapping[str, str], *args: str) -> dict[str, str]:
    given = env.get("PYSPARK_SUBMIT_ARGS", "pyspark-shell")  # (ends with the shell's name)
    return {**env, "PYSPARK_SUBMIT_ARGS": " ".join([*args, given])}


def short_jvm_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``env`` for a process whose Spark JVMs (its driver, the executors it starts) live
    for one small run."""
    executors = f"spark.executor.extraJavaOptions={SHORT_JVM}"
    return _submit_args(env, "--driver-java-options", SHORT_JVM, "--conf", executors)


def conf_env(confs: Mapping[str, str], env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``env`` for a process whose Spark session (the first it starts) takes ``confs``."""
    return _submit_args(env, *[a for k, v in confs.items() for a in ("--conf", f"{k}={v}")])


def interpreted_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``env`` for a process whose Spark session (the first it starts) runs interpreted,
    in a JVM that lives for one small run."""
    return conf_env(INTERPRETED, short_jvm_env(env))
