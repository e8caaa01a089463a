"""The group commit: one transaction per group, ops in order, each op's failure its own,
waiters told only after the COMMIT, deadlines deciding when to commit."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from devkit.store_helpers import append, append_batches, apply, begin
from pubcomp.sync.groupcommit import GroupCommit
from pubcomp.sync.session import OutState
from pubcomp.sync.store import (
    IO_ERRORS,
    READ_ONLY,
    Message,
    Reading,
    Store,
    StoreFull,
    StoreUnwritable,
    add_to_ranges,
)


def reading(i: int) -> Reading:
    return Reading("t", float(i), "2026-11-23T00:00:00.000Z", "C")


def outbox_count(path: Path) -> int:
    """Read by a connection of its own: only what is committed is seen."""
    db = sqlite3.connect(path)
    try:
        n: int = db.execute("SELECT COALESCE(SUM(n), 0) FROM outbox").fetchone()[0]
    finally:
        db.close()
    return n


async def running(store: Store, **kw: Any) -> tuple[GroupCommit, asyncio.Task[None]]:
    gc = GroupCommit(store, **kw)
    return gc, asyncio.create_task(gc.run())


def test_ops_of_a_group_share_one_commit_and_run_in_order(tmp_path: Path) -> None:
    async def main(s: Store) -> tuple[list[Any], int, int]:
        gc, task = await running(s, commit_delay=0.2)
        commits0 = s.io.commits
        order: list[int] = []

        def op(i: int) -> Any:
            def fn(db: sqlite3.Connection) -> int:
                order.append(i)
                s.append_batches_in(db, [(None, [reading(i)])])
                return i

            return fn

        futs = [gc.submit(op(i)) for i in range(10)]
        results = await asyncio.gather(*futs)
        gc.close()
        await task
        return results, s.io.commits - commits0, len(order)

    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        results, commits, ran = asyncio.run(main(s))
        assert results == list(range(10)) and ran == 10
        assert commits == 1  # ten ops, one transaction, one fsync
        assert [r["value"] for r in s.readings_between(1, s.given_seq())] == list(range(10))


def test_a_failing_op_is_undone_alone_and_its_waiter_hears_why(tmp_path: Path) -> None:
    async def main(s: Store) -> list[Any]:
        gc, task = await running(s, commit_delay=0.05)

        def bad(db: sqlite3.Connection) -> None:
            s.append_batches_in(db, [(None, [reading(99)])])
            raise StoreFull("no room for this one")

        futs = [
            gc.submit(lambda db: s.append_batches_in(db, [(None, [reading(1)])])),
            gc.submit(bad),
            gc.submit(lambda db: s.append_batches_in(db, [(None, [reading(2)])])),
        ]
        out = await asyncio.gather(*futs, return_exceptions=True)
        gc.close()
        await task
        return out

    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        out = asyncio.run(main(s))
        assert out[0] == [True] and out[2] == [True]
        assert isinstance(out[1], StoreFull)
        values = [r["value"] for r in s.readings_between(1, s.given_seq())]
        assert values == [1.0, 2.0]  # the failed op's reading was undone with it


def test_a_waiter_hears_only_after_the_commit(tmp_path: Path) -> None:
    """MQTT-4.6.0-2/-3 rest on this: an acknowledgement sent on the future's result is
    never ahead of the data it covers."""
    path = tmp_path / "s.db"

    async def main(s: Store) -> list[int]:
        gc, task = await running(s, commit_delay=0.05)
        seen_at_result: list[int] = []
        for i in range(5):
            fut = gc.submit(lambda db, i=i: s.append_batches_in(db, [(None, [reading(i)])]))
            fut.add_done_callback(lambda _: seen_at_result.append(outbox_count(path)))
            await fut
        gc.close()
        await task
        return seen_at_result

    with Store(path, gateway_id="gw") as s:
        assert asyncio.run(main(s)) == [1, 2, 3, 4, 5]


def sqlite_error(code: int, name: str) -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError("disk I/O error")
    exc.sqlite_errorcode, exc.sqlite_errorname = code, name  # type: ignore[attr-defined]
    return exc


@pytest.mark.parametrize(
    ("code", "name", "kind"),
    [(778, "SQLITE_IOERR_WRITE", IO_ERRORS), (776, "SQLITE_READONLY_DBMOVED", READ_ONLY)],
)
def test_a_commit_the_file_system_refuses_fails_every_waiter_as_unwritable(
    tmp_path: Path, code: int, name: str, kind: str
) -> None:
    """A dying card: the COMMIT fails, every waiter hears StoreUnwritable (none hears a
    result: nothing of the group is durable), the store says since when; the next commit
    that succeeds clears it. (An IOERR on a mount that takes the probe file is I/O errors.)"""
    path = tmp_path / "s.db"

    async def main(s: Store) -> tuple[list[Any], list[Any]]:
        gc, task = await running(s, commit_delay=0.05)

        def refused(db: sqlite3.Connection) -> None:
            raise sqlite_error(code, name)  # the disk's refusal: the whole group is undone

        # The three ops run, then the disk refuses the last op of their group.
        futs = [
            gc.submit(lambda db, i=i: s.append_batches_in(db, [(None, [reading(i)])]))
            for i in range(3)
        ]
        futs.append(gc.submit(refused))
        first = await asyncio.gather(*futs, return_exceptions=True)
        assert not s.write_state.writable and s.write_state.kind == kind
        assert s.write_state.since is not None and name in (s.write_state.last_error or "")
        second = await asyncio.gather(
            gc.submit(lambda db: s.append_batches_in(db, [(None, [reading(7)])]))
        )
        gc.close()
        await task
        return first, second

    with Store(path, gateway_id="gw") as s:
        first, second = asyncio.run(main(s))
        assert all(isinstance(x, StoreUnwritable) and x.kind == kind for x in first), first
        assert "refusing new readings" in str(first[0])
        assert second == [[True]]
        assert s.write_state.writable and s.write_state.errors == 1
        assert [r["value"] for r in s.readings_between(1, s.given_seq())] == [7.0]


def test_lazy_ops_wait_for_their_deadline_or_ride_an_earlier_commit(tmp_path: Path) -> None:
    async def main(s: Store) -> tuple[int, int, bool]:
        gc, task = await running(s, commit_delay=0.0)
        lazy = gc.submit(lambda db: s.append_batches_in(db, [(None, [reading(1)])]), within=30)
        await asyncio.sleep(0)  # the loop turns: a lazy op alone does not commit
        before = s.io.commits
        assert not lazy.done()
        await gc.submit(lambda db: s.append_batches_in(db, [(None, [reading(2)])]), within=0)
        rode = lazy.done()  # committed with the urgent one, long before its 30 s
        gc.close()
        await task
        return before, s.io.commits, rode

    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        before, after, rode = asyncio.run(main(s))
        assert rode and after - before == 1


def test_sources_lead_the_group_and_close_commits_what_is_left(tmp_path: Path) -> None:
    async def main(s: Store) -> list[str]:
        gc, task = await running(s, commit_delay=0.0)
        log: list[str] = []
        held = [reading(7)]

        def source() -> None:
            if held:
                rs = list(held)
                held.clear()
                log.append("source")
                gc.submit_nowait(lambda db: s.append_batches_in(db, [(None, rs)]), within=0)

        gc.add_source(source)
        gc.poke(30)  # the source has something, and may wait 30 s ...
        fut = gc.submit(lambda db: log.append(f"op sees {s.given_seq()}"))
        await fut  # ... but rides this commit, ahead of the op
        gc.close()
        await task
        return log

    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        assert asyncio.run(main(s)) == ["source", "op sees 1"]


def test_message_seqs_of_a_node_are_kept_as_ranges() -> None:
    r: list[list[int]] = []
    for seq in (5, 3, 4, 9, 7, 8):
        r = add_to_ranges(r, seq)
    assert r == [[3, 5], [7, 9]]
    assert add_to_ranges(r, 6) == [[3, 9]]
    many: list[list[int]] = []
    for seq in range(0, 200, 2):  # 100 gaps: the oldest ranges merge, bounded
        many = add_to_ranges(many, seq)
    assert len(many) == 64 and many[-1] == [198, 198]


def test_store_dedups_node_keys_in_any_order_and_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    r = [reading(0)]
    with Store(path, gateway_id="gw") as s:
        got = append_batches(s, [("n/1/5", r), ("n/1/3", r), ("n/1/4", r), ("n/2/4", r)])
        assert got == [True, True, True, True]
        assert append_batches(s, [("n/1/4", r), ("n/1/6", r), ("x-key", r)]) == [False, True, True]
        assert append_batches(s, [("x-key", r)]) == [False]
    with Store(path) as s:
        assert append_batches(s, [("n/1/3", r), ("n/2/4", r), ("n/2/5", r)]) == [
            False,
            False,
            True,
        ]
        db = sqlite3.connect(path)
        rows = db.execute("SELECT producer, boot, seqs FROM node_seen ORDER BY boot").fetchall()
        db.close()
        assert rows == [("n", 1, "[[3,6]]"), ("n", 2, "[[4,5]]")]


def test_keys_in_a_store_made_before_schema_2_are_still_seen(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    with Store(path, gateway_id="gw"):
        pass
    db = sqlite3.connect(path)
    db.execute("INSERT INTO seen VALUES ('n/1/7', 0)")  # as schema 1 kept message keys
    db.commit()
    db.close()
    with Store(path) as s:
        assert append_batches(s, [("n/1/7", [reading(0)]), ("n/1/8", [reading(1)])]) == [
            False,
            True,
        ]


def test_a_seq_is_never_given_twice_even_after_the_outbox_drains(tmp_path: Path) -> None:
    from pubcomp.sync.session import OutState
    from pubcomp.sync.store import Message

    path = tmp_path / "s.db"
    with Store(path, gateway_id="gw") as s:
        first, last = append(s, [reading(i) for i in range(3)])
        begin(s, "k", [Message(0, 1, 2, OutState.QUEUED, "t", first, last)])
        assert apply(s, "k", completed=[1]) == 3
        assert s.stats()["backlog"] == 0
    with Store(path) as s:
        first, last = append(s, [reading(9)])
        assert first == last > 3  # a gap (the floor is raised a block ahead), never a repeat
        assert s.waiting(0, 10)[0][1]["id"] == f"gw/{s.epoch}/{first}"


@pytest.mark.parametrize("delay", [0.0, 0.01])
def test_intake_pipelined_submits_commit_in_groups(tmp_path: Path, delay: float) -> None:
    from pubcomp.gateway.intake import Intake

    async def main(s: Store) -> tuple[list[bool], int]:
        intake = Intake(s, commit_delay=delay)
        task = asyncio.create_task(intake.run())
        c0 = s.io.commits
        stored = await asyncio.gather(*(intake.submit(f"n/1/{i}", [reading(i)]) for i in range(50)))
        intake.close()
        await task
        return stored, s.io.commits - c0

    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        stored, commits = asyncio.run(main(s))
        assert all(stored) and commits <= 2  # fifty messages waiting together: one group


def test_a_node_that_sends_seldom_may_wait_longer_one_flat_out_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Patience: 5 % of the gap between a node's messages, at most max_hold, and only
    when that is longer than the commit delay (docs/architecture.md)."""
    import pubcomp.gateway.intake as intake_mod
    from pubcomp.gateway.intake import Intake

    clock = [100.0]
    monkeypatch.setattr(intake_mod.time, "monotonic", lambda: clock[0])

    async def main() -> list[float | None]:
        with Store(tmp_path / "s.db", gateway_id="gw") as s:
            intake = Intake(s, commit_delay=0.01, max_hold=0.5)
            out = []
            for step in (0.0, 20.0, 20.0, 0.005, 0.005):  # every 20 s, then flat out
                clock[0] += step
                out.append(intake.patience("n"))
            return out

    first, slow, slow_again, burst, flat = asyncio.run(main())
    assert first is None  # no gap known yet
    assert slow == pytest.approx(0.5) and slow_again == pytest.approx(0.5)  # 1 s, capped
    assert burst is None and flat is None  # speeding up: served at once


