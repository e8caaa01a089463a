"""A FUSE file system that loses, at a cut, everything that was not fsynced.

model.py: the rules (what reaches the backing directory, and when).
fs.py: the FUSE side (mfusepy over libfuse 3) and a control socket.
mount.py: mount, cut, remount, for tests and bench/chaos_compare.py.
"""

from .mount import PowerCutMount, fuse_missing

__all__ = ["PowerCutMount", "fuse_missing"]
