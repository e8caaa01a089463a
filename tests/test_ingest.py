"""The cloud ingest against a real Mosquitto: an uplink (or paho) publishes, the ingest lands."""

from __future__ import annotations

import collections
import json
import time
import zlib
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devkit import duckdb_reference as ref
from devkit.broker import Mosquitto
from devkit.ingest_helpers import IngestProc, landed, rejected
from devkit.uplink_helpers import fill_store, run_uplink, start_uplink
from pubcomp.pipeline import ingest
from pubcomp.pipeline.job import Pipeline
from pubcomp.pipeline.landing import LandingWriter
from pubcomp.sync import wire


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
    res = run_uplink(tmp_path / "gw.db", mosquitto.url, "--batch", "50", end_to_end=True)
    assert res.returncode == 0, res.stderr
    _wait_landed(landing, ids)
    stats = ing.stop()
    counts = landed(landing)  # rolled files only: the stop rolled the last one
    assert counts.keys() == ids and max(counts.values()) == 1
    assert stats["readings"] == 5000 and stats["messages"] == 100
    assert not list((landing / "_incoming").rglob("*.jsonl")), "stop must roll every file"
    line = json.loads(next(landing.glob("date=*/*.jsonl")).read_text().splitlines()[0])
    assert line["gateway"] == "gw1" and line["received"].endswith("Z") and "origin" in line


# The n-th pass of each point: every message has its PUBREL, so the third always comes.
# How many groups a hundred PUBLISHes make depends on how the reads fall against the
# fsyncs (the ingest lets the broker send 100 at once, MQTT 5 Receive Maximum): the
# ingest stopped while the uplink sent them all made 3 here, and a CI run with
# ingest_landed:3 timed out waiting for the kill. Only the first group is sure to come.
@pytest.mark.parametrize(
    ("point", "n", "handling"),
    [("ingest_landed", 1, "PUBLISH x"), ("ingest_pubrel_received", 3, "PUBREL ")],
)
def test_sigkill_inside_the_receive_handshake_lands_nothing_twice(
    tmp_path: Path, persistent_mosquitto: Mosquitto, point: str, n: int, handling: str
) -> None:
    """Killed after a group's fsync, before its PUBRECs: the broker resends those
    PUBLISHes, and the restarted ingest finds their ids and digests in the landing
    files' receive records: acknowledged, not written again (MQTT-4.3.3-2, 5.0
    MQTT-4.3.3-10: never delivered twice). Killed after a PUBREL, before the PUBCOMP:
    the resent PUBREL is answered. Either way each reading is landed exactly once,
    counted in the landing files themselves, before any pipeline dedup."""
    landing = tmp_path / "landing"
    ing = IngestProc(persistent_mosquitto.port, landing)
    ing.start(crash_at=f"{point}:{n}")
    ids = fill_store(tmp_path / "gw.db", 2000, gateway="gw1")
    res = run_uplink(tmp_path / "gw.db", persistent_mosquitto.url, "--batch", "20")
    assert res.returncode == 0, res.stderr
    assert ing.wait_killed(broker_log=persistent_mosquitto.log_path) == -9
    assert ing.crashed_at().startswith(f"{point} {handling}"), ing.crashed_at()
    ing.start()  # recovers: rolls the dead run's file, rebuilds the receive state
    _wait_landed(landing, ids)
    stats = ing.stop()
    counts = landed(landing)
    assert counts.keys() == ids
    assert max(counts.values()) == 1, collections.Counter(counts.values())
    assert stats["recovered_ids"] >= 1
    if point == "ingest_landed":
        assert stats["repeats"] >= 1  # the resent PUBLISH was recognised


