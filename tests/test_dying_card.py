"""A dying card: the store's file system turns read-only, or fails its writes with EIO,
while nodes publish (devkit/powercut: ``readonly``, ``eio``, ``heal``).

The gateway must refuse new data (no PUBACK, so the nodes keep their messages), keep
delivering what the store holds (degraded session ``<id>-ro``, QoS 1), say so in its
status, and never acknowledge a reading it could not write. At the end: every
acknowledged reading reached the cloud, nothing arrived that no node sent or no commit
witnessed, and the only duplicates at the cloud are readings the degraded session sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from devkit.broker import Mosquitto, free_port
from devkit.checker import Checker
from devkit.gateway_helpers import GatewayProc, PahoNode
from devkit.link import LinkProxy
from devkit.node_helpers import wait_until
from devkit.powercut import PowerCutMount, fuse_missing
from devkit.store_helpers import append, append_batches, apply, begin
from pubcomp.gateway import commitlog
from pubcomp.gateway.commands import EXIT_STORE_UNWRITABLE
from pubcomp.gateway.status import verdict
from pubcomp.sync.client import ConnectOptions
from pubcomp.sync.degraded import DegradedDelivery
from pubcomp.sync.session import OutState
from pubcomp.sync.store import (
    IO_ERRORS,
    READ_ONLY,
    Message,
    Reading,
    Store,
    StoreUnwritable,
)
from pubcomp.sync.store import files as store_files
from pubcomp.sync.uplink import Uplink, UplinkConfig

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[PowerCutMount]:
    with PowerCutMount(tmp_path / "backing", tmp_path / "disk") as d:
        yield d


def acked(nodes: list[PahoNode]) -> set[str]:
    return set().union(*(n.reading_ids() for n in nodes))


def ts_us(ts: str) -> int:
    t = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    return int(t.timestamp()) * 1_000_000 + t.microsecond


@pytest.mark.parametrize(
    ("fault", "headline"), [("readonly", "STORE READ-ONLY"), ("eio", "STORE WRITES FAIL")]
)
def test_a_dying_card_refuses_new_readings_and_delivers_what_it_holds(
    tmp_path: Path, disk: PowerCutMount, mosquitto: Mosquitto, fault: str, headline: str
) -> None:
    link = LinkProxy(mosquitto.port)
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id=f"dying-{fault}").start()
    sensors = [{"id": "counter", "type": "simulated", "signal": "counter", "interval_s": 0.2}]
    commits = tmp_path / "commits.jsonl"
    witness = {"store": {"commit_log": str(commits)}}
    nodes = {"n1": "pw-1", "n2": "pw-2"}
    gw = GatewayProc(tmp_path, link.port, sensors=sensors, nodes=nodes, extra=witness)
    gw.db = disk.path / "state" / "gateway.db"
    gw.write()
    gw.start()
    nodes = [PahoNode(n, f"pw-{i}", gw.ingress_port).start() for i, n in ((1, "n1"), (2, "n2"))]
    try:
        assert wait_until(lambda: len(acked(nodes)) >= 60, 30)
        # The uplink goes down first, so the store holds a backlog when the card fails.
        link.down()
        before = len(acked(nodes))
        assert wait_until(lambda: len(acked(nodes)) >= before + 60, 30)
        assert wait_until(lambda: gw.status()["uplink"]["backlog"] >= 60, 30)

        getattr(disk, fault)()
        # A message whose commit returned before the fault may still get its PUBACK: at
        # most one per node (one in flight each). After that, none at all.
        assert wait_until(lambda: not gw.status()["store"]["writable"], 30), gw.status()
        at_fault = acked(nodes)
        counts_fault = Counter(checker.counts)  # the link is down: nothing more arrives
        st = gw.status()
        assert st["healthy"] is False
        link.up()  # the main session cannot advance: degraded delivery sends the backlog
        assert wait_until(lambda: at_fault <= checker.counts.keys(), 60), (
            f"held readings not delivered while {fault}: {gw.status()['uplink']['degraded']}"
        )
        counts_a = Counter(checker.counts)
        st = gw.status()
        up, store = st["uplink"], st["store"]
        assert up["degraded"]["active"], up
        assert up["degraded"]["delivered_while_unwritable"] >= 60
        assert st["intake"]["refused_unwritable"] >= 1 or any(
            d["rejected"].get("store_unwritable") for d in st["nodes"].values()
        ), st
        # The sensor's readings wait up to store.sensor_delay_ms (1 s) for a commit.
        assert wait_until(
            lambda: gw.status()["intake"]["sensor_readings_refused_unwritable"] >= 1, 30
        ), gw.status()["intake"]
        assert store["write_errors"] >= 1
        with_no_acks = acked(nodes)
        assert len(with_no_acks - at_fault) <= 2, "PUBACKs went on after the store failed"
        level, head, code = verdict(st)
        assert level == "unhealthy" and code == 1 and head.startswith(headline), head
        assert "refusing new readings; delivering the" in head and "(not durable)" in head
        with urllib.request.urlopen(gw.url("/metrics"), timeout=5) as r:
            metrics = r.read().decode()
        assert "pubcomp_store_writable 0.0" in metrics
        assert "pubcomp_store_write_errors_total" in metrics

        disk.heal()
        assert wait_until(lambda: gw.status()["store"]["writable"], 30)
        assert wait_until(lambda: gw.status()["uplink"]["state"] == "connected", 30)
        after = len(acked(nodes))
        assert wait_until(lambda: len(acked(nodes)) >= after + 30, 30), "acks did not resume"
    finally:
        for n in nodes:
            n.stop()
    every_ack = acked(nodes)
    assert gw.terminate() == 0
    gw.sensors = []  # quiet: the backlog can drain to 0
    gw.write()
    gw.start()

    def drained() -> bool:
        up = gw.status()["uplink"]
        return up["backlog"] == 0 and up["inflight_messages"] == 0

    assert wait_until(drained, 60), gw.status()["uplink"]
    assert wait_until(lambda: every_ack <= checker.counts.keys(), 30)
    gw.terminate()
    counts = Counter(checker.counts)
    readings = dict(checker.readings)
    checker.stop()

    missing = every_ack - counts.keys()
    assert not missing, f"{len(missing)} acknowledged readings never arrived"
    witness = commitlog.read(commits)
    claimed = set()
    for rid in counts:
        if rid.startswith(("n1/", "n2/")):
            if rid not in every_ack:
                claimed.add(rid)
        else:
            sensor, ts, _ = readings[rid]
            if sensor.startswith("$"):
                continue  # the gateway's own record ($ledger, issue 27), not a sensor's
            if (gw.gid, sensor, ts_us(ts)) not in witness:
                claimed.add(rid)
    assert not claimed, f"readings nobody acknowledged or witnessed: {sorted(claimed)[:5]}"
    dups = {rid for rid, n in counts.items() if n > 1}
    degraded = {rid for rid, n in counts_a.items() if n > counts_fault[rid]}
    odd = sorted(dups - degraded)[:5]
    assert dups <= degraded, f"duplicates not sent by degraded delivery: {odd}"
    assert dups, "degraded delivery's readings are sent again by the resumed QoS 2 session"


LEAVE_WAL = """
import os, sys
from pubcomp.sync.store import Reading, Store
s = Store(sys.argv[1], gateway_id=sys.argv[2])
batch = [Reading("t", float(i), "2026-11-21T00:00:00.000Z", "C") for i in range(25)]
s.commit(lambda db: s.append_in(db, batch))
print(s.epoch, flush=True)
os._exit(0)  # a crash: the WAL and its shared-memory file stay beside the store
"""


@pytest.mark.parametrize(
    ("fault", "left", "headline"),
    [("readonly", "closed", "STORE READ-ONLY"), ("eio", "crashed", "STORE WRITES FAIL")],
)
def test_a_gateway_started_on_a_dying_card_delivers_what_the_store_holds_and_moves_nothing(
    tmp_path: Path, disk: PowerCutMount, mosquitto: Mosquitto, fault: str, left: str, headline: str
) -> None:
    """Started on a card that already refuses writes, the gateway opens its store
    read-only and delivers what it holds on the degraded session, acknowledges nothing
    new, says so in its status, and moves nothing aside (it once took the open's error
    for corruption, then exited). When the card heals, it opens the store for writing,
    resumes its QoS 2 session and takes readings again.

    ``closed``: a store closed cleanly (no WAL: read with ``immutable=1``); ``crashed``: a
    process that died with the WAL beside the store (read with ``mode=ro``)."""
    db = disk.path / "state" / "gateway.db"
    gw = GatewayProc(tmp_path, mosquitto.port, nodes={"n1": "pw-1"})
    if left == "closed":
        with Store(db, gateway_id=gw.gid) as s:
            append(s, [Reading("t", float(i), "2026-11-21T00:00:00.000Z", "C") for i in range(25)])
            epoch = s.epoch
    else:
        out = subprocess.run(
            [sys.executable, "-c", LEAVE_WAL, str(db), gw.gid],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        epoch = out.stdout.strip()
        assert Path(f"{db}-wal").stat().st_size > 0
    held = {f"{gw.gid}/{epoch}/{seq}" for seq in range(1, 26)}
    before = sorted(p.name for p in db.parent.iterdir())
    checker = Checker(mosquitto.port, topic="telemetry/#", client_id=f"held-{fault}").start()
    gw.db = db
    gw.write()
    getattr(disk, fault)()
    gw.start(wait=False)
    node: PahoNode | None = None
    try:
        assert wait_until(lambda: held <= checker.counts.keys(), 60), gw.log.read_text()[-3000:]
        st = gw.status()
        level, head, code = verdict(st)
        assert level == "unhealthy" and code == 1 and head.startswith(headline), head
        assert st["uplink"]["degraded"]["delivered_while_unwritable"] >= 25, st["uplink"]
        assert "opened the store read-only" in gw.log.read_text()
        # A node's messages are refused (no PUBACK: the node keeps them) while held.
        node = PahoNode("n1", "pw-1", gw.ingress_port).start()
        assert wait_until(
            lambda: gw.status()["nodes"]["n1"]["rejected"].get("store_unwritable", 0) >= 1, 30
        ), gw.status()["nodes"]
        assert node.acked == []
        assert sorted(p.name for p in db.parent.iterdir()) == before  # nothing moved aside

        disk.heal()
        assert wait_until(lambda: gw.status()["store"]["writable"], 30), gw.status()["store"]
        assert wait_until(lambda: len(node.acked) >= 5, 30), "acks did not resume"
        acked_ids = node.reading_ids()  # (the node goes on publishing: no drained backlog)
        assert wait_until(lambda: acked_ids <= checker.counts.keys(), 60), gw.status()["uplink"]
    finally:
        if node is not None:
            node.stop()
        checker.stop()
    assert gw.terminate() == 0
    assert not any(".corrupt-" in p.name for p in db.parent.iterdir())
    with Store(db) as s:
        assert s.epoch == epoch  # the same store, written again: not a new one
    # The held readings: delivered while held, and again by the resumed QoS 2 session
    # (the cloud dedups by id); nothing else twice.
    dups = {rid for rid, n in checker.counts.items() if n > 1}
    assert dups <= held, sorted(dups - held)[:5]


def test_a_store_on_a_card_that_cannot_even_be_read_at_start_is_not_held(
    tmp_path: Path, disk: PowerCutMount
) -> None:
    """No store file on a read-only card (a fresh install, a wiped card): nothing to
    deliver, so ``gateway run`` says why in one line and exits EX_TEMPFAIL for systemd to
    try again, as before; nothing is created or moved."""
    (disk.path / "state").mkdir()
    db = disk.path / "state" / "gateway.db"
    gw = GatewayProc(tmp_path, free_port())
    gw.db = db
    gw.write()
    disk.readonly()
    gw.start(wait=False)
    assert gw.proc is not None
    rc = gw.proc.wait(60)
    log = gw.log.read_text()
    assert rc == EXIT_STORE_UNWRITABLE, log
    assert "cannot open the store" in log and "nothing was moved" in log, log
    assert "Traceback" not in log, log
    disk.heal()
    assert list(db.parent.iterdir()) == []


def test_a_held_store_reads_refuses_writes_and_opens_for_writing_once_the_card_heals(
    disk: PowerCutMount, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store under the gateway above: a crashed writer's WAL on a card failing with
    EIO is read from a copy in memory; every write is refused (counted); after the heal
    the next write opens the file for writing, the copy is dropped, the epoch is kept."""
    monkeypatch.setattr(store_files, "REOPEN_EVERY_S", 0.0)  # try at every write
    db = disk.path / "s.db"
    subprocess.run([sys.executable, "-c", LEAVE_WAL, str(db), "gw"], check=True, timeout=60)
    disk.eio()
    with pytest.raises(StoreUnwritable):
        Store(db)  # not asked to hold: the error, as before
    s = Store(db, hold_if_unwritable=True)
    try:
        assert s.held and not s.write_state.writable and s.write_state.kind == IO_ERRORS
        copy = s.held_copy
        assert copy is not None and copy.is_dir()
        rows = s.waiting_rows(0, 100)
        assert sum(n for _, n, _ in rows) == 25 and s.stats()["backlog"] == 25
        errors = s.write_state.errors
        with pytest.raises(StoreUnwritable):
            append(s, [Reading("t", 99.0, "2026-11-21T00:00:00.000Z", "C")])
        assert s.write_state.errors == errors + 1 and s.held
        disk.heal()
        first, last = append(s, [Reading("t", 99.0, "2026-11-21T00:00:00.000Z", "C")])
        assert (first, last) == (26, 26)  # ids go on from the held store's: no seq reused
        assert not s.held and s.write_state.writable and not copy.exists()
        assert s.stats()["backlog"] == 26
        epoch = s.epoch
    finally:
        s.close()
    with Store(db) as again:
        assert again.epoch == epoch and again.stats()["backlog"] == 26