def test_a_group_goes_at_once_when_every_producer_waits_on_it(tmp_path: Path) -> None:
    """Four nodes with one message in flight each: once all four wait, the group is
    full and commits without its (here hour-long) delay; three are not enough. One
    node keeping eight in flight is full at half of them, before its window stalls."""

    async def settle(gc: GroupCommit) -> None:
        for _ in range(20):  # let the loop run: a group that may go, goes
            await asyncio.sleep(0)

    def op(s: Store, i: int) -> Any:
        return lambda db: s.append_batches_in(db, [(None, [reading(i)])])

    async def scenario(s: Store, warm: list[str], then: list[str]) -> tuple[bool, int]:
        """``warm`` waits together once (within=0: no delay to learn from); then all
        of ``then`` but the last are submitted (done yet?), then the last (commits?)."""
        gc, task = await running(s, commit_delay=3600)
        async with asyncio.timeout(60):
            await asyncio.gather(*(gc.submit(op(s, 0), within=0, peer=p) for p in warm))
            c0 = s.io.commits
            early = [gc.submit(op(s, 1), peer=p) for p in then[:-1]]
            await settle(gc)
            went_early = any(f.done() for f in early)
            await asyncio.gather(*early, gc.submit(op(s, 2), peer=then[-1]))
            commits = s.io.commits - c0
        gc.close()
        await task
        return went_early, commits

    async def main(s: Store) -> dict[str, Any]:
        four = [f"n{i}" for i in range(4)]
        return {
            "four nodes": await scenario(s, four, four),
            "one node, 8 in flight": await scenario(s, ["p"] * 8, ["p"] * 4),
        }

    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        seen = asyncio.run(main(s))
    # (went before the last arrived, commits): never early, then one commit for all
    assert seen == {"four nodes": (False, 1), "one node, 8 in flight": (False, 1)}


