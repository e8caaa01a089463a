"""Test hooks act only through devkit/hooked.py, never in the product (issue 25).

``PUBCOMP_CRASH_AT``, ``PUBCOMP_COMMIT_LOG`` and ``PUBCOMP_CLOCK_KERNEL`` used to act
in the installed product whenever they were in its environment, and the unit
loads ``/etc/pubcomp/environment``: a variable left there from a test would make
a field gateway SIGKILL itself at a crash point, or believe an unsynced clock.
Now the product reads none of them: the crash points and the forced clock are
installed by devkit/hooked.py (not in the wheel), and the commit log, an audit
feature, is the fleet file's ``store.commit_log``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from devkit import hooked
from devkit.broker import Mosquitto
from devkit.gateway_helpers import GatewayProc
from devkit.node_helpers import wait_until
from devkit.procs import track
from devkit.uplink_helpers import fill_store, uplink_cmd
from pubcomp.gateway.clock import kernel_synced

HOOK_ENV = {"PUBCOMP_CRASH_AT": "publish_persisted", "PUBCOMP_CRASH_MARKER": "marker"}


def test_a_crash_point_in_the_environment_does_not_kill_the_product(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    store = tmp_path / "gw.db"
    fill_store(store, 20)
    env = {**os.environ, **HOOK_ENV, "PUBCOMP_CRASH_MARKER": str(tmp_path / "marker")}
    args = uplink_cmd(store, mosquitto.url, "--exit-when-drained")[2:]  # after the program
    plain = subprocess.run(
        [sys.executable, "-m", "pubcomp", *args], env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-2000:]  # drained, never killed
    assert not (tmp_path / "marker").exists()
    fill_store(store, 20)
    hooked_run = subprocess.run(
        hooked.command(*args), env=env, capture_output=True, text=True, timeout=60
    )
    assert hooked_run.returncode == -signal.SIGKILL, hooked_run.stderr[-2000:]
    assert (tmp_path / "marker").read_text().split()[0] == "publish_persisted"


def test_the_clock_and_commit_log_variables_do_nothing_in_the_product(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    kernel = kernel_synced()
    lie = "unsynced" if kernel else "synced"
    log = tmp_path / "commits.jsonl"
    sensors = [{"id": "c", "type": "simulated", "signal": "counter", "interval_s": 0.05}]
    gw = GatewayProc(tmp_path, mosquitto.port, sensors=sensors)
    env = {**os.environ, "PUBCOMP_CLOCK_KERNEL": lie, "PUBCOMP_COMMIT_LOG": str(log)}
    cmd = [sys.executable, "-m", "pubcomp", "gateway", "run", "--config", str(gw.fleet)]
    with gw.log.open("a") as out:
        proc = subprocess.Popen([*cmd, "--gateway", gw.gid], env=env, stdout=out, stderr=out)
        gw.proc = track(proc)  # type: ignore[arg-type]
    try:
        gw.wait_healthy()
        assert wait_until(lambda: gw.status()["intake"]["committed_readings"] >= 20, 30)
        assert gw.status()["clock"]["synced"] == bool(kernel)  # what the kernel says
    finally:
        assert gw.terminate() == 0
    assert not log.exists()
    assert "forced" not in gw.log.read_text()
    # The audit trail is the fleet file's, and the hook acts through devkit/hooked.py.
    gw.extra = {"store": {"commit_log": str(log)}}
    gw.write()
    gw.start({"PUBCOMP_CLOCK_KERNEL": lie})
    try:
        assert wait_until(lambda: log.exists() and len(log.read_text().splitlines()) >= 5, 30)
        assert gw.status()["clock"]["synced"] == (lie == "synced")
    finally:
        assert gw.terminate() == 0
