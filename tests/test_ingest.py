"""The cloud ingest against a real Mosquitto: an uplink (or paho) publishes, the ingest lands."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from pubcomp.devbroker import Mosquitto
from pubcomp.pipeline.job import Pipeline
from pubcomp.pipeline.landing import LandingWriter

from . import duckdb_reference as ref
from .ingest_helpers import IngestProc, landed, rejected
from .uplink_helpers import fill_store, run_uplink


def _wait_landed(landing: Path, expected: set[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if expected <= landed(landing, rolled_only=False).keys():
            return
        time.sleep(0.1)


def test_every_message_lands_exactly_once(tmp_path: Path, mosquitto: Mosquitto) -> None:
    landing = tmp_path / "landing"
    ing = IngestProc(mosquitto.port, landing).start()
    ids = fill_store(tmp_path / "gw.db", 5000, gateway="gw1")
    res = run_uplink(tmp_path / "gw.db", mosquitto.url, "--batch", "50")
    assert res.returncode == 0, res.stderr
    _wait_landed(landing, ids)
    stats = ing.stop()
    counts = landed(landing)  # rolled files only: the stop rolled the last one
    assert counts.keys() == ids and max(counts.values()) == 1
    assert stats["readings"] == 5000 and stats["messages"] == 100
    assert not list((landing / "_incoming").rglob("*.jsonl")), "stop must roll every file"
    line = json.loads(next(landing.glob("date=*/*.jsonl")).read_text().splitlines()[0])
    assert line["gateway"] == "gw1" and line["received"].endswith("Z") and "origin" in line


@pytest.mark.parametrize("point", ["ingest_landed", "ingest_committed"])
def test_sigkill_inside_the_receive_handshake(
    tmp_path: Path, persistent_mosquitto: Mosquitto, point: str
) -> None:
    """Killed after landing, before the ids are committed: the broker resends and the
    message may land twice (the pipeline dedups). Killed after the ids are committed,
    before PUBREC: the resent PUBLISH has a known id and is not written again
    (MQTT-4.3.3-2)."""
    landing = tmp_path / "landing"
    ing = IngestProc(persistent_mosquitto.port, landing)
    ing.start(crash_at=f"{point}:3")
    ids = fill_store(tmp_path / "gw.db", 2000, gateway="gw1")
    res = run_uplink(tmp_path / "gw.db", persistent_mosquitto.url, "--batch", "20")
    assert res.returncode == 0, res.stderr
    assert ing.proc is not None and ing.proc.wait(30) == -9  # the crash point fired
    ing.start()  # recovers: rolls the dead run's file, resumes the session
    _wait_landed(landing, ids)
    stats = ing.stop()
    counts = landed(landing)
    assert counts.keys() == ids
    assert max(counts.values()) <= 2
    if point == "ingest_committed":
        assert max(counts.values()) == 1
        assert stats["repeats"] >= 1  # the resent PUBLISH was recognised
    else:
        assert sum(counts.values()) > len(ids)  # landed twice: shows the window is real


def test_bad_messages_go_to_rejected_and_the_rest_lands(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    landing = tmp_path / "landing"
    ing = IngestProc(mosquitto.port, landing).start()
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bad-gw")
    c.connect("127.0.0.1", mosquitto.port)
    c.loop_start()
    good = {
        "v": 1,
        "gateway": "gw9",
        "readings": [
            {"id": "gw9/e/1", "origin": "gw9", "sensor": "t", "ts": None, "value": 1.5,
             "unit": "C", "flags": []},
        ],
    }  # fmt: skip
    bad = [
        b"not json",
        b'{"v":1,"gateway":"gw9","readings":[{"id":"x","value":NaN}]}',
        json.dumps({**good, "v": 2}).encode(),
        json.dumps({**good, "readings": [{**good["readings"][0], "id": "no-slashes"}]}).encode(),
        b"\xff\xfe binary",
    ]
    for p in [*bad, json.dumps(good).encode()]:
        c.publish("telemetry/gw9/readings", p, qos=2).wait_for_publish(10)
    c.loop_stop()
    c.disconnect()
    _wait_landed(landing, {"gw9/e/1"})
    stats = ing.stop()
    assert landed(landing) == {"gw9/e/1": 1}
    rej = rejected(landing)
    assert [r["reason"].split(":")[0] for r in rej] == ["not_json"] * 2 + ["schema"] * 2 + [
        "not_json"
    ]
    assert "readings/0/id" in rej[3]["reason"] and rej[4]["encoding"] == "base64"
    assert stats["rejected"] == {"not_json": 3, "schema": 2} and stats["readings"] == 1


def test_shared_group_splits_the_work_and_loses_nothing(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    landing = tmp_path / "landing"
    ings = [
        IngestProc(mosquitto.port, landing, f"ingest-{i}", "--shared-group", "g").start()
        for i in (1, 2)
    ]
    ids = fill_store(tmp_path / "gw.db", 4000, gateway="gw1")
    res = run_uplink(tmp_path / "gw.db", mosquitto.url, "--batch", "20")
    assert res.returncode == 0, res.stderr
    _wait_landed(landing, ids)
    stats = [i.stop() for i in ings]
    counts = landed(landing)
    assert counts.keys() == ids and max(counts.values()) == 1
    assert all(s["readings"] > 0 for s in stats), stats  # both took a share
    writers = {f.name.split("-20")[0] for f in landing.glob("date=*/*.jsonl")}
    assert writers == {"ingest-1", "ingest-2"}


def test_landing_writer_recovers_a_torn_file(tmp_path: Path) -> None:
    w = LandingWriter(tmp_path, "w1", max_age_s=3600)
    w.append([b'{"id":"a/b/1"}\n', b'{"id":"a/b/2"}\n'])
    assert not list(tmp_path.glob("date=*/*"))  # not visible until rolled
    path = next((tmp_path / "_incoming").rglob("w1-*.jsonl"))
    with path.open("ab") as f:
        f.write(b'{"id":"a/b/3"')  # a power cut mid-line: never acknowledged
    w2 = LandingWriter(tmp_path, "w1")  # the next start
    files = list(tmp_path.glob("date=*/*.jsonl"))
    assert len(files) == 1 and files[0].read_bytes() == b'{"id":"a/b/1"}\n{"id":"a/b/2"}\n'
    assert w2.rolled_files == 1
    with pytest.raises(ValueError):
        LandingWriter(tmp_path, "_hidden")


def test_sigkill_between_write_and_pubrec_then_the_pipeline_has_each_once(
    tmp_path: Path, persistent_mosquitto: Mosquitto, spark: Any
) -> None:
    """The end of the chain: killed after landing, before PUBREC, the message lands twice;
    after `pubcomp pipeline run` every reading is in `readings` exactly once, and the
    tables equal DuckDB's from the same landing files."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    ing = IngestProc(persistent_mosquitto.port, landing)
    ing.start(crash_at="ingest_landed:2")
    ids = fill_store(tmp_path / "gw.db", 1000, gateway="gw1")
    res = run_uplink(tmp_path / "gw.db", persistent_mosquitto.url, "--batch", "20")
    assert res.returncode == 0, res.stderr
    assert ing.proc is not None and ing.proc.wait(30) == -9
    ing.start()
    _wait_landed(landing, ids)
    ing.stop()
    counts = landed(landing)
    assert sum(counts.values()) > len(ids), "the kill must have landed a message twice"
    summary = Pipeline(spark, str(landing), str(wh)).run()
    assert summary.readings_written == len(ids)
    assert summary.duplicates_removed == sum(counts.values()) - len(ids)
    rows = spark.read.parquet(str(wh / "readings")).groupBy("id").count().collect()
    assert {r["id"] for r in rows} == ids and {r["count"] for r in rows} == {1}
    res_cmp = ref.compare(ref.build(landing), wh)
    assert all(a == b == 0 for _, a, b in res_cmp.values()), res_cmp
