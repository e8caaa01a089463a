"""``make demo``: a gateway, two nodes and the cloud here, a minute of trouble, then Spark.

What runs (everything it starts, it stops):
- a "cloud" Mosquitto on a free loopback port, reached through a link proxy
  (devkit/link.py) that can take the uplink down;
- ``pubcomp gateway run`` from examples/demo-fleet.yaml: a pulse counter
  (simulated pin), a DS18B20 probe (a sysfs directory the demo writes) and a
  PMS5003 (real frames on a pseudo-terminal), its state directory on the
  power-cut file system (devkit/powercut) where /dev/fuse exists;
- two nodes running the firmware's network code under CPython (firmware/host);
- ``pubcomp ingest run`` landing what the cloud receives, and a paho-mqtt
  subscriber counting every reading id at the cloud on its own.

The minute: the gateway's power is cut twice (once while the uplink is down, so
its backlog is on the disk when the power goes), the uplink is down for 20 s,
the cloud broker restarts once. Then the Spark pipeline runs, a summary table
is printed, and the pipeline report is written to demo-out/demo-report.html.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pubcomp.gateway import commitlog
from pubcomp.gateway.status import fetch as fetch_status
from pubcomp.pipeline.audit import landed

from .broker import Mosquitto, free_port
from .checker import Checker
from .demorig import SensorBench
from .link import LinkProxy
from .node import HostNode, node_config
from .procs import stop
from .sparkconf import SHORT_JVM

ROOT = Path(__file__).resolve().parents[1]
FLEET = ROOT / "examples" / "demo-fleet.yaml"
RUN_S = 60.0
NODE_INTERVAL_S = 0.25
NODE_PASSWORDS = {"node-1": "demo-node-1", "node-2": "demo-node-2"}


def bar(done: float, total: float, width: int = 30) -> str:
    filled = int(width * min(done / total, 1.0))
    return f"[{'#' * filled}{'.' * (width - filled)}]"


class Demo:
    def __init__(self, out: Path, stack: contextlib.ExitStack) -> None:
        self.out, self.stack = out, stack
        self.events: list[str] = []
        self.peak_backlog = 0
        self.cuts = 0
        self.records: set[str] = set()  # the gateway's $ledger records seen at the cloud

    # ------------------------------------------------------------ the parts

    def start_cloud(self) -> None:
        self.cloud = Mosquitto(self.out / "cloud", persistence=True).start()
        self.stack.callback(self.cloud.stop)
        self.link = LinkProxy(self.cloud.port)
        self.stack.callback(self.link.close)
        self.checker = Checker(self.cloud.port, "telemetry/#", "demo-checker", protocol=4)
        self.checker.start()
        self.stack.callback(self.checker.stop)

    def start_disk(self) -> Path:
        """The gateway's state directory: on the power-cut disk when FUSE is here."""
        from .powercut import PowerCutMount, fuse_missing

        why = fuse_missing()
        if why is not None:
            print(f"  no power-cut disk ({why}): a cut is a SIGKILL, the page cache survives")
            self.disk = None
            return self.out / "state"
        self.disk = PowerCutMount(self.out / "disk-backing", self.out / "disk").mount()
        self.stack.callback(self.disk.unmount)
        return self.disk.path / "state"

    def start_ingest(self) -> None:
        cmd = [sys.executable, "-m", "pubcomp", "ingest", "run", "--broker", self.cloud.url]
        cmd += ["--client-id", "demo-ingest", "--landing", str(self.out / "landing")]
        cmd += ["--roll-s", "2", "--keepalive", "5"]
        with (self.out / "ingest.log").open("a") as log:
            self.ingest = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        self.stack.callback(stop, self.ingest)

    def start_gateway(self) -> None:
        with (self.out / "gateway.log").open("a") as log:
            self.gateway = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pubcomp",
                    "gateway",
                    "run",
                    "--config",
                    str(FLEET),
                    "--gateway",
                    "gw-demo",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.gateway_env,
            )
        self.stack.callback(stop, self.gateway)
        deadline = time.monotonic() + 30
        while self.status() is None:
            if self.gateway.poll() is not None or time.monotonic() > deadline:
                tail = (self.out / "gateway.log").read_text()[-2000:]
                raise RuntimeError(f"the gateway did not start:\n{tail}")
            time.sleep(0.1)

    def status(self) -> dict[str, Any] | None:
        try:
            return fetch_status("127.0.0.1", self.health_port, timeout=1)
        except (OSError, ValueError):
            return None

    def start_nodes(self) -> None:
        rounds = int(RUN_S / NODE_INTERVAL_S)
        self.nodes = []
        for node, pw in NODE_PASSWORDS.items():
            cfg = node_config(node, pw, "127.0.0.1", self.ingress_port,
                              interval_s=NODE_INTERVAL_S, rounds=rounds)  # fmt: skip
            n = HostNode(self.out / node, cfg).start()
            self.stack.callback(n.kill)
            self.nodes.append(n)

    # ------------------------------------------------------------ the trouble

    def power_cut(self) -> None:
        self.cuts += 1
        if self.disk is not None:
            self.disk.cut(self.gateway)
        else:
            self.gateway.kill()
            self.gateway.wait()
        self.start_gateway()

    def run(self) -> int:
        self.start_cloud()
        state = self.start_disk()
        bench = SensorBench(self.out / "w1").start()
        self.stack.callback(bench.stop)
        self.ingress_port, self.health_port = free_port(), free_port()
        self.gateway_env = os.environ | {
            "PUBCOMP_DEMO_UPLINK_PORT": str(self.link.port),
            "PUBCOMP_DEMO_STATE": str(state),
            "PUBCOMP_DEMO_INGRESS_PORT": str(self.ingress_port),
            "PUBCOMP_DEMO_HEALTH_PORT": str(self.health_port),
            "PUBCOMP_DEMO_W1": str(self.out / "w1"),
            "PUBCOMP_DEMO_PMS_PORT": bench.pms_port,
            "PUBCOMP_DEMO_COMMIT_LOG": str(self.out / "commits.jsonl"),  # store.commit_log
        }
        self.start_ingest()
        self.start_gateway()
        self.start_nodes()
        print(f"cloud broker {self.cloud.url} (uplink via {self.link.port}), "
              f"gateway ingress :{self.ingress_port}, everything under {self.out}/")  # fmt: skip

        timeline: list[tuple[float, str, Callable[[], None]]] = [
            (8, "power cut 1: gateway off and on", self.power_cut),
            (15, "uplink down for 20 s", self.link.down),
            (25, "power cut 2, with the backlog on disk", self.power_cut),
            (35, "uplink back: the backlog drains", self.link.up),
            (45, "cloud broker restarted", self.cloud.restart),
        ]
        t0 = time.monotonic()
        while (t := time.monotonic() - t0) < RUN_S:
            while timeline and timeline[0][0] <= t:
                _, what, act = timeline.pop(0)
                self.events.append(f"{t:4.0f} s  {what}")
                self.show(t, what)
                print()
                act()
            self.show(t, self.events[-1].split("  ", 1)[1] if self.events else "running")
            time.sleep(0.25)
        print()
        return self.finish()

    def show(self, t: float, what: str) -> None:
        st = self.status()
        if st is None:
            gw = "gateway booting"
        else:
            up = st["uplink"]
            self.peak_backlog = max(self.peak_backlog, up["backlog"])
            gw = f"uplink {up['state']:<12} backlog {up['backlog']:>5,}"
        seen = len(self.checker.snapshot())
        line = f"\r  {bar(t, RUN_S)} {t:3.0f}/{RUN_S:.0f} s  {gw}  cloud has {seen:>6,}  {what}"
        print(f"{line:<130}", end="", flush=True)

    # ------------------------------------------------------------ the end

    def finish(self) -> int:
        print("  letting the nodes and the gateway drain ...", flush=True)
        for n in self.nodes:
            assert n.proc is not None
            n.wait(120)
        # Connected and nothing old waiting; then a graceful stop delivers the rest (the
        # sensors never stop, so the backlog is never empty while the gateway runs).
        wait_for(lambda: (s := self.status()) is not None and s["uplink"]["state"] == "connected"
                 and (s["uplink"]["oldest_age_s"] or 0) < 3, 120)  # fmt: skip
        self.gateway.terminate()
        self.gateway.wait(60)
        at_cloud = set(self.checker.snapshot())
        wait_for(lambda: at_cloud <= landed(self.out / "landing", rolled_only=False).keys(), 60)
        # The gateway's $ledger records (issue 27) travel like readings but are none.
        self.records = set(self.checker.records_seen())
        at_cloud -= self.records
        self.ingest.terminate()
        ingest_stats = json.loads((self.ingest.communicate(timeout=60)[0] or "{}").splitlines()[-1])
        print(f"  ingest landed {ingest_stats.get('readings', '?')} readings; running Spark ...")
        return self.pipeline(at_cloud)

    def pipeline(self, at_cloud: set[str]) -> int:
        from pubcomp.pipeline import health, report
        from pubcomp.pipeline.audit import delivered
        from pubcomp.pipeline.job import Pipeline, spark_session

        spark = spark_session(app="pubcomp-demo", java_options=SHORT_JVM)  # one small run
        self.stack.callback(spark.stop)
        wh = self.out / "warehouse"
        summary = Pipeline(spark, str(self.out / "landing"), str(wh)).run()
        health.update(spark, str(self.out / "landing"), str(wh))  # gateway_health, the fleet page
        got = delivered(spark, wh)
        node_ids: set[str] = set()
        node_acked = 0
        for n in self.nodes:
            taken = set(n.taken())
            node_ids |= taken
            m = re.findall(r"pending (\d+) lost (\d+)", n.output())
            if m and m[-1] == ("0", "0"):  # its last status: nothing waiting, nothing dropped
                node_acked += len(taken)
        sensor = commitlog.read(self.out / "commits.jsonl")
        lost_nodes = {i for i in node_ids if got.by_id[i] == 0}
        lost_sensor = {k for k in sensor if got.by_key[k] == 0}
        dup_in_table = sum(1 for c in got.by_id.values() if c > 1)
        # (a pipeline that keeps records out of readings has none of them there)
        records_in_table = sum(1 for i in self.records if got.by_id[i])
        rows = [
            ("produced: taken by the 2 nodes", len(node_ids)),
            ("produced: committed from the 3 sensors", len(sensor)),
            ("acknowledged (PUBACK to a node, or committed)", node_acked + len(sensor)),
            ("delivered to the cloud (paho subscriber, distinct ids)", len(at_cloud)),
            ("landed by the ingest, duplicates included", summary.readings_in),
            ("duplicates removed by the pipeline", summary.duplicates_removed),
            (
                "in the readings table, each once",
                summary.readings_written - dup_in_table - records_in_table,
            ),
            ("lost (acknowledged, not in the readings table)", len(lost_nodes | lost_sensor)),
        ]
        print("\n  what happened:")
        for e in self.events:
            print(f"    {e}")
        if self.disk is not None:
            st = self.disk.stats()
            print(f"    the gateway's disk: {st['cuts']} power cuts, {st['fsyncs']:,} fsyncs, "
                  f"{st['bytes_synced']:,} bytes made durable")  # fmt: skip
        print(f"    peak backlog in the gateway's store: {self.peak_backlog:,} readings\n")
        width = max(len(r[0]) for r in rows)
        print(f"  {'readings':<{width}}  {'count':>8}")
        for name, n in rows:
            print(f"  {name:<{width}}  {n:>8,}")
        self.print_rollup(spark, wh)
        page = self.out / "demo-report.html"
        report.write(spark, str(wh), page)
        print(f"\n  report: {page.resolve()}")
        ok = not lost_nodes and not lost_sensor and dup_in_table == 0 and node_acked
        print("  exactly once: YES" if ok else "  exactly once: NO (see the logs in demo-out/)")
        return 0 if ok else 1

    def print_rollup(self, spark: Any, wh: Path) -> None:
        from pyspark.sql import functions as F

        rows = (
            spark.read.parquet(str(wh / "rollup_1m"))
            .where(F.col("sensor") == "temp.cabinet")
            .orderBy("window_start")
            .select(F.unix_micros("window_start").alias("us"), "count", "min", "mean", "max")
            .collect()
        )
        print("\n  rollup_1m of temp.cabinet (the DS18B20):")
        print(f"    {'minute (UTC)':<17} {'count':>5} {'min':>7} {'mean':>7} {'max':>7}")
        for r in rows:
            minute = time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["us"] / 1e6))
            print(f"    {minute:<17} {r['count']:>5} {r['min']:>7.2f} {r['mean']:>7.2f} "
                  f"{r['max']:>7.2f}")  # fmt: skip


def wait_for(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return pred()


def main() -> int:
    out = Path("demo-out").resolve()
    if out.exists():
        with contextlib.suppress(OSError):
            subprocess.run(["fusermount3", "-u", "-z", str(out / "disk")], capture_output=True)
        shutil.rmtree(out)
    out.mkdir()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        rc = Demo(out, stack).run()
    print(f"  demo took {time.monotonic() - started:.0f} s; everything it started is stopped")
    return rc


if __name__ == "__main__":
    sys.exit(main())
