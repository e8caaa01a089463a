"""A fleet simulator: landing files as N gateways with M nodes each would make them.

For the pipeline's tests and its benchmark at a fleet's scale (issue 27), and for
the completeness work to check itself against: every gap it plants in a stream
is in the ground truth (``ground_truth.json``) with its reason.

What it models (one cycle of ``period_s`` at a time):

- a gateway's own sensors: ids ``{gateway}/{epoch}/{seq}``, ``seq`` the store's;
- its nodes' messages: ids ``{node}/{boot}/{seq}.{i}`` (``i`` < ``readings_per_message``);
  every node reading also takes a seq of the gateway's store (it is stored there),
  so a gateway's own seqs have gaps where its nodes' readings sit, as in
  sync/store.py;
- the uplink: whole outbox rows (``ROW_READINGS``) per message, received by one of
  two ingests on a shared subscription a moment later; each ingest rolls a file
  per minute of receipt (``{ingest}-{stamp}-0.jsonl`` in ``date=`` of that minute);
- duplicates: a message delivered again later (a session lost, not landed in time)
  to either ingest, same ids, a later ``received``;
- late files: an ingest's file rolled some minutes late (its lines were received
  earlier than copies that land before it: the first-received copy displaces);
- gateway restarts: the gateway is down for a few cycles (its sensors read
  nothing, its nodes keep their messages and send them when it is back) and the
  store's seq floor was raised by a block: seqs skipped, never given
  (``restart_skip``, not a loss: sync/store.py's ``SEQ_BLOCK``);
- store replacements: a new epoch from seq 1 (the old stream ends whole);
- quota evictions: an uplink outage longer than the store's quota holds; the
  ``drop_oldest`` policy evicts the oldest readings, which never arrive
  (``evicted``: in every stream those seqs carried);
- node drops: a node's messages that never reach its gateway (ring overflow, flash
  spill full: ``dropped_on_node``); the node's seqs go on;
- unexplained holes: a few messages whose lines are lost between the ingest and
  the landing zone (``unexplained``: the alarm the completeness table must raise).

Ground truth (``ground_truth.json``): the parameters; per stream (origin and epoch
or boot) its first and last position and how many readings it committed; every
hole: the stream, first and last missing id, how many readings, the reason, their
timestamps, and for ``evicted`` and ``unexplained`` the store seqs; every seq block
skipped at a restart. A position is ``seq`` for a gateway's stream and ``seq.i``
for a node's. Plus ``files``: the landing files in the order they became
available (a late file after the ones rolled before it), with their line counts,
so the benchmark can cut history and increments at file boundaries.

Seeded and deterministic; lines are made with string templates (about 2 us a line),
so 50,000,000 readings take minutes, a test's thousands a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

SEQ_BLOCK = 10_000  # sync/store.py: the outbox seq floor is raised by this much
ROW_READINGS = 100  # sync/store.py: readings per outbox row (and per message here)
START = datetime(2026, 11, 1, tzinfo=UTC)
INGESTS = ("ingest-a", "ingest-b")


@dataclass
class FleetSpec:
    gateways: int = 4
    nodes: int = 3  # per gateway
    readings: int = 20_000  # committed readings to make (about; whole cycles)
    period_s: float = 60.0  # a cycle: every sensor read once, every node sends once
    own_sensors: int = 2  # the gateway's own sensors
    readings_per_message: int = 3  # a node message's readings (i = 0 .. n-1)
    seed: int = 1
    dup_rate: float = 0.03  # messages delivered twice
    late_file_rate: float = 0.01  # files rolled late (by 2 to 6 minutes)
    restarts: int = 1  # per gateway over the run
    replacements: int = 1  # store replacements over the whole fleet
    outages: int = 1  # uplink outages that overflow the quota (whole fleet)
    node_drops: int = 2  # node drop windows (whole fleet)
    unexplained: int = 2  # messages lost without a reason (whole fleet)
    reboots: int = 1  # node reboots over the whole fleet (a new boot: a new stream)
    roll_minutes: int = 1  # an ingest rolls a file per this many minutes of receipt


@dataclass
class _Stream:
    origin: str
    epoch: str
    kind: str  # gateway | node
    gateway: str
    first: str = ""
    last: str = ""
    count: int = 0

    def add(self, pos: str) -> None:
        if not self.count:
            self.first = pos
        self.last = pos
        self.count += 1


@dataclass
class _Node:
    name: str
    boot: int = 0
    seq: int = 0
    pending: list[tuple[float, int, int]] = field(default_factory=list)  # (ts, boot, seq)


@dataclass
class _Gateway:
    name: str
    epoch: str
    nodes: list[_Node]
    seq: int = 0
    down_until: int = -1  # cycle


class _Files:
    """The landing files: one per ingest and minute of receipt, appended to as lines come."""

    def __init__(self, root: Path, roll_minutes: int) -> None:
        self.root = root
        self.roll = roll_minutes
        self.open: dict[tuple[str, int], TextIO] = {}
        self.lines: dict[tuple[str, int], int] = {}
        self.delay: dict[tuple[str, int], int] = {}  # minutes a late file is rolled late

    def path(self, key: tuple[str, int]) -> Path:
        ingest, minute = key
        t = START + timedelta(minutes=minute * self.roll)
        return self.root / f"date={t:%Y-%m-%d}" / f"{ingest}-{t:%Y%m%dT%H%M}-0.jsonl"

    def write(self, key: tuple[str, int], text: str, n: int) -> None:
        fh = self.open.get(key)
        if fh is None:
            p = self.path(key)
            p.parent.mkdir(parents=True, exist_ok=True)
            fh = self.open[key] = p.open("a")
        fh.write(text)
        self.lines[key] = self.lines.get(key, 0) + n

    def close_before(self, minute: int) -> None:
        for key in [k for k in self.open if k[1] < minute]:
            self.open.pop(key).close()

    def manifest(self) -> list[dict[str, Any]]:
        self.close_before(1 << 62)
        order = sorted(self.lines, key=lambda k: (k[1] + self.delay.get(k, 0), k[1], k[0]))
        return [
            {
                "file": str(self.path(k).relative_to(self.root)),
                "lines": self.lines[k],
                "available_minute": (k[1] + self.delay.get(k, 0)) * self.roll,
            }
            for k in order
        ]


class _Clock:
    """Wire times (``2026-11-01T00:00:00.000Z``) from milliseconds, the second's text cached."""

    def __init__(self) -> None:
        self.base = int(START.timestamp())
        self.cache: dict[int, str] = {}

    def __call__(self, ms: int) -> str:
        s, frac = divmod(ms, 1000)
        head = self.cache.get(s)
        if head is None:
            if len(self.cache) > 100_000:
                self.cache.clear()
            head = self.cache[s] = datetime.fromtimestamp(self.base + s, UTC).strftime(
                "%Y-%m-%dT%H:%M:%S"
            )
        return f"{head}.{frac:03d}Z"


