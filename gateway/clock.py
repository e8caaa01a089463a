"""Is the wall clock right? And what time is it, if it is not?

A Pi has no real-time clock: it boots with the time it saved at shutdown
(fake-hwclock) and is wrong until NTP, or a GPS receiver, says otherwise. The
gateway asks the kernel (``adjtimex``: TIME_ERROR / STA_UNSYNC means no time
daemon has disciplined the clock) and accepts GPS time from the NMEA driver
once two fixes agree with the monotonic clock.

While unsynchronised, timestamps are taken as ``reference + monotonic`` with a
reference fixed when the gateway started, and flagged ``clock_unsynced``. When
the clock syncs, one number, ``shift = true offset - reference``, corrects
every such timestamp exactly, however the wall clock was stepped in between;
the corrected readings keep ``clock_unsynced`` and gain ``clock_corrected``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sqlite3
import time
from collections.abc import Callable

from pubcomp.sensors.api import ClockFix

from ..sync.store import Store
from ..sync.wire import wire_time

log = logging.getLogger(__name__)

TIME_ERROR = 5  # adjtimex: clock not synchronised
GPS_MIN_YEAR = 2025  # a GPS week-number rollover puts receivers ~19.6 years in the past
GPS_AGREEMENT_S = 1.0  # two fixes must agree with the monotonic clock this closely
GPS_DISAGREEMENT_S = 2.0  # a synced kernel clock wins over a GPS this far off

UNSYNCED = "clock_unsynced"
CORRECTED = "clock_corrected"


def correct_waiting(store: Store, db: sqlite3.Connection, after_seq: int, shift_s: float) -> int:
    """Inside the caller's transaction: shift this run's waiting unsynced readings (seqs
    above ``after_seq``) by ``shift_s``, flag them ``clock_corrected`` and count them in
    the store's counters, so the count is durable with the correction it describes."""
    n = store.shift_times_in(db, after_seq, shift_s, UNSYNCED, CORRECTED)
    store.count_in(db, CORRECTED, n)
    return n


def kernel_synced() -> bool | None:
    """True if a time daemon disciplines the clock; None if the kernel cannot say."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        timex = ctypes.create_string_buffer(512)  # struct timex is 208 bytes; modes=0 reads only
        state: int = libc.adjtimex(timex)
    except (OSError, AttributeError):
        return None
    if state < 0:
        return None
    return state != TIME_ERROR


# Replaces what the kernel says, for tests only: they run several gateways on one machine,
# some synced and some not. Set by devkit/hooked.py (PUBCOMP_CLOCK_KERNEL), never by the
# product or its environment (issue 25).
_forced: bool | None = None


def force_kernel_state(synced: bool | None) -> None:
    """Make ``kernel_check`` say ``synced`` whatever the kernel says (None: ask it again)."""
    global _forced
    _forced = synced


def kernel_check() -> Callable[[], bool | None]:
    """``kernel_synced``, unless a test forced the answer (``force_kernel_state``)."""
    forced = _forced
    if forced is not None:
        log.warning("the kernel's clock state is not asked: forced %s by a test hook",
                    "synced" if forced else "unsynced")  # fmt: skip
        return lambda: forced
    return kernel_synced


def iso(t: float) -> str:
    return wire_time(t)


class ClockWatch:
    """The gateway's idea of the time, and whether to trust it.

    ``source`` is "kernel" (NTP/chrony synced), "gps" (a sane GPS fix, kernel
    unsynced) or "none". ``stamp(mono)`` gives a reading's ISO time and flags;
    ``poll()`` and ``on_fix()`` return the shift to apply to earlier unsynced
    stamps when the clock has just become trustworthy, else None.
    """

    def __init__(
        self,
        kernel: Callable[[], bool | None] = kernel_synced,
        *,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self._kernel, self._wall, self._mono = kernel, wall, mono
        self.reference = wall() - mono()  # used for stamps while unsynced
        self.source = "none"
        self._gps_offset: float | None = None
        self._last_fix: ClockFix | None = None
        self.corrections = 0
        self.gps_rejected = 0
        self.poll()

    @property
    def synced(self) -> bool:
        return self.source != "none"

    def offset(self) -> float:
        """Wall time minus monotonic time, by the best source."""
        if self.source == "kernel":
            return self._wall() - self._mono()
        if self.source == "gps" and self._gps_offset is not None:
            return self._gps_offset
        return self.reference

    def stamp(self, mono: float) -> tuple[str, tuple[str, ...]]:
        ts = iso(self.offset() + mono)
        return (ts, ()) if self.synced else (ts, (UNSYNCED,))

    def poll(self) -> float | None:
        synced = self._kernel()
        if synced and self.source != "kernel":
            if self._gps_offset is not None:
                gap = abs(self._gps_offset - (self._wall() - self._mono()))
                if gap > GPS_DISAGREEMENT_S:
                    log.warning("GPS time differs from the synced system clock by %.1f s", gap)
            return self._became("kernel", self._wall() - self._mono())
        if not synced and self.source == "kernel":
            # Lost sync (the time daemon stopped): stamp from the last good offset,
            # flagged, so the next sync corrects the drift since.
            self.reference = self._wall() - self._mono()
            self.source = "gps" if self._gps_offset is not None else "none"
            log.warning("system clock lost synchronisation; now %s", self.source)
        return None

    def on_fix(self, fix: ClockFix) -> float | None:
        """A GPS time: trusted once two fixes agree with the monotonic clock."""
        prev, self._last_fix = self._last_fix, fix
        if fix.utc.year < GPS_MIN_YEAR:
            self.gps_rejected += 1
            return None
        offset = fix.utc.timestamp() - fix.mono
        if prev is None or prev.utc.year < GPS_MIN_YEAR:
            return None
        if abs(offset - (prev.utc.timestamp() - prev.mono)) > GPS_AGREEMENT_S:
            self.gps_rejected += 1
            return None
        self._gps_offset = offset
        if self.source == "none":
            return self._became("gps", offset)
        return None

    def _became(self, source: str, offset: float) -> float | None:
        was, self.source = self.source, source
        if was != "none":
            return None  # stamps were already good (GPS, now NTP too): nothing to correct
        shift = offset - self.reference
        log.info("clock synchronised by %s; earlier stamps shift by %+.3f s", source, shift)
        self.corrections += 1
        return shift
