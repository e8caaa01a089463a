"""What an operator sees of one gateway through an uplink outage: ``pubcomp status`` (its
headline and exit code), ``/status.json`` and the status page in a real browser.

A real ``pubcomp gateway run``, a real Mosquitto as the cloud (killed, then started again
on the same port), and Debian's chromium in headless mode: ``--dump-dom`` for assertions,
``--screenshot`` at desktop and phone width for a person to look at (set
PUBCOMP_SCREENSHOT_DIR to keep them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from devkit.broker import Mosquitto, free_port
from devkit.gateway_helpers import GatewayProc
from pubcomp.gateway.health import backlog_svg, fit_span
from pubcomp.sync.units import counted, size

SENSORS = [{"id": "temp", "type": "simulated", "signal": "sine", "unit": "C", "interval_s": 0.05}]
SIZES = {"desktop": (1280, 900), "phone": (390, 844)}
HEADLINE_DOWN = re.compile(
    r"^uplink DOWN since \d\d:\d\d:\d\d \((\d+) s\), ([\d,]+) readings held safely on disk$"
)


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("no chromium: `make setup` installs it (scripts/install-system-deps.sh)")
    return path


class Browser:
    """Headless chromium, one process per page load, as a person would open the page."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.shots = Path(os.environ.get("PUBCOMP_SCREENSHOT_DIR") or tmp / "shots")
        self.shots.mkdir(parents=True, exist_ok=True)

    def _run(self, url: str, size: tuple[int, int], *action: str) -> str:
        flags = [
            "--headless",
            "--no-sandbox",  # as root in CI
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={self.tmp / 'chromium-profile'}",
            f"--window-size={size[0]},{size[1]}",
        ]
        done = subprocess.run(
            [chromium(), *flags, *action, url], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    def dom(self, url: str, size: tuple[int, int] = SIZES["desktop"]) -> Page:
        return Page(self._run(url, size, "--dump-dom"))

    def screenshot(self, url: str, name: str) -> list[Path]:
        return [
            self.shot(url, f"status-{name}-{label}.png", window) for label, window in SIZES.items()
        ]

    def shot(self, url: str, name: str, size: tuple[int, int] = SIZES["desktop"]) -> Path:
        """One screenshot, ``name`` in the screenshot folder."""
        path = self.shots / name
        self._run(url, size, f"--screenshot={path}")
        assert path.stat().st_size > 10_000, path
        return path


class Page(HTMLParser):
    """The DOM chromium rendered: elements by id, with their attributes and text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.source = text
        self.by_id: dict[str, dict[str, Any]] = {}
        self.metas: list[dict[str, str]] = []
        self._open: list[tuple[str, dict[str, Any] | None]] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "meta":
            self.metas.append(a)
            return
        el = None
        if "id" in a:
            el = self.by_id[a["id"]] = {"tag": tag, "attrs": a, "text": ""}
        if tag not in ("br", "img", "input", "link", "hr"):
            self._open.append((tag, el))

    def handle_endtag(self, tag: str) -> None:
        if any(t == tag for t, _ in self._open):
            while self._open.pop()[0] != tag:
                pass

    def handle_data(self, data: str) -> None:
        for _, el in self._open:
            if el is not None:
                el["text"] += data

    def text(self, eid: str) -> str:
        return " ".join(self.by_id[eid]["text"].split())

    def attr(self, eid: str, name: str) -> str:
        return str(self.by_id[eid]["attrs"][name])

    def summary(self, key: str) -> str:
        m = re.search(rf"<tr><th>{re.escape(key)}</th><td>(.*?)</td></tr>", self.source)
        assert m, key
        return m.group(1)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {what}"
        time.sleep(0.1)


def pubcomp(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pubcomp", *args], capture_output=True, text=True, timeout=timeout
    )


def check_page(page: Page, level: str) -> str:
    """What every state of the page must have; returns the headline."""
    assert any(
        m.get("name") == "viewport" and "width=device-width" in m.get("content", "")
        for m in page.metas
    )
    assert page.attr("verdict", "class") == f"verdict {level}", page.text("verdict")
    assert re.match(r"Drawn \d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", page.text("drawn"))
    chart = page.by_id["backlog-chart"]["attrs"]
    assert chart["width"] == "100%"  # fluid: the chart takes the page's width
    assert re.search(r"\d\d:\d\d", page.source[page.source.index('id="backlog-chart"') :])
    assert "No nodes in this gateway" in page.text("nodes")  # not a bare header
    assert re.search(r"disk free [\d.]+ (GB|MB)", page.summary("store"))
    return page.text("verdict")


def test_outage_as_the_operator_sees_it(tmp_path: Path) -> None:
    cloud = Mosquitto(tmp_path / "broker").start()
    gw = GatewayProc(tmp_path, cloud.port, sensors=SENSORS)
    gw.start()
    browser = Browser(tmp_path)
    # No --gateway: the fleet file has one gateway, so it is the one.
    status = lambda: pubcomp("status", "--config", str(gw.fleet))  # noqa: E731
    try:
        # Healthy: delivering, no ETA for a steady flow, exit 0.
        wait_for("deliveries", lambda: gw.status()["uplink"]["delivered"] > 0)
        up = gw.status()["uplink"]
        assert up["state"] == "connected" and up["eta_s"] is None
        out = status()
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith("OK, delivering: uplink connected since ")
        page = browser.dom(gw.url("/"))
        assert check_page(page, "ok").startswith("OK, delivering")
        assert page.summary("last error") == "-"
        browser.screenshot(gw.url("/"), "1-healthy")

        # Outage: the cloud broker is gone.
        cloud.kill()
        # The first error is the closed connection; the next try's refusal follows after
        # the back-off (on a busy machine the backlog may pass 60 before it).
        down = wait_for(
            "the uplink to notice, try again, and a backlog of 60",
            lambda: (
                (u := gw.status()["uplink"])["state"] != "connected"
                and u["backlog"] > 60
                and (u["last_error_text"] or "").startswith("nothing accepts")
                and u
            ),
        )
        # Deliveries from before the outage promise nothing: no rate, no ETA.
        assert down["drain_rate"] == 0.0 and down["eta_s"] is None, down
        assert down["down_since"] is not None and down["last_error_at"] is not None
        assert down["last_error_text"] == (
            f"nothing accepts connections at 127.0.0.1:{cloud.port}: "
            "the broker is down or not listening there"
        )
        out = status()
        assert out.returncode == 4, out.stdout + out.stderr  # running, not delivering
        head = out.stdout.splitlines()[0]
        m = HEADLINE_DOWN.match(head)
        assert m and int(m.group(2).replace(",", "")) >= 60, head
        err = next(x for x in out.stdout.splitlines() if x.startswith("last error"))
        assert re.match(r"last error\s+\d\d:\d\d:\d\d \(\d+ s ago\): nothing accepts", err), err
        assert "Errno" not in err
        page = browser.dom(gw.url("/"))
        assert HEADLINE_DOWN.match(check_page(page, "down"))
        assert page.summary("ETA") == "-"
        browser.screenshot(gw.url("/"), "2-outage")
        # The outage lasts until the backlog holds twice what it held when first seen.
        wait_for("a larger backlog", lambda: gw.status()["uplink"]["backlog"] > 2 * down["backlog"])

        # The broker is back on the same port: the held readings drain.
        cloud.start()
        after = wait_for(
            "the drain",
            lambda: (u := gw.status()["uplink"])["last_drain"] and u["catch_up"] is None and u,
        )
        held = after["last_drain"]["readings"]
        assert held > 2 * down["backlog"], after
        log = gw.log.read_text()
        assert re.search(r"connected again after \d+ s down; \d+ readings waiting", log), log
        assert f"backlog drained: {held} readings delivered in " in log
        out = status()
        assert out.returncode == 0, out.stdout + out.stderr
        head = out.stdout.splitlines()[0]
        assert head.startswith("OK, delivering again: uplink back since "), head
        assert f"the {held:,} readings held were delivered in " in head
        err = next(x for x in out.stdout.splitlines() if x.startswith("last error"))
        assert re.match(r"last error\s+past: \d\d:\d\d:\d\d \(\d+ s ago\), resolved ", err), err
        page = browser.dom(gw.url("/"))
        check_page(page, "ok")
        # The chart caught the peak: the backlog found when the uplink connected again.
        assert int(page.attr("backlog-chart", "data-peak")) >= held
        assert page.summary("last error").startswith("past: ")
        browser.screenshot(gw.url("/"), "3-drained")
    finally:
        assert gw.terminate() == 0
        cloud.kill()


def test_young_gateway_chart_and_sizes() -> None:
    now = 1_800_000_000.0
    # A new gateway with no backlog: a readable axis (0 to 10, not 0 to 1), a span that
    # fits its minute of history, and time ticks.
    hist = [(now - 40 + i * 2, 0) for i in range(21)]
    span = fit_span(hist, now, None)
    assert span == 60.0
    svg = backlog_svg(hist, now, span)
    assert 'data-top="10"' in svg and 'data-peak="0"' in svg and svg.count('class="xtick') >= 3
    # An outage 70 s ago, an hour into the gateway's life: the span fits the outage.
    hist = [(now - 3600 + i * 2, 0) for i in range(1800)]
    assert fit_span(hist, now, now - 70) == 70 * 1.5 + 30
    # A peak between two samples of a column survives the drawing.
    hist = [(now - 60 + i, 0) for i in range(60)] + [(now - 0.5, 296)]
    assert 'data-peak="296"' in backlog_svg(hist, now, 3600.0)
    assert size(80_498_200_000) == "80.5 GB" and size(512_000_000) == "512.0 MB"
    assert size(24_576) == "24.6 kB"  # a new store, not "0.0 MB"
    assert counted(1, "message") == "1 message" and counted(1200, "message") == "1,200 messages"


def test_operator_errors_are_one_line(tmp_path: Path, mosquitto: Mosquitto) -> None:
    gw = GatewayProc(tmp_path, mosquitto.port, sensors=SENSORS, nodes={"node-1": "pw-1"})
    gw.start()
    try:
        # The same fleet file again: the health port answers, so the store is left alone.
        again = pubcomp("gateway", "run", "--config", str(gw.fleet))
        assert again.returncode == 1
        assert again.stderr.count("\n") == 1, again.stderr
        assert f"already answers on health port {gw.health_port}" in again.stderr
        assert "another gateway gw-e2e is probably running" in again.stderr
        # Another copy with its own health port and store but the same ingress port.
        other_dir = tmp_path / "other"
        other_dir.mkdir()
        other = GatewayProc(other_dir, mosquitto.port, nodes={"node-1": "pw-1"})
        other.ingress_port, other.health_port = gw.ingress_port, free_port()
        other.write()
        clash = pubcomp("gateway", "run", "--config", str(other.fleet))
        assert clash.returncode == 1
        assert clash.stderr.count("\n") == 1, clash.stderr
        assert f"port {gw.ingress_port} (ingress) is already in use" in clash.stderr
        assert gw.status()["healthy"]
    finally:
        assert gw.terminate() == 0

    verbose = pubcomp("gateway", "run", "--config", str(gw.fleet), "--log-level", "verbose")
    assert verbose.returncode == 2 and verbose.stderr.count("\n") == 1, verbose.stderr
    assert "--log-level verbose: not a level; use one of DEBUG, INFO, WARNING" in verbose.stderr

    wh = tmp_path / "warehouse"
    landing = tmp_path / "landing"
    run = pubcomp("pipeline", "run", "--landing", str(landing), "--warehouse", str(wh))
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert f"landing {landing} does not exist" in run.stderr

    (wh / "readings").mkdir(parents=True)
    out = tmp_path / "report.html"
    typo = tmp_path / "wherehouse"
    rep = pubcomp("pipeline", "report", "--warehouse", str(typo), "--out", str(out))
    assert rep.returncode == 2 and rep.stderr.count("\n") == 1, rep.stderr
    assert f"warehouse {typo} does not exist (did you mean {wh}?)" in rep.stderr
    assert not out.exists()

    # One gateway in the fleet file: --gateway is not needed.
    shown = pubcomp("config", "show", str(gw.fleet))
    assert shown.returncode == 0 and "id: gw-e2e" in shown.stdout
