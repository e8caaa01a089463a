"""Run ``pubcomp ingest run`` as a real process and read what it landed."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from pubcomp.pipeline.audit import landed

from . import hooked
from .powercut import PowerCutMount
from .procs import track

__all__ = ["IngestProc", "Publisher", "landed", "malformed_lines", "rejected", "writeback_cuts"]


class IngestProc:
    def __init__(self, port: int, landing: Path, client_id: str = "ingest-1", *extra: str):
        self.port, self.landing, self.client_id, self.extra = port, landing, client_id, extra
        self.log = landing.parent / f"{client_id}.log"
        self.marker = landing.parent / f"{client_id}.crash"  # what a crash point writes
        self.proc: subprocess.Popen[str] | None = None
        self.runs = 0

    def start(self, crash_at: str | None = None, wait: bool = True) -> IngestProc:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PUBCOMP_CRASH_")}
        self.marker.unlink(missing_ok=True)
        if crash_at:
            env["PUBCOMP_CRASH_AT"] = crash_at
            env["PUBCOMP_CRASH_MARKER"] = str(self.marker)
        self.runs += 1
        mark = f"run {self.runs}\n"
        with self.log.open("a") as f:
            f.write(mark)
        cmd = hooked.command("-v", "ingest", "run")  # crash points act only through it
        cmd += ["--broker", f"mqtt://127.0.0.1:{self.port}", "--client-id", self.client_id]
        cmd += ["--landing", str(self.landing), "--roll-s", "0.5", "--keepalive", "5"]
        with self.log.open("a") as f:
            self.proc = subprocess.Popen(
                [*cmd, *self.extra], env=env, stdout=subprocess.PIPE, stderr=f, text=True
            )
        track(self.proc)
        if wait:
            self.wait_subscribed(mark)
        return self

    def wait_subscribed(self, mark: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text()
            if "subscribed to" in text[text.rfind(mark) :]:
                return
            assert self.proc is not None and self.proc.poll() is None, text[-3000:]
            time.sleep(0.05)
        raise TimeoutError(self.log.read_text()[-3000:])

    def wait_killed(self, timeout: float = 60.0, broker_log: Path | None = None) -> int:
        """The exit code once the armed crash point has killed the process; on a timeout an
        AssertionError carrying the log, not a bare TimeoutExpired (a CI run's only trace)."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            n = len(landed(self.landing, rolled_only=False))
            raise AssertionError(
                f"ingest not killed within {timeout} s ({n} ids landed); its log:\n"
                + self.log.read_text()[-4000:]
                + (f"\nthe broker's:\n{broker_log.read_text()[-4000:]}" if broker_log else "")
            ) from None

    def crashed_at(self) -> str:
        """What the crash point wrote before the kill ("" if none fired)."""
        return self.marker.read_text().strip() if self.marker.exists() else ""

    def stop(self) -> dict[str, object]:
        assert self.proc is not None
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=30)
        return json.loads(out.strip().splitlines()[-1])


def rejected(landing: Path) -> list[dict[str, str]]:
    return [
        json.loads(line)
        for f in sorted(landing.glob("_rejected/date=*/*.jsonl"))
        for line in f.read_text().splitlines()
    ]


def malformed_lines(landing: Path) -> list[str]:
    """Lines of rolled files (readings, ``_rejected``, ``_status``: where Spark, the audit
    and the fleet view read) that are not a JSON object: ``file:line: repr``."""
    bad = []
    for pattern in ("date=*/*.jsonl", "_rejected/date=*/*.jsonl", "_status/date=*/*.jsonl"):
        for f in sorted(landing.glob(pattern)):
            for n, line in enumerate(f.read_bytes().split(b"\n")[:-1], 1):
                try:  # as UTF-8: from bytes, json.loads would guess UTF-16 from zeros
                    ok = isinstance(json.loads(line.decode("utf-8")), dict)
                except ValueError:
                    ok = False
                if not ok:
                    bad.append(f"{f.relative_to(landing)}:{n}: {line[:80]!r}")
    return bad


