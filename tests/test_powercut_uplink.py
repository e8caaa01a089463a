"""Power cuts, not kills, at each break point of the uplink's QoS 2 handshake.

tests/test_uplink_crashes.py kills the uplink (SIGKILL) at each named point of
sync/faults.py; a kill leaves the page cache to the restarted process, so an
uplink that forgot an fsync would pass it. Here the store lives on the power-cut
file system (devkit/powercut): the uplink kills itself at the point, then the power
goes (everything not fsynced is dropped) and the uplink starts again from what was
durable. Each test asserts:

- the crash happened at the intended point (the marker faults.py writes);
- what the handshake had committed before the point survived the cut: the packet
  ids before the PUBLISH (design rule 1), the PUBREC before the PUBREL (rule 2);
- the resumed connection first resends, in original order, a PUBREL for every
  message whose PUBREC was committed and a PUBLISH with DUP=1 and the same id for
  every other one, and never a PUBLISH after its PUBREL (read from the cloud
  Mosquitto's own log, ``log_type all``);
- every reading the store had committed reaches an independent paho subscriber
  exactly once per reading id, counted before any dedup;
- the cloud Mosquitto never logged "Reused message ID" (a packet id reused while
  the broker still held it: it drops the new message).

MQTT statements enforced (3.1.1 / 5.0 ids, /work/shared/mqtt-normative.md):
MQTT-2.3.1-2 / 5.0 MQTT-2.2.1-3 (a new PUBLISH gets an id not in use), MQTT-2.3.1-3
(a resend keeps its id), MQTT-3.3.1-1 (DUP=1 on a resend), MQTT-4.3.3-1 / 5.0
MQTT-4.3.3-6 (no PUBLISH resent after its PUBREL), MQTT-4.4.0-1 (on reconnect with
the session present, resend unacknowledged PUBLISH and PUBREL with their original
ids), MQTT-4.6.0-1 (resend in the original order), and through the broker
MQTT-4.3.3-2 / 5.0 MQTT-4.3.3-10 (a repeated PUBLISH before PUBREL is not
delivered twice).
"""

from __future__ import annotations

import json
import re
import signal
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.broker import Mosquitto
from devkit.checker import Checker, exactly_once_report
from devkit.gateway_helpers import GatewayProc
from devkit.node_helpers import wait_until
from devkit.powercut import PowerCutMount, fuse_missing
from devkit.uplink_helpers import fill_store, inflight_rows, run_uplink, summary

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))

# Every uplink point of sync/faults.py (the others are the ingest's and the pipeline's),
# with the state its message must hold in the store after the cut: the last commit the
# handshake made before that point.
POINTS = {
    "publish_persisted": "PUBLISH_SENT",  # rule 1: ids committed before the PUBLISH
    "publish_written": "PUBLISH_SENT",
    "pubrec_received": "PUBLISH_SENT",  # the PUBREC not committed yet: PUBLISH again
    "pubrel_written": "PUBREL_SENT",  # rule 2: the PUBREC committed before the PUBREL
    "pubcomp_received": "PUBREL_SENT",  # the deletion rides a later commit (rule 3)
}
PROTOCOLS = {"mqtt5": "5", "mqtt311": "3.1.1"}
CLIENT = "gw1"

_CONNECTED = re.compile(r"New client connected from \S+ as (\S+) \(p\d+, c(\d)")
_RECEIVED = re.compile(
    r"Received (PUBLISH|PUBREL) from (\S+) \((?:d(\d), q\d, r\d, m(\d+)|Mid: (\d+))"
)


Packet = tuple[str, int, int | None]  # ("PUBLISH", id, DUP) or ("PUBREL", id, None)


def broker_trace(log: str, client: str) -> list[tuple[bool, list[Packet]]]:
    """What the broker received from ``client``: for each connection, its clean start
    flag and the PUBLISH and PUBREL packets, in order."""
    conns: list[tuple[bool, list[Packet]]] = []
    for line in log.splitlines():
        if (m := _CONNECTED.search(line)) and m.group(1) == client:
            conns.append((m.group(2) == "1", []))
        elif (m := _RECEIVED.search(line)) and m.group(2) == client and conns:
            kind, dup, pid_pub, pid_rel = m.group(1, 3, 4, 5)
            if kind == "PUBLISH":
                conns[-1][1].append(("PUBLISH", int(pid_pub), int(dup)))
            else:
                conns[-1][1].append(("PUBREL", int(pid_rel), None))
    return conns


