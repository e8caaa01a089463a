"""A power cut at every step of applying a release (issue 28, part 3): the gateway's state
directory (its store and its release directory) on the power-cut file system
(devkit/powercut), a real ``pubcomp gateway run --release-dir`` killed at a step's crash
point (sync/faults.py, armed through devkit/hooked.py), then the power cut: everything the
gateway wrote and did not fsync is gone (strict model), or a seeded part of it survives,
torn (writeback model). Started again, the gateway runs the old release or the new one,
never neither, carries on from where it was, and the cloud hears of each step once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devkit.broker import Mosquitto
from devkit.node_helpers import wait_until
from devkit.powercut import PowerCutMount, fuse_missing
from pubcomp.sync import release

from .release_helpers import PREFIX, Audit, ReleaseGateway, Signer, publish

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))

GID = "gw-cut"
COUNTER = {"id": "counter", "type": "simulated", "signal": "counter", "interval_s": 0.2}
SINE = {"id": "sine", "type": "simulated", "signal": "sine", "interval_s": 0.2}
APPLIED = ["fetched", "verified", "staged", "switched", "trial", "committed"]
ROLLED = ["fetched", "verified", "staged", "switched", "trial", "rolling_back", "rolled_back"]

# (crash point, the release fails its trial?): each step, right after it is durable
# (or, for ``release_current`` and ``release_rolled_back``, after the rename of
# ``current`` and before the state says so).
STEPS = [
    ("release_fetched", False),
    ("release_verified", False),
    ("release_staged", False),
    ("release_switched", False),
    ("release_current", False),
    ("release_trial", False),
    ("release_committed", False),
    ("release_rolling_back", True),
    ("release_rolled_back", True),
]
WRITEBACK = [("release_staged", False), ("release_current", False), ("release_rolled_back", True)]


@pytest.fixture
def disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PowerCutMount]:
    seed = getattr(request, "param", None)
    with PowerCutMount(tmp_path / "backing", tmp_path / "disk", writeback=seed) as d:
        yield d


def _run(tmp_path: Path, disk: PowerCutMount, port: int, point: str, fails: bool) -> None:
    audit = Audit(port, client_id=f"audit-{point}")
    signer = Signer(tmp_path)
    gw = ReleaseGateway(tmp_path, port, signer, gid=GID, sensors=[COUNTER], trial_s=3.0)
    gw.db = disk.path / "state" / "gateway.db"
    gw.release_dir = disk.path / "state" / "release"
    gw.write()
    publish(port, release.keys_topic(PREFIX), signer.keys())
    marker = tmp_path / "crashed"  # off the cut disk
    gw.start(env={"PUBCOMP_CRASH_AT": point, "PUBCOMP_CRASH_MARKER": str(marker)})
    probe = {"id": "probe", "type": "ds18b20", "base": str(tmp_path / "no-w1"), "interval_s": 1}
    text = gw.fleet_text(sensors=[COUNTER, probe if fails else SINE])
    publish(port, release.release_topic(PREFIX, GID), signer.release(GID, 1, text))

    assert gw.proc is not None
    proc = gw.proc
    assert wait_until(lambda: proc.poll() is not None, 60), f"{point} never hit\n{gw.tail()}"
    assert marker.read_text().startswith(point), marker.read_text()
    disk.cut()  # the power goes while the gateway lies dead at the step: unsynced bytes go too
    gw.start()  # never neither: it starts, on the old release or the new one
    assert gw.rel()["version"] in (None, 1), gw.rel()
    assert gw.status()["healthy"], gw.status()["health_problems"]

    end = (
        gw.wait_release(state="rolled_back", version=None, bad=[1], timeout=60)
        if fails
        else gw.wait_release(state="committed", version=1, timeout=60)
    )
    sensors = set(gw.status()["sensors"])
    assert sensors == ({"counter"} if fails else {"counter", "sine"}), sensors
    want = ROLLED if fails else APPLIED
    events = audit.wait(*((e, 1) for e in want))
    time.sleep(0.5)  # anything sent twice would be here by now
    events = audit.events()
    starts = [e for e, _ in events if e == "trial"]
    once = [e for e, _ in events if e != "trial"]
    assert sorted(once) == sorted(e for e in want if e != "trial"), events
    # One trial event per start in trial: a cut in the trial makes a second start.
    trials = sorted(int(f.split(":")[1]) for fl in audit.flags_of("trial") for f in fl
                    if f.startswith("attempt:"))  # fmt: skip
    assert sorted(set(trials)) == list(range(1, len(starts) + 1)), trials
    assert len(starts) == (2 if point == "release_trial" else 1), (point, trials)
    assert not list((disk.path / "state").glob("*corrupt*")), "the store was moved aside"
    print(f"{point}: {disk.stats()}, end {end['state']}")
    audit.stop()
    assert gw.terminate() == 0


@pytest.mark.parametrize("point,fails", STEPS, ids=[p for p, _ in STEPS])
def test_a_power_cut_at_each_step_of_an_apply(
    tmp_path: Path, disk: PowerCutMount, mosquitto: Mosquitto, point: str, fails: bool
) -> None:
    _run(tmp_path, disk, mosquitto.port, point, fails)


@pytest.mark.parametrize("disk", [20261128], indirect=True, ids=["writeback"])
@pytest.mark.parametrize("point,fails", WRITEBACK, ids=[p for p, _ in WRITEBACK])
def test_a_power_cut_with_torn_writeback_at_the_renames(
    tmp_path: Path, disk: PowerCutMount, mosquitto: Mosquitto, point: str, fails: bool
) -> None:
    """The writeback model: a seeded part of the unsynced pages and a prefix of the
    unsynced renames reach the disk at the cut, torn at 512-byte sectors; the start
    believes only a staged release that hashes to what the store holds."""
    _run(tmp_path, disk, mosquitto.port, point, fails)
