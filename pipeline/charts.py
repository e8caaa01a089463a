"""The report's pictures: matplotlib figures rendered to PNG bytes (no display needed)."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import matplotlib

matplotlib.use("Agg")  # headless: a cloud VM or CI has no display

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

DPI = 80


@dataclass
class Series:
    """One sensor's rollup windows, oldest first, and what its values are (its kind)."""

    unit: str = ""
    kind: str = "gauge"
    starts: list[datetime] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)
    sums: list[float] = field(default_factory=list)
    last: list[float] = field(default_factory=list)
    # The first window began before the data did, or the last ended after it: drawn
    # lighter, since a counter's sum there (or a gauge's mean) covers part of a window.
    partial_first: bool = False
    partial_last: bool = False


# How each kind is drawn, and how its panel says so (docs/pipeline.md).
TITLES = {
    "gauge": "mean per {per}, min-max band",
    "counter": "sum per {per}",
    "total": "running total at the end of each {per}",
}


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _time_axis(ax: plt.Axes) -> None:
    locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
    formatter = mdates.ConciseDateFormatter(locator)
    # Seconds as HH:MM:SS: the default "10, 20, 30" between minute labels read as minutes.
    formatter.formats[5] = "%H:%M:%S"
    formatter.zero_formats[5] = "%H:%M"
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(formatter)


def fleet_heatmap(
    origins: list[str], starts: list[datetime], counts: np.ndarray, per: str
) -> bytes:
    """Readings per origin (rows) and window (columns): a dark cell is a gap."""
    height = min(0.22 * len(origins) + 1.2, 24.0)
    fig, ax = plt.subplots(figsize=(10, height))
    edges = [*starts, starts[-1] + (starts[-1] - starts[-2] if len(starts) > 1 else _one(per))]
    mesh = ax.pcolormesh(
        mdates.date2num(edges),
        np.arange(len(origins) + 1),
        counts,
        cmap="viridis",
        shading="flat",
        vmin=0,  # a gap (0) is dark, a normal hour bright: noise between full hours is not news
    )
    ax.set_yticks(np.arange(len(origins)) + 0.5, labels=origins, fontsize=7)
    ax.invert_yaxis()
    _time_axis(ax)
    ax.set_title(f"readings per origin and {per} (UTC)", fontsize=10)
    fig.colorbar(mesh, ax=ax, label=f"readings / {per}", pad=0.01)
    return png(fig)


def completeness_grid(
    gateways: list[str],
    days: list[str],
    explained: np.ndarray,
    unexplained: np.ndarray,
    expected: np.ndarray,
) -> bytes:
    """Per gateway (rows) and day (columns): a complete day is pale, a day with readings
    missing for a reason amber, a day with any unexplained red; each gap's count written
    in its cell, so the gaps stand out whatever their share."""
    from matplotlib.colors import ListedColormap

    state = np.where(unexplained > 0, 3, np.where(explained > 0, 2, np.where(expected > 0, 1, 0)))
    cmap = ListedColormap(["#ffffff", "#e3f4e3", "#ffc766", "#e0474c"])
    height = min(0.32 * len(gateways) + 1.4, 24.0)
    width = min(max(0.55 * len(days) + 2.5, 6.0), 16.0)
    fig, ax = plt.subplots(figsize=(width, height))
    ax.pcolormesh(
        np.arange(len(days) + 1), np.arange(len(gateways) + 1), state, cmap=cmap, vmin=0, vmax=3,
        edgecolors="#ffffff", linewidth=1.5,
    )  # fmt: skip
    for i in range(len(gateways)):
        for j in range(len(days)):
            n_bad, n_ok = int(unexplained[i, j]), int(explained[i, j])
            if n_bad or n_ok:
                text = f"{n_bad:,}" if n_bad else f"{n_ok:,}"
                ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=7,
                        color="white" if n_bad else "#333")  # fmt: skip
    ax.set_yticks(np.arange(len(gateways)) + 0.5, labels=gateways, fontsize=7)
    ax.set_xticks(np.arange(len(days)) + 0.5, labels=[d[5:] for d in days], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(
        "missing per gateway and day (UTC): red unexplained (count), amber held, evicted, "
        "refused or dropped (count), green complete",
        fontsize=9,
    )
    return png(fig)


def _one(per: str) -> timedelta:
    return {"minute": timedelta(minutes=1), "hour": timedelta(hours=1)}.get(per, timedelta(days=1))


def sensor_panels(origin: str, series: dict[str, Series], per: str) -> bytes:
    return png(sensor_figure(origin, series, per))


def sensor_figure(origin: str, series: dict[str, Series], per: str) -> Figure:
    """One panel per sensor, drawn by its kind: a gauge's mean with its min-max band, a
    counter's sum as bars, a total's value at each window's end as steps. Each window
    has its width (the last one too); windows the data only partly covers are lighter."""
    names = sorted(series)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(10, 1.7 * len(names) + 0.5), sharex=True, squeeze=False
    )
    step = _one(per)
    for ax, name in zip(axes[:, 0], names, strict=True):
        s = series[name]
        edges = mdates.date2num([*s.starts, s.starts[-1] + step])
        alpha = np.ones(len(s.starts))
        alpha[0] = 0.35 if s.partial_first else 1.0
        alpha[-1] = 0.35 if s.partial_last else alpha[-1]
        if s.kind == "counter":
            colours = [(*matplotlib.colors.to_rgb("tab:blue"), 0.8 * a) for a in alpha]
            ax.bar(
                edges[:-1], s.sums, width=np.diff(edges), align="edge", color=colours,
                edgecolor="white", linewidth=0.5,
            )  # fmt: skip
            unit = f"{s.unit or 'count'} / {per}"
        else:
            values = s.last if s.kind == "total" else s.mean
            if s.kind == "gauge":
                ax.stairs(s.high, edges, baseline=s.low, fill=True, color="tab:blue", alpha=0.2)
            # baseline=None: no drop to zero at either end (a temperature is not 0 there)
            ax.stairs(values, edges, baseline=None, color="tab:blue", linewidth=1)
            for i in (0, len(values) - 1):
                if alpha[i] < 1:  # a partial window: dashed over its own width
                    ax.hlines(values[i], edges[i], edges[i + 1], colors="white", linestyles=":")
            unit = s.unit or "value"
        ax.set_ylabel(unit, fontsize=8)
        note = ", lighter: partly covered" if s.partial_first or s.partial_last else ""
        title = TITLES.get(s.kind, TITLES["gauge"]).format(per=per)
        ax.set_title(f"{name}: {title}{note}", fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    _time_axis(axes[-1, 0])
    fig.suptitle(f"{origin} (UTC)", fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    return fig
