# The flash spill: an append-only log of messages over a few segment files.
#
# Why a log: flash wears per erase block, and rewriting one queue file on every
# acknowledgement would hit the same blocks again and again. Records are only
# ever appended, and the segments are reused in turn, so writes spread over
# ``segments x segment_bytes`` of flash.
#
# Records, one line each, ending in ";\n" so a line torn by a power cut is
# recognised and skipped:
#   G <gen>;          first line of a segment: its generation (segment file = gen % n)
#   M <record>;       a message (message.record())
#   H <gen> <off>;    the head moved: the first unacknowledged record is at
#                     byte <off> of segment <gen> (written after each ack)
# Messages are acknowledged in order (one QoS 1 publish in flight), so the log
# is a FIFO and the head is all the acknowledgement state there is.
# When the log is full and the oldest segment still holds unacknowledged
# messages, they are dropped and counted: the newest readings are kept.
import os

from . import message


def _exists(path):
    try:
        os.stat(path)
        return True
    except OSError:
        return False


class SpillLog:
    def __init__(self, directory, segments=4, segment_bytes=32768):
        self.dir = directory
        self.n = segments
        self.limit = segment_bytes
        self.dropped = 0  # readings
        self.drops = None  # which messages were dropped (drops.py), if someone asks
        self.torn = 0  # lines skipped at recovery
        self.bytes_written = 0
        self.pending = 0  # messages after the head
        self.pending_readings = 0
        self._cache = None  # (gen, off, length, Message) of the head record
        if not _exists(directory):
            os.mkdir(directory)
        self._recover()

    def _path(self, gen):
        return "%s/%d.log" % (self.dir, gen % self.n)

    # ------------------------------------------------------------ recovery

    def _segments(self):
        """[(gen, lines)] of valid segments, oldest first."""
        found = []
        for i in range(self.n):
            path = "%s/%d.log" % (self.dir, i)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if not data.startswith(b"G ") or b";\n" not in data:
                continue
            first = data[: data.index(b";\n")]
            try:
                gen = int(first[2:].decode())
            except ValueError:
                continue
            if gen % self.n == i:
                found.append((gen, data))
        found.sort()
        # Only a contiguous run of generations ending at the newest is the log.
        run = []
        for gen, data in reversed(found):
            if run and gen != run[-1][0] - 1:
                break
            run.append((gen, data))
        run.reverse()
        return run

    def _recover(self):
        segs = self._segments()
        if not segs:
            self.gen = -1
            self.size = 0
            self.head = None
            self._rotate()
            return
        head = (segs[0][0], 0)
        messages = []  # (gen, off, readings)
        for gen, data in segs:
            off = 0
            while off < len(data):
                end = data.find(b"\n", off)
                if end < 0:
                    self.torn += 1
                    break
                line = data[off:end]
                if not line.endswith(b";"):
                    self.torn += 1
                elif line.startswith(b"H "):
                    parts = line[2:-1].decode().split()
                    head = (int(parts[0]), int(parts[1]))
                elif line.startswith(b"M "):
                    try:
                        msg = message.from_record(line[2:-1].decode())
                        messages.append((gen, off, message.count(msg)))
                    except (ValueError, TypeError):
                        self.torn += 1
                off = end + 1
        if head[0] < segs[0][0]:  # the head's segment was reused: start of what is left
            head = (segs[0][0], 0)
        self.head = head
        for gen, off, n in messages:
            if (gen, off) >= head:
                self.pending += 1
                self.pending_readings += n
        self.gen = segs[-1][0]
        data = segs[-1][1]
        self.size = len(data)
        if not data.endswith(b"\n"):  # a torn tail: end it, so the next record starts clean
            self._write("\n")

    # ------------------------------------------------------------ writing

    def _write(self, text):
        data = text.encode()
        with open(self._path(self.gen), "ab") as f:
            f.write(data)
        self.size += len(data)
        self.bytes_written += len(data)

    def _rotate(self):
        gen = self.gen + 1
        reused = gen - self.n  # the generation whose file this one overwrites
        if self.head is not None and self.head[0] <= reused:
            self._drop_through(reused)
        self.gen = gen
        header = ("G %d;\n" % gen).encode()
        with open(self._path(gen), "wb") as f:
            f.write(header)
        self.size = len(header)
        self.bytes_written += len(header)
        if self.head is None:
            self.head = (gen, 0)
        elif self.head[0] <= reused:
            self.head = (reused + 1, 0)
            self._append("H %d %d;\n" % self.head)

    def _drop_through(self, gen):
        """Count the pending messages of segment ``gen`` as dropped."""
        while self.pending and self.head[0] <= gen:
            msg = self.peek()
            if msg is None:
                break
            self.dropped += message.count(msg)
            if self.drops is not None:
                self.drops.add(msg[message.BOOT], "spill_full", msg[message.SEQ])
            self._advance()

    def _append(self, line):
        if self.size + len(line.encode()) > self.limit and self.size > 64:
            self._rotate()
        self._write(line)

    def append(self, msg):
        self._append("M %s;\n" % message.record(msg))
        self.pending += 1
        self.pending_readings += message.count(msg)

    # ------------------------------------------------------------ reading

    def peek(self):
        """The oldest unacknowledged message, or None."""
        if not self.pending:
            return None
        if self._cache is not None and self._cache[:2] == self.head:
            return self._cache[3]
        gen, off = self.head
        while gen <= self.gen:
            try:
                with open(self._path(gen), "rb") as f:
                    f.seek(off)
                    while True:
                        line = f.readline()
                        if not line:
                            break
                        if line.startswith(b"M ") and line.endswith(b";\n"):
                            try:
                                msg = message.from_record(line[2:-2].decode())
                            except (ValueError, TypeError):
                                msg = None
                            if msg is not None:
                                self.head = (gen, off)
                                self._cache = (gen, off, len(line), msg)
                                return msg
                        off += len(line)
            except OSError:
                pass
            gen, off = gen + 1, 0
        self.pending = self.pending_readings = 0  # nothing readable is left
        return None

    def _advance(self):
        msg = self.peek()
        gen, off, length, _ = self._cache
        self.head = (gen, off + length)
        self._cache = None
        self.pending -= 1
        self.pending_readings -= message.count(msg)

    def ack(self):
        """The head message was acknowledged: move past it, durably."""
        self._advance()
        self._append("H %d %d;\n" % self.head)
