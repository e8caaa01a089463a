# Node software updates, the node's side, run by the real MicroPython interpreter
# (WebAssembly port, tests/firmware/run_mpy.mjs): manifest and chunk checks against
# offers made by the gateway's own code (CPython's hmac; the vectors module is
# written by tests/test_node_update_logic.py), resumption after a reboot, every bad
# input refused and counted with nothing applied, pubboot's pointer switch, and the
# RAM one chunk costs. Prints "PASS <name>" per check, "MEASURE <name> <value>" per
# figure and "DONE" at the end; an assertion error stops the run with a traceback.
import gc
import os
import sys

sys.path.insert(0, "/lib")
os.chdir("/flash")

import pubboot  # noqa: E402
import update_vectors as V  # noqa: E402
from pubnode import auth  # noqa: E402
from pubnode import update as U  # noqa: E402


def fresh(name):
    os.chdir("/flash")
    U.rm_tree(name)
    os.mkdir(name)
    os.chdir(name)


def chunk_for(vec, req):
    """The gateway's answer to a request G v i off, from the vectors."""
    _, v, i, off = req.decode().split()
    return vec["chunks"][(int(i), int(off))]


def fetch_all(u, vec, limit=1000):
    n = 0
    while u.state == U.FETCH and n < limit:
        u.take(chunk_for(vec, u.request()))
        n += 1
    return n


def read(p):
    with open(p, "rb") as f:
        return f.read()


def fsize(p):
    try:
        return os.stat(p)[6]
    except OSError:
        return -1


def check_key():
    assert auth.node_key(V.PASSWORD, V.NODE) == V.KEY  # the gateway's derivation, CPython hmac
    m = auth.Mac(b"k" * 100)  # a key longer than a block is hashed first (RFC 2104)
    assert m.digest(b"abc") == V.LONG_KEY_MAC, m.digest(b"abc")
    print("PASS key")


def check_full_update():
    fresh("t1")
    staged = []
    u = U.Updater(V.NODE, V.KEY, 0, 0)
    u.take(V.V1["manifest"])
    assert u.state == U.FETCH and u.version == 1, (u.state, u.refused)
    n = fetch_all(u, V.V1)
    assert u.state == U.READY, (u.state, u.refused, u.last)
    assert n == len(V.V1["chunks"]), n
    assert u.apply(staged.append) == 1 and staged == [1]
    for path, data in V.FILES1:
        assert read("sets/1/" + path) == data, path
    assert "upd" not in os.listdir(), os.listdir()
    assert u.state == U.IDLE and not u.refused, u.refused
    print("PASS full_update")


def check_resume_after_reboot():
    fresh("t2")
    u = U.Updater(V.NODE, V.KEY, 0, 0)
    u.take(V.V1["manifest"])
    for _ in range(3):  # the first file and part of the second
        u.take(chunk_for(V.V1, u.request()))
    at = (u.index, u.offset)
    assert at[0] >= 1 and at[1] > 0, at
    # A power cut mid-append: part of the next chunk reached the flash.
    with open("upd/1/" + V.FILES1[at[0]][0], "ab") as f:
        f.write(b"torn")
    u = U.Updater(V.NODE, V.KEY, 0, 0)  # the reboot: only the flash is left
    assert u.state == U.FETCH and (u.index, u.offset) == at, (u.state, u.index, u.offset)
    fetch_all(u, V.V1)
    assert u.state == U.READY
    u.apply(lambda v: None)
    for path, data in V.FILES1:
        assert read("sets/1/" + path) == data, path
    # Every file whole but not yet moved: the reboot finds it READY, checking each hash.
    fresh("t2b")
    u = U.Updater(V.NODE, V.KEY, 0, 0)
    u.take(V.V1["manifest"])
    fetch_all(u, V.V1)
    u = U.Updater(V.NODE, V.KEY, 0, 0)
    assert u.state == U.READY, u.state
    # Cut after the rename to sets/, before the pointer: READY again, apply finishes.
    staged = []
    os.mkdir("sets")
    os.rename("upd/1", "sets/1")
    u = U.Updater(V.NODE, V.KEY, 0, 0)
    assert u.state == U.READY
    assert u.apply(staged.append) == 1 and staged == [1]
    # Cut after the pointer, before upd/ went: the trial boot runs 1, so it is dropped.
    fresh("t2c")
    u = U.Updater(V.NODE, V.KEY, 0, 0)
    u.take(V.V1["manifest"])
    u = U.Updater(V.NODE, V.KEY, 1, 0)
    assert u.state == U.IDLE and "upd" not in os.listdir(), os.listdir()
    print("PASS resume_after_reboot")


