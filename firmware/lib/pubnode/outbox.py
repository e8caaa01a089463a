# What the node still owes the gateway: the RAM ring, and the flash log behind it.
#
# spill mode "off":      RAM only; a full ring drops its oldest readings (counted).
# spill mode "overflow": a full ring spills its oldest messages to the flash log;
#                        a long outage is then bounded by flash, not RAM.
# spill mode "always":   every message goes to the flash log before anything is
#                        sent, so a reset or power cut loses nothing taken.
# Order is kept: the log only ever holds messages older than the ring's, so the
# next message to send is the log's head, else the ring's.
from .drops import Drops
from .message import BOOT, SEQ, count


class Outbox:
    def __init__(self, ring, log=None, mode="off"):
        if mode != "off" and log is None:
            raise ValueError("spill mode %r needs a flash log" % mode)
        self.ring = ring
        self.log = log
        self.mode = mode
        self.dropped = 0  # readings dropped from RAM with nowhere to go
        # Which messages were dropped (RAM and flash), told to the gateway (drops.py).
        self.drops = Drops()
        if log is not None:
            log.drops = self.drops

    def put(self, msg):
        if self.mode == "always":
            self.log.append(msg)
            return
        for old in self.ring.push(msg):
            if self.log is not None and self.mode == "overflow":
                self.log.append(old)
            else:
                self.dropped += count(old)
                self.drops.add(old[BOOT], "ring_overflow", old[SEQ])

    def peek(self):
        if self.log is not None and self.log.pending:
            msg = self.log.peek()
            if msg is not None:
                return msg
        return self.ring.peek()

    def ack(self):
        if self.log is not None and self.log.pending:
            self.log.ack()
        else:
            self.ring.pop()

    def spill_all(self):
        """Move RAM's messages to flash (before deep sleep, which clears RAM)."""
        if self.log is None:
            return
        while len(self.ring):
            self.log.append(self.ring.pop())

    @property
    def pending_readings(self):
        n = self.ring.readings
        if self.log is not None:
            n += self.log.pending_readings
        return n

    @property
    def lost(self):
        return self.dropped + (self.log.dropped if self.log is not None else 0)

    def full(self):
        """True when the next message would push something out of RAM (the LED says so)."""
        return self.mode != "always" and self.ring.readings >= self.ring.capacity
