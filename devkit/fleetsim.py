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
  the landing zone (``unexplained``: the alarm the completeness table must raise);
- node messages the gateway refused (``refused``: ``invalid_time``), messages the
  broker refused for good (``dead_letter``), and messages still held at the end (in
  flight at an ingest that stopped: ``held``, in the last ledger's ``held``);
- each message's receive record on its last line (``_mqtt``: the ``outbox`` span of
  store seqs it carried, as pipeline/ingest.py writes it), and each gateway's
  ``$ledger`` record (docs/wire-format.md) every ``ledger_every`` cycles while it is up
  and its uplink too, when its store is replaced (the old store's, at its clean stop)
  and at the end: a store seq of its own, told once, travelling like any reading.

Messages are whole outbox rows of up to ``ROW_READINGS`` readings that never split a
node message (its readings are one row set in the store).

Ground truth (``ground_truth.json``): the parameters; per stream (origin and epoch
or boot) its first and last position and how many readings it committed; every
hole: the stream, first and last missing id, how many readings, the reason, their
timestamps, and for ``evicted`` and ``unexplained`` the store seqs; every seq block
skipped at a restart. A position is ``seq`` for a gateway's stream and ``seq.i``
for a node's. ``gaps``: the same holes as the completeness table names them, per
stream and position: the store stream ``{gateway}/{epoch}`` by store seq, a node
stream ``{node}/{boot}`` by message seq (``gateway, stream, kind, lo, hi, reason,
detail``), the skipped blocks included (reason ``skipped``). Plus ``files``: the
landing files in the order they became available (a late file after the ones rolled
before it), with their line counts,
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
    refusals: int = 2  # node messages the gateway refuses (invalid_time; whole fleet)
    dead_letters: int = 1  # messages the broker refuses for good (whole fleet)
    held: int = 1  # messages still held at a gateway at the end (whole fleet)
    ledger_every: int = 5  # a gateway's $ledger record every this many cycles
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
class _Ledger:
    """What a gateway has to tell in its next $ledger record (pipeline/completeness.py)."""

    since_ms: int = 0
    streams: dict[str, dict[str, Any]] = field(default_factory=dict)
    held: dict[str, set[int]] = field(default_factory=dict)  # never landing: the end's
    stored: dict[str, list[list[int]]] = field(default_factory=dict)  # per node stream
    active: set[str] = field(default_factory=set)  # node streams stored in since the last

    def add(self, stream: str, what: str, lo: int, hi: int, *, at: str = "", why: str = "") -> None:
        entry = self.streams.setdefault(stream, {})
        if what in ("evicted", "dead_letter"):
            events = entry.setdefault(what, [])
            if events and events[-1]["at"] == at:
                _add_range(events[-1]["ranges"], lo, hi)
            else:
                events.append({"at": at, "ranges": [[lo, hi]]})
        elif what in ("refused", "node_dropped"):
            _add_range(entry.setdefault(what, {}).setdefault(why, []), lo, hi)
        else:
            _add_range(entry.setdefault(what, []), lo, hi)

    def store(self, stream: str, seq: int) -> None:
        _add_range(self.stored.setdefault(stream, []), seq, seq)
        self.active.add(stream)


def _add_range(ranges: list[list[int]], lo: int, hi: int) -> None:
    """Append ``[lo, hi]`` to sorted disjoint ranges (merged with the last if adjacent)."""
    if ranges and ranges[-1][1] + 1 >= lo:
        ranges[-1][1] = max(ranges[-1][1], hi)
    else:
        ranges.append([lo, hi])


def _ranges(values: set[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in sorted(values):
        _add_range(out, v, v)
    return out


@dataclass
class _Gateway:
    name: str
    epoch: str
    nodes: list[_Node]
    seq: int = 0
    down_until: int = -1  # cycle
    ledger: _Ledger = field(default_factory=_Ledger)


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
        self.gaps: list[dict[str, Any]] = []
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
        self.refuse_at = {
            (rng.randrange(spec.gateways), rng.randrange(max(1, spec.nodes)), when())
            for _ in range(spec.refusals if spec.nodes else 0)
        }
        self.dead_at = {(rng.randrange(spec.gateways), when()) for _ in range(spec.dead_letters)}
        # Held at the end: in one of the last cycles (the last ledger, after it, tells it).
        self.held_at = {
            (rng.randrange(spec.gateways), max(0, c - 1 - rng.randrange(3)))
            for _ in range(spec.held)
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
        end_ms = int(self.cycles * spec.period_s * 1000)
        for gw in self.gateways:  # a clean stop: the last ledger tells what is still held
            self._send_ledger(gw, end_ms)
        truth = {
            "spec": asdict(spec),
            "cycles": self.cycles,
            "streams": [asdict(s) for s in self.streams.values()],
            "holes": self.holes,
            "skips": self.skips,
            "replaced": self.replaced,
            "gaps": self.gaps,
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
            self._send_ledger(gw, base_ms)  # the old store's last word, at its clean stop
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
                self._hole_node(gw, node, ts, "dropped_on_node")
            elif (g, n, cycle) in self.refuse_at:
                self._hole_node(gw, node, ts, "refused")
            else:
                node.pending.append((ts, node.boot, node.seq))
            node.seq += 1
        if cycle < gw.down_until:
            return  # down: its sensors read nothing; its nodes hold their messages
        if cycle == gw.down_until:  # back: the floor was raised by a block at the restart
            skip = rng.randrange(1, SEQ_BLOCK)
            first, last = gw.seq + 1, gw.seq + skip
            self.skips.append(
                {"gateway": gw.name, "epoch": gw.epoch, "first": first,
                 "last": last, "reason": "restart_skip", "cycle": cycle}
            )  # fmt: skip
            gw.ledger.add(f"{gw.name}/{gw.epoch}", "skipped", first, last)
            self._gap(gw.name, f"{gw.name}/{gw.epoch}", first, last, "skipped")
            gw.seq += skip
        # The cycle's readings, in store order: own sensors, then each node's messages;
        # a unit is what one row must hold whole (a reading, or a node message).
        units: list[list[tuple[int, str, str, str, str, int, float]]] = []
        own = self._stream(gw.name, gw.epoch, "gateway", gw.name)
        ts_own = base_ms + rng.randrange(0, 1000)
        for k in range(spec.own_sensors):
            gw.seq += 1
            own.add(str(gw.seq))
            value = round(rng.gauss(20, 5) * 16) / 16
            units.append([(gw.seq, f"{gw.name}/{gw.epoch}/{gw.seq}", gw.name, f"g{k}", "",
                           ts_own, value)])  # fmt: skip
        for node in gw.nodes:
            for ts, boot, nseq in node.pending:
                st = self._stream(node.name, str(boot), "node", gw.name)
                gw.ledger.store(f"{node.name}/{boot}", nseq)
                unit = []
                for i in range(spec.readings_per_message):
                    gw.seq += 1
                    st.add(f"{nseq}.{i}")
                    value = round(rng.gauss(12, 4) * 16) / 16
                    unit.append((gw.seq, f"{node.name}/{boot}/{nseq}.{i}", node.name, f"t{i}",
                                 "", ts, value))  # fmt: skip
                units.append(unit)
            node.pending.clear()
        self._deliver(g, gw, cycle, base_ms, units)

    def _deliver(
        self, g: int, gw: _Gateway, cycle: int, base_ms: int, units: list[list[Any]]
    ) -> None:
        spec, rng = self.spec, self.rng
        out = self.outage_at.get(g)
        send_ms = base_ms + 1500
        in_outage = out is not None and out <= cycle < out + 10
        if in_outage:
            # The uplink is down; when it is back (cycle out+10) the store holds only the
            # last 6 cycles (its quota): drop_oldest evicted the first 4 cycles' readings,
            # when the backlog grew past the quota 6 cycles later.
            assert out is not None
            if cycle < out + 4:
                at = self.clock(int((cycle + 6) * spec.period_s * 1000))
                self._lose(gw, [r for u in units for r in u], "evicted", at=at)
                return
            send_ms = int((out + 10) * spec.period_s * 1000) + 1500 + (cycle - out) * 200
        ledger = not in_outage and cycle % spec.ledger_every == spec.ledger_every - 1
        rows = self._rows(units)
        if ledger:  # after the cycle's readings (which it tells as held: not yet landed)
            rows.append([self._ledger_line(gw, base_ms + 1400, [r for u in units for r in u])])
        plain = len(rows) - 1 if ledger else len(rows)
        for plan, reason in ((self.lost_at, "unexplained"), (self.dead_at, "dead_letter"),
                             (self.held_at, "held")):  # fmt: skip
            if (g, cycle) in plan and plain:
                k = rng.randrange(plain)
                msg = rows.pop(k)
                plain -= 1
                self._lose(gw, msg, reason, at=self.clock(send_ms))
        for msg in rows:
            received = send_ms + rng.randrange(50, 3000)
            ingest = rng.randrange(len(INGESTS))
            self._land(gw, msg, received, ingest)
            if rng.random() < spec.dup_rate:  # sent again: not landed in time, or session lost
                self._land(
                    gw, msg, received + rng.randrange(5_000, 600_000), rng.randrange(len(INGESTS))
                )

    @staticmethod
    def _rows(units: list[list[Any]]) -> list[list[Any]]:
        """Outbox rows of up to ``ROW_READINGS`` readings, a unit never split."""
        rows: list[list[Any]] = []
        for u in units:
            if rows and len(rows[-1]) + len(u) <= ROW_READINGS:
                rows[-1].extend(u)
            else:
                rows.append(list(u))
        return rows

    # ------------------------------------------------------------ the ledger

    def _ledger_line(self, gw: _Gateway, now_ms: int, pending: list[Any]) -> tuple[Any, ...]:
        """The gateway's $ledger record (a store seq of its own), its events taken."""
        led = gw.ledger
        store = f"{gw.name}/{gw.epoch}"
        held: dict[str, set[int]] = {k: set(v) for k, v in led.held.items()}
        for r in pending:  # appended before the record, not landed yet
            stream, pos = _position(r[1], store)
            held.setdefault(stream, set()).add(pos)
            held.setdefault(store, set()).add(r[0])
        streams: dict[str, dict[str, Any]] = {k: dict(v) for k, v in led.streams.items()}
        for stream, seqs in held.items():
            if seqs:
                streams.setdefault(stream, {})["held"] = _ranges(seqs)
        for stream in led.active:
            streams.setdefault(stream, {})["stored"] = [list(r) for r in led.stored[stream]]
        top = gw.seq
        record = {"v": 1, "window": [self.clock(led.since_ms), self.clock(now_ms)], "top": top,
                  "streams": streams}  # fmt: skip
        led.streams, led.active, led.since_ms = {}, set(), now_ms
        gw.seq += 1
        rid = f"{gw.name}/{gw.epoch}/{gw.seq}"
        return (gw.seq, rid, gw.name, "$ledger", json.dumps(record, separators=(",", ":")),
                now_ms, 0.0)  # fmt: skip

    def _send_ledger(self, gw: _Gateway, now_ms: int) -> None:
        """A ledger in a message of its own (a clean stop), landed a moment later."""
        line = self._ledger_line(gw, now_ms, [])
        self._land(gw, [line], now_ms + self.rng.randrange(50, 3000), 0)

    # ------------------------------------------------------------ landing

    def _land(self, gw: _Gateway, msg: list[Any], received: int, ingest: int) -> None:
        rcv = self.clock(received)
        clock = self.clock
        parts = []
        for _, rid, origin, sensor, extra, ts, value in msg:
            if extra:  # a record: value and unit null, its body in ``record``
                parts.append(
                    f'{{"id":"{rid}","origin":"{origin}","sensor":"{sensor}","ts":"{clock(ts)}",'
                    f'"value":null,"unit":null,"flags":[],"record":{extra},"gateway":"{gw.name}",'
                    f'"received":"{rcv}"}}\n'
                )
            else:
                parts.append(_line(rid, origin, sensor, clock(ts), value, gw.name, rcv))
        span = f'"epoch":"{gw.epoch}","first":{msg[0][0]},"last":{msg[-1][0]}'
        box = f',"_mqtt":{{"outbox":{{{span}}}}}}}\n'
        parts[-1] = parts[-1][:-2] + box
        key = (INGESTS[ingest], received // 60_000 // self.spec.roll_minutes)
        if key not in self.files.lines and self.rng.random() < self.spec.late_file_rate:
            self.files.delay[key] = self.rng.randrange(2, 7)  # files rolled late
        self.files.write(key, "".join(parts), len(msg))

    # ------------------------------------------------------------ holes

    def _gap(
        self, gateway: str, stream: str, lo: int, hi: int, reason: str, detail: Any = None
    ) -> None:
        kind = "store" if stream.split("/")[0] == gateway else "node"
        self.gaps.append({"gateway": gateway, "stream": stream, "kind": kind, "lo": lo, "hi": hi,
                          "reason": reason, "detail": detail})  # fmt: skip

    def _lose(self, gw: _Gateway, lost: list[Any], reason: str, at: str) -> None:
        """A message (or a cycle's readings) that never lands: its holes, its ledger events
        (evicted, dead_letter; held: told by every later ledger), the truth's gaps."""
        store = f"{gw.name}/{gw.epoch}"
        by_stream: dict[str, set[int]] = {}
        for r in lost:
            stream, pos = _position(r[1], store)
            by_stream.setdefault(stream, set()).add(pos)
        store_seqs = {r[0] for r in lost}
        by_stream[store] = store_seqs
        name = {"unexplained": "unexplained", "evicted": "evicted",
                "dead_letter": "dead_letter", "held": "held"}[reason]  # fmt: skip
        for stream, poss in by_stream.items():
            for lo, hi in _ranges(poss):
                self._gap(gw.name, stream, lo, hi, name)
                if reason in ("evicted", "dead_letter"):
                    gw.ledger.add(stream, reason, lo, hi, at=at)
            if reason == "held":
                gw.ledger.held.setdefault(stream, set()).update(poss)
        self._hole(gw, [r for r in lost if r[3] != "$ledger"], reason)

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

    def _hole_node(self, gw: _Gateway, node: _Node, ts: int, reason: str) -> None:
        """A message the node dropped (or the gateway refused): told in the gateway's next
        ledger; a drop merged with the node's previous one if adjacent."""
        n = self.spec.readings_per_message
        epoch = str(node.boot)
        stream = f"{node.name}/{epoch}"
        st = self._stream(node.name, epoch, "node", gw.name)
        for i in range(n):
            st.add(f"{node.seq}.{i}")
        if reason == "refused":
            gw.ledger.add(stream, "refused", node.seq, node.seq, why="invalid_time")
            self._gap(gw.name, stream, node.seq, node.seq, "refused", "invalid_time")
        else:
            gw.ledger.add(stream, "node_dropped", node.seq, node.seq, why="ring_overflow")
            self._gap(gw.name, stream, node.seq, node.seq, "node_dropped", "ring_overflow")
        prev = self.holes[-1] if self.holes else None
        if (
            prev is not None
            and prev["reason"] == reason
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
                "reason": reason, "ts_first": self.clock(ts), "ts_last": self.clock(ts),
            }
        )  # fmt: skip


def _position(rid: str, store: str) -> tuple[str, int]:
    """A landed line's position: a node reading's ``({node}/{boot}, message seq)``, else
    ``(store, store seq)``."""
    origin, epoch, tail = rid.split("/")
    if "." in tail:
        return f"{origin}/{epoch}", int(tail.split(".")[0])
    return store, int(tail)


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
