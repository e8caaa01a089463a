# Messages this node gave up, told to the gateway (issue 27): the RAM ring
# overflowing with nowhere to spill ("ring_overflow"), the flash log reusing a
# segment that still held unsent messages ("spill_full").
#
# Each drop is kept as (boot, reason, first seq, last seq), neighbours merged,
# and rides the next message sent as its optional "dropped" field
# (docs/wire-format.md). The gateway stores it in the same transaction as that
# message, so the report is kept exactly when the message is: the entries are
# forgotten at its PUBACK, and a retry of the same message carries the same
# entries (fixed at its first send), since the gateway keeps the first copy it
# stores. What RAM held is lost at a reset, like the readings it described.
MAX_REPORT = 8  # entries per message: a long outage's drops go over a few messages
MAX_KEPT = 64  # entries kept; past it the oldest two merge (a wider range told)


class Drops:
    def __init__(self):
        self.entries = []  # [boot, reason, lo, hi], oldest first
        self.attached = 0  # entries[:attached] ride the message in flight
        self.key = None  # (boot, seq) of that message
        self.messages = 0  # messages dropped, ever (the status line's "lost")

    def add(self, boot, reason, seq):
        self.messages += 1
        e = self.entries[-1] if len(self.entries) > self.attached else None
        if e is not None and e[0] == boot and e[1] == reason and e[3] + 1 == seq:
            e[3] = seq
            return
        self.entries.append([boot, reason, seq, seq])
        while len(self.entries) > MAX_KEPT and self.attached < len(self.entries) - 1:
            i = self.attached
            a, b = self.entries[i], self.entries[i + 1]
            if a[0] == b[0] and a[1] == b[1]:
                a[3] = b[3]
                del self.entries[i + 1]
            else:
                del self.entries[i]  # a different boot or reason: the oldest goes untold

    def attach(self, key):
        """The "dropped" field of the message ``key`` ((boot, seq)), or None: the
        same entries on every retry of that message."""
        if self.key != key:
            self.key = key
            self.attached = min(len(self.entries), MAX_REPORT)
        if not self.attached:
            return None
        return [
            {"boot": b, "reason": r, "seqs": [[lo, hi]]}
            for b, r, lo, hi in self.entries[: self.attached]
        ]

    def acked(self):
        """The message carrying them was acknowledged: the gateway has them."""
        del self.entries[: self.attached]
        self.attached = 0
        self.key = None