def test_degraded_delivery_sends_only_what_the_store_held_when_the_card_failed(
    disk: PowerCutMount, mosquitto: Mosquitto
) -> None:
    """Rows committed after the card heals (the commit that proves it, a node's message
    right after) belong to the QoS 2 session alone: the degraded session's read
    connection sees them before its loop sees the store writable, and once sent them
    as copies (CI: ``test_a_gateway_started_on_a_dying_card...[eio]`` got a node's
    readings twice). Here the card heals and 5 readings are committed while the degraded
    session is sending its first message: seen failing (they went out on it)."""
    with Store(disk.path / "s.db", gateway_id="gw-ro") as s:
        held = append(s, [Reading("t", i, "2026-11-21T00:00:00.000Z", "C") for i in range(20)])
        disk.eio()
        with pytest.raises(StoreUnwritable):
            append(s, [Reading("t", -1.0, "2026-11-21T00:00:00.000Z", "C")])
        up = Uplink(s, f"mqtt://127.0.0.1:{mosquitto.port}", ConnectOptions("gw-ro"),
                    UplinkConfig(batch=2))  # fmt: skip
        late: list[tuple[int, int]] = []
        encoded = []

        def encode(bodies: list[bytes]) -> bytes:
            encoded.append(len(bodies))
            if not late:  # the card heals and a node's message is committed meanwhile
                disk.heal()
                late.append(append(s, [Reading("t", 100.0 + i, "2026-11-21T00:00:01.000Z", "C")
                                       for i in range(5)]))  # fmt: skip
            return up.degraded.link.encode(bodies)

        link = dataclasses.replace(up.degraded.link, encode=encode)
        degraded = DegradedDelivery(s, up.commits, link, lambda _: None, probe_every=60)
        checker = Checker(mosquitto.port, topic="telemetry/#", client_id="ro-check").start()
        try:
            asyncio.run(asyncio.wait_for(degraded.run(asyncio.Event()), 60))
            assert late and s.write_state.writable
            assert wait_until(lambda: checker.messages >= len(encoded), 30), checker.messages
        finally:
            checker.stop()
    first, last = held
    late_ids = {f"gw-ro/{s.epoch}/{q}" for q in range(late[0][0], late[0][1] + 1)}
    got = set(checker.counts)
    assert got, "the degraded session sent nothing"
    assert got <= {f"gw-ro/{s.epoch}/{q}" for q in range(first, last + 1)}
    assert not got & late_ids, sorted(got & late_ids)


