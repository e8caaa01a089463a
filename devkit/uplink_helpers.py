"""Run ``pubcomp uplink run`` as a real process and fill stores with readings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pubcomp.sync.store import Reading, Store

from . import hooked
from .store_helpers import append


def fill_store(path: Path, n: int, gateway: str = "gw1") -> set[str]:
    """Put n readings in a (new) store, five to a commit as a gateway's sensors would;
    return their reading ids."""
    with Store(path, gateway_id=gateway) as store:
        seqs: list[int] = []
        for start in range(0, n, 5):
            first, last = append(
                store,
                (
                    Reading(f"s{i % 7}", float(i), f"2026-11-21T00:00:{i % 60:02d}.000Z", "C")
                    for i in range(start, min(n, start + 5))
                ),
            )
            seqs += range(first, last + 1)
        return {f"{gateway}/{store.epoch}/{seq}" for seq in seqs}


def uplink_cmd(
    store: Path, url: str, *extra: str, client_id: str = "gw1", end_to_end: bool = False
) -> list[str]:
    """``pubcomp uplink run`` through devkit/hooked.py (crash points from the environment).
    ``end_to_end`` off unless asked: most tests here check the QoS 2 hop with a paho
    checker, and no ingest would ever say what landed."""
    return hooked.command(
        "uplink",
        "run",
        "--store",
        str(store),
        "--broker",
        url,
        "--client-id",
        client_id,
        "--keepalive",
        "5",
        *([] if end_to_end else ["--no-end-to-end"]),
        *extra,
    )


def run_uplink(
    store: Path,
    url: str,
    *extra: str,
    crash_at: str | None = None,
    marker: Path | None = None,
    timeout: float = 60,
    end_to_end: bool = False,
    progress: Callable[[], object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the uplink to the end (``--exit-when-drained``) or to its crash point; with
    ``marker``, the crash point writes its name there before the kill. With ``progress``
    (what an independent observer has seen so far, e.g. a checker's count), ``timeout``
    is the longest the run may go without it changing: a drain of thousands takes as long
    as the machine is busy, and a stalled one still fails."""
    env = dict(os.environ)
    env.pop("PUBCOMP_CRASH_AT", None)
    env.pop("PUBCOMP_CRASH_MARKER", None)
    if crash_at:
        env["PUBCOMP_CRASH_AT"] = crash_at
    if marker is not None:
        env["PUBCOMP_CRASH_MARKER"] = str(marker)
    cmd = uplink_cmd(store, url, "--exit-when-drained", *extra, end_to_end=end_to_end)
    if progress is None:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        out, err = communicate_while(proc, progress, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def communicate_while(
    proc: subprocess.Popen[str], progress: Callable[[], object], stall: float
) -> tuple[str, str]:
    """``proc.communicate()`` for as long as ``progress()`` keeps changing: killed, and
    ``TimeoutExpired`` raised, only after ``stall`` seconds without a change."""
    seen, since = progress(), time.monotonic()
    while True:
        try:
            return proc.communicate(timeout=1)
        except subprocess.TimeoutExpired:
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > stall:
                proc.kill()
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(proc.args, stall, out, err) from None


def start_uplink(
    store: Path, url: str, *extra: str, end_to_end: bool = False
) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "PUBCOMP_CRASH_AT"}
    return subprocess.Popen(
        uplink_cmd(store, url, *extra, end_to_end=end_to_end),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def summary(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stop_after(
    proc: subprocess.Popen[str], until_stderr: str, timeout: float = 60
) -> dict[str, object]:
    """Let a running uplink go on until a line of its log contains ``until_stderr`` (what
    the test waits for: a refusal, an error), then SIGTERM it; its summary line. Waiting
    for the line, not for a time: on a busy machine the process may take seconds to start."""
    seen = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if until_stderr in line:
                seen.set()
        seen.set()  # ended without it: the summary says why

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    seen.wait(timeout)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(30)
    t.join(10)
    return json.loads(out.strip().splitlines()[-1])


def store_states(path: Path) -> list[str]:
    return [state for _, state in inflight_rows(path)]


def inflight_rows(path: Path) -> list[tuple[int | None, str]]:
    """(packet id, state) of every in-flight message, in original send order."""
    import sqlite3

    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT packet_id, state FROM out_inflight ORDER BY ord").fetchall()
    finally:
        db.close()
    return [(pid, state) for pid, state in rows]
