# Node software from the gateway: an offer's manifest, its chunks, the staged set.
#
# The gateway offers a set of application files (what deploy.sh copies to
# /lib) as a manifest: version, chunk size, and per file its path, size and
# SHA-256, with an HMAC-SHA256 under this node's update key (auth.py). The
# node asks for one chunk at a time (a request, then its answer), so at most
# one chunk is in RAM; umqtt reads a whole message into RAM, which is why
# chunks are small (docs/firmware.md has the measurement). Each chunk carries a
# MAC over (version, file, offset, data) and is written to flash only when it
# verifies, is the one asked for and is as long as it must be; a file counts
# only when its SHA-256 matches the manifest.
#
# Everything lives in flash under upd/: the manifest as received, and the
# files being fetched under upd/<version>/. After a reboot the node verifies
# the manifest again, keeps each whole file whose SHA-256 matches, and resumes
# the first one that is not whole at its last whole chunk: nothing is trusted
# that does not verify. When every file verifies, apply() renames
# upd/<version> to sets/<version> (beside the running set) and points
# sets/pending at it (pubboot.py); the next boot tries it once.
#
# An offer of kind "image" is one whole MicroPython image for an ESP32: its
# chunks go to the next OTA partition (image.py) instead of files, its progress
# to upd/image.pos (after each chunk: the bytes below it were written whole);
# apply() checks the partition's SHA-256, notes the trial (pubboot.stage_image)
# and calls set_boot().
import hashlib
import json
import os

from . import auth

try:
    from binascii import hexlify
except ImportError:
    from ubinascii import hexlify

IDLE, FETCH, READY = "idle", "downloading", "ready"
MAX_FILES = 64
MAX_CHUNK = 16384
MAX_BAD_CHUNKS = 5  # refused chunks in a row before the offer is given up
MAX_FILE_RETRIES = 3  # files whose SHA-256 did not match, per offer
SPARE_BYTES = 8192  # flash left free after a set is staged
READ_BLOCK = 512
IMAGE_BLOCK = 4096  # an ESP32 partition's erase block (image.py)


def _size(p):
    try:
        return os.stat(p)[6]
    except OSError:
        return -1


def _exists(p):
    return _size(p) >= 0


def rm_tree(path):
    try:
        names = os.listdir(path)
    except OSError:
        try:
            os.remove(path)
        except OSError:
            pass
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


def makedirs(path):
    at = ""
    for part in path.split("/"):
        at = part if not at else at + "/" + part
        if not _exists(at):
            os.mkdir(at)


def file_sha(p):
    h = hashlib.sha256()
    buf = bytearray(READ_BLOCK)
    view = memoryview(buf)
    with open(p, "rb") as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return hexlify(h.digest()).decode()


def free_bytes():
    try:
        st = os.statvfs(".")
    except (AttributeError, OSError):
        return None
    return st[0] * st[4]


def ok_path(p):
    """A file of a set: relative, no '..', a few safe characters."""
    if not p or p[0] == "/" or len(p) > 96:
        return False
    for part in p.split("/"):
        if part in ("", ".", ".."):
            return False
    for ch in p:
        if not (ch.isalpha() or ch.isdigit() or ch in "._-/"):
            return False
    return True


def parse_manifest(body):
    """The manifest's fields, or a string saying what is wrong with it."""
    try:
        m = json.loads(body.decode())
    except (ValueError, UnicodeError):
        return "the manifest is not JSON"
    if not isinstance(m, dict):
        return "the manifest is not an object"
    node, version, chunk, files = m.get("node"), m.get("version"), m.get("chunk"), m.get("files")
    kind = m.get("kind", "files")
    if kind not in ("files", "image"):
        return "the manifest's kind %r is not files or image" % (kind,)
    if not isinstance(node, str) or not isinstance(version, int) or version < 1:
        return "the manifest has no node or version"
    if not isinstance(chunk, int) or not 64 <= chunk <= MAX_CHUNK:
        return "the manifest's chunk size is not 64..%d" % MAX_CHUNK
    if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
        return "the manifest lists no files, or more than %d" % MAX_FILES
    out = []
    for f in files:
        if not (isinstance(f, list) and len(f) == 3):
            return "a manifest entry is not [path, size, sha256]"
        path, size, sha = f
        if not (isinstance(path, str) and ok_path(path)):
            return "the manifest names a file outside the set: %r" % (path,)
        if not (isinstance(size, int) and size >= 0) or not (isinstance(sha, str) and len(sha) == 64):
            return "the manifest's entry for %s has no size or SHA-256" % path
        out.append((path, size, sha))
    if kind == "image" and (len(out) != 1 or IMAGE_BLOCK % chunk):
        return "an image offer has one file and chunks that divide %d" % IMAGE_BLOCK
    return (node, version, chunk, out, str(m.get("label", "")), kind)


