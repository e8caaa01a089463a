"""Exactly once from the gateway's store to the landing zone, whatever the broker keeps
(issue 24): the broker is a relay, never the only copy.

Every test runs real processes: a cloud Mosquitto, ``pubcomp uplink run`` over a
store, ``pubcomp ingest run``. What landed is counted in the landing files, and
the gateway's store is read straight from its SQLite file.
"""

from __future__ import annotations

import collections
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from devkit.broker import Mosquitto
from devkit.checker import Recorder
from devkit.gateway_helpers import GatewayProc
from devkit.ingest_helpers import IngestProc, landed
from devkit.procs import stop
from devkit.uplink_helpers import fill_store, start_uplink
from pubcomp.sync import wire
from tests.metrics_helpers import samples, scrape_text


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def store_counts(path: Path) -> dict[str, int]:
    """What the gateway's store holds, read from the file: messages in flight (with a
    packet id), readings waiting for a first send, readings awaiting landing."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        live = db.execute("SELECT COUNT(*) FROM out_inflight WHERE packet_id IS NOT NULL")
        inflight = live.fetchone()[0]
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
        awaiting_top = 0
        awaiting = 0
        if "awaiting_landing" in tables:
            row = db.execute(
                "SELECT COALESCE(MAX(last_seq), 0), COUNT(*) FROM awaiting_landing"
            ).fetchone()
            awaiting_top = row[0]
            awaiting = db.execute(
                "SELECT COALESCE(SUM(o.n), 0) FROM outbox o JOIN awaiting_landing a "
                "ON o.seq BETWEEN a.first_seq AND a.last_seq"
            ).fetchone()[0]
        high = db.execute("SELECT COALESCE(MAX(last_seq), 0) FROM out_inflight").fetchone()[0]
        waiting = db.execute(
            "SELECT COALESCE(SUM(n), 0) FROM outbox WHERE seq > ?", (max(high, awaiting_top),)
        ).fetchone()[0]
        outbox = db.execute("SELECT COALESCE(SUM(n), 0) FROM outbox").fetchone()[0]
    finally:
        db.close()
    return {"inflight": inflight, "waiting": waiting, "awaiting": awaiting, "outbox": outbox}


def delivered_all(path: Path) -> bool:
    """Every reading has been PUBCOMP'd by the broker (none in flight, none waiting)."""
    c = store_counts(path)
    return c["inflight"] == 0 and c["waiting"] == 0


@pytest.fixture
def brokers() -> Iterator[list[Mosquitto]]:
    """Brokers a test starts itself (its own settings); killed whatever the outcome."""
    started: list[Mosquitto] = []
    yield started
    for b in started:
        b.kill()


@pytest.mark.parametrize("persistence", [True, False], ids=["autosave", "no-persistence"])
def test_broker_sigkill_while_the_ingest_is_away_loses_nothing(
    tmp_path: Path, persistence: bool, brokers: list[Mosquitto]
) -> None:
    """The cloud broker PUBCOMPs the gateway's messages, holds them for an ingest that
    is away (an upgrade, an outage), and is SIGKILLed: Mosquitto saves its database
    only every ``autosave_interval`` (30 min by default) or at a clean stop, so
    everything it acknowledged since is gone. The gateway kept the readings (they were
    delivered, not landed); the broker's CONNACK says the session is gone, and the
    gateway publishes them again under new packet ids with the same reading ids. A
    broker without persistence has also forgotten the ingest's subscription: what the
    gateway re-sends before the ingest subscribes again is dropped, and goes out once
    more after the (here short) landing timeout."""
    broker = Mosquitto(tmp_path / "broker", persistence=persistence).start()
    brokers.append(broker)
    landing = tmp_path / "landing"
    ing = IngestProc(broker.port, landing).start()
    ing.stop()  # its persistent session and subscription stay at the broker
    if persistence:
        broker.stop()  # a clean stop saves the ingest's session, as autosave would
        broker.start()
    store = tmp_path / "gw.db"
    ids = fill_store(store, 600, gateway="gw1")
    up = start_uplink(
        store, broker.url, "--batch", "20", "--protocol", "3.1.1", "--landed-timeout", "3",
        end_to_end=True,
    )  # fmt: skip
    try:
        wait_until(lambda: delivered_all(store), 60, "the broker to PUBCOMP every message")
        broker.kill()
        broker.start()
        ing.start()
        wait_until(
            lambda: ids <= landed(landing, rolled_only=False).keys(),
            60,
            "every reading to land after the broker's restart",
        )
    finally:
        stop(up)
    ing.stop()
    counts = landed(landing)
    assert ids - counts.keys() == set(), f"{len(ids - counts.keys())} readings lost"
    assert counts.keys() == ids, "only the gateway's readings land"


