from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hypothesis  # noqa: F401  # imported early: see the note below
import pytest

from devkit.broker import Mosquitto
from devkit.sparkconf import FIXED_PLANS, INTERPRETED, JUDGE_AGAIN

# Twice, with a fresh install, CPython 3.11.7 raised "SystemError: AST constructor
# recursion depth mismatch" while pytest's assertion rewriter compiled a hypothesis
# module imported deep inside a test module's imports. Importing hypothesis here,
# while pytest loads this file, compiles it early and shallow.


@pytest.fixture(autouse=True)
def _no_stray_processes() -> Iterator[None]:
    """A failing test must not leave a gateway or an ingest running behind it."""
    yield
    from devkit.procs import kill_stray

    kill_stray()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path / "broker").start()
    yield broker
    broker.kill()


@pytest.fixture
def persistent_mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path / "broker", persistence=True).start()
    yield broker
    broker.kill()


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One local Spark for the whole test session (JVM start-up is the slow part)."""
    pytest.importorskip("pyspark", reason="pyspark missing: make test installs it")
    from pubcomp.pipeline.job import spark_session

    session = spark_session("local[2]", app="pubcomp-tests")
    session.conf.set("spark.sql.shuffle.partitions", "2")
    for key, value in {**INTERPRETED, **FIXED_PLANS, **JUDGE_AGAIN}.items():  # (sparkconf says why)
        session.conf.set(key, value)
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
