"""The gateway's ledger end to end (issue 27, part 2): a real ``pubcomp gateway run``, a
real Mosquitto, real SQLite (on the power-cut file system for the cuts), nodes as paho
clients or the firmware's host port, and the ``$ledger`` records counted by the
independent paho checker (devkit/checker.py), which knows nothing of pubcomp.

What each test holds the records to: every position of a stream is landed or told
(held, skipped, evicted, refused, dropped on the node), and nothing is told twice.
On the code before the ledger no record arrives at all: each test fails waiting for
the record it names."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.broker import Mosquitto
from devkit.checker import Checker
from devkit.gateway_helpers import GatewayProc, PahoNode
from devkit.link import LinkProxy
from devkit.node_helpers import NodeProc, node_config, wait_until
from devkit.powercut import PowerCutMount, fuse_missing
from pubcomp.sync.ranges import RangeSet
from pubcomp.sync.wire import wire_time

GID = "gw-ledger"
COUNTER = {"id": "counter", "type": "simulated", "signal": "counter", "interval_s": 0.1}


def ledger_gateway(tmp: Path, cloud_port: int, **kw: Any) -> GatewayProc:
    """A gateway that sends a record every second and lets readings go at the broker's
    PUBCOMP (no ingest needed: the checker is the cloud)."""
    extra = {"ledger": {"interval_s": 1}, "uplink": {"end_to_end": False}}
    for k, v in kw.pop("extra", {}).items():
        extra[k] = extra.get(k, {}) | v
    return GatewayProc(tmp, cloud_port, gid=GID, extra=extra, **kw)


def cloud(port: int) -> Checker:
    return Checker(port, topic="telemetry/#", client_id="ledger-checker").start()


def records(checker: Checker) -> list[dict[str, Any]]:
    """The records delivered, oldest first (by their store seq)."""
    seen = checker.records_seen()
    return [seen[k] for k in sorted(seen, key=lambda k: (k.split("/")[1], int(k.split("/")[2])))]


def ranges_of(rec: dict[str, Any], stream: str, kind: str) -> list[list[int]]:
    """One kind's ranges of one stream in a record, whatever its shape."""
    got = rec["streams"].get(stream, {}).get(kind)
    if got is None:
        return []
    if isinstance(got, dict):  # refused, node_dropped: per reason
        return [r for rs in got.values() for r in rs]
    if got and isinstance(got[0], dict):  # evicted, dead_letter: per time
        return [r for e in got for r in e["ranges"]]
    return list(got)


def told(recs: Iterable[dict[str, Any]], stream: str, kind: str) -> RangeSet:
    """Every position told under ``kind`` across the records; told twice fails."""
    out, n = RangeSet(), 0
    for rec in recs:
        for lo, hi in ranges_of(rec, stream, kind):
            out.add(lo, hi)
            n += hi - lo + 1
    assert out.count() == n, f"{stream} {kind}: a position told twice: {out}"
    return out


def store_seqs(checker: Checker, epoch_prefix: str) -> set[int]:
    """The store seqs of the gateway's own readings and records landed at the cloud."""
    return {
        int(k.rsplit("/", 1)[1])
        for k in checker.snapshot()
        if k.startswith(epoch_prefix) and "." not in k.rsplit("/", 1)[1]
    }


def once(checker: Checker) -> None:
    """Each record arrived once (QoS 2 end to end: no copy for the cloud to remove)."""
    counts = checker.snapshot()
    twice = {k: n for k in checker.records_seen() if (n := counts[k]) != 1}
    assert twice == {}, twice


def unexplained(checker: Checker, epoch: str) -> list[int]:
    """Store seqs up to the newest record's ``top`` that are neither landed nor told
    (skipped, evicted, dead-lettered, or held by that record)."""
    recs = records(checker)
    stream = f"{GID}/{epoch}"
    mine = [r for r in recs if stream in r["streams"]]
    if not mine:
        return [-1]
    top = mine[-1]["top"]
    explained = RangeSet()
    for kind in ("skipped", "evicted", "dead_letter"):
        explained.update(told(mine, stream, kind))
    explained.update(ranges_of(mine[-1], stream, "held"))
    landed = store_seqs(checker, f"{GID}/{epoch}/")
    return [s for s in range(1, top + 1) if s not in landed and not explained.covers(s, s)]


