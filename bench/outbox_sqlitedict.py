"""sqlitedict as the outbox, against pubcomp's session store doing the same moves.

The design card named sqlitedict for the outbox (issue 17). Both sides here take
N readings through the moves the uplink makes for each QoS 2 message, one
reading per message, each move committed before the protocol step it covers
(design rules 1-3):

1. queued: the reading is stored;
2. in flight: it gets a packet id (before the PUBLISH is written);
3. released: PUBREC received (before the PUBREL is written);
4. done: PUBCOMP received, the reading is forgotten.

- pubcomp: ``sync.store.Store`` (one SQLite file, WAL, ``synchronous=FULL``):
  ``append``, ``begin_messages``, ``apply(released=)``, ``apply(completed=)``,
  each one transaction. Taking a reading into flight writes one message row that
  claims its seq; the reading does not move.
- sqlitedict 2.1: one ``SqliteDict`` table for queued readings and one for in-flight
  ones, in the same file, ``autocommit=True``. Step 2 is two commits (add to in
  flight, delete from queued): each table has its own connection and thread, so
  no transaction spans both. sqlitedict runs ``PRAGMA synchronous=OFF`` on every
  connection it opens; the third row forces ``synchronous=FULL`` through its
  connection (``SqliteDict.conn.execute``) to show what durability would cost it,
  the fourth does the same in WAL mode (one fsync per commit, as pubcomp's).

Each system runs in a child process under ``strace -f -c -e trace=fsync,fdatasync``
(fsyncs counted as the system calls the process makes; without strace: "-"),
and the child reads its own ``write_bytes`` from /proc/self/io at the end (bytes
it sent towards the disk, all threads). Printed per reading: fsyncs, bytes
written, and the time per reading.

Then the crash: a child moves one reading from queued to in flight and SIGKILLs
itself between the two tables' commits, in either order (add first, or delete
first); the parent opens the file again and says where the reading is. The same
kill after pubcomp's one-transaction move, for contrast.

    python bench/outbox_sqlitedict.py [--readings 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # devkit/ and pubcomp run from the checkout

from devkit.store_helpers import append, apply, begin  # noqa: E402
from pubcomp.sync.session import OutState  # noqa: E402
from pubcomp.sync.store import Message, Reading, Store  # noqa: E402

SESSION = "bench"
TOPIC = "telemetry/gw/readings"
SYSTEMS = ("pubcomp", "sqlitedict", "sqlitedict-full", "sqlitedict-wal")
LABELS = {
    "pubcomp": "pubcomp Store (WAL, synchronous=FULL)",
    "sqlitedict": "sqlitedict, autocommit (as shipped: synchronous=OFF)",
    "sqlitedict-full": "sqlitedict, autocommit, synchronous=FULL forced",
    "sqlitedict-wal": "sqlitedict, autocommit, WAL, synchronous=FULL forced",
}


def write_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no write_bytes in /proc/self/io")


def reading(i: int) -> dict[str, Any]:
    return {"id": f"gw/1/{i}", "sensor": f"s{i % 7}", "ts": "2026-11-24T00:00:00.000Z",
            "value": float(i), "unit": "C"}  # fmt: skip


# ---------------------------------------------------------------- the moves, per system


class StoreOutbox:
    def __init__(self, path: Path) -> None:
        self.store = Store(path, gateway_id="gw")
        self.msgs: dict[str, tuple[int, int]] = {}  # reading id -> (seq, packet id)

    def queue(self, r: dict[str, Any]) -> None:
        first, _ = append(self.store, [Reading(r["sensor"], r["value"], r["ts"], r["unit"])])
        self.msgs[r["id"]] = (first, 0)

    def in_flight(self, rid: str, packet_id: int) -> None:
        seq, _ = self.msgs[rid]
        msg = Message(0, packet_id, 2, OutState.QUEUED, TOPIC, seq, seq)
        begin(self.store, SESSION, [msg])
        self.msgs[rid] = (seq, packet_id)

    def released(self, rid: str) -> None:
        apply(self.store, SESSION, released=[self.msgs[rid][1]])

    def done(self, rid: str) -> None:
        apply(self.store, SESSION, completed=[self.msgs.pop(rid)[1]])

    def close(self) -> None:
        self.store.close()


class DictOutbox:
    def __init__(self, path: Path, *, full: bool, wal: bool = False) -> None:
        from sqlitedict import SqliteDict

        mode = "WAL" if wal else "DELETE"  # DELETE is sqlitedict's default journal
        self.queued = SqliteDict(str(path), "queued", autocommit=True, journal_mode=mode)
        self.inflight = SqliteDict(str(path), "inflight", autocommit=True, journal_mode=mode)
        if full:
            for d in (self.queued, self.inflight):
                d.conn.execute("PRAGMA synchronous=FULL")

    def queue(self, r: dict[str, Any]) -> None:
        self.queued[r["id"]] = r

    def in_flight(self, rid: str, packet_id: int, kill: str | None = None) -> None:
        r = self.queued[rid]
        if kill == "delete-first":
            del self.queued[rid]
            os.kill(os.getpid(), signal.SIGKILL)
        self.inflight[rid] = {"reading": r, "packet_id": packet_id, "state": "PUBLISH_SENT"}
        if kill == "add-first":
            os.kill(os.getpid(), signal.SIGKILL)
        del self.queued[rid]

    def released(self, rid: str) -> None:
        entry = self.inflight[rid]
        entry["state"] = "PUBREL_SENT"
        self.inflight[rid] = entry

    def done(self, rid: str) -> None:
        del self.inflight[rid]

    def close(self) -> None:
        self.queued.close()
        self.inflight.close()


def open_outbox(system: str, path: Path) -> StoreOutbox | DictOutbox:
    if system == "pubcomp":
        return StoreOutbox(path)
    return DictOutbox(path, full=system != "sqlitedict", wal=system == "sqlitedict-wal")


def child_moves(system: str, path: Path, n: int) -> None:
    """The measured run: n readings through the four moves, one commit each."""
    box = open_outbox(system, path)
    before = write_bytes()
    t0 = time.perf_counter()
    for i in range(n):
        r = reading(i)
        box.queue(r)
        box.in_flight(r["id"], i % 65535 + 1)
        box.released(r["id"])
        box.done(r["id"])
    box.close()
    print(json.dumps({"bytes": write_bytes() - before, "seconds": time.perf_counter() - t0}))


def child_crash(system: str, path: Path, order: str) -> None:
    """Queue one reading, then die in the middle of taking it into flight."""
    box = open_outbox(system, path)
    r = reading(0)
    box.queue(r)
    if isinstance(box, DictOutbox):
        box.in_flight(r["id"], 1, kill=order)
    else:
        box.in_flight(r["id"], 1)  # one transaction: the kill can only come before or after
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- the parent


def strace_binary() -> str | None:
    return shutil.which("strace")


def measure(system: str, n: int, work: Path) -> dict[str, Any]:
    path = work / f"{system}.db"
    cmd = [sys.executable, __file__, "--child", "moves", "--system", system,
           "--path", str(path), "--readings", str(n)]  # fmt: skip
    trace = work / f"{system}.strace"
    strace = strace_binary()
    if strace:
        cmd = [strace, "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", str(trace), *cmd]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"{system}: {res.stderr[-2000:]}")
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    out["fsyncs"] = fsync_calls(trace.read_text()) if strace else None
    return out


def fsync_calls(strace_summary: str) -> int:
    """Calls of fsync and fdatasync from ``strace -c``'s table."""
    total = 0
    for line in strace_summary.splitlines():
        cols = line.split()
        if cols and cols[-1] in ("fsync", "fdatasync"):
            # columns: % time, seconds, usecs/call, calls, [errors,] syscall
            nums = [c for c in cols[:-1] if re.fullmatch(r"[\d.]+", c)]
            total += int(nums[3])
    return total