def refused_nothing_applied(u, reason, text):
    assert u.refused.get(reason) == 1, (reason, u.refused)
    assert u.last is not None and text in u.last[2], (text, u.last)
    assert "sets" not in os.listdir(), os.listdir()


def check_bad_offers():
    cases = [
        (V.BAD_MAC, 0, 0, "bad_mac", "HMAC does not verify"),
        (V.OTHER_NODE, 0, 0, "other_node", "is for node node-b, not this node (node-a)"),
        (V.V1["manifest"], 2, 0, "not_newer", "not newer than the running version 2"),
        (V.V1["manifest"], 0, 1, "rolled_back", "version 1 was rolled back"),
        (V.NOT_JSON, 0, 0, "bad_manifest", "not JSON"),
        (V.ESCAPING, 0, 0, "bad_manifest", "outside the set"),
    ]
    for msg, running, bad, reason, text in cases:
        fresh("t3")
        u = U.Updater(V.NODE, V.KEY, running, bad)
        u.take(msg)
        assert u.state == U.IDLE, (reason, u.state)
        refused_nothing_applied(u, reason, text)
        assert "upd" not in os.listdir(), (reason, os.listdir())
    print("PASS bad_offers")


def started():
    fresh("t4")
    u = U.Updater(V.NODE, V.KEY, 0, 0)
    u.take(V.V1["manifest"])
    u.take(chunk_for(V.V1, u.request()))  # one good chunk in
    return u


def check_bad_chunks():
    u = started()
    want = (u.index, u.offset)
    good = chunk_for(V.V1, u.request())
    path = "upd/1/" + V.FILES1[u.index][0]
    size = fsize(path)
    u.take(good[:-7])  # truncated
    refused_nothing_applied(u, "chunk_truncated", "expected")
    later = V.V1["chunks"][(u.index, u.offset + V.CHUNK)]
    u.take(later)  # a later chunk in place of the one asked for: reordered
    refused_nothing_applied(u, "chunk_order", "out of order")
    forged = bytearray(good)
    forged[-1] ^= 1
    u.take(bytes(forged))  # one bit of the data changed: its MAC does not verify
    refused_nothing_applied(u, "chunk_mac", "MAC does not verify")
    u.take(V.V1["chunks"][(0, 0)])  # a late repeat of an answer already written
    assert u.refused.get("stale") == 1, u.refused
    assert (u.index, u.offset) == want and fsize(path) == size  # nothing written
    u.take(good)  # the right one still goes in
    assert (u.index, u.offset) != want
    fetch_all(u, V.V1)
    assert u.state == U.READY
    # Five bad chunks in a row: the offer is given up, its files dropped.
    u = started()
    good = chunk_for(V.V1, u.request())
    for _ in range(U.MAX_BAD_CHUNKS):
        u.take(good[:-1])
    assert u.state == U.IDLE and u.refused["gave_up"] == 1, u.refused
    assert u.last[1] == "failed" and "upd" not in os.listdir(), u.last
    print("PASS bad_chunks")


def check_file_sha_mismatch():
    fresh("t5")
    u = U.Updater(V.NODE, V.KEY, 0, 0)
    u.take(V.SHA_BAD["manifest"])
    assert u.state == U.FETCH
    fetch_all(u, V.SHA_BAD)
    assert u.refused["file_sha"] == U.MAX_FILE_RETRIES, u.refused
    assert u.refused["gave_up"] == 1 and u.state == U.IDLE, u.refused
    assert "does not match the manifest" in str(u.refused) or u.last[1] == "failed", u.last
    assert "upd" not in os.listdir() and "sets" not in os.listdir(), os.listdir()
    print("PASS file_sha_mismatch")


def check_withdrawn_and_replaced():
    u = started()
    u.take(b"E not offered\n")
    assert u.state == U.IDLE and u.last[1] == "withdrawn" and "upd" not in os.listdir()
    u = started()
    u.take(V.V2["manifest"])  # a newer offer replaces the one being fetched
    assert u.state == U.FETCH and u.version == 2 and (u.index, u.offset) == (0, 0)
    assert os.listdir("upd") == ["manifest"] or sorted(os.listdir("upd")) == ["2", "manifest"]
    print("PASS withdrawn_and_replaced")