def test_a_broker_queue_that_overflows_loses_nothing(
    tmp_path: Path, brokers: list[Mosquitto]
) -> None:
    """Mosquitto's ``max_queued_messages`` (1,000 by default) drops what arrives for an
    absent subscriber beyond it, after PUBCOMPing it to the publisher ("Outgoing
    messages are being dropped"). The messages are not landed within the gateway's
    ``landed_timeout``, so it publishes them again; nothing is lost."""
    broker = Mosquitto(tmp_path / "broker", max_queued_messages=10).start()
    brokers.append(broker)
    landing = tmp_path / "landing"
    ing = IngestProc(broker.port, landing).start()
    ing.stop()
    store = tmp_path / "gw.db"
    ids = fill_store(store, 500, gateway="gw1")
    up = start_uplink(
        store, broker.url, "--batch", "10", "--landed-timeout", "2", "--protocol", "3.1.1",
        end_to_end=True,
    )  # fmt: skip
    try:
        wait_until(lambda: delivered_all(store), 60, "the broker to PUBCOMP every message")
        assert "Outgoing messages are being dropped" in broker.log()
        ing.start()
        wait_until(
            lambda: ids <= landed(landing, rolled_only=False).keys(),
            60,
            "every reading to land once re-sent",
        )
        wait_until(lambda: store_counts(store)["outbox"] == 0, 30, "the store to let them go")
    finally:
        stop(up)
    ing.stop()
    counts = landed(landing)
    assert counts.keys() == ids
    # Copies are allowed (the pipeline removes them), but only of re-sent readings.
    assert collections.Counter(counts.values())[1] >= 100


