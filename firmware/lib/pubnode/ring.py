# RAM ring buffer of unacknowledged messages, oldest first.
#
# Capacity is counted in readings. The slots are allocated once, so a long
# outage does not fragment the heap; a message pushed into a full ring evicts
# the oldest ones, which the caller spills to flash or drops (and counts).
from .message import count


class Ring:
    def __init__(self, capacity):
        self.capacity = capacity
        self._slots = [None] * max(1, capacity)
        self._head = 0
        self.count = 0
        self.readings = 0

    def __len__(self):
        return self.count

    def push(self, msg):
        """Append ``msg``; return the list of messages evicted to make room."""
        evicted = []
        n = count(msg)
        while self.count and (self.readings + n > self.capacity or self.count == len(self._slots)):
            evicted.append(self.pop())
        self._slots[(self._head + self.count) % len(self._slots)] = msg
        self.count += 1
        self.readings += n
        return evicted

    def peek(self):
        return self._slots[self._head] if self.count else None

    def pop(self):
        msg = self._slots[self._head]
        self._slots[self._head] = None
        self._head = (self._head + 1) % len(self._slots)
        self.count -= 1
        self.readings -= count(msg)
        return msg