def test_on_a_full_disk_a_group_commits_its_deliveries_and_refuses_the_rest(
    tmp_path: Path,
) -> None:
    """A real full disk (a 4 MB tmpfs): a group holding new readings and a delivery. The
    WAL truncated is not room enough, so the delivery commits alone (with the reserve)
    and the readings' waiter hears StoreFull: never acknowledged, never stored."""
    from tests.test_store import readings, tiny_tmpfs

    async def main(s: Store) -> list[Any]:
        gc, task = await running(s, commit_delay=0.05)
        futs = [
            gc.submit(lambda db: s.append_batches_in(db, [(None, readings(2000))])),
            gc.submit(lambda db: s.apply_in(db, "k", completed=[1]), frees=True),
        ]
        out = await asyncio.gather(*futs, return_exceptions=True)
        gc.close()
        await task
        return out

    with tiny_tmpfs(tmp_path / "disk", "4m") as disk, Store(disk / "s.db") as s:
        append(s, readings(100))
        begin(s, "k", [Message(0, 1, 2, OutState.QUEUED, "t", 1, 100)])
        with pytest.raises(StoreFull):
            for i in range(1, 10_000):
                append(s, readings(100, i * 100))
        backlog, refused = s.stats()["backlog"], s.refused_disk_full
        added, delivered = asyncio.run(main(s))
        assert isinstance(added, StoreFull) and "disk full" in str(added)
        assert delivered == 100 and s.refused_disk_full == refused + 1
        assert s.stats()["backlog"] == backlog - 100


