"""The ingest's landing files under the writeback power-cut model, many seeds (issue 24).

Two sweeps, each printing its figures and those of a peer measured in the same run:

1. **Replay** (``--replay N`` seeds, fast, no processes): the write-then-cut moment.
   Twelve messages appended and fsynced, then a group of 1 to 12 more written and
   not fsynced; devkit/powercut's model lets the seed choose which unsynced pages
   reached the disk (some torn at 512-byte sectors, holes reading as zeros); the
   next start's ``LandingWriter`` recovers the file. Counted per seed: a receive
   record trusted whose message is not whole (the broker's resend is acknowledged
   without being written: readings **lost**), lines kept whose record is not
   trusted (the resend lands again: readings **twice**), a **malformed** line in the
   rolled file (``pipeline/audit.py`` fails on it). The peer is the landing code
   of ``--against`` (default: the commit before the seal), run on the same bytes.
2. **Processes** (``--processes K`` seeds, about 10 s each): ``pubcomp ingest run``
   on the power-cut mount in writeback mode (5 ms added to each write), a paho
   publisher at QoS 2 through a real Mosquitto, ``--cuts`` cuts a seed, each right
   after one of the ingest's writes: PUBCOMP'd readings lost or landed twice,
   malformed lines in rolled files (``devkit.ingest_helpers.writeback_cuts``, the
   scenario tests/test_powercut_ingest.py runs for 4 seeds).

    python bench/ingest_writeback.py [--replay 1000] [--processes 10 --cuts 10]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import random
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devkit.powercut.model import Image  # noqa: E402
from pubcomp.pipeline import landing  # noqa: E402

BEFORE_SEAL = "9dbb07f"  # main before issue 24: recovery cut after the last newline and record


def landing_at(rev: str) -> ModuleType:
    """pipeline/landing.py as it was at ``rev``, loaded beside the current one."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:pipeline/landing.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "landing_then.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("landing_then", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def message(m: int) -> bytes:
    readings = [
        {"id": f"gw/e/{m * 100 + i}", "value": i, "received": "2026-11-24T10:00:00.000Z"}
        for i in range(10)
    ]
    readings[-1]["_mqtt"] = {"session": "s", "packet_id": m + 1, "qos": 2, "digest": f"d{m}"}
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in readings)


def disk_after_cut(work: Path, seed: int, synced: bytes, unsynced: bytes) -> bytes:
    image = Image(work / "backing", writeback=True)
    node = image.make("/f", stat.S_IFREG | 0o644)
    image.write(node.ino, synced, 0)
    image.fsync(node.ino)
    image.write(node.ino, unsynced, len(synced))
    image.writeback(random.Random(seed))
    return bytes(Image(work / "backing").lookup("/f").data)


def judge(mod: ModuleType, work: Path, data: bytes, messages: int) -> dict[str, bool]:
    """Recover ``data`` with ``mod``'s LandingWriter; what the ingest would then do wrong."""
    incoming = work / "landing" / "_incoming" / "readings"
    incoming.mkdir(parents=True)
    (incoming / "w-20261124T100000000000Z-1.jsonl").write_bytes(data)
    w = mod.LandingWriter(work / "landing", "w", message_records=True)
    rolled = list((work / "landing").glob("date=*/*.jsonl"))
    kept = rolled[0].read_bytes() if rolled else b""
    trusted = {r["digest"] for r in w.receive_records()}
    ids: set[str] = set()
    malformed = False
    for line in kept.splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except ValueError:
            malformed = True
    whole = [all(f"gw/e/{m * 100 + i}" in ids for i in range(10)) for m in range(messages)]
    some = [any(f"gw/e/{m * 100 + i}" in ids for i in range(10)) for m in range(messages)]
    return {
        "lost": any(f"d{m}" in trusted and not whole[m] for m in range(messages)),
        "twice": any(f"d{m}" not in trusted and some[m] for m in range(messages)),
        "malformed": malformed,
    }


def replay(seeds: int, against: str) -> None:
    then = landing_at(against)
    totals: dict[str, dict[str, int]] = {"now": {}, against: {}}
    for seed in range(seeds):
        rng = random.Random(seed)
        unsynced_n = rng.randint(1, 12)
        # What the ingest writes: sealed records (the old recovery ignores the seal).
        msgs = [landing.seal(message(m)) for m in range(12 + unsynced_n)]
        with tempfile.TemporaryDirectory() as t:
            data = disk_after_cut(Path(t), seed, b"".join(msgs[:12]), b"".join(msgs[12:]))
            for name, mod in (("now", landing), (against, then)):
                got = judge(mod, Path(t) / name, data, len(msgs))
                for k, v in {**got, "any": any(got.values())}.items():
                    totals[name][k] = totals[name].get(k, 0) + v
    print(f"replay of the write-then-cut moment, {seeds} seeds (1-12 unsynced messages):")
    print(f"{'landing code':>14} {'lost':>6} {'twice':>6} {'malformed':>10} {'any':>6}")
    for name, t in totals.items():
        print(f"{name:>14} {t['lost']:>6} {t['twice']:>6} {t['malformed']:>10} {t['any']:>6}")
    ratio = totals["now"]["any"] / max(1, totals[against]["any"])
    print(f"seeds with a fault, now / {against}: {ratio:.3f}")


def processes(seeds: int, cuts: int) -> None:
    from devkit.broker import Mosquitto
    from devkit.ingest_helpers import writeback_cuts
    from devkit.powercut import fuse_missing

    if (why := fuse_missing()) is not None:
        print(f"processes: skipped ({why})")
        return
    print(f"processes: {seeds} seeds x {cuts} cuts, each right after one of the ingest's writes")
    keys = ("pubcompd", "lost", "twice", "malformed_lines", "bad_lost", "bad_twice", "quarantined")
    print(f"{'seed':>6} " + " ".join(f"{k:>15}" for k in keys) + f" {'s':>5}")
    totals: dict[str, int] = dict.fromkeys(keys, 0)
    for seed in range(seeds):
        with tempfile.TemporaryDirectory() as t:
            broker = Mosquitto(Path(t) / "broker").start()
            started = time.monotonic()
            try:
                got: dict[str, Any] = writeback_cuts(Path(t), broker.port, 1000 + seed, cuts)
            finally:
                broker.kill()
        for k in keys:
            totals[k] += got[k]
        cells = " ".join(f"{got[k]:>15}" for k in keys)
        print(f"{1000 + seed:>6} {cells} {time.monotonic() - started:>5.0f}", flush=True)
    print(f"{'all':>6} " + " ".join(f"{totals[k]:>15}" for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replay", type=int, default=1000, help="seeds of the replay (0: none)")
    ap.add_argument("--against", default=BEFORE_SEAL, help="the peer's git revision")
    ap.add_argument("--processes", type=int, default=0, help="seeds with real processes")
    ap.add_argument("--cuts", type=int, default=10, help="cuts a process seed")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # every recovery says what it cut
    if args.replay:
        replay(args.replay, args.against)
    if args.processes:
        processes(args.processes, args.cuts)


if __name__ == "__main__":
    main()
