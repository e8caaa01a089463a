"""``make demo``: the uplink against a local Mosquitto, checked by an independent subscriber.

What it shows (until the full gateway demo lands): readings go into a fresh
durable store, the uplink is killed twice in the middle of QoS 2 handshakes,
restarted each time, and a paho-mqtt subscriber that knows nothing of pubcomp
counts every reading id: each arrives exactly once.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .checker import Checker, exactly_once_report
from .devbroker import Mosquitto

READINGS = 30_000


def _bar(done: int, total: int, width: int = 40) -> str:
    filled = int(width * done / max(total, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="pubcomp-demo-"))
    broker = Mosquitto(work / "broker", persistence=True).start()
    checker = Checker(broker.port, topic="telemetry/#", client_id="demo-checker").start()
    store = work / "gateway.db"
    src = work / "readings.jsonl"
    rng = random.Random(7)
    with src.open("w") as f:
        for i in range(READINGS):
            value = 20 + 5 * math.sin(i / 300) + rng.gauss(0, 0.2)
            ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1_795_000_000 + i)) + ".000Z"
            f.write(
                json.dumps({"sensor": "temp-1", "ts": ts, "value": round(value, 3), "unit": "C"})
            )
            f.write("\n")
    cmd = [sys.executable, "-m", "pubcomp"]
    subprocess.run(
        [*cmd, "store", "import", "--store", str(store), "--gateway-id", "gw-demo", str(src)],
        check=True,
    )
    uplink = [*cmd, "uplink", "run", "--store", str(store), "--broker", broker.url,
              "--client-id", "gw-demo", "--batch", "50", "--exit-when-drained"]  # fmt: skip
    print(f"broker {broker.url}, store {store}")
    kills = 0
    try:
        for attempt in range(1, 10):
            env = dict(os.environ)
            if kills < 2:
                # Kill the uplink (SIGKILL) in the middle of a QoS 2 handshake.
                point = ["pubrec_received", "pubrel_written"][kills]
                env["PUBCOMP_CRASH_AT"] = f"{point}:{40 - 35 * kills}"
            proc = subprocess.Popen([*uplink], env=env, stdout=subprocess.PIPE, text=True)
            while proc.poll() is None:
                print(
                    "\r  delivered " + _bar(len(checker.snapshot()), READINGS), end="", flush=True
                )
                time.sleep(0.1)
            out = proc.stdout.read() if proc.stdout else ""
            if proc.returncode == -signal.SIGKILL:
                kills += 1
                print(
                    f"\r  run {attempt}: uplink killed at {env['PUBCOMP_CRASH_AT']}; restarting"
                    + " " * 20
                )
                continue
            summary = json.loads(out.strip().splitlines()[-1])
            break
        with sqlite_epoch(store) as epoch:
            expected = {f"gw-demo/{epoch}/{i}" for i in range(1, READINGS + 1)}
        counts = checker.wait_for(expected, 30)
        print("\r  delivered " + _bar(len(counts), READINGS))
        report = exactly_once_report(counts, expected)
        print()
        print(f"  readings stored        {READINGS}")
        print(f"  uplink killed          {kills} times (SIGKILL mid-handshake)")
        print(f"  delivered (checker)    {sum(counts.values())}")
        print(f"  distinct reading ids   {len(counts)}")
        print(f"  missing                {report['missing']}")
        print(f"  duplicated             {report['duplicated']}")
        print(f"  last drain rate        {summary['drain_rate']} readings/s")
        ok = report["missing"] == 0 and report["duplicated"] == 0 and report["unexpected"] == 0
        print("\n  exactly once: " + ("YES" if ok else "NO"))
        return 0 if ok else 1
    finally:
        checker.stop()
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


class sqlite_epoch:
    def __init__(self, path: Path) -> None:
        import sqlite3

        self.db = sqlite3.connect(path)

    def __enter__(self) -> str:
        return self.db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()[0]

    def __exit__(self, *exc: object) -> None:
        self.db.close()


if __name__ == "__main__":
    sys.exit(main())
