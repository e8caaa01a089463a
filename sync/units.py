"""Figures as an operator reads them: durations, byte counts, counted things (status,
fleet views)."""

from __future__ import annotations


def duration(s: float | None) -> str:
    """Seconds as "42 s", "17 min", "3.5 h" or "2.0 d"; "-" for none."""
    if s is None:
        return "-"
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def size(n: float | None) -> str:
    """Bytes as kB below 1 MB (a new store is not "0.0 MB"), MB, or GB from 10 GB on
    (80,498.2 MB reads better as 80.5 GB)."""
    if n is None:
        return "-"
    if n >= 10e9:
        return f"{n / 1e9:,.1f} GB"
    if n >= 1e6:
        return f"{n / 1e6:,.1f} MB"
    return f"{n / 1e3:,.1f} kB"


def counted(n: int, noun: str) -> str:
    """The noun agrees with its number: "1 message", "1,200 messages"."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"