def test_readings_an_op_claims_are_not_dropped_by_an_op_ahead_of_it(tmp_path: Path) -> None:
    """The uplink builds a message's payload before the op committing its packet id runs
    (``claims``): an op ahead of it in the same group, a ``drop_oldest`` quota drop, must
    drop newer waiting readings, never those (with ``claims=0`` it drops seqs 1-100: the
    message would go out with readings the store counts as dropped)."""

    async def main(s: Store) -> None:
        gc, task = await running(s, commit_delay=0.05)
        batch = [reading(i) for i in range(1000, 1010)]
        m = Message(0, 1, 2, OutState.QUEUED, "t", 1, 100)
        await asyncio.gather(
            gc.submit(lambda db: s.append_batches_in(db, [(None, batch)])),
            gc.submit(lambda db: s.begin_messages_in(db, "k", [m]), frees=True, claims=100),
        )
        assert gc.claimed() == 0  # committed: nothing claimed any more
        gc.close()
        await task

    with Store(tmp_path / "s.db", gateway_id="gw", policy="drop_oldest") as s:
        append(s, [reading(i) for i in range(200)])  # rows 1-100, 101-200
        s.quota_bytes = s.stats()["store_bytes"]  # full from now on
        asyncio.run(main(s))
        assert s.counters()["dropped_quota"] >= 64
        assert len(s.readings_between(1, 100)) == 100  # the claimed message is whole
        assert s.readings_between(101, 200) == []  # the newer waiting row went instead


def test_a_cancelled_loop_fails_its_waiters_and_refuses_more(tmp_path: Path) -> None:
    """Cancelled (as ``asyncio.run`` cancels what is left at its end), the loop tells the
    waiters of the group it stopped waiting for and of the ops still queued that their op
    is not acknowledged: before, they, and a gateway's stop that awaited one, hung."""
    from pubcomp.sync.errors import CommitStopped

    async def main(s: Store) -> list[str]:
        gc, task = await running(s, commit_delay=0.0)
        started, release = threading.Event(), threading.Event()

        def slow(db: sqlite3.Connection) -> None:
            started.set()
            release.wait(30)

        in_flight = gc.submit(slow)
        await asyncio.to_thread(started.wait, 30)
        queued = gc.submit(lambda db: None)
        task.cancel()
        told = await asyncio.wait_for(
            asyncio.gather(in_flight, queued, return_exceptions=True), timeout=30
        )
        release.set()
        with pytest.raises(CommitStopped):
            gc.submit(lambda db: None)
        return [type(t).__name__ for t in told]

    with Store(tmp_path / "s.db", gateway_id="gw") as s:
        assert asyncio.run(main(s)) == ["CommitStopped", "CommitStopped"]