def pointers():
    return sorted(n for n in os.listdir("sets") if not n.isdigit())


def check_pointer_switch():
    fresh("t6")
    path0 = list(sys.path)
    assert pubboot.select() == 0 and not pubboot.trial
    os.mkdir("sets")
    os.mkdir("sets/3")
    pubboot.stage(3)
    assert pubboot.select() == 3 and pubboot.trial and sys.path[0] == "sets/3"
    assert pointers() == ["pending", "trial"], pointers()
    pubboot.commit()
    assert pointers() == ["current"] and not pubboot.trial
    assert pubboot.select() == 3 and not pubboot.trial
    # A set that never commits: its one try is used, the next boot rolls it back.
    os.mkdir("sets/4")
    pubboot.stage(4)
    assert pubboot.select() == 4 and pubboot.trial
    assert pubboot.select() == 3 and pubboot.rolled_back == 4 and pubboot.bad == 4
    assert "4" not in os.listdir("sets") and pointers() == ["bad", "current"], os.listdir("sets")
    # Staged again (a replay): at or below bad, never tried.
    os.mkdir("sets/4")
    pubboot.stage(4)
    assert pubboot.select() == 3 and not pubboot.trial and "pending" not in pointers()
    # FAT: cut between removing the pointer and renaming its temp file over it.
    os.rename("sets/current", "sets/current.tmp")
    assert pubboot.select() == 3
    # Cut after commit wrote current, before pending went: pending == current, cleaned.
    os.mkdir("sets/5")
    pubboot.stage(5)
    pubboot.select()
    pubboot._write("current", 5)
    assert pubboot.select() == 5 and not pubboot.trial and "pending" not in pointers()
    # A pointer to a set that is gone: the factory set runs.
    U.rm_tree("sets/5")
    assert pubboot.select() == 0
    # deploy.sh: the cabled library runs; the gateway's sets go, the rolled-back floor stays.
    os.mkdir("sets/6")
    pubboot._write("current", 6)
    pubboot.factory()
    assert pubboot.select() == 0 and pubboot.bad == 4 and pointers() == ["bad"], pointers()
    assert [n for n in os.listdir("sets") if n.isdigit()] == []
    sys.path[:] = path0
    print("PASS pointer_switch")


def check_ram_per_chunk():
    # Every byte allocated while one chunk message is read (as umqtt does: one bytes
    # object of the whole message), checked and written, with the collector off: an
    # upper bound of the heap a chunk needs on top of what the updater keeps.
    for size in V.RAM_SIZES:
        vec = V.RAM[size]
        fresh("t7")
        u = U.Updater(V.NODE, V.KEY, 0, 0)
        u.take(vec["manifest"])
        worst = 0
        for _ in range(5):  # the fifth completes the file: its SHA-256 is read back
            msg = chunk_for(vec, u.request())
            gc.collect()
            gc.disable()
            a0 = gc.mem_alloc()
            u.take(msg)
            a1 = gc.mem_alloc()
            gc.enable()
            # umqtt's sock.read(n) holds the whole message (len(msg) bytes) meanwhile.
            worst = max(worst, a1 - a0 + len(msg))
        assert u.refused == {}, u.refused
        print("MEASURE ram_bytes_chunk_%d %d %d" % (size, worst, len(msg)))


check_key()
check_full_update()
check_resume_after_reboot()
check_bad_offers()
check_bad_chunks()
check_file_sha_mismatch()
check_withdrawn_and_replaced()
check_pointer_switch()
check_ram_per_chunk()
# --- next run ---
# What the updater keeps while it fetches (the manifest parsed, the MAC pads): measured
# across runPython calls, as this port frees only what no running call holds.
os.chdir("/flash")
fresh("t8")
gc.collect()
before = gc.mem_alloc()
# --- next run ---
held = U.Updater(V.NODE, V.KEY, 0, 0)
held.take(V.V1["manifest"])
# --- next run ---
gc.collect()
print("MEASURE ram_bytes_updater_held %d" % (gc.mem_alloc() - before))
print("DONE")