def test_crash_points_fire_only_on_the_packet_they_name(
    tmp_path: Path, persistent_mosquitto: Mosquitto
) -> None:
    """``ingest_landed:1`` must not fire on the SUBACK's round: the first PUBLISH is
    the first pass. The crash marker names what was being handled."""
    landing = tmp_path / "landing"
    ing = IngestProc(persistent_mosquitto.port, landing).start(crash_at="ingest_landed:1")
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="one-gw")
    c.connect("127.0.0.1", persistent_mosquitto.port)
    c.loop_start()
    msg = {"v": 1, "gateway": "gw7", "readings": [
        {"id": "gw7/e/1", "origin": "gw7", "sensor": "t", "ts": None, "value": 1.0,
         "unit": "C", "flags": []}]}  # fmt: skip
    assert ing.proc is not None and ing.proc.poll() is None, ing.crashed_at()
    c.publish("telemetry/gw7/readings", json.dumps(msg).encode(), qos=2).wait_for_publish(10)
    assert ing.wait_killed(broker_log=persistent_mosquitto.log_path) == -9
    assert ing.crashed_at() == "ingest_landed PUBLISH x1 ids 1"
    c.loop_stop()
    c.disconnect()
    ing.start()
    _wait_landed(landing, {"gw7/e/1"})
    stats = ing.stop()
    assert landed(landing) == {"gw7/e/1": 1} and stats["repeats"] == 1


def test_one_fsync_covers_every_connection(tmp_path: Path, mosquitto: Mosquitto) -> None:
    """Three connections in one process (a shared group) commit together: groups
    holding messages from several connections, each reading once."""
    landing = tmp_path / "landing"
    ing = IngestProc(
        mosquitto.port, landing, "ingest-1", "--shared-group", "g", "--connections", "3"
    ).start()
    stores = [tmp_path / f"gw{g}.db" for g in range(4)]
    ids = set().union(*(fill_store(s, 3000, gateway=f"gw{g}") for g, s in enumerate(stores)))
    ups = [start_uplink(s, mosquitto.url, "--exit-when-drained", "--client-id", s.stem,
                        end_to_end=True) for s in stores]  # fmt: skip
    for u in ups:
        assert u.wait(120) == 0, u.stderr.read() if u.stderr else ""
    _wait_landed(landing, ids)
    stats = ing.stop()
    counts = landed(landing)
    assert counts.keys() == ids and max(counts.values()) == 1
    assert stats["connections"] == 3
    assert stats["shared_commits"] >= 1, stats
    assert stats["commits"] < stats["messages"], stats  # grouped, not one fsync a message


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
    # End to end: each ingest acknowledges what it landed on its own topic, and the
    # gateway lets a message go once either has (ranges combined, not one watermark).
    res = run_uplink(tmp_path / "gw.db", mosquitto.url, "--batch", "20", end_to_end=True)
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


def test_landing_writer_cuts_an_unfinished_message(tmp_path: Path) -> None:
    """A message's lines end with its receive record; lines after the last record are
    the start of a message never acknowledged (a kill or power cut inside the write).
    Recovery cuts them (keeping them in ``_quarantine``), so the broker's resend lands
    that message once."""
    w = LandingWriter(tmp_path, "w1", max_age_s=3600, message_records=True)
    record = b'"_mqtt":{"session":"s","packet_id":1,"qos":2,"digest":"d"}}\n'
    w.append([b'{"id":"a/b/1"}\n{"id":"a/b/2",' + record])  # one message, sealed here
    path = next((tmp_path / "_incoming").rglob("w1-*.jsonl"))
    done = path.read_bytes()
    n = done.index(b',"length":')  # the seal: the message's length to here, and a CRC
    head = done[:n] + b',"length":%d' % n
    assert done == head + b',"crc32":"%08x"}}\n' % zlib.crc32(head)
    with path.open("ab") as f:
        f.write(b'{"id":"a/b/3"}\n{"id":"a/b/4"}\n{"id":"a/b/5"')  # no record: unfinished
    w2 = LandingWriter(tmp_path, "w1", message_records=True)
    files = list(tmp_path.glob("date=*/*.jsonl"))
    assert len(files) == 1 and files[0].read_bytes() == done
    assert list(w2.receive_records()) == [{"session": "s", "packet_id": 1, "qos": 2, "digest": "d"}]
    cut = (tmp_path / "_quarantine" / "readings" / f"{path.name}.{len(done)}").read_bytes()
    assert cut == b'{"id":"a/b/3"}\n{"id":"a/b/4"}\n{"id":"a/b/5"'


