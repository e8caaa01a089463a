"""``pubcomp pipeline report``: its numbers against DuckDB, its pictures as real PNGs."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
import pytest
from matplotlib import image as mpimg
from matplotlib.patches import StepPatch

from devkit import duckdb_reference as ref
from devkit.sparkconf import short_jvm_env
from pubcomp.pipeline import charts, report
from pubcomp.pipeline import transforms as T
from pubcomp.pipeline.job import Pipeline
from pubcomp.pipeline.synth import write_landing

from .test_pipeline import BAD_LINES


class Tables(HTMLParser):
    """The report's tables by id (rows of cell texts), and its images' sources."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.images: list[str] = []
        self._table: str | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id") or ""
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag == "td":
            self._cell = []
        elif tag == "img":
            self.images.append(a.get("src") or "")

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None


def _parse(path: Path) -> Tables:
    t = Tables()
    t.feed(path.read_text())
    return t


def _n(cell: str) -> int:
    return int(cell.replace(",", ""))


def test_report_numbers_equal_duckdb_and_charts_are_pngs(spark: Any, tmp_path: Path) -> None:
    landing, wh, out = tmp_path / "landing", tmp_path / "wh", tmp_path / "report.html"
    write_landing(landing, 6_000, origins=3, sensors=9, late_rate=0.05, seed=11)
    (landing / "date=2026-11-20" / "bad.jsonl").write_text("\n".join(BAD_LINES) + "\n")
    Pipeline(spark, str(landing), str(wh)).run()
    # A second batch: files delivered again (cross-batch duplicates) and a day a week late.
    day = landing / "date=2026-11-20"
    shutil.copy(day / "synth-11-0.jsonl", day / "again-0.jsonl")
    write_landing(
        landing, 200, origins=3, sensors=9, seed=12, start=datetime(2026, 11, 14, tzinfo=UTC),
        span_s=3600, late_rate=1.0, late_max_s=7 * 86400, dup_rate=0, name="late",
    )  # fmt: skip
    Pipeline(spark, str(landing), str(wh)).run()

    facts = report.write(spark, str(wh), out)
    page = _parse(out)
    want = ref.quality(ref.build(landing), T.LATE_AFTER_S)
    got = {
        (r[0], r[1]): (_n(r[2]), _n(r[3]), _n(r[4]), _n(r[5])) for r in page.tables["quality"] if r
    }
    assert got == want
    assert sum(v[1] for v in got.values()) > 0  # duplicates were there to count
    assert sum(v[2] for v in got.values()) > 200  # so were late readings (the week-late day)
    assert sum(v[3] for v in got.values()) > 0
    # BAD_LINES: six name origin "gw"; "not json at all" has no origin to name.
    quarantine = {(r[0], r[1]): _n(r[2]) for r in page.tables["quarantine"] if r}
    assert sum(n for (o, _), n in quarantine.items() if o == "gw") == len(BAD_LINES) - 1
    assert quarantine[("(unreadable)", "malformed_line")] == 1
    assert ("(unreadable)", "missing_id") not in quarantine  # it has an origin: "gw"
    # A day a week back widens the span past 6 hours: hourly windows.
    assert facts.per == "hour" and facts.level == "rollup_1h"
    # One heatmap and one panel per origin, each a real PNG of a sensible size.
    assert len(page.images) == 1 + 3
    for src in page.images:
        data = base64.b64decode(src.removeprefix("data:image/png;base64,"))
        img = mpimg.imread(io.BytesIO(data), format="png")
        assert img.shape[0] > 150 and img.shape[1] > 500, img.shape
    runs = page.tables["runs"]
    assert len([r for r in runs if r]) == 2


def test_report_cli_on_an_empty_warehouse_says_so(tmp_path: Path) -> None:
    # A warehouse whose runs have landed nothing yet (a misspelled path is refused instead:
    # tests/test_gateway_status_page.py::test_operator_errors_are_one_line).
    (tmp_path / "wh" / "readings").mkdir(parents=True)
    out = tmp_path / "r.html"
    cmd = [sys.executable, "-m", "pubcomp", "pipeline", "report", "--warehouse"]
    cmd += [str(tmp_path / "wh"), "--out", str(out), "--master", "local[1]"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=short_jvm_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"wrote .*r\.html: 0 origins", done.stdout)
    assert "holds no readings yet" in out.read_text()


def test_each_kind_is_drawn_for_what_it_is_and_every_window_has_its_width() -> None:
    """A gauge as its mean and band, a counter as bars of its sums, a total as steps of its
    last values; the last window as wide as the others, a partly covered one lighter,
    and second ticks that cannot be read as minutes."""
    t0 = datetime(2026, 11, 20, 10, 0, tzinfo=UTC)
    starts = [t0 + timedelta(minutes=i) for i in range(3)]
    end = mdates.date2num(t0 + timedelta(minutes=3))

    def series(kind: str) -> charts.Series:
        return charts.Series(
            "mm", kind, list(starts), mean=[1.0, 2.0, 3.0], low=[0.5, 1.5, 2.5],
            high=[1.5, 2.5, 3.5], sums=[0.6, 0.8, 0.2], last=[0.6, 1.4, 1.6], partial_last=True,
        )  # fmt: skip

    kinds = {"air.temp": "gauge", "rain.count": "counter", "rain.total": "total"}
    fig = charts.sensor_figure("gw", {n: series(k) for n, k in kinds.items()}, "minute")
    fig.canvas.draw()
    axes = {ax.get_title(loc="left").split(":")[0]: ax for ax in fig.axes}
    titles = {n: ax.get_title(loc="left") for n, ax in axes.items()}
    assert "mean per minute, min-max band" in titles["air.temp"]
    assert "sum per minute" in titles["rain.count"] and "lighter" in titles["rain.count"]
    assert "running total" in titles["rain.total"]

    bars = axes["rain.count"].patches
    assert [round(b.get_height(), 6) for b in bars] == [0.6, 0.8, 0.2]
    assert all(b.get_width() > 0 for b in bars)
    assert bars[-1].get_x() + bars[-1].get_width() == pytest.approx(end)
    assert bars[-1].get_facecolor()[3] < bars[0].get_facecolor()[3]  # partly covered
    for name, values in (("rain.total", [0.6, 1.4, 1.6]), ("air.temp", [1.0, 2.0, 3.0])):
        steps = [p for p in axes[name].patches if isinstance(p, StepPatch) and not p.get_fill()]
        assert list(steps[0].get_data().values) == values
        assert steps[0].get_data().edges[-1] == pytest.approx(end)  # the last window drawn
    plt.close(fig)
    # Two minutes of data: ticks every 30 s, each labelled as a time of day.
    two = charts.Series("C", "gauge", starts[:2], [1.0, 2.0], [0.5, 1.5], [1.5, 2.5])
    fig = charts.sensor_figure("gw", {"air.temp": two}, "minute")
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[-1].get_xticklabels() if t.get_text()]
    assert "10:00:30" in labels and not any(re.fullmatch(r"\d\d", t) for t in labels), labels
    plt.close(fig)
