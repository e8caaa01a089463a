"""The ingest's power cut in the writeback model (devkit/powercut, rules 4-6).

``pubcomp ingest run`` lands into a landing zone on the power-cut file system in
writeback mode, with 5 ms added to each write; a paho publisher (QoS 2) delivers
wire-format messages to a real Mosquitto, plus bad messages (to ``_rejected``) and
bad status messages (to the status landing's ``_rejected``). The power is cut
right after one of the ingest's writes reached the page cache, before its fsync
returned (``arm``), again and again, each cut with its own seed: a random subset
of the unsynced pages reaches the disk, some torn at 512-byte sectors, holes
reading as zeros. After the run:

- every reading the broker PUBCOMP'd to the publisher is in the landing zone, and
  once (counted in the files, before any dedup);
- every bad message the broker PUBCOMP'd is in ``_rejected`` once;
- no rolled file (readings, ``_rejected``, ``_status``) holds a line that is not
  JSON, and ``pipeline/audit.py`` reads the landing zone.

A failing cut names its seed (``powercut: cut N writeback {...}`` in the captured
output). The scenario is ``devkit.ingest_helpers.writeback_cuts``;
``bench/ingest_writeback.py`` runs it for many more seeds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.broker import Mosquitto
from devkit.ingest_helpers import writeback_cuts
from devkit.powercut import fuse_missing

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))

CUTS = 10  # a seed's cuts, each with its own seed ("{seed}:{cut}"): 40 in all
SEEDS = [20261124, 31, 5, 77]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path / "broker").start()
    yield b
    b.kill()


@pytest.mark.parametrize("seed", SEEDS)
def test_ingest_power_cuts_in_the_writeback_model_land_each_pubcompd_reading_once(
    tmp_path: Path, broker: Mosquitto, seed: int
) -> None:
    got = writeback_cuts(tmp_path, broker.port, seed, CUTS)
    print(f"seed {seed}: {got}")
    assert got["cuts"] == CUTS and got["frozen_after_a_write"] == CUTS, got
    assert got["malformed_lines"] == 0, f"malformed lines in rolled files: {got}"
    assert got["pubcompd"] > 1000, got
    assert got["lost"] == 0, f"PUBCOMP'd readings lost: {got}"
    assert got["twice"] == 0, f"readings landed twice: {got}"
    assert got["unexpected"] == 0, got
    assert got["bad_pubcompd"] > 5 and got["bad_lost"] == 0 and got["bad_twice"] == 0, got
    assert got["audit"] == "ok", got