class Publisher:
    """A gateway stand-in (paho, QoS 2, 20 in flight): messages of 10 readings, and now
    and then a message that is not JSON; it knows which ones the broker completed."""

    def __init__(self, port: int, gateway: str = "gw1") -> None:
        self.gateway = gateway
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{gateway}")
        self.client.max_inflight_messages_set(20)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.sent: list[tuple[mqtt.MQTTMessageInfo, list[str], bytes | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def _run(self) -> None:
        m = 0
        while not self._stop.is_set():
            m += 1
            if m % 25 == 0:
                bad = b"not json %d" % m
                info = self.client.publish(f"telemetry/{self.gateway}/readings", bad, qos=2)
                self.sent.append((info, [], bad))
                self.client.publish(f"telemetry/{self.gateway}/status", b'{"v":1}', qos=1)
                continue
            ids = [f"{self.gateway}/e1/{m * 10 + i}" for i in range(10)]
            readings = [
                {"id": rid, "origin": self.gateway, "sensor": "t",
                 "ts": "2026-11-24T10:00:00.000Z", "value": m + i / 10, "unit": "C", "flags": []}
                for i, rid in enumerate(ids)
            ]  # fmt: skip
            payload = json.dumps({"v": 1, "gateway": self.gateway, "readings": readings})
            info = self.client.publish(f"telemetry/{self.gateway}/readings", payload, qos=2)
            self.sent.append((info, ids, None))
            time.sleep(0.004)

    def stop(self) -> tuple[set[str], set[bytes]]:
        """Stop publishing, wait for every PUBCOMP; the readings and bad payloads completed."""
        self._stop.set()
        self._thread.join(10)
        ids: set[str] = set()
        bad: set[bytes] = set()
        for info, rids, payload in self.sent:
            info.wait_for_publish(60)
            if info.is_published():  # PUBCOMP received
                ids.update(rids)
                if payload is not None:
                    bad.add(payload)
        self.client.loop_stop()
        self.client.disconnect()
        return ids, bad


def json_lines(landing: Path, pattern: str) -> Iterator[dict[str, Any]]:
    """The lines of the files that parse as JSON objects (malformed_lines finds the rest)."""
    for f in sorted(landing.glob(pattern)):
        try:
            data = f.read_bytes()
        except FileNotFoundError:  # rolled between the listing and the read
            continue
        for line in data.splitlines():
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError:
                continue
            if isinstance(rec, dict):
                yield rec


def count(landing: Path, incoming: bool = False) -> collections.Counter[str]:
    """Reading ids in the rolled files (and the open ones), skipping malformed lines: the
    old landing code leaves some, and its losses and doubles are worth counting too."""
    ids = collections.Counter(r.get("id") for r in json_lines(landing, "date=*/*.jsonl"))
    if incoming:
        ids.update(r.get("id") for r in json_lines(landing, "_incoming/readings/*.jsonl"))
    return ids


def settled(progress: Callable[[], int], goal: int, quiet_s: float = 10.0) -> None:
    """Wait until ``progress()`` reaches ``goal``, or has not moved for ``quiet_s``
    (what the broker had is delivered: the rest was lost), within a minute."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + 60
    while time.monotonic() < deadline:
        now = progress()
        if now >= goal:
            return
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > quiet_s:
            return
        time.sleep(0.2)


def writeback_cuts(work: Path, port: int, seed: int, cuts: int) -> dict[str, Any]:
    """The ingest on the power-cut file system in writeback mode (5 ms added to each
    write), a ``Publisher`` on the broker at ``port``, ``cuts`` cuts each right after
    one of the next three writes (seeds ``{seed}:{i}``); then what landed, counted
    against what the broker PUBCOMP'd (tests/test_powercut_ingest.py asserts on it,
    bench/ingest_writeback.py sweeps seeds)."""
    rng = random.Random(seed)
    with PowerCutMount(work / "backing", work / "disk", writeback=seed, write_delay=0.005) as disk:
        landing = disk.path / "landing"
        ingest = IngestProc(port, landing)
        ingest.log = work / "ingest.log"  # the log is the witness: off the cut disk
        ingest.start()
        pub = Publisher(port).start()
        frozen = 0
        for _ in range(cuts):
            time.sleep(rng.uniform(0.1, 0.6))
            disk.arm(rng.randint(1, 3))  # right after one of the next three writes
            frozen += disk.wait_frozen(10)
            assert ingest.proc is not None
            disk.cut(ingest.proc)
            ingest.start()
        ids, bad = pub.stop()

        settled(lambda: len(ids & count(landing, incoming=True).keys()), len(ids))
        ingest.stop()
        counts = count(landing)
        malformed = malformed_lines(landing)
        try:
            landed(landing)  # pipeline/audit.py reads every rolled line
            audit = "ok"
        except ValueError as exc:
            audit = f"fails: {exc}"
        rejected_bad = collections.Counter(
            r["payload"].encode()
            for r in json_lines(landing, "_rejected/date=*/*.jsonl")
            if r.get("topic", "").endswith("/readings")
        )
        return {
            "cuts": disk.cuts,
            "frozen_after_a_write": frozen,
            "pubcompd": len(ids),
            "lost": len(ids - counts.keys()),
            "twice": sum(1 for i in ids if counts[i] > 1),
            "unexpected": len(counts.keys() - ids),
            "malformed": malformed[:3],
            "malformed_lines": len(malformed),
            "bad_pubcompd": len(bad),
            "bad_lost": len(bad - rejected_bad.keys()),
            "bad_twice": sum(1 for b in bad if rejected_bad[b] > 1),
            "audit": audit,
            "quarantined": len(list(landing.glob("_quarantine/*/*"))),
            "seeds": [c.get("seed") for c in disk.cut_log],
        }