def test_sigkill_between_write_and_pubrec_then_the_pipeline_has_each_once(
    tmp_path: Path, persistent_mosquitto: Mosquitto, spark: Any
) -> None:
    """The end of the chain: killed after landing, before PUBREC, nothing lands twice
    (the receive records in the landing file recognise the resend), the pipeline has
    nothing to remove, every reading is in `readings` once, and the tables equal
    DuckDB's from the same landing files (which carry the extra `_mqtt` field)."""
    landing, wh = tmp_path / "landing", tmp_path / "wh"
    ing = IngestProc(persistent_mosquitto.port, landing)
    ing.start(crash_at="ingest_landed:1")  # the first group: the only one sure to come
    ids = fill_store(tmp_path / "gw.db", 1000, gateway="gw1")
    res = run_uplink(tmp_path / "gw.db", persistent_mosquitto.url, "--batch", "20")
    assert res.returncode == 0, res.stderr
    assert ing.wait_killed(broker_log=persistent_mosquitto.log_path) == -9
    assert ing.crashed_at().startswith("ingest_landed PUBLISH x"), ing.crashed_at()
    ing.start()
    _wait_landed(landing, ids)
    ing.stop()
    counts = landed(landing)
    assert counts.keys() == ids and max(counts.values()) == 1
    summary = Pipeline(spark, str(landing), str(wh)).run()
    assert summary.readings_written == len(ids)
    assert summary.duplicates_removed == 0
    rows = spark.read.parquet(str(wh / "readings")).groupBy("id").count().collect()
    assert {r["id"] for r in rows} == ids and {r["count"] for r in rows} == {1}
    res_cmp = ref.compare(ref.build(landing), wh)
    assert all(a == b == 0 for _, a, b in res_cmp.values()), res_cmp


_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["", "a", "a/b/c", "a//c", "a/b/c\n", "x/y/z/w", "2026-11-21T00:00:01.000Z",
                     "2026-11-21T00:00:01Z", "2026-11-21T00:00:01.000Z\n", "C",
                     "gauge", "counter", "total", "rate"]),
    st.lists(st.sampled_from(["a", "a", 1]), max_size=3), st.just({}),
)  # fmt: skip


@st.composite
def _near_valid(draw: st.DrawFn) -> dict[str, Any]:
    """A valid cloud message with a few fields replaced, removed or added."""
    readings = [
        {"id": f"gw/e/{i}", "origin": "gw", "sensor": "t", "ts": "2026-11-21T00:00:01.000Z",
         "value": 1.5, "unit": "C", "flags": ["clock_unsynced"]}
        for i in range(draw(st.integers(1, 3)))
    ]  # fmt: skip
    msg: dict[str, Any] = {"v": 1, "gateway": "gw", "readings": readings}
    for _ in range(draw(st.integers(0, 2))):
        target = draw(st.sampled_from([msg, *readings]))
        key = draw(st.sampled_from([*target, "extra", "kind"]))
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(_junk)
    return msg


@settings(max_examples=600, deadline=None)
@given(_near_valid())
def test_the_fast_schema_check_is_never_more_lenient_than_the_schema(msg: dict[str, Any]) -> None:
    """The ingest checks the cloud schema in plain Python first and asks jsonschema only
    about what that check does not accept: it must never accept what the schema refuses."""
    schema_ok = not list(wire.validator(wire.CLOUD_SCHEMA).iter_errors(msg))
    if ingest._plainly_valid(msg):
        assert schema_ok, msg


