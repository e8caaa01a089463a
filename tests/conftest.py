from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pubcomp.devbroker import Mosquitto


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