def floor_on_disk(db: Path) -> int:
    """The store's seq floor (``meta.last_seq``) as committed, read beside the running
    gateway (WAL: a reader never waits for the writer); 0 before the store exists."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    except sqlite3.OperationalError:
        return 0
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()
    except sqlite3.OperationalError:  # the store being made
        return 0
    finally:
        con.close()
    return int(row[0]) if row else 0


def epoch_of(checker: Checker) -> str:
    epochs = {k.split("/")[1] for k in checker.snapshot() if k.startswith(GID + "/")}
    assert len(epochs) == 1, epochs
    return epochs.pop()


# ------------------------------------------------------------------ (a) a restart


def test_a_restarts_skipped_block_arrives_once_and_explains_every_gap(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """Two clean restarts: the seqs after each jump a block (the floor). The records that
    arrive tell exactly the gaps in the gateway's store stream as ``skipped``, each once,
    and every record arrives once. Old code: no record arrives."""
    checker = cloud(mosquitto.port)
    gw = ledger_gateway(tmp_path, mosquitto.port, sensors=[COUNTER])
    try:
        for _ in range(3):
            gw.start()
            n = len(checker.snapshot())
            assert wait_until(lambda n=n: len(checker.snapshot()) > n + 10, 30)
            assert gw.terminate() == 0  # a clean stop: its record names the highest seq
        gw.sensors = []  # quiet, so that everything can land
        gw.write()
        gw.start()
        epoch = epoch_of(checker)
        stream = f"{GID}/{epoch}"

        def settled() -> bool:
            recs = records(checker)
            return len(told(recs, stream, "skipped")) == 3 and unexplained(checker, epoch) == []

        assert wait_until(settled, 30), (records(checker)[-3:], unexplained(checker, epoch)[:10])
    finally:
        checker.stop()
        gw.kill()
    recs = records(checker)
    landed = store_seqs(checker, f"{stream}/")
    skipped = told(recs, stream, "skipped")
    gaps, prev = RangeSet(), 0
    for s in sorted(landed):
        if s > prev + 1:
            gaps.add(prev + 1, s - 1)
        prev = s
    assert skipped == gaps, (skipped, gaps)  # clean stops: exactly the blocks, nothing more
    assert all(hi - lo + 1 >= 10_000 for lo, hi in skipped)
    once(checker)


# ------------------------------------------------------------------ (b) drop_oldest


class BulkNode(PahoNode):
    """A node whose messages hold 100 readings each: a small quota fills in seconds."""

    def payload(self, seq: int) -> bytes:
        readings = [{"sensor": f"n{i}", "value": seq + i / 100, "unit": "C"} for i in range(100)]
        msg = {"v": 1, "node": self.node, "boot": self.boot, "seq": seq, "ts": wire_time()}
        return json.dumps({**msg, "readings": readings}).encode()

    def reading_ids(self) -> set[str]:
        return {f"{self.node}/{self.boot}/{s}.{i}" for s in self.acked for i in range(100)}


def test_b_drop_oldest_evictions_arrive_once_with_store_and_node_positions(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """The uplink is down and a small quota with ``drop_oldest`` evicts a node's oldest
    messages. Once it is back, the records tell which node messages were evicted (and
    their store seqs): with what landed they make every message the node had
    acknowledged, none of them both, none told twice. Old code: no record arrives."""
    link = LinkProxy(mosquitto.port)
    link.down()
    checker = cloud(mosquitto.port)
    quota = {"store": {"quota_mb": 0.1, "policy": "drop_oldest"}}
    gw = ledger_gateway(tmp_path, link.port, nodes={"n1": "pw-1"}, extra=quota)
    node = BulkNode("n1", "pw-1", gw.ingress_port)
    try:
        gw.start()
        node.start()
        assert wait_until(
            lambda: gw.status()["store"]["counters"].get("dropped_quota", 0) > 1000, 60
        ), gw.status()["store"]
        node.stop()
        link.up()
        acked = set(node.acked)

        def settled() -> bool:
            recs = records(checker)
            landed = {int(k.split("/")[2].split(".")[0]) for k in checker.readings_seen("n1/1/")}
            evicted = told(recs, "n1/1", "evicted")
            return (
                bool(evicted)
                and landed | {s for lo, hi in evicted for s in range(lo, hi + 1)} == acked
            )

        assert wait_until(settled, 60), records(checker)[-2:]
    finally:
        checker.stop()
        gw.kill()
        link.close()
    recs = records(checker)
    landed = {int(k.split("/")[2].split(".")[0]) for k in checker.readings_seen("n1/1/")}
    evicted = told(recs, "n1/1", "evicted")
    assert not any(evicted.covers(s, s) for s in landed)  # evicted and landed: never both
    assert evicted.count() > 5
    # A node message is one outbox row of 100 readings: its store seqs were evicted too.
    store_evicted = told(recs, f"{GID}/{epoch_of(checker)}", "evicted")
    assert store_evicted.count() == 100 * evicted.count()
    once(checker)


# ------------------------------------------------------------------ (c) refused


class TimeTravellingNode(PahoNode):
    """Messages 5 and 6 name a day the calendar does not have: the ingress refuses them
    (invalid_time) and, in MQTT 3.1.1, acknowledges them all the same."""

    def payload(self, seq: int) -> bytes:
        body = json.loads(super().payload(seq))
        if seq in (5, 6):
            body["ts"] = "2026-02-30T00:00:00.000Z"
        return json.dumps(body).encode()


def test_c_a_refused_node_message_is_told_once_with_its_reason(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """The records tell node n1's boot 1: messages 5 and 6 refused as ``invalid_time``,
    the others stored; once. Old code: no record arrives."""
    checker = cloud(mosquitto.port)
    gw = ledger_gateway(tmp_path, mosquitto.port, nodes={"n1": "pw-1"})
    node = TimeTravellingNode("n1", "pw-1", gw.ingress_port)
    try:
        gw.start()
        node.start()
        assert wait_until(lambda: len(node.acked) >= 12, 30)
        node.stop()

        def settled() -> bool:
            recs = records(checker)
            return bool(told(recs, "n1/1", "refused")) and max(
                (r for rec in recs for r in ranges_of(rec, "n1/1", "stored")),
                key=lambda r: r[1],
                default=[0, 0],
            )[1] == max(node.acked)

        assert wait_until(settled, 30), records(checker)[-2:]
        gw.terminate()
    finally:
        checker.stop()
        gw.kill()
    recs = records(checker)
    assert told(recs, "n1/1", "refused") == RangeSet([(5, 6)])  # once
    reasons = {r for rec in recs for r in rec["streams"].get("n1/1", {}).get("refused", {})}
    assert reasons == {"invalid_time"}
    stored = [rec["streams"]["n1/1"]["stored"] for rec in recs if "n1/1" in rec["streams"]]
    last = max(node.acked)
    assert [[0, 4], [7, last]] in stored  # the node stream's own view: 5 and 6 not stored
    landed = {int(k.split("/")[2].split(".")[0]) for k in checker.readings_seen("n1/1/")}
    assert landed == set(node.acked) - {5, 6}
    once(checker)


# ------------------------------------------------------------------ (d) the node's drops


def test_d_a_nodes_ring_overflow_is_reported_and_told_once(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """The firmware (host port, RAM only: no flash log) samples 60 rounds while its
    gateway cannot be reached; its ring of 10 readings overflows. When the link is
    back it reports what it dropped with its next message; the records tell it as
    ``node_dropped`` ``ring_overflow``, and with what landed it makes every message the
    node took, 0 to 59, none both, none twice. Old code: no record (and no report)."""

    class CountingLink(LinkProxy):
        refused = 0

        def _refuse(self, client: Any) -> None:
            self.refused += 1
            super()._refuse(client)

    checker = cloud(mosquitto.port)
    gw = ledger_gateway(tmp_path, mosquitto.port, nodes={"node-r": "pw-r"})
    gw.start()
    link = CountingLink(gw.ingress_port)
    link.down()
    cfg = node_config(
        "node-r", "pw-r", link.port, rounds=60, buffer_readings=10, spill={"mode": "off"}
    )
    node = NodeProc(tmp_path / "flash", cfg)
    try:
        node.start()
        assert wait_until(lambda: link.refused >= 2, 30)  # it sampled on, unheard
        link.up()
        assert node.wait(60) == 0, node.output()[-3000:]  # its rounds done, nothing owed
        boot = node.boots()
        stream = f"node-r/{boot}"

        def settled() -> bool:
            landed = {
                int(k.split("/")[2].split(".")[0]) for k in checker.readings_seen(f"{stream}/")
            }
            dropped = told(records(checker), stream, "node_dropped")
            return bool(dropped) and dropped.count() + len(landed) == 60

        assert wait_until(settled, 30), (records(checker)[-2:], node.output()[-2000:])
    finally:
        checker.stop()
        node.kill()
        gw.kill()
        link.close()
    recs = records(checker)
    landed = {int(k.split("/")[2].split(".")[0]) for k in checker.readings_seen(f"{stream}/")}
    dropped = told(recs, stream, "node_dropped")
    assert not any(dropped.covers(s, s) for s in landed)
    assert {s for lo, hi in dropped for s in range(lo, hi + 1)} | landed == set(range(60))
    reasons = {r for rec in recs for r in rec["streams"].get(stream, {}).get("node_dropped", {})}
    assert reasons == {"ring_overflow"}
    once(checker)


# ------------------------------------------------------------------ power cuts


@pytest.fixture
def disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PowerCutMount]:
    seed = getattr(request, "param", None)
    with PowerCutMount(tmp_path / "backing", tmp_path / "disk", writeback=seed) as d:
        yield d


class RefusedNode(PahoNode):
    """Every message names 30 February: refused (invalid_time), acknowledged, told."""

    def payload(self, seq: int) -> bytes:
        body = json.loads(super().payload(seq))
        body["ts"] = "2026-02-30T00:00:00.000Z"
        return json.dumps(body).encode()


@pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))
@pytest.mark.parametrize("disk", [None, 20261125], indirect=True, ids=["strict", "writeback"])
def test_power_cuts_between_events_and_records_lose_nothing_and_tell_nothing_twice(
    tmp_path: Path, disk: PowerCutMount, mosquitto: Mosquitto
) -> None:
    """The store on the power-cut disk, cut 4 times at random moments while a sensor
    reads, a node's messages are refused (each refusal an event committed before its
    PUBACK) and a record is built every second. Afterwards: every refusal the node had
    acknowledged is told, once; every seq of the store stream is landed or told
    (skipped at each restart, never twice). Events and the record that takes them are
    one transaction: a cut between them can neither lose nor repeat one. Old code: no
    record arrives."""
    rng = random.Random(20261125)
    checker = cloud(mosquitto.port)
    # Two readings a second: the uplink catches up between them even on a loaded machine.
    sensor = {**COUNTER, "interval_s": 0.5}
    gw = ledger_gateway(tmp_path, mosquitto.port, sensors=[sensor], nodes={"n1": "pw-1"})
    gw.db = disk.path / "state" / "gateway.db"
    gw.write()
    gw.start()
    node = RefusedNode("n1", "pw-1", gw.ingress_port).start()
    floor = 0  # the floor this start opened with
    try:
        for _ in range(4):
            # The floor raised a block past this start's seqs (a delivery emptied the
            # outbox; committed, so fsynced): the next start skips the rest of the block
            # and must tell it. Waited for, whatever the machine's load ...
            assert wait_until(lambda f=floor: floor_on_disk(gw.db) > f, 90), "never drained"
            time.sleep(rng.uniform(0.5, 2.0))  # ... then the moment of the cut
            assert gw.proc is not None
            if disk.writeback is not None and disk.cuts % 2:
                disk.arm(rng.randint(1, 8))
                assert disk.wait_frozen(10), "the gateway wrote nothing"
            disk.cut(gw.proc)
            floor = floor_on_disk(gw.db)
            gw.start()
        assert wait_until(lambda: len(node.acked) > 20, 30)
        node.stop()
        acked = set(node.acked)
        gw.terminate()
        gw.sensors = []
        gw.write()
        gw.start()
        epoch = epoch_of(checker)

        def settled() -> bool:
            # A refusal committed whose PUBACK the cut lost is refused (and told) again
            # when the node retries: refusals may repeat, never go missing.
            covered = {
                s
                for rec in records(checker)
                for lo, hi in ranges_of(rec, "n1/1", "refused")
                for s in range(lo, hi + 1)
            }
            return covered >= acked and unexplained(checker, epoch) == []

        assert wait_until(settled, 60), (records(checker)[-2:], unexplained(checker, epoch)[:10])
    finally:
        checker.stop()
        gw.kill()
    print(f"ledger power cuts: {disk.stats()}, {len(acked)} refusals acknowledged")
    recs = records(checker)
    stream = f"{GID}/{epoch}"
    # The block of each start after a cut (seen raised before the cut), each told once.
    assert len(told(recs, stream, "skipped")) >= 4, told(recs, stream, "skipped")
    assert not list((disk.path / "state").glob("*corrupt*")), "the store was moved aside"
    once(checker)


@pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))
@pytest.mark.parametrize("disk", [None, 20261126], indirect=True, ids=["strict", "writeback"])
def test_a_cut_on_either_side_of_the_records_commit_tells_each_refusal_once(
    tmp_path: Path, disk: PowerCutMount, mosquitto: Mosquitto
) -> None:
    """A node's refused messages are events on the card; then the power goes at the two
    moments that matter, each reached by a crash point (sync/faults.py) and followed by
    a cut of the power-cut disk: (1) the record built and appended, its transaction not
    committed: after the restart the events are still there and a later record tells
    them; (2) the record committed: the events went with it, and it travels. Either way
    every refusal the node had acknowledged is told exactly once. Old code: the gateway
    never passes the crash points (no record op) and no record arrives."""
    checker = cloud(mosquitto.port)
    gw = ledger_gateway(tmp_path, mosquitto.port, nodes={"n1": "pw-1"})
    gw.db = disk.path / "state" / "gateway.db"
    gw.write()
    marker = tmp_path / "crash-marker"
    acked: set[int] = set()
    try:
        for point, boot in (("ledger_built", 1), ("ledger_committed", 2)):
            # No record but the clean stop's, so the events wait for it; the crash point
            # kills the gateway inside that stop, and the disk's power goes with it.
            gw.extra["ledger"] = {"interval_s": 3600}
            gw.write()
            crash = {"PUBCOMP_CRASH_AT": f"{point}:1", "PUBCOMP_CRASH_MARKER": str(marker)}
            gw.start(crash)
            node = RefusedNode("n1", "pw-1", gw.ingress_port, boot=boot).start()
            assert wait_until(lambda n=node: len(n.acked) >= 10, 30)
            node.stop()  # every refusal acknowledged: none is retried after the cut
            acked |= {boot * 1000 + s for s in node.acked}
            assert gw.terminate() == -signal.SIGKILL, gw.log.read_text()[-3000:]
            assert marker.read_text().split()[0] == point, "crashed somewhere else"
            disk.cut()
        gw.extra["ledger"] = {"interval_s": 1}
        gw.write()
        gw.start()

        def refused() -> set[int]:
            recs = records(checker)
            return {
                boot * 1000 + s
                for boot in (1, 2)
                for lo, hi in told(recs, f"n1/{boot}", "refused")
                for s in range(lo, hi + 1)
            }

        assert wait_until(lambda: refused() == acked, 30), (sorted(acked), sorted(refused()))
    finally:
        checker.stop()
        gw.kill()
    once(checker)
