"""A Spark standalone cluster on loopback: a master and one worker, real JVMs.

Started from the pyspark package's own ``bin/spark-class`` (the jars pip installed),
so no Spark download is needed. The worker's executors are separate JVMs from the
driver: what the pipeline keeps only in the driver, or writes where an executor
cannot read it, fails here and not in ``local[*]``.

    with SparkStandalone(tmp_path).start() as cluster:
        subprocess.run(["pubcomp", "pipeline", "run", "--master", cluster.url, ...])
        cluster.apps()  # the applications the master ran, with their state
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import pyspark

from devkit.broker import free_port
from devkit.sparkconf import SHORT_JVM, short_jvm_env

SPARK_HOME = Path(pyspark.__file__).resolve().parent


def cluster_env(root: Path) -> dict[str, str]:
    """The environment of the cluster's JVMs and of a driver talking to it: everything on
    loopback (this machine's host name resolves to an address executors may not reach),
    the driver's Python on the executors too. Every JVM of it lives for a test's few
    small runs (``sparkconf.SHORT_JVM``)."""
    return {
        **short_jvm_env(os.environ),
        "SPARK_DAEMON_JAVA_OPTS": SHORT_JVM,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_HOSTNAME": "127.0.0.1",
        "SPARK_LOG_DIR": str(root / "logs"),
        "SPARK_WORKER_DIR": str(root / "work"),
        "PYSPARK_PYTHON": sys.executable,
    }


class SparkStandalone:
    def __init__(self, root: Path, cores: int = 2, memory: str = "1536m") -> None:
        self.root = root
        self.cores, self.memory = cores, memory
        self.port, self.ui = free_port(), free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []
        self.env = cluster_env(root)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spawn(self, name: str, *args: str) -> None:
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        (self.root / "work").mkdir(parents=True, exist_ok=True)
        out = (self.root / "logs" / f"{name}.out").open("wb")
        self.logs.append(out)
        cmd = [str(SPARK_HOME / "bin" / "spark-class"), *args]
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT))

    def state(self) -> dict[str, Any]:
        """The master's view (its web UI's JSON): workers, applications."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui}/json/", timeout=5) as r:
            data: dict[str, Any] = json.loads(r.read())
            return data

    def _wait(self, what: str, ok: Any, deadline_s: float) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"spark {what}: a process exited: {self.log_tail()}")
            try:
                if ok():
                    return
            except OSError:  # the web UI is not up yet
                pass
            time.sleep(0.5)
        raise TimeoutError(f"spark {what} not up in {deadline_s} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join(
            f.read_text(errors="replace")[-1500:] for f in sorted((self.root / "logs").glob("*"))
        )

    def start(self, deadline_s: float = 120) -> SparkStandalone:
        master = "org.apache.spark.deploy.master.Master"
        self._spawn("master", master, "--host", "127.0.0.1", "--port", str(self.port),
                    "--webui-port", str(self.ui))  # fmt: skip
        self._wait("master", lambda: self.state()["status"] == "ALIVE", deadline_s)
        worker = "org.apache.spark.deploy.worker.Worker"
        self._spawn(
            "worker", worker, "--host", "127.0.0.1", "--cores", str(self.cores),
            "--memory", self.memory, "--webui-port", str(free_port()),
            "--work-dir", str(self.root / "work"), self.url,
        )  # fmt: skip
        self._wait("worker", lambda: self.state().get("aliveworkers", 0) >= 1, deadline_s)
        return self

    def apps(self) -> list[dict[str, Any]]:
        """Every application the master ran or runs (name, state, cores, ...)."""
        s = self.state()
        return [*s.get("activeapps", []), *s.get("completedapps", [])]

    def stop(self) -> None:
        for p in reversed(self.procs):  # the worker first, so it does not reconnect
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs.clear()
        for f in self.logs:
            f.close()
        self.logs.clear()

    def __enter__(self) -> SparkStandalone:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
