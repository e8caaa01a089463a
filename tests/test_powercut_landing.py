"""Power cuts of the gateway while delivered readings await their landing (issue 24).

The gateway's store is on the power-cut file system (devkit/powercut: only what was
fsynced survives a cut). The cloud ingest is away for the first cuts, so the broker
completes the gateway's messages and holds them for it: the gateway keeps every one
of them (awaiting landing) through the cuts. Then the ingest comes back and says what
it landed. Every reading a node had acknowledged lands, and the gateway's store lets
them all go.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.broker import Mosquitto
from devkit.gateway_helpers import GatewayProc, PahoNode
from devkit.ingest_helpers import IngestProc, landed
from devkit.node_helpers import wait_until
from devkit.powercut import PowerCutMount, fuse_missing

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))

CUTS = 6


@pytest.fixture
def disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PowerCutMount]:
    """The strict model, or writeback (a seeded subset of unsynced pages reaches the disk,
    some torn) with the seed a test passes (``indirect``)."""
    seed = getattr(request, "param", None)
    with PowerCutMount(tmp_path / "backing", tmp_path / "disk", writeback=seed) as d:
        yield d


@pytest.mark.parametrize("disk", [None, 20261125], indirect=True, ids=["strict", "writeback"])
def test_gateway_power_cuts_while_readings_await_landing_lose_nothing(
    tmp_path: Path, disk: PowerCutMount, persistent_mosquitto: Mosquitto
) -> None:
    rng = random.Random(20261125)
    broker = persistent_mosquitto
    landing = tmp_path / "landing"
    ingest = IngestProc(broker.port, landing).start()
    ingest.stop()  # away: its session queues what the gateway delivers
    gw = GatewayProc(tmp_path, broker.port, nodes={"n1": "pw-1", "n2": "pw-2"})
    gw.extra = {"uplink": {"landed_timeout_s": 600}}
    gw.db = disk.path / "state" / "gateway.db"
    gw.write()
    gw.start()
    nodes = [PahoNode(n, f"pw-{i}", gw.ingress_port).start() for i, n in ((1, "n1"), (2, "n2"))]
    awaiting_at_cuts = []
    for cut in range(CUTS):
        assert wait_until(
            lambda: (gw.status()["uplink"]["end_to_end"]["awaiting_landing"] or 0) > 0, 30
        ), gw.status()["uplink"]
        time.sleep(rng.uniform(0.2, 1.0))
        awaiting_at_cuts.append(gw.status()["uplink"]["end_to_end"]["awaiting_landing"])
        assert gw.proc is not None
        disk.cut(gw.proc)
        if cut == CUTS // 2:
            ingest.start()  # back: what it lands from now on is let go
        gw.start()
    for n in nodes:
        n.stop()
    acked = set().union(*(n.reading_ids() for n in nodes))
    assert wait_until(lambda: acked <= landed(landing, rolled_only=False).keys(), 60)

    def let_go() -> bool:
        e2e = gw.status()["uplink"]["end_to_end"]
        return e2e["awaiting_landing"] == 0 and gw.status()["uplink"]["backlog"] == 0

    assert wait_until(let_go, 60), gw.status()["uplink"]
    gw.terminate()
    ingest.stop()
    counts = landed(landing)
    # Every cut while the ingest was away fell on readings awaiting landing (after it is
    # back, they are let go within a second or so, and a cut may find none).
    assert len(acked) > 300 and min(awaiting_at_cuts[: CUTS // 2 + 1]) > 0, awaiting_at_cuts
    assert acked <= counts.keys(), f"{len(acked - counts.keys())} acknowledged readings lost"
    # Copies only of what was sent again (the pipeline removes them), never a stranger.
    # (The gateway's own ids are its $ledger records: it has no sensors here.)
    assert {k.split("/")[0] for k in counts} <= {"n1", "n2", gw.gid}
