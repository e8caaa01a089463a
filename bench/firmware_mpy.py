# Run by bench/firmware.py under the real MicroPython (WebAssembly port):
# RAM of a 500-reading buffer and flash bytes per reading, each beside a peer.
import gc
import json
import os
import sys
import time

sys.path.insert(0, "/lib")
os.chdir("/flash")
from pubnode import message as M  # noqa: E402
from pubnode.ring import Ring  # noqa: E402
from pubnode.spill import SpillLog  # noqa: E402

NAMES = ("t-probe", "air-t", "air-rh")
# --- next run ---
gc.collect()
before = gc.mem_alloc()
# --- next run ---
ring = Ring(500)
seq = 0
while ring.readings + 3 <= 500:
    ring.push(
        M.new(9, seq, int(time.time()), time.ticks_ms(), [(n, 20.0 + seq / 16, "C") for n in NAMES])
    )
    seq += 1
# --- next run ---
gc.collect()
ours = gc.mem_alloc() - before
# --- next run ---
gc.collect()
before = gc.mem_alloc()
# --- next run ---
# The peer: the same rounds held the obvious way, as the wire format's dicts.
naive = []
for s in range(seq):
    readings = [{"sensor": n, "value": 20.0 + s / 16, "unit": "C"} for n in NAMES]
    naive.append({"boot": 9, "seq": s, "ts": time.time(), "readings": readings})
# --- next run ---
gc.collect()
peer = gc.mem_alloc() - before
print("RESULT ram", ring.readings, ours, peer)
# Flash: 200 messages arrive during an outage, then drain. Ours appends each
# message and each ack; the peer rewrites one JSON queue file on every change.
log = SpillLog("bench-spill", 4, 32768)
start = log.bytes_written
msgs = [
    M.new(9, s, int(time.time()), 0, [(n, 20.0 + s / 16, "C") for n in NAMES]) for s in range(200)
]
for m in msgs:
    log.append(m)
for _ in msgs:
    log.ack()
ours = log.bytes_written - start
peer = 0
queue = []
for m in msgs:
    queue.append(M.record(m))
    peer += len(json.dumps(queue))
while queue:
    queue.pop(0)
    peer += len(json.dumps(queue))
print("RESULT flash", len(msgs) * 3, ours, peer)
