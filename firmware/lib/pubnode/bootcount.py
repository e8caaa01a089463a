# The boot counter in flash: the epoch of this node's reading ids.
#
# Written atomically (a temp file, then a rename), so a power cut leaves the old
# value or the new one, never a torn one. Incremented before anything is
# published, so a boot number is never used twice. A node without a readable
# counter (new, or its flash wiped) starts at a random number rather than at 1:
# starting at 1 again would make the gateway drop its new readings as repeats.
import os

from .rand import bits


def _read(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text or not text.isdigit():
        return None
    return int(text)


def _random_start():
    # 24 random bits, shifted so it cannot collide with a counter that grew from 1.
    return (bits(24) + 1) << 6


def _sync():
    sync = getattr(os, "sync", None)
    if sync:
        sync()


def next_boot(path="boot.txt"):
    tmp = path + ".tmp"
    cur = _read(path)
    if cur is None:
        cur = _read(tmp)  # cut after removing the old file, before the rename (FAT)
    new = _random_start() if cur is None else cur + 1
    with open(tmp, "w") as f:
        f.write(str(new))
    try:
        os.rename(tmp, path)
    except OSError:  # FAT will not rename over an existing file
        os.remove(path)
        os.rename(tmp, path)
    _sync()
    return new