@pytest.mark.parametrize(("fault", "kind"), [("readonly", READ_ONLY), ("eio", IO_ERRORS)])
def test_writes_outside_the_group_commit_say_unwritable_too(
    disk: PowerCutMount, fault: str, kind: str
) -> None:
    """Readings committed outside the group commit (``Store.commit``: store import, the
    standalone uplink's producers), with or without message keys, classify a refusing
    card as the group commit does: StoreUnwritable, recorded in the write state, cleared
    by the next write that succeeds."""

    def batch(i: int) -> list[Reading]:
        return [Reading("t", float(i), "2026-11-21T00:00:00.000Z", "C")]

    with Store(disk.path / "s.db", gateway_id="gw") as s:
        append(s, batch(0))
        getattr(disk, fault)()
        with pytest.raises(StoreUnwritable) as one:
            append(s, batch(1))
        with pytest.raises(StoreUnwritable) as two:
            append_batches(s, [("n/1/1", batch(2))])
        assert one.value.kind == two.value.kind == kind
        assert not s.write_state.writable and s.write_state.errors == 2
        disk.heal()
        first, last = append(s, batch(3))
        assert last == first > 1 and s.write_state.writable
        assert s.stats()["backlog"] == 2  # the refused ones were never stored


@pytest.mark.parametrize(("fault", "kind"), [("readonly", READ_ONLY), ("eio", IO_ERRORS)])
def test_every_write_path_of_the_store_says_unwritable(
    disk: PowerCutMount, fault: str, kind: str
) -> None:
    """Not only the readings: every op of the session, committed outside the group
    commit (tools, the standalone uplink's tests), fails on a refusing card as
    StoreUnwritable, each counted in the write state, never as a bare sqlite3 error that
    leaves the store looking writable."""

    def reading(i: int) -> Reading:
        return Reading("t", float(i), "2026-11-21T00:00:00.000Z", "C")

    with Store(disk.path / "s.db", gateway_id="gw") as s:
        append(s, [reading(i) for i in range(4)])
        begin(s, "k", [Message(0, 1, 2, Q, "t", 1, 2)])
        append_batches(s, [("n/1/1", [reading(9)])])  # a node's key, for prune_seen
        getattr(disk, fault)()  # (every write below changes rows: an empty one writes nothing)
        writes: list[tuple[str, Callable[[], object]]] = [
            ("begin_messages", lambda: begin(s, "k", [Message(0, 2, 2, Q, "t", 3, 4)])),
            ("apply", lambda: apply(s, "k", completed=[1])),
            ("requeue_lost", lambda: s.commit(lambda db: s.requeue_lost_in(db, "k"), frees=True)),
            (
                "adopt_orphans",
                lambda: s.commit(lambda db: s.adopt_orphans_in(db, "other"), frees=True),
            ),
            ("session_started", lambda: s.commit(lambda db: s.session_started_in(db, "k"))),
            ("prune_seen", lambda: s.commit(lambda db: s.prune_seen_in(db, 0))),
            ("probe_write", lambda: s.commit(s.probe_write_in)),
        ]
        for errors, (name, write) in enumerate(writes, 1):
            with pytest.raises(StoreUnwritable) as refused:
                write()
            assert refused.value.kind == kind, name
            assert s.write_state.errors == errors and not s.write_state.writable, name
        disk.heal()
        assert apply(s, "k", completed=[1]) == 4  # nothing of the refused ones took (one row)
        assert s.write_state.writable and s.stats()["backlog"] == 1


Q = OutState.QUEUED