def _publish(port: int, topic: str, payload: bytes, **login: str) -> int:
    """Publish one retained QoS 1 message with paho (MQTT 5); its PUBACK's reason code."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    if login:
        c.username_pw_set(login["user"], login["password"])
    codes: list[int] = []
    c.on_publish = lambda _c, _u, _mid, rc, _p: codes.append(rc.value)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        c.publish(topic, payload, qos=1, retain=True).wait_for_publish(10)
        wait_until(lambda: bool(codes), 10, "the PUBACK")
    finally:
        c.loop_stop()
        c.disconnect()
    return codes[0]


def _store_epoch(path: Path) -> str:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return str(db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()[0])
    finally:
        db.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "hmac"])
def test_a_forged_or_out_of_range_acknowledgement_changes_nothing(
    tmp_path: Path, mosquitto: Mosquitto, keyed: bool
) -> None:
    """Acknowledgements the gateway cannot believe let nothing go: one naming seqs it
    never sent, one for a replaced store's epoch, and (with ``--landed-key-file``) one
    without the ingest's HMAC. A believable one, published last, is the marker: once
    its readings are gone, the others have been read and ignored."""
    store = tmp_path / "gw.db"
    fill_store(store, 100, gateway="gw1")
    epoch = _store_epoch(store)
    master = bytes(range(32))
    extra: list[str] = []
    key = None
    if keyed:
        key = wire.gateway_key(master, "gw1")
        (tmp_path / "gw1.key").write_text(key.hex())
        extra = ["--landed-key-file", str(tmp_path / "gw1.key")]
    up = start_uplink(
        store, mosquitto.url, "--batch", "10", "--landed-timeout", "600", *extra, end_to_end=True
    )
    try:
        wait_until(lambda: delivered_all(store), 30, "every message delivered")
        forged = [
            ("far", wire.encode_landed("gw1", epoch, "forger", [(1, 10**6)], key=key)),
            ("old", wire.encode_landed("gw1", "an-old-epoch", "forger", [(1, 100)], key=key)),
        ]
        if keyed:  # in range, right epoch, but not from a holder of the key
            forged.append(("unsigned", wire.encode_landed("gw1", epoch, "forger", [(1, 100)])))
        for name, payload in forged:
            assert _publish(mosquitto.port, f"telemetry/gw1/landed/{name}", payload) == 0
        marker = wire.encode_landed("gw1", epoch, "ingest-1", [(1, 50)], key=key)
        assert _publish(mosquitto.port, "telemetry/gw1/landed/ingest-1", marker) == 0
        wait_until(lambda: store_counts(store)["outbox"] == 50, 30, "the marker's readings to go")
    finally:
        stop(up)
    out, _ = up.communicate()
    acks = json.loads(out.strip().splitlines()[-1])["end_to_end"]["acks"]
    assert acks["accepted"] == 1 and acks["out_of_range"] == 1 and acks["other_epoch"] == 1
    assert acks.get("bad_hmac", 0) == (1 if keyed else 0)
    c = store_counts(store)
    assert c["outbox"] == 50 and c["awaiting"] == 50, c  # seqs 51-100: nothing believed


def test_only_the_ingest_may_say_landed(tmp_path: Path, brokers: list[Mosquitto]) -> None:
    """The ACL shipped in examples/mosquitto/acl: another gateway, and the gateway
    itself, are refused (0x87) when they publish on a landed topic; the ingest's
    acknowledgement is what lets the readings go, every one landed once."""
    users = {"gw1": "pw-gw1", "gw2": "pw-gw2", "ingest-1": "pw-ingest"}
    acl = Path(__file__).parent.parent / "examples" / "mosquitto" / "acl"
    broker = Mosquitto(tmp_path / "broker", users=users, acl_file=acl).start()
    brokers.append(broker)
    for u, p in users.items():
        (tmp_path / f"{u}.pw").write_text(p)
    landing = tmp_path / "landing"
    login = ["--username", "ingest-1", "--password-file", str(tmp_path / "ingest-1.pw")]
    ing = IngestProc(broker.port, landing, "ingest-1", *login).start()
    ing.stop()
    store = tmp_path / "gw.db"
    ids = fill_store(store, 200, gateway="gw1")
    epoch = _store_epoch(store)
    gw = ["--username", "gw1", "--password-file", str(tmp_path / "gw1.pw")]
    up = start_uplink(
        store, broker.url, "--batch", "20", "--landed-timeout", "600", *gw, end_to_end=True
    )
    try:
        wait_until(lambda: delivered_all(store), 30, "every message delivered")
        forged = wire.encode_landed("gw1", epoch, "ingest-1", [(1, 200)])
        for user in ("gw2", "gw1"):
            code = _publish(
                broker.port, "telemetry/gw1/landed/ingest-1", forged,
                user=user, password=users[user],
            )  # fmt: skip
            assert code == 0x87, f"{user} may publish a landed acknowledgement ({code:#x})"
        assert store_counts(store)["awaiting"] == 200
        ing.start()
        wait_until(lambda: store_counts(store)["outbox"] == 0, 30, "the ingest's acknowledgement")
    finally:
        stop(up)
    ing.stop()
    counts = landed(landing)
    assert counts.keys() == ids and max(counts.values()) == 1


@pytest.mark.parametrize("how", ["share3", "partitions2"])
def test_several_ingests_one_killed_and_restarted_lose_nothing(
    tmp_path: Path, mosquitto: Mosquitto, how: str
) -> None:
    """Several ingests share the fleet: three in a ``$share`` group (MQTT 5), or two on
    partitioned topics (brokers without ``$share``: each gateway publishes under its
    partition's prefix, each ingest subscribes to one). Each acknowledges what it
    landed on its own topic; a gateway lets a message go once any of them has. One
    ingest is SIGKILLed mid-run and restarted: every reading lands (copies only of
    what was re-sent, which the pipeline removes) and every store empties."""
    landing = tmp_path / "landing"
    n_ing = 3 if how == "share3" else 2
    ings = []
    for i in range(n_ing):
        extra = (
            ["--shared-group", "fleet"]
            if how == "share3"
            else ["--topic", f"telemetry/p{i}/+/readings", "--status-topic", ""]
        )
        ings.append(IngestProc(mosquitto.port, landing, f"ingest-{i}", *extra).start())
    ids: set[str] = set()
    ups = []
    for g in range(4):
        store = tmp_path / f"gw{g}.db"
        ids |= fill_store(store, 2000, gateway=f"gw{g}")
        prefix = "telemetry" if how == "share3" else f"telemetry/p{g % 2}"
        ups.append(
            start_uplink(
                store, mosquitto.url, "--batch", "20", "--client-id", f"gw{g}",
                "--topic-prefix", prefix, "--landed-timeout", "5", "--exit-when-drained",
                end_to_end=True,
            )
        )  # fmt: skip
    victim = ings[1]
    wait_until(lambda: len(landed(landing, rolled_only=False)) > 1000, 60, "a first part to land")
    assert victim.proc is not None
    victim.proc.kill()
    victim.proc.wait(10)
    victim.start()
    for u in ups:
        assert u.wait(120) == 0, u.stderr.read() if u.stderr else ""
    for ing in ings:
        ing.stop()
    counts = landed(landing)
    assert counts.keys() == ids, f"{len(ids - counts.keys())} lost"
    copies = sum(counts.values()) - len(ids)
    assert copies <= 0.25 * len(ids), f"{copies} copies of {len(ids)}"
    for g in range(4):
        c = store_counts(tmp_path / f"gw{g}.db")
        assert c["outbox"] == 0 and c["awaiting"] == 0, (g, c)


def _status_text(gw: GatewayProc) -> str:
    cmd = [sys.executable, "-m", "pubcomp", "status", "--config", str(gw.fleet)]
    out = subprocess.run([*cmd, "--gateway", gw.gid], capture_output=True, text=True, timeout=30)
    return out.stdout


def test_the_operator_sees_awaiting_landing_and_end_to_end_off(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """A real gateway with a sensor, the ingest away then back: `pubcomp status`, /metrics
    and the status message say how many delivered readings await landing and for how
    long; once the ingest is back they are let go (counted as landed). The same gateway
    with ``uplink.end_to_end: false`` says so, sends payloads without the ``outbox``
    field (an older ingest's schema refuses unknown fields) and lets go at PUBCOMP."""
    landing = tmp_path / "landing"
    ing = IngestProc(mosquitto.port, landing).start()
    ing.stop()
    sensors = [{"id": "c", "type": "simulated", "signal": "counter", "interval_s": 0.05}]
    gw = GatewayProc(tmp_path, mosquitto.port, sensors=sensors)
    gw.extra = {"status": {"min_interval_s": 1, "heartbeat_s": 5}}
    gw.write()
    seen = Recorder(mosquitto.port, "telemetry/#")
    gw.start()
    try:
        wait_until(
            lambda: gw.status()["uplink"]["end_to_end"]["awaiting_landing"] >= 20,
            30,
            "delivered readings awaiting landing",
        )
        text = _status_text(gw)
        assert "awaiting landing" in text and "oldest" in text, text
        m = samples(scrape_text(gw))
        assert m[("pubcomp_end_to_end", ())] == 1
        assert m[("pubcomp_awaiting_landing_readings", ())] >= 20
        assert m[("pubcomp_awaiting_landing_age_seconds", ())] > 0
        wait_until(
            lambda: any(
                json.loads(p).get("uplink", {}).get("awaiting_landing", 0) > 0
                for t, p in seen.messages()
                if t.endswith("/status")
            ),
            30,
            "a status message saying what awaits landing",
        )
        ing.start()
        wait_until(
            lambda: samples(scrape_text(gw))[("pubcomp_landed_readings_total", ())] >= 20,
            30,
            "the ingest's acknowledgement to let them go",
        )
        assert all("outbox" in json.loads(p) for t, p in seen.messages() if t.endswith("/readings"))
    finally:
        gw.terminate()
    ing.stop()
    gw.extra = {"uplink": {"end_to_end": False}}
    gw.write()
    before = len(seen.messages())
    gw.start()
    try:
        wait_until(lambda: gw.status()["uplink"]["delivered"] >= 20, 30, "deliveries")
        assert "end to end OFF" in _status_text(gw)
        assert samples(scrape_text(gw))[("pubcomp_end_to_end", ())] == 0
        assert gw.status()["uplink"]["end_to_end"] == {"enabled": False}
        later = [p for t, p in seen.messages()[before:] if t.endswith("/readings")]
        assert later and all("outbox" not in json.loads(p) for p in later)
    finally:
        gw.terminate()
        seen.stop()
