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
    """One sensor's rollup windows, oldest first."""

    unit: str = ""
    starts: list[datetime] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _time_axis(ax: plt.Axes) -> None:
    locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))


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


def _one(per: str) -> timedelta:
    return {"minute": timedelta(minutes=1), "hour": timedelta(hours=1)}.get(per, timedelta(days=1))


def sensor_panels(origin: str, series: dict[str, Series], per: str) -> bytes:
    """One panel per sensor: the mean of each window, with its min-max band."""
    names = sorted(series)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(10, 1.7 * len(names) + 0.5), sharex=True, squeeze=False
    )
    for ax, name in zip(axes[:, 0], names, strict=True):
        s = series[name]
        x = mdates.date2num(s.starts)
        ax.fill_between(x, s.low, s.high, color="tab:blue", alpha=0.2, linewidth=0, step="post")
        ax.plot(x, s.mean, color="tab:blue", linewidth=1, drawstyle="steps-post")
        ax.set_ylabel(s.unit or "value", fontsize=8)
        ax.set_title(f"{name}: mean per {per}, min-max band", fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    _time_axis(axes[-1, 0])
    fig.suptitle(origin, fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    return png(fig)
