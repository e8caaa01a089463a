"""What a user sets is what the uplink does (issue 25): ``--batch`` and ``--max-bytes``
hold for readings that were stored together, and a full disk does not stop delivery.

Real processes: ``pubcomp uplink run`` against a real Mosquitto; what was sent is seen
by an independent paho subscriber, which records every payload.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from devkit.broker import Mosquitto
from devkit.checker import Recorder
from devkit.ingest_helpers import IngestProc, landed
from devkit.store_helpers import append
from devkit.uplink_helpers import run_uplink
from pubcomp.sync.store import Reading, Store, StoreFull
from tests.test_store import tiny_tmpfs


def _readings(seen: Recorder) -> list[str]:
    return [r["id"] for p in seen.payloads() for r in json.loads(p)["readings"]]


def _wait_readings(seen: Recorder, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(_readings(seen)) < n:
        time.sleep(0.05)


def _stored_together(path: Path, n: int) -> set[str]:
    """``n`` readings appended in one call (one node message, or one group commit of
    sensor readings): stored packed, up to 100 to an outbox row."""
    with Store(path, gateway_id="gw1") as s:
        first, last = append(
            s, (Reading(f"s{i % 3}", float(i), "2026-11-25T00:00:00.000Z", "C") for i in range(n))
        )
        return {f"gw1/{s.epoch}/{q}" for q in range(first, last + 1)}


def test_batch_is_honoured_for_readings_stored_together(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """``--batch 1`` over three readings stored together: three messages of one reading
    (before: one message with all three, since a row was never split)."""
    ids = _stored_together(tmp_path / "gw.db", 3)
    seen = Recorder(mosquitto.port)
    try:
        res = run_uplink(tmp_path / "gw.db", mosquitto.url, "--batch", "1")
        assert res.returncode == 0, res.stderr
        _wait_readings(seen, 3)
    finally:
        seen.stop()
    assert [len(json.loads(p)["readings"]) for p in seen.payloads()] == [1, 1, 1]
    assert set(_readings(seen)) == ids


@pytest.mark.parametrize(("batch", "max_bytes"), [(100, 4096), (7, 128 * 1024)])
def test_a_node_message_of_500_readings_respects_batch_and_max_bytes(
    tmp_path: Path, mosquitto: Mosquitto, batch: int, max_bytes: int
) -> None:
    ids = _stored_together(tmp_path / "gw.db", 500)
    seen = Recorder(mosquitto.port)
    try:
        args = ("--batch", str(batch), "--max-bytes", str(max_bytes))
        res = run_uplink(tmp_path / "gw.db", mosquitto.url, *args)
        assert res.returncode == 0, res.stderr
        _wait_readings(seen, 500)
    finally:
        seen.stop()
    assert max(len(p) for p in seen.payloads()) <= max_bytes
    assert max(len(json.loads(p)["readings"]) for p in seen.payloads()) <= batch
    got = _readings(seen)
    assert set(got) == ids and len(got) == 500  # every reading once, ids unchanged


def test_a_full_disk_does_not_stop_the_uplink(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """A real uplink on a full disk (a 4 MB tmpfs the store filled until it refused new
    readings): it delivers everything, end to end, and the store empties. Before, the
    uplink's first new message (its packet ids, a session transition) raised StoreFull,
    which nothing caught: the process died, and systemd would restart it into the same
    full disk."""
    landing = tmp_path / "landing"
    ing = IngestProc(mosquitto.port, landing).start()
    with tiny_tmpfs(tmp_path / "disk", "4m") as disk:
        store = disk / "gw.db"
        ids: set[str] = set()
        with Store(store, gateway_id="gw1") as s, pytest.raises(StoreFull):
            for i in range(100_000):
                first, last = append(
                    s,
                    (
                        Reading("t", float(j), "2026-11-25T00:00:00.000Z", "C")
                        for j in range(i * 50, i * 50 + 50)
                    ),
                )
                ids |= {f"gw1/{s.epoch}/{q}" for q in range(first, last + 1)}
        res = run_uplink(store, mosquitto.url, "--batch", "100", end_to_end=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        ing.stop()
        counts = landed(landing)
        assert counts.keys() == ids and max(counts.values()) == 1
        with Store(store) as s:
            assert s.stats()["backlog"] == 0 and s.stats()["awaiting_landing"] == 0
