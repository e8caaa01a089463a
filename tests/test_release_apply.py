"""Signed releases applied by a real ``pubcomp gateway run --release-dir`` (issue 28, part 3):
a real Mosquitto as the cloud, sensors (simulated) and a node (paho), releases made with
sync/release.py and published retained by paho. A good release is switched to, tried
and committed; one whose trial fails is rolled back by itself and marked bad; each step
reaches the cloud once as a ``$release`` audit reading."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

from devkit import hooked
from devkit.broker import Mosquitto, free_port
from devkit.gateway_helpers import PahoNode
from devkit.link import SlowLink
from devkit.node_helpers import wait_until
from pubcomp.sync import release

from .fleet_helpers import StatusWatcher
from .release_helpers import PREFIX, Audit, ReleaseGateway, Signer, exactly_once, publish

GID = "gw-rel"
COUNTER = {"id": "counter", "type": "simulated", "signal": "counter", "interval_s": 0.2}
SINE = {"id": "sine", "type": "simulated", "signal": "sine", "interval_s": 0.2}
APPLIED = ("fetched", "verified", "staged", "switched", "trial", "committed")


def _gateway(tmp_path: Path, port: int, **kwargs: object) -> tuple[ReleaseGateway, Signer]:
    signer = Signer(tmp_path)
    gw = ReleaseGateway(
        tmp_path, port, signer, gid=GID, sensors=[COUNTER], nodes={"n1": "pw-1"}, **kwargs
    )
    publish(port, release.keys_topic(PREFIX), signer.keys())
    return gw, signer


def test_a_good_release_is_switched_to_tried_and_committed(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    audit = Audit(mosquitto.port)
    gw, signer = _gateway(tmp_path, mosquitto.port)
    gw.start()
    node = PahoNode("n1", "pw-1", gw.ingress_port).start()
    try:
        assert gw.wait_release(state="idle", version=None)
        pid = gw.proc.pid if gw.proc else None
        text = gw.fleet_text(sensors=[COUNTER, SINE])
        publish(mosquitto.port, release.release_topic(PREFIX, GID), signer.release(GID, 1, text))
        rel = gw.wait_release(state="committed", version=1)
        assert rel["sha256"] == release.sha256_hex(text) and rel["bad"] == []
        # The same process (re-executed in place), now running release 1's sensors.
        assert gw.proc is not None and gw.proc.pid == pid and gw.proc.poll() is None
        assert "sine" in gw.status()["sensors"]
        assert (gw.release_dir / "current").read_text() == "1\n"
        assert (gw.release_dir / "previous").read_text() == "config\n"
        events = audit.wait(*((e, 1) for e in APPLIED))
        assert exactly_once(events) == {(e, 1): 1 for e in APPLIED}, events
        assert [e for e, _ in events] == list(APPLIED)
        # What the operator reads: `pubcomp status`, the status page, /metrics.
        out = subprocess.run(
            [*hooked.command("status", "--config", str(gw.fleet), "--gateway", GID)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        print(out.stdout)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"release 1, sha256 {rel['sha256'][:12]}, committed" in out.stdout, out.stdout
        with urllib.request.urlopen(gw.url("/"), timeout=5) as r:
            assert "release 1, sha256" in r.read().decode()
        with urllib.request.urlopen(gw.url("/metrics"), timeout=5) as r:
            metrics = r.read().decode()
        assert "pubcomp_release_version 1.0" in metrics
        assert 'pubcomp_release_events_total{event="committed"} 1.0' in metrics
    finally:
        node.stop()
        audit.stop()
    assert gw.terminate() == 0


def test_a_release_whose_sensor_cannot_read_is_rolled_back_and_marked_bad(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """The trial's sensors gate: a 1-Wire probe with no such device builds (check mode
    passes) but never reads; silence until trial_s is a failure. The gateway goes back to
    what ran (its --config file), marks 1 bad, refuses 1 again, takes 2."""
    audit = Audit(mosquitto.port)
    gw, signer = _gateway(tmp_path, mosquitto.port, trial_s=4.0)
    gw.start()
    probe = {"id": "probe", "type": "ds18b20", "base": str(tmp_path / "no-w1"), "interval_s": 0.5}
    bad = gw.fleet_text(sensors=[COUNTER, probe])
    publish(mosquitto.port, release.release_topic(PREFIX, GID), signer.release(GID, 1, bad))
    rel = gw.wait_release(state="rolled_back", version=None, timeout=60)
    assert rel["bad"] == [1] and "probe" in rel["last_error"], rel
    assert "probe" not in gw.status()["sensors"]  # the --config file's sensors again
    assert not (gw.release_dir / "current").exists()
    want = [(e, 1) for e in ("fetched", "verified", "staged", "switched", "trial")]
    want += [("rolling_back", 1), ("rolled_back", 1)]
    events = audit.wait(*want)
    assert exactly_once(events) == {w: 1 for w in want}, events

    # Its retained copy came again when the gateway reconnected: ignored, not re-applied.
    assert gw.rel()["ignored"] >= 1
    # Bad here: it comes back only as a newer release.
    good = gw.fleet_text(sensors=[COUNTER, SINE])
    publish(mosquitto.port, release.release_topic(PREFIX, GID), signer.release(GID, 2, good))
    rel = gw.wait_release(state="committed", version=2, timeout=60)
    assert rel["bad"] == [1] and rel["previous"] is None
    publish(mosquitto.port, release.release_topic(PREFIX, GID), signer.release(GID, 1, bad))
    assert wait_until(lambda: gw.rel()["ignored"] >= 2, 10)
    assert gw.rel()["state"] == "committed" and gw.rel()["version"] == 2
    audit.stop()
    assert gw.terminate() == 0


def test_a_release_whose_uplink_broker_does_not_answer_is_rolled_back(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """The uplink gate: nothing listens where release 1 sends readings, so nothing is
    delivered in its trial. Back on the old broker, the trial's and the rollback's audit
    readings (committed while the dead broker was configured) reach the cloud once."""
    audit = Audit(mosquitto.port)
    gw, signer = _gateway(tmp_path, mosquitto.port, trial_s=4.0)
    gw.start()
    dead = gw.fleet_text(broker_port=free_port())
    publish(mosquitto.port, release.release_topic(PREFIX, GID), signer.release(GID, 1, dead))
    rel = gw.wait_release(state="rolled_back", version=None, timeout=60)
    assert "uplink" in rel["last_error"], rel
    want = [("trial", 1), ("rolling_back", 1), ("rolled_back", 1)]
    events = audit.wait(*want)
    assert exactly_once(events)[("rolled_back", 1)] == 1
    assert wait_until(lambda: gw.status()["uplink"]["state"] == "connected", 20)
    audit.stop()
    assert gw.terminate() == 0


def test_current_set_back_by_hand_while_stopped_runs_and_is_recorded(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """docs/operations.md, "By hand": the operator stops the gateway, names release 1 in
    ``current`` and starts it. Release 1 runs, the state follows (``set_by_hand``, told
    to the cloud once, said in the status), and the retained release 2, the newest
    applied here, is not taken again (same-version: no news, not a refusal)."""
    audit = Audit(mosquitto.port)
    gw, signer = _gateway(tmp_path, mosquitto.port, trial_s=10.0)
    gw.start()
    try:
        topic = release.release_topic(PREFIX, GID)
        publish(mosquitto.port, topic, signer.release(GID, 1, gw.fleet_text()))
        gw.wait_release(state="committed", version=1, timeout=60)
        publish(mosquitto.port, topic, signer.release(GID, 2, gw.fleet_text(sensors=[SINE])))
        gw.wait_release(state="committed", version=2, timeout=60)
        assert gw.terminate() == 0
        (gw.release_dir / "current.new").write_text("1\n")
        (gw.release_dir / "current.new").rename(gw.release_dir / "current")
        gw.start()
        rel = gw.wait_release(state="committed", version=1, timeout=30)
        assert "current was set to 1 by hand (the state said 2)" in rel["last_error"], rel
        assert set(gw.status()["sensors"]) == {"counter"}  # release 1's
        audit.wait(("set_by_hand", 1))
        assert exactly_once(audit.events())[("set_by_hand", 1)] == 1
        # The retained release 2 came at the connection: ignored, never refused or applied.
        assert wait_until(lambda: gw.rel()["ignored"] >= 1, 20), gw.rel()
        assert gw.rel()["refused"] == {} and gw.rel()["version"] == 1
        assert (gw.release_dir / "current").read_text() == "1\n"
    finally:
        audit.stop()
    assert gw.terminate() == 0


def test_switches_keep_the_gateway_online_at_the_broker(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Four releases, each a re-execution: before each, the status says ``switched``
    (the goodbye, sent whole), the stop's DISCONNECT reaches the broker, and no offline
    message (the Will) ever appears, so a rollout never sees the gateway leave. Seen
    failing (a Will at about one switch in six) while paho-mqtt's keepalive check could
    close the socket with the DISCONNECT still queued (gateway/fleetstatus.py)."""
    watcher = StatusWatcher(mosquitto.port)
    gw, signer = _gateway(tmp_path, mosquitto.port)
    gw.start()
    try:
        for v in range(1, 5):
            text = gw.fleet_text(sensors=[COUNTER, SINE] if v % 2 else [COUNTER])
            publish(
                mosquitto.port, release.release_topic(PREFIX, GID), signer.release(GID, v, text)
            )
            gw.wait_release(state="committed", version=v, timeout=90)
        said = watcher.all(GID)
        offline = [(m["reason"], m["id"]) for m in said if not m["online"]]
        assert offline == [], offline
        runs = {m["id"].split("/")[0] for m in said}
        switched = {
            m["id"].split("/")[0]
            for m in said
            if (m.get("release") or {}).get("state") == "switched"
        }
        assert len(runs) == 5 and len(switched) == 4, said  # each process but the last
        assert "chore" not in gw.tail(200_000), gw.tail()  # no chore "died" at a stop
    finally:
        watcher.close()
    assert gw.terminate() == 0
    # The broker's own word: every status connection ended with a DISCONNECT.
    assert f"{GID}-status closed its connection" not in mosquitto.log_path.read_text()