def check_resume(resumed: list[Packet], survivors: list[tuple[int | None, str]]) -> None:
    """MQTT-4.4.0-1, MQTT-4.6.0-1, MQTT-2.3.1-3, MQTT-3.3.1-1: the resumed connection
    begins with the in-flight messages that survived the cut, in their original order,
    with their ids: a PUBREL where the PUBREC was committed (never the PUBLISH again:
    MQTT-4.3.3-1 / 5.0 MQTT-4.3.3-6), else the PUBLISH with DUP=1. New PUBLISHes after
    them carry DUP=0 (MQTT-3.3.1-3)."""
    resend: list[Packet] = [
        ("PUBREL", pid, None) if state == "PUBREL_SENT" else ("PUBLISH", pid, 1)
        for pid, state in survivors
        if pid is not None
    ]
    assert resend and resumed[: len(resend)] == resend, (resend, resumed[: len(resend) + 5])
    new = [p for p in resumed[len(resend) :] if p[0] == "PUBLISH"]
    assert all(dup == 0 for _, _, dup in new), "a new PUBLISH marked DUP"


@pytest.fixture(params=["strict", "writeback"])
def disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PowerCutMount]:
    """Each case in both power-cut models: the strict one (only what was fsynced survives)
    and writeback (a seeded subset of the unsynced pages too, some torn, holes reading as
    zeros: what SQLite's WAL checksums are for), the seed fixed per case."""
    seed = zlib.crc32(request.node.nodeid.encode()) if request.param == "writeback" else None
    with PowerCutMount(tmp_path / "backing", tmp_path / "disk", writeback=seed) as d:
        yield d


@pytest.fixture
def cloud(tmp_path: Path) -> Iterator[Mosquitto]:
    """The cloud broker, logging every packet (the trace the resume is checked against)."""
    broker = Mosquitto(tmp_path / "broker", extra_config="log_type all\n").start()
    yield broker
    broker.kill()


@pytest.mark.parametrize("protocol", list(PROTOCOLS.values()), ids=list(PROTOCOLS))
@pytest.mark.parametrize("point", list(POINTS))
def test_power_cut_at_break_point_then_resume_exactly_once(
    tmp_path: Path, disk: PowerCutMount, cloud: Mosquitto, point: str, protocol: str
) -> None:
    checker = Checker(cloud.port, "telemetry/#", client_id="cut-checker").start()
    store = disk.path / "gw.db"
    marker = tmp_path / "crash-marker"  # off the cut disk
    args = ("--protocol", protocol, "--batch", "10")
    try:
        # A warm session, as a gateway has it: established at the broker, ids in use
        # not starting at 1. Then more readings (committed: append returns after fsync).
        expected = fill_store(store, 300, gateway=CLIENT)
        warm = run_uplink(store, cloud.url, *args)
        assert warm.returncode == 0 and summary(warm)["backlog"] == 0, warm.stderr[-3000:]
        expected |= fill_store(store, 600, gateway=CLIENT)

        first = run_uplink(store, cloud.url, *args, crash_at=f"{point}:3", marker=marker)
        assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
        assert marker.read_text().split() == [point], "crashed somewhere else"
        disk.cut()  # the power goes: the page cache (the FUSE process's memory) with it
        survivors = inflight_rows(store)
        assert POINTS[point] in {state for _, state in survivors}, survivors

        # Batches of 7 now: the messages in flight keep their readings, new ones differ,
        # so a packet id reused for a new message carries another payload, which
        # Mosquitto logs as "Reused message ID" (an identical one it takes as a resend).
        second = run_uplink(store, cloud.url, "--protocol", protocol, "--batch", "7")
        assert second.returncode == 0, second.stderr[-3000:]
        assert summary(second)["backlog"] == 0
        assert summary(second)["resent_after_session_loss"] == 0  # resumed, not requeued
        counts = checker.wait_for(expected, 30)
    finally:
        checker.stop()

    report = exactly_once_report(counts, expected)
    assert report["missing"] == 0, report  # every committed reading
    assert report["duplicated"] == 0, report  # once per reading id, before any dedup
    assert report["unexpected"] == 0, report
    log = cloud.log()
    assert "Reused message ID" not in log

    trace = broker_trace(log, CLIENT)
    # A new store clears any stale session first (clean start, nothing sent), then
    # every connection keeps the session: warm, cut, resumed.
    assert [clean for clean, _ in trace] == [True, False, False, False], trace
    assert trace[0][1] == []
    check_resume(trace[3][1], survivors)