def where_after_crash(system: str, order: str, work: Path) -> str:
    path = work / f"crash-{system}-{order}.db"
    cmd = [sys.executable, __file__, "--child", "crash", "--system", system,
           "--path", str(path), "--order", order]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if res.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the crash child was not killed: {res.returncode} {res.stderr}")
    if system == "pubcomp":
        with Store(path) as store:
            _, _, msgs = store.load_session(SESSION)
            waiting = store.oldest_undelivered_seq() > store.taken_seq()
        queued, flying = waiting and not msgs, bool(msgs)
    else:
        from sqlitedict import SqliteDict

        with SqliteDict(str(path), tablename="queued") as q:
            queued = "gw/1/0" in q
        with SqliteDict(str(path), tablename="inflight") as f:
            flying = "gw/1/0" in f
    if queued and flying:
        return "in both tables: sent twice after the restart"
    if not queued and not flying:
        return "in neither table: lost"
    return "in flight only (one place)" if flying else "queued only (one place)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--readings", type=int, default=1000)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--child", choices=("moves", "crash"), help=argparse.SUPPRESS)
    ap.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    ap.add_argument(
        "--order", choices=("add-first", "delete-first", "one-tx"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.child == "moves":
        child_moves(args.system, args.path, args.readings)
        return
    if args.child == "crash":
        child_crash(args.system, args.path, args.order)
        return

    # Under the repository, not /tmp: write_bytes counts only what reaches a block
    # device, and /tmp may be a tmpfs.
    (ROOT / ".cache").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="outbox-", dir=ROOT / ".cache"))
    systems = args.systems.split(",")
    try:
        rows = {s: measure(s, args.readings, work) for s in systems}
        crashes = {
            (s, order): where_after_crash(s, order, work)
            for s in systems
            for order in (("add-first", "delete-first") if s != "pubcomp" else ("one-tx",))
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    n = args.readings
    how = "strace -f -c" if strace_binary() else "not counted: strace missing"
    print(f"\n{n:,} readings, one per message, four moves each (queued, in flight, "
          f"released, done), each committed; fsyncs by {how}, bytes: write_bytes\n")  # fmt: skip
    print(f"{'outbox':<54} {'fsyncs/reading':>15} {'bytes/reading':>14} {'µs/reading':>11}")
    for s, r in rows.items():
        fs = "-" if r["fsyncs"] is None else f"{r['fsyncs'] / n:.2f}"
        print(f"{LABELS[s]:<54} {fs:>15} {r['bytes'] / n:>14,.0f} "
              f"{r['seconds'] / n * 1e6:>11,.0f}")  # fmt: skip
    ours = rows.get("pubcomp")
    if ours:
        for s, r in rows.items():
            if s != "pubcomp":
                fs = (
                    f"fsyncs {r['fsyncs'] / max(ours['fsyncs'], 1):.2f}x"
                    if r["fsyncs"] is not None and ours["fsyncs"] is not None
                    else "fsyncs -"
                )
                print(f"ratio: {LABELS[s]} to pubcomp: {fs}, "
                      f"bytes {r['bytes'] / max(ours['bytes'], 1):.2f}x")  # fmt: skip
    print("\nSIGKILL while taking a reading into flight:")
    for (s, order), where in crashes.items():
        when = {
            "add-first": "after the in-flight commit, before the queued delete",
            "delete-first": "after the queued delete, before the in-flight commit",
            "one-tx": "right after the one transaction",
        }[order]
        print(f"  {LABELS[s]:<54} killed {when}: {where}")


if __name__ == "__main__":
    main()