class Updater:
    def __init__(
        self, node_id, key, running, bad, root="upd", sets="sets", image=0, image_bad=0,
        image_sink=None,
    ):
        self.node_id = node_id
        self.mac = auth.Mac(key)
        self.running = running  # the version of the set that runs (0: factory)
        self.bad = bad  # the highest version rolled back here
        self.image = image  # the same for a whole image (ESP32)
        self.image_bad = image_bad
        self.image_sink = image_sink  # a callable giving image.ImageSink or None
        self.root = root
        self.sets = sets
        self.refused = {}  # reason -> count: chunks and offers not taken
        self.last = None  # [version, result, why]: the last offer's outcome
        self.changed = False  # something the gateway has not heard yet
        self._clear()
        self._resume()

    def _clear(self):
        self.state = IDLE
        self.version = None
        self.label = ""
        self.files = []
        self.chunk = 0
        self.index = 0
        self.offset = 0
        self.sig = None
        self.kind = "files"
        self.sink = None  # image.ImageSink while an image is fetched
        self.bad_chunks = 0
        self.retries = 0

    # ------------------------------------------------------------ what to say

    def hello(self, trial=False, boot=0):
        """What the node tells the gateway: its software, what it holds, the last outcome
        (``refused`` counts from 0 at each boot; ``boot`` tells the gateway when)."""
        have = None
        if self.state != IDLE:
            have = [self.version, self.index, self.offset, len(self.files)]
        self.changed = False
        body = {
            "sw": self.running,
            "fw": self.image,
            "fw_bad": self.image_bad,
            "kind": self.kind,
            "boot": boot,
            "state": "trial" if trial else self.state if self.state != IDLE else "running",
            "bad": self.bad,
            "have": have,
            "last": self.last,
            "refused": self.refused,
        }
        return b"H " + json.dumps(body).encode()

    def request(self):
        """The next chunk to ask for, or None."""
        if self.state != FETCH:
            return None
        return ("G %d %d %d" % (self.version, self.index, self.offset)).encode()

    def progress(self):
        done = sum(f[1] for f in self.files[: self.index]) + self.offset
        return done, sum(f[1] for f in self.files)

    # ------------------------------------------------------------ what came

    def take(self, msg):
        """One message from the gateway on nodes/<id>/update."""
        kind = msg[:1]
        if kind == b"M":
            self._offer(msg)
        elif kind == b"C":
            self._chunk(msg)
        elif kind == b"A":
            pass  # the offer is still the one being fetched
        elif kind in (b"N", b"E"):
            if self.state == FETCH:
                # The gateway no longer offers what is being fetched (withdrawn or replaced).
                print("update: version %d is no longer offered: %s" % (self.version, _text(msg)))
                self._drop("withdrawn", "no longer offered")
        else:
            self._count("unknown_message")

    def _count(self, reason):
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def _refuse(self, version, reason, text, result="refused"):
        self._count(reason)
        self.last = [version, result, text]
        self.changed = True
        print("update: refused: " + text)

    def _offer(self, msg, quiet=False):
        nl = msg.find(b"\n")
        if nl < 3 or msg[1:2] != b" ":
            if not quiet:
                self._refuse(None, "bad_manifest", "an offer that is not a manifest")
            return False
        sig = bytes(msg[2:nl])
        body = memoryview(msg)[nl + 1 :]
        got = parse_manifest(bytes(body))
        if isinstance(got, str):
            if not quiet:
                self._refuse(None, "bad_manifest", "offer not taken: " + got)
            return False
        node, version, chunk, files, label, kind = got
        running, bad = (self.image, self.image_bad) if kind == "image" else (self.running, self.bad)
        what = "image" if kind == "image" else "version"
        why = None
        if node != self.node_id:
            why = ("other_node", "offer of version %d is for node %s, not this node (%s)"
                   % (version, node, self.node_id))  # fmt: skip
        elif not auth.equal(self.mac.hexdigest(auth.MANIFEST, body), sig):
            why = ("bad_mac", "offer of version %d: its HMAC does not verify under this node's "
                   "key (forged, or made with another node's key)" % version)  # fmt: skip
        elif version <= running:
            why = ("not_newer", "offer of %s %d is not newer than the running %s %d "
                   "(an old offer replayed?)" % (what, version, what, running))  # fmt: skip
        elif version <= bad:
            why = ("rolled_back", "%s %d was rolled back on this node; only a newer "
                   "%s is taken" % (what, version, what))  # fmt: skip
        elif kind == "image":
            sink = self.image_sink() if self.image_sink else None
            if sink is None:
                why = ("no_ota", "offer of image %d: this board has no OTA partition "
                       "(esp32.Partition); it takes application files only" % version)  # fmt: skip
            elif files[0][1] > sink.size:
                why = ("too_big", "image %d is %d bytes; the OTA partition %s holds %d"
                       % (version, files[0][1], sink.label, sink.size))  # fmt: skip
        if why is not None:
            if not quiet:
                self._refuse(version, why[0], why[1])
            return False
        if self.state != IDLE and version == self.version and sig == self.sig:
            return True  # the same offer again: carry on where it is
        total = 0
        for f in files:
            total += f[1]
        free = free_bytes() if kind == "files" else None
        if not quiet and free is not None and total + SPARE_BYTES > free:
            self._refuse(version, "no_space", "offer of version %d needs %d bytes of flash, %d "
                         "free" % (version, total + SPARE_BYTES, free))  # fmt: skip
            return False
        if not quiet:
            rm_tree(self.root)
            makedirs(self.root)
            with open(self.root + "/manifest.tmp", "wb") as f:
                f.write(msg)
            os.rename(self.root + "/manifest.tmp", self.root + "/manifest")
            print("update: taking version %d (%d files, %d bytes)" % (version, len(files), total))
        self._clear()
        self.state = FETCH
        self.version, self.label, self.chunk, self.files, self.sig = version, label, chunk, files, sig
        self.kind = kind
        if kind == "image":
            self.sink = self.image_sink()
        self.changed = True
        if not quiet:
            self._next_file()
        return True

    def _staged(self, i):
        return "%s/%d/%s" % (self.root, self.version, self.files[i][0])

    def _chunk(self, msg):
        if self.state != FETCH:
            self._count("stale")
            return
        nl = msg.find(b"\n")
        try:
            head = bytes(msg[2:nl]).decode().split()
            version, index, offset = int(head[0]), int(head[1]), int(head[2])
            sig = head[3].encode()
        except (ValueError, IndexError):
            self._bad_chunk("bad_chunk", "a chunk that is not understood")
            return
        if version != self.version:
            self._count("stale")  # an answer about another offer
            return
        if (index, offset) != (self.index, self.offset):
            if index < self.index or (index == self.index and offset < self.offset):
                self._count("stale")  # a late answer to an earlier request: already written
                return
            self._bad_chunk("chunk_order", "chunk out of order: asked for %s at %d, got file %d "
                            "at %d" % (self.files[self.index][0], self.offset, index, offset))  # fmt: skip
            return
        path, size, sha = self.files[index]
        data = memoryview(msg)[nl + 1 :]
        want = min(self.chunk, size - offset)
        if len(data) != want:
            self._bad_chunk("chunk_truncated", "chunk of %s at %d: %d bytes, expected %d "
                            "(truncated)" % (path, offset, len(data), want))  # fmt: skip
            return
        mac = self.mac.digest(auth.CHUNK, auth.chunk_header(version, index, offset), data)
        if not auth.equal(hexlify(mac[: auth.CHUNK_MAC_BYTES]), sig):
            self._bad_chunk("chunk_mac", "chunk of %s at %d: its MAC does not verify (forged or "
                            "corrupted); not written" % (path, offset))  # fmt: skip
            return
        if self.sink is not None:
            self.sink.write(offset, data)
            with open(self.root + "/image.pos", "w") as f:
                f.write(str(offset + want))
        else:
            with open(self._staged(index), "ab") as f:
                f.write(data)
        self.offset += want
        self.bad_chunks = 0
        if self.offset == size:
            self._file_done()

    def _bad_chunk(self, reason, text):
        self.bad_chunks += 1
        self._refuse(self.version, reason, text, "bad_chunk")
        if self.bad_chunks >= MAX_BAD_CHUNKS:
            self._give_up("%d bad chunks in a row (last: %s)" % (self.bad_chunks, text))

    def _file_done(self):
        path, size, sha = self.files[self.index]
        if self.sink is not None:
            got = self.sink.sha(size)
        else:
            got = file_sha(self._staged(self.index))
        if got != sha:
            if self.sink is None:
                os.remove(self._staged(self.index))
            self.offset = 0
            self.retries += 1
            self._refuse(self.version, "file_sha", "%s: SHA-256 %s... does not match the "
                         "manifest's %s...; discarded" % (path, got[:12], sha[:12]), "bad_file")  # fmt: skip
            if self.retries >= MAX_FILE_RETRIES:
                self._give_up("%d files did not match their SHA-256" % self.retries)
            return
        self.index += 1
        self.offset = 0
        self._next_file()

    def _next_file(self):
        """Make the current file's directory; step over empty files; READY after the last."""
        while self.index < len(self.files):
            if self.sink is not None:
                return  # an image: one "file", in the partition
            p = self._staged(self.index)
            d = p[: p.rfind("/")]
            makedirs(d)
            if self.files[self.index][1]:
                return
            open(p, "wb").close()  # an empty file (an empty __init__.py) has no chunk
            if file_sha(p) != self.files[self.index][2]:
                self._give_up("%s: empty, but the manifest's SHA-256 says otherwise"
                              % self.files[self.index][0])  # fmt: skip
                return
            self.index += 1
        self.state = READY
        self.changed = True
        print("update: version %d: every file verified" % self.version)

    def _give_up(self, why):
        self._count("gave_up")
        self._drop("failed", "version %d given up: %s" % (self.version, why))

    def _drop(self, result, why):
        self.last = [self.version, result, why]
        self.changed = True
        rm_tree(self.root)
        self._clear()

    # ------------------------------------------------------------ after a reboot

    def _resume(self):
        try:
            with open(self.root + "/manifest", "rb") as f:
                msg = f.read()
        except OSError:
            rm_tree(self.root)  # a download that never got its manifest written
            return
        if not self._offer(msg, quiet=True):
            rm_tree(self.root)  # taken already (it runs), rolled back, or not ours
            self._clear()
            return
        if self.kind == "image":
            self._resume_image()
            return
        staged = "%s/%d" % (self.root, self.version)
        if not _exists(staged) and _exists("%s/%d" % (self.sets, self.version)):
            self.state = READY  # cut after apply() renamed it, before the pointer
            return
        for i in range(len(self.files)):
            path, size, sha = self.files[i]
            p = self._staged(i)
            have = _size(p)
            if have == size and file_sha(p) == sha:
                continue
            if have > size or have == size:  # too long, or whole but wrong: start it again
                os.remove(p)
                have = 0
            have = max(have, 0)
            keep = have - have % self.chunk
            if keep != have:
                _cut(p, keep)  # a torn last chunk: only whole chunks were verified
            for j in range(i + 1, len(self.files)):
                if _exists(self._staged(j)):
                    os.remove(self._staged(j))  # written after a file that is not whole
            self.index, self.offset = i, keep
            self._next_file()
            print("update: resuming version %d at %s, byte %d" % (self.version, path, keep))
            return
        self.index = len(self.files)
        self._next_file()

    def _resume_image(self):
        if self.sink is None:
            rm_tree(self.root)
            self._clear()
            return
        try:
            with open(self.root + "/image.pos") as f:
                pos = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pos = 0
        size = self.files[0][1]
        if pos >= size and self.sink.sha(size) == self.files[0][2]:
            self.index = 1
            self.state = READY
            return
        # Back to the start of its block: a chunk cut mid-write is written again after
        # an erase (flash bits only clear: writing it over itself might not mend it).
        self.offset = min(pos, size) - min(pos, size) % IMAGE_BLOCK
        print("update: resuming image %d at byte %d" % (self.version, self.offset))

    # ------------------------------------------------------------ the switch

    def apply(self, stage, stage_image=None):
        """Move the verified set beside the running one and point sets/pending at it;
        an image: note its trial (stage_image), then boot it next (set_boot)."""
        v = self.version
        if self.sink is not None:
            stage_image(v, self.sink.label)
            self.sink.switch()
            rm_tree(self.root)
            self._clear()
            return v
        src, dst = "%s/%d" % (self.root, v), "%s/%d" % (self.sets, v)
        if not _exists(self.sets):
            os.mkdir(self.sets)
        if _exists(src):
            rm_tree(dst)  # a partial copy from an earlier try
            os.rename(src, dst)
        stage(v)
        rm_tree(self.root)
        self._clear()
        return v


def _cut(p, n):
    """Keep the first n bytes of file p (MicroPython files cannot truncate)."""
    buf = bytearray(READ_BLOCK)
    left = n
    with open(p, "rb") as src, open(p + ".cut", "wb") as dst:
        while left > 0:
            got = src.readinto(buf)
            if not got:
                break
            got = min(got, left)
            dst.write(memoryview(buf)[:got])
            left -= got
    os.remove(p)
    os.rename(p + ".cut", p)


def _text(msg):
    nl = msg.find(b"\n")
    return bytes(msg[2 : nl if nl > 0 else len(msg)]).decode() or "-"
