"""Clock sync: readings stamped before sync are flagged, then corrected exactly once synced."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from devkit.gateway_helpers import offline_config
from devkit.store_helpers import append, begin
from pubcomp.gateway import service
from pubcomp.gateway.clock import (
    CORRECTED,
    UNSYNCED,
    ClockWatch,
    correct_waiting,
    iso,
    kernel_synced,
)
from pubcomp.gateway.intake import Intake
from pubcomp.sensors.api import ClockFix
from pubcomp.sync.store import Reading, Store


class FakeTime:
    def __init__(self, wall: float, mono: float) -> None:
        self.w, self.m = wall, mono
        self.synced: bool | None = False

    def wall(self) -> float:
        return self.w

    def mono(self) -> float:
        return self.m

    def kernel(self) -> bool | None:
        return self.synced

    def tick(self, s: float) -> None:
        self.w += s
        self.m += s


def _t(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def test_kernel_state_is_read_from_adjtimex() -> None:
    assert kernel_synced() in (True, False)  # a Linux kernel always answers


def test_unsynced_stamps_are_corrected_exactly_even_across_a_clock_step() -> None:
    true_start = 1_800_000_000.0
    ft = FakeTime(wall=true_start - 86_400 * 30, mono=100.0)  # booted a month in the past
    clock = ClockWatch(ft.kernel, wall=ft.wall, mono=ft.mono)
    assert clock.source == "none"
    ft.tick(5)
    ts1, flags1 = clock.stamp(ft.mono())
    assert flags1 == (UNSYNCED,)
    # NTP steps the wall clock first; the kernel reports sync a little later.
    ft.w = true_start + 5.0
    ft.tick(1)
    ts2, flags2 = clock.stamp(ft.mono())  # stamped after the step, before sync was noticed
    assert flags2 == (UNSYNCED,)
    ft.synced = True
    shift = clock.poll()
    assert shift is not None
    # Both stamps become the true times they were taken at (5 s and 6 s after true_start).
    assert _t(ts1) + shift == pytest.approx(true_start + 5.0, abs=0.002)
    assert _t(ts2) + shift == pytest.approx(true_start + 6.0, abs=0.002)
    ft.tick(1)
    assert clock.stamp(ft.mono()) == (iso(true_start + 7.0), ())
    assert clock.poll() is None  # already synced: nothing more to correct


def test_gps_time_needs_two_agreeing_sane_fixes() -> None:
    ft = FakeTime(wall=1_000_000_000.0, mono=50.0)  # 2001: a Pi with a dead clock
    clock = ClockWatch(ft.kernel, wall=ft.wall, mono=ft.mono)
    rollover = datetime(2006, 4, 2, tzinfo=UTC)  # a receiver with the week-number bug
    assert clock.on_fix(ClockFix("gps", rollover, mono=50.0)) is None
    assert clock.gps_rejected == 1
    real = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    assert clock.on_fix(ClockFix("gps", real, mono=50.0)) is None  # one fix is not enough
    # A second fix that disagrees with the monotonic clock (a glitch) is refused.
    assert clock.on_fix(ClockFix("gps", real + timedelta(seconds=30), mono=51.0)) is None
    assert clock.source == "none"
    assert clock.on_fix(ClockFix("gps", real + timedelta(seconds=2), mono=52.0)) is None
    shift = clock.on_fix(ClockFix("gps", real + timedelta(seconds=3), mono=53.0))
    assert clock.source == "gps" and shift is not None
    assert clock.stamp(60.0) == (iso(real.timestamp() + 10.0), ())


def test_store_shifts_only_waiting_unsynced_readings_of_this_run(tmp_path: Path) -> None:
    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        old = "2001-09-09T01:46:40.000Z"
        append(s, [Reading("a", 1.0, old, flags=[UNSYNCED])])  # a previous run's: left alone
        first_new = s.given_seq()
        append(s, [Reading("b", 2.0, old, flags=[UNSYNCED]) for _ in range(3)])
        append(s, [Reading("c", 3.0, old)])  # stamped while synced: no flag, left alone
        # The first new reading is already in a message: its payload must not change.
        begin(s, "sess", [_message(first_new + 1)])
        n = _correct(s, first_new, 3600.5)
        assert n == 2
        rows = {r["id"]: r for r in s.readings_between(1, s.given_seq())}
        by_seq = [rows[f"gw/{s.epoch}/{i}"] for i in range(1, 6)]
        assert [r["ts"] for r in by_seq] == [old, old, *["2001-09-09T02:46:40.500Z"] * 2, old]
        assert by_seq[2]["flags"] == [UNSYNCED, CORRECTED]
        assert by_seq[1]["flags"] == [UNSYNCED]
        assert _correct(s, first_new, 10.0) == 0  # never twice
        assert s.counters()["clock_corrected"] == 2


def _correct(s: Store, after_seq: int, shift_s: float) -> int:
    n: int = s.commit(lambda db: correct_waiting(s, db, after_seq, shift_s))
    return n


def _message(seq: int) -> Any:
    from pubcomp.sync.session import OutState
    from pubcomp.sync.store import Message

    return Message(0, 1, 2, OutState.QUEUED, "t", seq, seq)


def test_an_operation_runs_after_the_readings_queued_before_it(tmp_path: Path) -> None:
    """A clock correction is an op in the group commit: it sees every reading added before it."""

    async def main(s: Store) -> int:
        intake = Intake(s)
        task = asyncio.create_task(intake.run())
        for i in range(50):
            intake.add(Reading("x", float(i), "2026-01-01T00:00:00.000Z"))
        seen: int = await intake.commits.submit(lambda db: s.given_seq())
        intake.close()
        await task
        return seen

    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        assert asyncio.run(main(s)) == 50


def test_gateway_corrects_readings_taken_before_the_clock_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path: a simulated sensor, a wall clock an hour slow, then NTP sync."""
    monkeypatch.setattr(service, "CLOCK_POLL_S", 0.2)
    synced = False
    slow = 3600.0
    clock = ClockWatch(
        lambda: synced, wall=lambda: time.time() - (0 if synced else slow), mono=time.monotonic
    )
    # The uplink reaches nothing: every reading waits in the store, where it can be corrected.
    cfg = offline_config(
        tmp_path,
        "gw-clock",
        gpio="simulated",
        sensors=[{"id": "t", "type": "simulated", "interval_s": 0.05}],
    )
    t_start = t_sync = t_seen = 0.0

    async def committed(gw: service.Gateway, n: int) -> None:
        """Until the gateway has committed ``n`` more readings (however loaded the machine)."""
        while getattr(gw, "intake", None) is None:
            await asyncio.sleep(0.02)
        target = gw.intake.stats.committed_readings + n
        while gw.intake.stats.committed_readings < target:
            await asyncio.sleep(0.02)

    async def seen_synced() -> None:
        while not clock.synced:
            await asyncio.sleep(0.02)

    async def main() -> int:
        nonlocal synced, t_start, t_sync, t_seen
        t_start = time.time()
        gw = service.Gateway(cfg, clock=clock)
        stop = asyncio.Event()
        run = asyncio.create_task(gw.run(stop))
        await asyncio.wait_for(committed(gw, 12), 60)
        synced = True
        t_sync = time.time()
        # Readings stay flagged until the clock loop's next poll sees the sync, however
        # late a busy machine runs it: the checks below count from when it saw it.
        await asyncio.wait_for(seen_synced(), 60)
        t_seen = time.time()
        await asyncio.wait_for(committed(gw, 20), 60)
        stop.set()
        return await run

    assert asyncio.run(main()) == 0
    with Store(tmp_path / "gw.db") as s:
        rows = s.readings_between(1, s.given_seq())
    rows = [r for r in rows if not r["sensor"].startswith("$")]  # the stop's $ledger record
    before = [r for r in rows if UNSYNCED in r["flags"]]
    after = [r for r in rows if UNSYNCED not in r["flags"]]
    assert all(r["flags"] == ["simulated"] for r in after)  # a made-up signal says so
    assert len(before) >= 10 and len(after) >= 10, (len(before), len(after))
    assert all(CORRECTED in r["flags"] for r in before)
    # Corrected stamps are true times: within the run, and before the sync was seen.
    assert all(t_start - 0.3 < _t(r["ts"]) <= t_seen + 0.3 for r in before)
    assert all(_t(r["ts"]) >= t_sync - 0.3 for r in after)
