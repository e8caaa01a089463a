"""The report's fleet page in the middle of a rollout whose canary fails its gate: three
real gateways (``--release-dir``), a real Mosquitto, ``pubcomp ingest run`` landing their
statuses, ``pubcomp fleet rollout`` under way; the landing zone as it was when the
failing canary had rolled the release back, made into the page by ``pubcomp pipeline
run`` and ``pubcomp pipeline report``, read and drawn by Debian's chromium (set
PUBCOMP_SCREENSHOT_DIR to keep the picture: docs/img/fleet-rollout-desktop.png).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.broker import Mosquitto
from devkit.ingest_helpers import IngestProc
from devkit.procs import track
from pubcomp.sync.exitcodes import EXIT_ROLLOUT_HALTED

from .test_fleet_e2e import _cli
from .test_gateway_status_page import Browser
from .test_release_rollout import FAST, GATEWAYS, PUBCOMP, ROOT, Fleet, _first_rollout, wait_until


@pytest.fixture
def fleet(tmp_path: Path, mosquitto: Mosquitto) -> Iterator[Fleet]:
    f = Fleet(tmp_path, mosquitto)
    yield f
    f.close()


def landed_releases(landing: Path) -> dict[str, dict[str, Any]]:
    """Each gateway's release as its newest landed online status says it (the files the
    ingest has rolled into ``_status/``, which ``pubcomp pipeline run`` reads)."""
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(landing.glob("_status/date=*/*.jsonl")):
        for line in f.read_text().splitlines():
            msg = json.loads(line)
            if msg.get("online") and msg.get("release"):
                out[msg["gateway"]] = msg["release"]
    return out


def release_cells(page: str) -> dict[str, str]:
    """Each gateway's release cell, as text (the page's own rows, by ``data-gateway``)."""
    out = {}
    for gw, row in re.findall(r'<tr class="s\d" data-gateway="([^"]+)">(.*?)</tr>', page):
        cell = re.search(r'<td>([^<]*<span class="rel .*?)</td>', row)
        out[gw] = " ".join(re.sub(r"<[^>]+>", " ", cell.group(1)).split()) if cell else ""
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)  # three gateways, two rollouts, Spark: minutes on a busy machine
def test_the_fleet_page_during_a_rollout_whose_canary_fails(
    tmp_path: Path,
    fleet: Fleet,
    mosquitto: Mosquitto,
    spark: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def run(*args: str, ok: bool = True) -> None:
        """The command in this process (the session's Spark), its output shown."""
        code, out, err = _cli(list(args), capsys)
        assert code == 0 or not ok, out + err
        with capsys.disabled():
            print(f"$ pubcomp {' '.join(args)}\n{out}{err}exit {code}")

    landing, wh = tmp_path / "landing", tmp_path / "warehouse"
    ingest = IngestProc(mosquitto.port, landing).start()
    # Clocks synchronised (devkit/hooked.py): on the page, the release is the news.
    monkeypatch.setenv("PUBCOMP_CLOCK_KERNEL", "synced")
    for g in GATEWAYS:
        fleet.start(g)
    _first_rollout(fleet)
    # Release 2: a new sensor everywhere, and on gw-b one that never reads: gw-b's trial
    # fails, the canary's gate with it, and the rollout reverts gw-a and gw-b.
    fleet.write(extra_sensor="salinity", broken_on="gw-b")
    fleet.release()
    cmd = [
        *PUBCOMP, "fleet", "rollout", "--config", str(fleet.file),
        "--signing-key", fleet.signing_key, "--broker", mosquitto.url, *FAST,
        "--canary", "gw-a,gw-b", "--waves", "100%",
    ]  # fmt: skip
    rollout = track(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True))
    try:
        wait_until(
            lambda: 2 in landed_releases(landing).get("gw-b", {}).get("bad", []),
            120,
            "gw-b's status saying it rolled release 2 back lands",
        )
        # The landing zone as it is now: the rollout is still reverting.
        under_way = rollout.poll() is None
        ingest.stop()
        assert under_way, "the rollout ended before the page's statuses were landed"
    finally:
        out, _ = rollout.communicate(timeout=240)
    with capsys.disabled():
        print(out)
    assert rollout.returncode == EXIT_ROLLOUT_HALTED, out
    landed = landed_releases(landing)
    assert landed["gw-c"]["version"] == 1 and landed["gw-b"]["bad"] == [2]

    try:
        run("pipeline", "run", "--landing", str(landing), "--warehouse", str(wh))
        report = tmp_path / "report.html"
        run("pipeline", "report", "--warehouse", str(wh), "--out", str(report))
        run("fleet", "status", "--warehouse", str(wh), ok=False)
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", "2")  # the CLI's session settings
    page_file = tmp_path / "report-fleet.html"
    browser = Browser(tmp_path)
    page = browser.dom(page_file.as_uri()).source
    cells = release_cells(page)
    assert set(cells) == set(GATEWAYS), cells
    # gw-b rolled release 2 back: it says so, or (when the landing zone froze a moment
    # later, on a loaded machine) it is back on 1 and on its way to the revert, 3.
    b = cells["gw-b"]
    assert "rolled back" in b or "rolling back" in b or b.startswith("1 → 3"), cells
    assert "bad: 2" in cells["gw-b"] and "pm-gw-b" in page, cells  # why, as gw-b said it
    assert cells["gw-c"] == "1 committed", cells  # never saw release 2
    # gw-a committed 2 as a canary: it runs 2, or is on its way to the revert, 3 (how far
    # it got by the time gw-b's rollback landed depends on the machine's load).
    assert cells["gw-a"].split()[0] in ("2", "3"), cells
    # A wide desktop: the page's table is wider than 1280 px once a release has failed.
    browser.shot(page_file.as_uri(), "fleet-rollout-desktop.png", (1440, 760))