@pytest.mark.parametrize("point", list(POINTS))
def test_gateway_power_cut_at_break_point_delivers_each_committed_reading_once(
    tmp_path: Path, disk: PowerCutMount, cloud: Mosquitto, point: str
) -> None:
    """The same cut inside a real gateway: a sensor commits readings through the group
    commit the uplink shares (its transitions may wait there for company); after a warm
    run, the uplink crashes at the point and the power goes. Every reading the commit log
    witnessed (written after each commit returned) reaches the subscriber once, under
    one id, and the first connection after the cut resumes the session (the statements
    of the module docstring: MQTT-4.4.0-1, 4.6.0-1, 2.3.1-2/-3, 3.3.1-1, 4.3.3-1 and
    5.0 MQTT-2.2.1-3, 4.3.3-6)."""
    checker = Checker(cloud.port, "telemetry/#", client_id="gw-cut-checker").start()
    sensors = [{"id": "count", "type": "simulated", "signal": "counter", "interval_s": 0.02}]
    witness = tmp_path / "commits.jsonl"  # off the cut disk
    store = {"sensor_delay_ms": 100, "commit_log": str(witness)}
    extra = {"uplink": {"batch": 10, "linger_ms": 50}, "store": store}
    gw = GatewayProc(tmp_path, cloud.port, sensors=sensors, extra=extra)
    gw.db = disk.path / "state" / "gateway.db"
    gw.write()
    marker = tmp_path / "crash-marker"
    try:
        gw.start()  # warm: the session established, ids in use
        assert wait_until(lambda: gw.status()["uplink"]["delivered"] >= 50, 60), "warm run"
        assert gw.terminate() == 0
        crash = {"PUBCOMP_CRASH_AT": f"{point}:5", "PUBCOMP_CRASH_MARKER": str(marker)}
        gw.start(crash, wait=False)  # it may crash before its health server is up
        assert gw.proc is not None
        assert gw.proc.wait(60) == -signal.SIGKILL, gw.log.read_text()[-3000:]
        assert marker.read_text().split() == [point], "crashed somewhere else"
        disk.cut()
        survivors = inflight_rows(gw.db)
        assert POINTS[point] in {state for _, state in survivors}, survivors
        at_cut = len(cloud.log())

        gw.start()  # the sensor goes on; the uplink resumes the session
        assert wait_until(lambda: gw.status()["uplink"]["delivered"] >= 100, 60), "resumed"
        assert gw.terminate() == 0
        gw.sensors = []  # quiet, so the committed set is final and the backlog can reach 0
        gw.write()
        gw.start()
        assert wait_until(
            lambda: (u := gw.status()["uplink"])["backlog"] == 0 and u["inflight_messages"] == 0,
            60,
        ), gw.status()["uplink"]
        assert gw.terminate() == 0
        committed = {
            (r["sensor"], r["ts"], r["value"])
            for r in map(json.loads, witness.read_text().splitlines())
        }

        def delivered() -> dict[str, tuple[Any, ...]]:
            return checker.readings_seen(f"{gw.gid}/")

        arrived = wait_until(lambda: committed <= set(delivered().values()), 30)
        lost = committed - set(delivered().values())
        assert arrived, f"{len(lost)} committed readings never arrived: {sorted(lost)[:3]}"
        counts = checker.wait_for(set(delivered()), 10)
    finally:
        checker.stop()

    got = delivered()
    assert len(committed) > 100
    assert committed <= set(got.values()), "a committed reading never arrived"
    assert {k for k, n in counts.items() if n != 1} == set(), "a duplicate before any dedup"
    assert len(set(got.values())) == len(got), "a reading delivered under two ids"
    log = cloud.log()
    assert "Reused message ID" not in log
    trace = broker_trace(log[at_cut:], gw.gid)
    assert trace and not any(clean for clean, _ in trace), "the session was not resumed"
    check_resume(trace[0][1], survivors)
