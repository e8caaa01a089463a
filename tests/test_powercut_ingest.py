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
output). ``bench/ingest_writeback.py`` runs the same for many more seeds.
"""

from __future__ import annotations

import collections
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from devkit.broker import Mosquitto
from devkit.ingest_helpers import IngestProc, landed, malformed_lines
from devkit.powercut import PowerCutMount, fuse_missing

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))

CUTS = 10  # a seed's cuts, each with its own seed ("{seed}:{cut}"): 40 in all
SEEDS = [20261124, 31, 5, 77]


class Publisher:
    """A gateway stand-in (paho, QoS 2, 20 in flight): messages of 10 readings, and now
    and then a message that is not JSON; it knows which ones the broker completed."""

    def __init__(self, port: int, gateway: str = "gw1") -> None:
        self.gateway = gateway
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{gateway}")
        self.client.max_inflight_messages_set(20)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.sent: list[tuple[mqtt.MQTTMessageInfo, list[str], bytes | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def _run(self) -> None:
        m = 0
        while not self._stop.is_set():
            m += 1
            if m % 25 == 0:
                bad = b"not json %d" % m
                info = self.client.publish(f"telemetry/{self.gateway}/readings", bad, qos=2)
                self.sent.append((info, [], bad))
                self.client.publish(f"telemetry/{self.gateway}/status", b'{"v":1}', qos=1)
                continue
            ids = [f"{self.gateway}/e1/{m * 10 + i}" for i in range(10)]
            readings = [
                {"id": rid, "origin": self.gateway, "sensor": "t",
                 "ts": "2026-11-24T10:00:00.000Z", "value": m + i / 10, "unit": "C", "flags": []}
                for i, rid in enumerate(ids)
            ]  # fmt: skip
            payload = json.dumps({"v": 1, "gateway": self.gateway, "readings": readings})
            info = self.client.publish(f"telemetry/{self.gateway}/readings", payload, qos=2)
            self.sent.append((info, ids, None))
            time.sleep(0.004)

    def stop(self) -> tuple[set[str], set[bytes]]:
        """Stop publishing, wait for every PUBCOMP; the readings and bad payloads completed."""
        self._stop.set()
        self._thread.join(10)
        ids: set[str] = set()
        bad: set[bytes] = set()
        for info, rids, payload in self.sent:
            info.wait_for_publish(60)
            if info.is_published():  # PUBCOMP received
                ids.update(rids)
                if payload is not None:
                    bad.add(payload)
        self.client.loop_stop()
        self.client.disconnect()
        return ids, bad


def json_lines(landing: Path, pattern: str) -> Iterator[dict[str, Any]]:
    """The lines of the files that parse as JSON objects (malformed_lines finds the rest)."""
    for f in sorted(landing.glob(pattern)):
        try:
            data = f.read_bytes()
        except FileNotFoundError:  # rolled between the listing and the read
            continue
        for line in data.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec


def count(landing: Path, incoming: bool = False) -> collections.Counter[str]:
    """Reading ids in the rolled files (and the open ones), skipping malformed lines: the
    old landing code leaves some, and its losses and doubles are worth counting too."""
    ids = collections.Counter(r.get("id") for r in json_lines(landing, "date=*/*.jsonl"))
    if incoming:
        ids.update(r.get("id") for r in json_lines(landing, "_incoming/readings/*.jsonl"))
    return ids


def settled(progress: Callable[[], int], goal: int, quiet_s: float = 5.0) -> None:
    """Wait until ``progress()`` reaches ``goal``, or has not moved for ``quiet_s``
    (what the broker had is delivered: the rest was lost), within a minute."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + 60
    while time.monotonic() < deadline:
        now = progress()
        if now >= goal:
            return
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > quiet_s:
            return
        time.sleep(0.2)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    b = Mosquitto(tmp_path / "broker").start()
    yield b
    b.kill()


def run_cuts(tmp_path: Path, broker: Mosquitto, seed: int, cuts: int) -> dict[str, object]:
    """The scenario; returns what it saw (the test asserts on it, bench/ prints it)."""
    rng = random.Random(seed)
    with PowerCutMount(
        tmp_path / "backing", tmp_path / "disk", writeback=seed, write_delay=0.005
    ) as disk:
        landing = disk.path / "landing"
        ingest = IngestProc(broker.port, landing)
        ingest.log = tmp_path / "ingest.log"  # the log is the witness: off the cut disk
        ingest.start()
        pub = Publisher(broker.port).start()
        frozen = 0
        for _ in range(cuts):
            time.sleep(rng.uniform(0.1, 0.6))
            disk.arm(rng.randint(1, 3))  # right after one of the next three writes
            frozen += disk.wait_frozen(10)
            assert ingest.proc is not None
            disk.cut(ingest.proc)
            ingest.start()
        ids, bad = pub.stop()

        settled(lambda: len(ids & count(landing, incoming=True).keys()), len(ids))
        ingest.stop()
        counts = count(landing)
        malformed = malformed_lines(landing)
        try:
            landed(landing)  # pipeline/audit.py reads every rolled line
            audit = "ok"
        except ValueError as exc:
            audit = f"fails: {exc}"
        rejected_bad = collections.Counter(
            r["payload"].encode()
            for r in json_lines(landing, "_rejected/date=*/*.jsonl")
            if r.get("topic", "").endswith("/readings")
        )
        return {
            "cuts": disk.cuts,
            "frozen_after_a_write": frozen,
            "pubcompd": len(ids),
            "lost": len(ids - counts.keys()),
            "twice": sum(1 for i in ids if counts[i] > 1),
            "unexpected": len(counts.keys() - ids),
            "malformed": malformed[:3],
            "malformed_lines": len(malformed),
            "bad_pubcompd": len(bad),
            "bad_lost": len(bad - rejected_bad.keys()),
            "bad_twice": sum(1 for b in bad if rejected_bad[b] > 1),
            "audit": audit,
            "quarantined": len(list(landing.glob("_quarantine/*/*"))),
            "seeds": [c.get("seed") for c in disk.cut_log],
        }


@pytest.mark.parametrize("seed", SEEDS)
def test_ingest_power_cuts_in_the_writeback_model_land_each_pubcompd_reading_once(
    tmp_path: Path, broker: Mosquitto, seed: int
) -> None:
    got = run_cuts(tmp_path, broker, seed, CUTS)
    print(f"seed {seed}: {got}")
    assert got["cuts"] == CUTS and got["frozen_after_a_write"] == CUTS, got
    assert got["malformed_lines"] == 0, f"malformed lines in rolled files: {got}"
    assert got["pubcompd"] > 1000, got
    assert got["lost"] == 0, f"PUBCOMP'd readings lost: {got}"
    assert got["twice"] == 0, f"readings landed twice: {got}"
    assert got["unexpected"] == 0, got
    assert got["bad_pubcompd"] > 5 and got["bad_lost"] == 0 and got["bad_twice"] == 0, got
    assert got["audit"] == "ok", got
