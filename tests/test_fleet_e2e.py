"""The fleet seen from the cloud: three real gateways, a real Mosquitto, the real ingest and Spark.

One gateway is killed (its Will marks it offline), one has its uplink cut for a
while (its backlog rises, then drains), one runs without a synchronised clock.
``pubcomp fleet watch`` shows them live from the retained statuses; the ingest
lands the statuses beside the readings; ``pubcomp pipeline run`` keeps
``gateway_health``; ``pubcomp fleet status`` and the report's fleet page list
the gateways worst first.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devkit.broker import Mosquitto
from devkit.gateway_helpers import GatewayProc
from devkit.ingest_helpers import IngestProc
from devkit.procs import track
from pubcomp import cli
from pubcomp.pipeline import health

from .fleet_helpers import CutProxy, StatusWatcher

SIM = [{"id": "t", "type": "simulated", "interval_s": 0.2, "unit": "C"}]
FAST = {"status": {"min_interval_s": 1, "heartbeat_s": 10}}


def _until(what: str, cond: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise TimeoutError(what)


class LiveWatch:
    """``pubcomp fleet watch`` running (stdout not a terminal: one table per redraw)."""

    def __init__(self, url: str) -> None:
        cmd = [sys.executable, "-m", "pubcomp", "fleet", "watch", "--broker", url]
        self.proc = track(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line)

    def screens(self) -> list[str]:
        return "".join(self.out).split("--- ")[1:]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _order(text: str, names: list[str]) -> list[str]:
    """The gateways in the order the table lists them."""
    rows = [ln.split()[0] for ln in text.splitlines() if ln.split() and ln.split()[0] in names]
    return list(dict.fromkeys(rows))


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def _watch_once(url: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pubcomp", "fleet", "watch", "--broker", url, "--once"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_three_gateways_seen_from_the_cloud(
    tmp_path: Path, mosquitto: Mosquitto, spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    landing, wh = tmp_path / "landing", tmp_path / "warehouse"
    ingest = IngestProc(mosquitto.port, landing).start()
    proxy = CutProxy(mosquitto.port)
    watcher = StatusWatcher(mosquitto.port)
    live = LiveWatch(mosquitto.url)
    names = ["gw-kill", "gw-cut", "gw-noclock"]
    gws: dict[str, GatewayProc] = {}
    try:
        for gid, port, clock in (
            ("gw-kill", mosquitto.port, "synced"),
            ("gw-cut", proxy.port, "synced"),  # its uplink and status link go through the proxy
            ("gw-noclock", mosquitto.port, "unsynced"),
        ):
            (tmp_path / gid).mkdir()
            gw = GatewayProc(tmp_path / gid, port, gid=gid, sensors=SIM, extra=FAST)
            gws[gid] = gw.start(env={"PUBCOMP_CLOCK_KERNEL": clock})
        for gid in names:
            watcher.wait(gid, lambda m: m["online"] and m["uplink"]["state"] == "connected")
        assert watcher.latest("gw-noclock")["clock"] == {  # type: ignore[index]
            "source": "none",
            "synced": False,
            "corrections": 0,
        }

        # The uplink is cut; the status link (client id gw-cut-status) still passes.
        proxy.cut("gw-cut")
        at_cut = watcher.mark("gw-cut")
        rising = [
            watcher.wait(
                "gw-cut",
                lambda m, n=n: (
                    m["online"]  # type: ignore[misc]
                    and m["uplink"]["state"] != "connected"
                    and m["uplink"]["backlog"] >= n
                ),
                timeout=60,
                after=at_cut,
            )["uplink"]["backlog"]
            for n in (10, 40)
        ]
        assert rising[0] < rising[1]
        cut = watcher.latest("gw-cut")
        assert cut is not None and cut["verdict"]["level"] == "down" and cut["verdict"]["exit"] == 4

        gws["gw-kill"].kill()
        will = watcher.wait("gw-kill", lambda m: not m["online"], timeout=30)
        assert will["reason"] == "will"

        # fleet watch, once, from the retained statuses: worst first, exit 3 (one offline).
        res = _watch_once(mosquitto.url)
        assert res.returncode == 3, res.stdout + res.stderr
        assert res.stdout.startswith("3 of 3 gateways need attention: 1 OFFLINE, ")
        assert _order(res.stdout, names) == ["gw-kill", "gw-cut", "gw-noclock"], res.stdout
        assert "gw-kill: connection lost, the broker sent its Will" in res.stdout
        # The live view saw the same.
        screen = _until(
            "the live watch shows the Will",
            lambda: next(
                (s for s in reversed(live.screens()) if "OFFLINE" in s and "gw-cut" in s), None
            ),
        )
        assert _order(screen, names) == ["gw-kill", "gw-cut", "gw-noclock"], screen

        proxy.restore("gw-cut")
        at_restore = watcher.mark("gw-cut")
        drained = watcher.wait(  # delivering again, nothing old waiting
            "gw-cut",
            lambda m: (
                m["online"]
                and m["verdict"]["level"] == "ok"
                and (m["uplink"]["oldest_age_s"] or 0) < 10
            ),
            timeout=90,
            after=at_restore,
        )
        assert drained["uplink"]["delivered"] > cut["uplink"]["delivered"]
        res = _watch_once(mosquitto.url)
        assert _order(res.stdout, names) == ["gw-kill", "gw-noclock", "gw-cut"], res.stdout
        assert watcher.invalid == []
        live.stop()

        # Everything the watcher saw has landed: then stop the ingest (it rolls its files).
        wanted = {will["id"], drained["id"], watcher.latest("gw-noclock")["id"]}  # type: ignore[index]

        def landed_ids() -> set[str]:
            files = [*landing.glob("_status/date=*/*.jsonl")]
            files += landing.glob("_incoming/_status/*.jsonl")
            ids = set()
            for f in files:
                try:  # whole lines only: the ingest may be writing the last one
                    ids |= {json.loads(ln)["id"] for ln in f.read_text().split("\n")[:-1]}
                except FileNotFoundError:  # rolled between the listing and the read
                    continue
            return ids

        _until("statuses landed", lambda: wanted <= landed_ids())
        stats = ingest.stop()
        assert stats["status"]["messages"] >= 10 and stats["status"]["rejected"] == 0
        for gid in ("gw-cut", "gw-noclock"):
            assert gws[gid].terminate() == 0

        # pubcomp pipeline run: the readings as before, and gateway_health.
        code, out, err = _cli(
            ["pipeline", "run", "--landing", str(landing), "--warehouse", str(wh)], capsys
        )
        assert code == 0, err
        assert re.search(r"gateway status: [\d,]+ messages, 3 gateways", out), out
        assert ", 0 quarantined," in out  # no status line reached the readings
        readings = spark.read.parquet(str(wh / "readings"))
        assert {r.gateway for r in readings.select("gateway").distinct().collect()} == set(names)

        views = {v.gateway: v for v in health.views(spark, str(wh))}
        assert views.keys() == set(names)
        k, c, n = views["gw-kill"], views["gw-cut"], views["gw-noclock"]
        assert not k.online and k.reason == "will" and k.backlog is not None  # last known
        assert c.online and c.uplink_state == "connected" and (c.oldest_age_s or 0) < 10
        assert n.clock_synced is False and n.clock_source == "none"
        minutes = spark.read.parquet(str(wh / "gateway_health_1m")).where("gateway = 'gw-cut'")
        assert minutes.agg({"backlog_max": "max"}).first()[0] >= 40  # it rose ...
        assert c.history and max(b for _, b in c.history) >= 40  # ... and drained

        # pubcomp fleet status: the same order, exit 3 (an offline gateway is the worst).
        code, out, err = _cli(["fleet", "status", "--warehouse", str(wh)], capsys)
        assert code == 3, out + err
        assert _order(out, names) == ["gw-kill", "gw-noclock", "gw-cut"], out
        assert "gw-noclock: clock not synchronised" in out
        code, out, err = _cli(["fleet", "status", "--warehouse", str(wh), "--json"], capsys)
        rows = json.loads(out)
        assert [r["gateway"] for r in rows] == ["gw-kill", "gw-noclock", "gw-cut"]
        assert [r["judgement"]["code"] for r in rows] == [3, 5, 0]

        # The report and its fleet page.
        report = tmp_path / "report.html"
        code, out, err = _cli(
            ["pipeline", "report", "--warehouse", str(wh), "--out", str(report)], capsys
        )
        assert code == 0, err
        page = (tmp_path / "report-fleet.html").read_text()
        # The fleet table's rows first, worst first (the completeness section names them again).
        named = list(dict.fromkeys(re.findall(r'data-gateway="([^"]+)"', page)))
        assert named == ["gw-kill", "gw-noclock", "gw-cut"]
        peaks = dict(
            re.findall(r'aria-label="([\w-]+): backlog per minute[^"]*" data-peak="(\d+)"', page)
        )
        assert int(peaks["gw-cut"]) >= 40, peaks
        assert 'href="report-fleet.html"' in report.read_text()

        # A second run with nothing new changes nothing.
        before = sorted(map(str, spark.read.parquet(str(wh / "gateway_health")).collect()))
        code, out, err = _cli(
            ["pipeline", "run", "--landing", str(landing), "--warehouse", str(wh)], capsys
        )
        assert "gateway status: 0 messages, 3 gateways" in out, out
        after = sorted(map(str, spark.read.parquet(str(wh / "gateway_health")).collect()))
        assert before == after
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", "2")  # the CLI's session settings
        live.stop() if live.proc.poll() is None else None
        watcher.close()
        proxy.close()