def _line(rid: str, origin: str, sensor: str, ts: str, value: float, gw: str, rcv: str) -> str:
    return (
        f'{{"id":"{rid}","origin":"{origin}","sensor":"{sensor}","ts":"{ts}",'
        f'"value":{value},"unit":"C","flags":[],"gateway":"{gw}","received":"{rcv}"}}\n'
    )


class Simulator:
    def __init__(self, spec: FleetSpec, root: Path) -> None:
        self.spec = spec
        self.root = root
        self.rng = random.Random(spec.seed)
        self.files = _Files(root, spec.roll_minutes)
        self.clock = _Clock()
        self.streams: dict[tuple[str, str], _Stream] = {}
        self.holes: list[dict[str, Any]] = []
        self.skips: list[dict[str, Any]] = []
        self.replaced: list[dict[str, Any]] = []
        self.gateways = [
            _Gateway(
                f"gw{g:04d}",
                self._epoch(),
                [_Node(f"gw{g:04d}-n{n:02d}") for n in range(spec.nodes)],
            )
            for g in range(spec.gateways)
        ]
        per_cycle = spec.gateways * (spec.own_sensors + spec.nodes * spec.readings_per_message)
        self.cycles = max(1, -(-spec.readings // max(1, per_cycle)))
        self._plan()

    def _epoch(self) -> str:
        return f"{self.rng.getrandbits(48):012x}"

    # ------------------------------------------------------------ the plan

    def _plan(self) -> None:
        """When each event happens: cycles chosen up front, away from the run's edges."""
        rng, c, spec = self.rng, self.cycles, self.spec
        lo, hi = max(1, c // 10), max(2, c - c // 10 - 12)

        def when() -> int:
            return rng.randrange(lo, max(lo + 1, hi))

        self.restart_at = {(g, when()) for g in range(spec.gateways) for _ in range(spec.restarts)}
        self.replace_at = {(rng.randrange(spec.gateways), when()) for _ in range(spec.replacements)}
        # An outage of 10 cycles whose backlog the quota holds only the last 6 of.
        self.outage_at = {rng.randrange(spec.gateways): when() for _ in range(spec.outages)}
        self.drops = {
            (rng.randrange(spec.gateways), rng.randrange(max(1, spec.nodes)), when())
            for _ in range(spec.node_drops if spec.nodes else 0)
        }
        self.lost_at = {(rng.randrange(spec.gateways), when()) for _ in range(spec.unexplained)}
        self.reboot_at = {
            (rng.randrange(spec.gateways), rng.randrange(max(1, spec.nodes)), when())
            for _ in range(spec.reboots if spec.nodes else 0)
        }

    # ------------------------------------------------------------ running

    def run(self) -> dict[str, Any]:
        spec = self.spec
        for cycle in range(self.cycles):
            base_ms = int(cycle * spec.period_s * 1000)
            for g, gw in enumerate(self.gateways):
                self._cycle(g, gw, cycle, base_ms)
            # Files of minutes that nothing can reach any more are closed (latest receipt:
            # an outage's backlog, 12 cycles, plus a resend's 10 minutes).
            horizon = (base_ms // 60_000 - int(12 * spec.period_s / 60) - 12) // spec.roll_minutes
            if cycle % 50 == 0:
                self.files.close_before(horizon)
        truth = {
            "spec": asdict(spec),
            "cycles": self.cycles,
            "streams": [asdict(s) for s in self.streams.values()],
            "holes": self.holes,
            "skips": self.skips,
            "replaced": self.replaced,
            "files": self.files.manifest(),
        }
        truth["readings"] = sum(s["count"] for s in truth["streams"])
        truth["lines"] = sum(f["lines"] for f in truth["files"])
        (self.root / "ground_truth.json").write_text(json.dumps(truth, indent=1) + "\n")
        return truth

    def _stream(self, origin: str, epoch: str, kind: str, gw: str) -> _Stream:
        s = self.streams.get((origin, epoch))
        if s is None:
            s = self.streams[(origin, epoch)] = _Stream(origin, epoch, kind, gw)
        return s

    def _cycle(self, g: int, gw: _Gateway, cycle: int, base_ms: int) -> None:
        spec, rng = self.spec, self.rng
        if (g, cycle) in self.replace_at:
            old = gw.epoch
            gw.epoch, gw.seq = self._epoch(), 0
            self.replaced.append({"gateway": gw.name, "old": old, "new": gw.epoch, "cycle": cycle})
        if (g, cycle) in self.restart_at:
            gw.down_until = cycle + 3
        for n, node in enumerate(gw.nodes):
            if (g, n, cycle) in self.reboot_at:
                node.boot, node.seq = node.boot + 1, 0
            ts = base_ms + rng.randrange(0, 1000)
            dropped = any(d[:2] == (g, n) and d[2] <= cycle < d[2] + 4 for d in self.drops)
            if dropped:
                self._hole_node(gw, node, ts)
            else:
                node.pending.append((ts, node.boot, node.seq))
            node.seq += 1
        if cycle < gw.down_until:
            return  # down: its sensors read nothing; its nodes hold their messages
        if cycle == gw.down_until:  # back: the floor was raised by a block at the restart
            skip = rng.randrange(1, SEQ_BLOCK)
            self.skips.append(
                {"gateway": gw.name, "epoch": gw.epoch, "first": gw.seq + 1,
                 "last": gw.seq + skip, "reason": "restart_skip", "cycle": cycle}
            )  # fmt: skip
            gw.seq += skip
        # The cycle's readings, in store order: own sensors, then each node's messages.
        batch: list[tuple[int, str, str, str, str, int, float]] = []  # seq, id, origin, ...
        own = self._stream(gw.name, gw.epoch, "gateway", gw.name)
        ts_own = base_ms + rng.randrange(0, 1000)
        for k in range(spec.own_sensors):
            gw.seq += 1
            own.add(str(gw.seq))
            value = round(rng.gauss(20, 5) * 16) / 16
            batch.append((gw.seq, f"{gw.name}/{gw.epoch}/{gw.seq}", gw.name, f"g{k}", "", ts_own,
                          value))  # fmt: skip
        for node in gw.nodes:
            for ts, boot, nseq in node.pending:
                st = self._stream(node.name, str(boot), "node", gw.name)
                for i in range(spec.readings_per_message):
                    gw.seq += 1
                    st.add(f"{nseq}.{i}")
                    value = round(rng.gauss(12, 4) * 16) / 16
                    batch.append((gw.seq, f"{node.name}/{boot}/{nseq}.{i}", node.name, f"t{i}",
                                  "", ts, value))  # fmt: skip
            node.pending.clear()
        self._deliver(g, gw, cycle, base_ms, batch)

    def _deliver(self, g: int, gw: _Gateway, cycle: int, base_ms: int, batch: list[Any]) -> None:
        spec, rng = self.spec, self.rng
        out = self.outage_at.get(g)
        send_ms = base_ms + 1500
        if out is not None and out <= cycle < out + 10:
            # The uplink is down; when it is back (cycle out+10) the store holds only the
            # last 6 cycles (its quota): drop_oldest evicted the first 4 cycles' readings.
            if cycle < out + 4:
                self._hole(gw, batch, "evicted")
                return
            send_ms = int((out + 10) * spec.period_s * 1000) + 1500 + (cycle - out) * 200
        if (g, cycle) in self.lost_at and batch:
            k = rng.randrange(len(batch))
            lost, batch = batch[k : k + 1], batch[:k] + batch[k + 1 :]
            self._hole(gw, lost, "unexplained")
        for start in range(0, len(batch), ROW_READINGS):
            msg = batch[start : start + ROW_READINGS]
            received = send_ms + rng.randrange(50, 3000)
            ingest = rng.randrange(len(INGESTS))
            self._land(gw, msg, received, ingest)
            if rng.random() < spec.dup_rate:  # sent again: not landed in time, or session lost
                self._land(
                    gw, msg, received + rng.randrange(5_000, 600_000), rng.randrange(len(INGESTS))
                )

    def _land(self, gw: _Gateway, msg: list[Any], received: int, ingest: int) -> None:
        rcv = self.clock(received)
        clock = self.clock
        text = "".join(
            _line(rid, origin, sensor, clock(ts), value, gw.name, rcv)
            for _, rid, origin, sensor, _, ts, value in msg
        )
        key = (INGESTS[ingest], received // 60_000 // self.spec.roll_minutes)
        if key not in self.files.lines and self.rng.random() < self.spec.late_file_rate:
            self.files.delay[key] = self.rng.randrange(2, 7)  # files rolled late
        self.files.write(key, text, len(msg))

    # ------------------------------------------------------------ holes

    def _hole(self, gw: _Gateway, lost: list[Any], reason: str) -> None:
        """One hole per stream the lost readings belong to (in store order)."""
        by: dict[tuple[str, str], list[Any]] = {}
        for r in lost:
            origin, epoch, pos = r[1].split("/")
            by.setdefault((origin, epoch), []).append((r, pos))
        for (origin, epoch), rows in by.items():
            first, last = rows[0], rows[-1]
            self.holes.append(
                {
                    "origin": origin, "epoch": epoch,
                    "kind": "gateway" if origin == gw.name else "node", "gateway": gw.name,
                    "first": first[1], "last": last[1], "count": len(rows), "reason": reason,
                    "ts_first": self.clock(first[0][5]), "ts_last": self.clock(last[0][5]),
                    "store": {"epoch": gw.epoch, "first": first[0][0], "last": last[0][0]},
                }
            )  # fmt: skip

    def _hole_node(self, gw: _Gateway, node: _Node, ts: int) -> None:
        """A message the node dropped: merged with the node's previous drop if adjacent."""
        n = self.spec.readings_per_message
        epoch = str(node.boot)
        st = self._stream(node.name, epoch, "node", gw.name)
        for i in range(n):
            st.add(f"{node.seq}.{i}")
        prev = self.holes[-1] if self.holes else None
        if (
            prev is not None
            and prev["reason"] == "dropped_on_node"
            and (prev["origin"], prev["epoch"]) == (node.name, epoch)
            and prev["last"] == f"{node.seq - 1}.{n - 1}"
        ):
            prev["last"], prev["count"], prev["ts_last"] = (
                f"{node.seq}.{n - 1}",
                prev["count"] + n,
                self.clock(ts),
            )
            return
        self.holes.append(
            {
                "origin": node.name, "epoch": epoch, "kind": "node", "gateway": gw.name,
                "first": f"{node.seq}.0", "last": f"{node.seq}.{n - 1}", "count": n,
                "reason": "dropped_on_node", "ts_first": self.clock(ts), "ts_last": self.clock(ts),
            }
        )  # fmt: skip


def simulate(root: Path, spec: FleetSpec | None = None, **kw: Any) -> dict[str, Any]:
    """Write the fleet's landing files under ``root`` (``date=…/`` as the ingest rolls
    them) and ``root/ground_truth.json``; return the ground truth."""
    spec = spec or FleetSpec(**kw)
    root.mkdir(parents=True, exist_ok=True)
    return Simulator(spec, root).run()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    for f in FleetSpec.__dataclass_fields__.values():
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = vars(ap.parse_args())
    out = args.pop("out")
    truth = simulate(out, FleetSpec(**args))
    print(
        f"{truth['readings']:,} readings committed, {truth['lines']:,} landing lines in "
        f"{len(truth['files'])} files, {len(truth['streams'])} streams, "
        f"{len(truth['holes'])} holes, {len(truth['skips'])} seq blocks skipped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