def test_a_sigterm_during_a_switch_stops_the_gateway_instead_of_starting_it_again(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """``systemctl stop`` while the gateway stops to re-execute into a release: it must
    end, not start again (systemd would wait, then SIGKILL it). A slow link (0.5 s each
    way) keeps the switch's stop open long enough to be hit: its goodbye waits a round
    trip for its PUBACK. The next start takes the release on where its state says (a
    trial, then the commit). Old code: the signal only set the stop already set, and the
    process re-executed and ran on (a CI teardown waited 30 s for it)."""
    link = SlowLink(mosquitto.port, delay=0.5)
    gw, signer = _gateway(tmp_path, link.port)
    gw.start()
    try:
        text = gw.fleet_text(sensors=[COUNTER, SINE])
        publish(mosquitto.port, release.release_topic(PREFIX, GID), signer.release(GID, 1, text))
        assert wait_until(lambda: "release 1: switched; the gateway starts" in gw.tail(), 60)
        assert gw.terminate() == 0, gw.tail()
        log = gw.tail(20_000)
        assert "SIGTERM during the" in log and "re-executing" not in log, log
        gw.start()
        rel = gw.wait_release(state="committed", version=1, timeout=90)
        assert "sine" in gw.status()["sensors"] and rel["bad"] == []
    finally:
        link.close()
    assert gw.terminate() == 0
