# Which set of the node's application files runs: chosen at every boot, before
# anything of a set is imported (docs/firmware.md, "Node software updates").
#
# deploy.sh puts the factory set in /lib/pubnode (version 0). Sets that arrive
# from the gateway live in sets/<version>/pubnode/...; pointer files say which
# one runs:
#   sets/current   the committed set (absent: the factory set in /lib)
#   sets/pending   a verified set to try once
#   sets/trial     written as the pending set starts: its one try is used
#   sets/bad       the highest version rolled back: never taken again
# A pending set is committed by the application once it has connected and had
# a reading acknowledged (commit()); a boot that finds its try used up and no
# commit rolls it back. This file is not part of any set, so a broken set
# cannot break the fall-back from it.
#
# Pointers are written atomically: a temp file, then a rename. FAT (the ffat
# partition of some ESP32 boards) will not rename over a file, so there the old
# one is removed first, and a cut in between leaves only the temp file, which
# _read takes. littlefs (MicroPython's default) renames over a file atomically.
import os
import sys

DIR = "sets"
FW = "fw"  # the same for a whole MicroPython image (ESP32): current, trial, bad
version = 0  # the set running since select()
trial = False  # True while a pending set has its one try
rolled_back = None  # a version select() rolled back at this boot
bad = 0
image = 0  # the image's version (0: the one flashed by cable)
image_trial = False
image_rolled_back = None
image_bad = 0


def _exists(p):
    try:
        os.stat(p)
        return True
    except OSError:
        return False


def _read_one(p):
    with open(p) as f:
        text = f.read().strip()
    if " " in text:  # fw/trial: "<version> <partition>"
        v, label = text.split(" ", 1)
        return (int(v), label) if v.isdigit() else None
    return int(text) if text.isdigit() else None


def _read(name, d=DIR):
    p = d + "/" + name
    try:
        return _read_one(p)
    except OSError:
        pass
    try:
        return _read_one(p + ".tmp")  # cut between the remove and the rename (FAT)
    except OSError:
        return None


def _sync():
    sync = getattr(os, "sync", None)
    if sync:
        sync()


def _write(name, value, d=DIR):
    if not _exists(d):
        os.mkdir(d)
    p = d + "/" + name
    with open(p + ".tmp", "w") as f:
        f.write(str(value))
    try:
        os.rename(p + ".tmp", p)
    except OSError:  # FAT will not rename over an existing file
        os.remove(p)
        os.rename(p + ".tmp", p)
    _sync()


def _remove(name, d=DIR):
    for p in (d + "/" + name, d + "/" + name + ".tmp"):
        try:
            os.remove(p)
        except OSError:
            pass


def rm_tree(path):
    try:
        names = os.listdir(path)
    except OSError:
        return
    for n in names:
        p = path + "/" + n
        try:
            os.remove(p)
        except OSError:
            rm_tree(p)
    try:
        os.rmdir(path)
    except OSError:
        pass


def path(v):
    return DIR + "/" + str(v)


def select():
    """At boot: pick the set, put it first on sys.path; its version (0: factory)."""
    global version, trial, rolled_back, bad
    cur = _read("current") or 0
    pend = _read("pending")
    tried = _read("trial")
    bad = _read("bad") or 0
    trial = False
    rolled_back = None
    if pend is not None:
        if pend == cur or pend <= bad or not _exists(path(pend)):
            # A commit or a roll-back cut short by a power cut, or a set that is gone.
            _remove("pending")
            _remove("trial")
        elif tried == pend:
            # Its one try ended (a crash, the watchdog, the trial's time limit, a power
            # cut) without a commit: back to the set that ran before.
            bad = max(bad, pend)
            _write("bad", bad)
            _remove("pending")
            _remove("trial")
            rm_tree(path(pend))
            rolled_back = pend
            print("pubboot: set %d did not commit on its try: rolled back to %d" % (pend, cur))
        else:
            _write("trial", pend)
            cur = pend
            trial = True
    elif tried is not None:
        _remove("trial")
    if cur and not _exists(path(cur)):
        print("pubboot: set %d is missing; running the factory set" % cur)
        cur = 0
    version = cur
    if cur:
        sys.path.insert(0, path(cur))
    return version


def stage(v):
    """A verified set in sets/<v>: try it at the next boot."""
    _write("pending", v)


def commit():
    """The running set proved itself: keep it, drop every other set."""
    global trial
    _write("current", version)
    _remove("pending")
    _remove("trial")
    trial = False
    try:
        names = os.listdir(DIR)
    except OSError:
        names = []
    for n in names:
        if n.isdigit() and int(n) != version:
            rm_tree(path(n))


def factory():
    """deploy.sh: the library it copied runs from now on (sets/bad is kept)."""
    for name in ("current", "pending", "trial"):
        _remove(name)
    try:
        names = os.listdir(DIR)
    except OSError:
        return
    for n in names:
        if n.isdigit():
            rm_tree(path(n))


# ------------------------------------------------------------ a whole image (ESP32)
#
# The image is written to the next OTA partition and booted with set_boot(); ESP-IDF's
# bootloader boots it once "pending verify" and goes back to the previous partition at
# the next boot unless the application calls mark_app_valid_cancel_rollback(). fw/trial
# ("<version> <partition>") is written before set_boot(): a boot that finds it and runs
# another partition knows the image did not verify or did not commit.


def select_image():
    global image, image_trial, image_rolled_back, image_bad
    image = _read("current", FW) or 0
    image_bad = _read("bad", FW) or 0
    image_trial = False
    image_rolled_back = None
    t = _read("trial", FW)
    if not isinstance(t, tuple):
        return image
    v, label = t
    try:
        from esp32 import Partition
    except ImportError:
        _remove("trial", FW)
        return image
    if Partition(Partition.RUNNING).info()[4] == label:
        image = v
        image_trial = True
    else:
        image_bad = max(image_bad, v)
        _write("bad", image_bad, FW)
        _remove("trial", FW)
        image_rolled_back = v
        print("pubboot: image %d did not boot or commit: the bootloader went back" % v)
    return image


def stage_image(v, label):
    _write("trial", "%d %s" % (v, label), FW)


def commit_image():
    global image_trial
    from esp32 import Partition

    Partition.mark_app_valid_cancel_rollback()
    _write("current", image, FW)
    _remove("trial", FW)
    image_trial = False