def test_a_counter_or_a_total_takes_the_fast_check_and_a_bad_kind_does_not() -> None:
    reading = {"id": "gw/e/1", "origin": "gw", "sensor": "rain.count", "ts": None,
               "value": 0.2, "unit": "mm", "flags": []}  # fmt: skip
    for kind, ok in (("counter", True), ("total", True), ("gauge", True), ("rate", False)):
        msg = {"v": 1, "gateway": "gw", "readings": [reading | {"kind": kind}]}
        assert ingest._plainly_valid(msg) is ok, kind
        assert (not list(wire.validator(wire.CLOUD_SCHEMA).iter_errors(msg))) is ok, kind


def test_one_encoder_call_gives_the_same_lines_as_one_call_a_reading() -> None:
    received = "2026-11-21T00:00:01.000Z"
    tricky = ['"received":"2026-11-21T00:00:01.000Z"},{', "é", "\\", '"', "\n"]
    readings = [
        {"id": f"gw/e/{i}", "origin": "gw", "sensor": s, "ts": None, "value": i / 3,
         "unit": s, "flags": [s], "gateway": "gw", "received": received}
        for i, s in enumerate(tricky)
    ]  # fmt: skip
    readings[-1]["_mqtt"] = {"session": "s", "packet_id": 1, "qos": 2, "digest": "d"}
    lines = ingest._json_lines(readings, received).decode().splitlines()
    assert [json.loads(line) for line in lines] == readings
    assert lines == [json.dumps(r, separators=(",", ":"), ensure_ascii=False) for r in readings]


def test_ids_a_previous_version_committed_are_held_until_pubrel(tmp_path: Path) -> None:
    """A landing zone from before the receive records: the ids in its
    ``_state/ingest-{client}.db`` (committed after their messages landed) are held as
    pending, so their redelivery is acknowledged, not landed again; the file is only read."""
    import sqlite3

    from pubcomp.sync.client import ConnectOptions
    from pubcomp.sync.packets import Publish, Pubrec

    state = tmp_path / "_state"
    state.mkdir()
    with sqlite3.connect(state / "ingest-ingest-1.db") as db:
        db.execute("CREATE TABLE in_qos2 (session TEXT, packet_id INTEGER)")
        db.executemany(
            "INSERT INTO in_qos2 VALUES (?, ?)",
            [("mqtt://127.0.0.1:1883#ingest-1", 17), ("mqtt://elsewhere:1883#ingest-1", 18)],
        )
    before = (state / "ingest-ingest-1.db").read_bytes()
    ing = ingest.Ingest(
        "mqtt://127.0.0.1:1883", ConnectOptions("ingest-1"), "telemetry/+/readings", tmp_path
    )
    _, session = ing._session(0, 5)
    assert session.pending.keys() == {17}
    assert session.receive(Publish("t", b"x", 2, dup=True, packet_id=17)).ack == Pubrec(17)
    assert (state / "ingest-ingest-1.db").read_bytes() == before


@pytest.mark.parametrize(
    ("options", "why"),
    [
        (["--connections", "2"], "more than one connection needs a shared group"),
        (["--shared-group", "g", "--protocol", "3.1.1"], "shared subscriptions need MQTT 5"),
    ],
)
def test_ingest_options_that_cannot_work_together_end_in_one_line(
    tmp_path: Path, capsys: Any, options: list[str], why: str
) -> None:
    """A mistake ends in one line and exit 2 (docs/operations.md), not a traceback."""
    from pubcomp import cli

    argv = ["ingest", "run", "--broker", "mqtt://127.0.0.1:1", "--client-id", "ing"]
    argv += ["--landing", str(tmp_path)]
    code = cli.main([*argv, *options])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("pubcomp ingest run: ") and why in err, err
    assert not list(tmp_path.iterdir())  # nothing made before the options were checked
