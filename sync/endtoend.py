"""End to end (design rule 9): what the gateway knows of the cloud's landing zone.

The broker is a relay, never the only copy. A message the broker completed
(PUBCOMP, PUBACK) stays in the store, *awaiting landing*, until the cloud ingest
says, after its own fsync, that its seqs are landed: an acknowledgement it
publishes retained on ``{prefix}/{gateway}/landed/{ingest}`` (sync/wire.py,
``LandedAck``). This module holds the rules, without I/O:

- ``judge(payload)``: an acknowledgement is believed only if it names this
  gateway and this store's epoch, every seq in it has been sent, and (with a
  key) its HMAC is right; anything else changes nothing, is counted, and is
  logged once per kind;
- ``known``: the seqs acknowledged so far, so a message completed by the broker
  after its landing was heard of (the ingest can be quicker than the broker's
  PUBCOMP), or queued to be published again, is let go at once;
- ``timeout()``: how long a delivered message may wait for its landing before
  it is published again. It doubles with every round of re-sends that nothing
  lands after (an ingest down for an hour must not make every gateway flood the
  broker), up to ``timeout_max``, and is back to ``timeout`` once anything lands.
"""

from __future__ import annotations

import collections
import logging
import time

from .ranges import RangeSet
from .wire import LandedAck, landed_mac_ok, parse_landed

log = logging.getLogger(__name__)

# Ranges ``known`` keeps: seqs go out oldest first, so they merge into few; this bounds
# them when they do not (several ingests landing one gateway's messages).
KNOWN_RANGES = 4096


class EndToEnd:
    def __init__(
        self,
        gateway: str,
        epoch: str,
        *,
        timeout: float,
        timeout_max: float,
        key: bytes | None = None,
    ) -> None:
        self.gateway, self.epoch = gateway, epoch
        self.base_timeout, self.timeout_max = timeout, max(timeout, timeout_max)
        self.key = key
        self.known = RangeSet()
        self.sent_high = 0  # no acknowledgement may name a seq above this
        self.acks: collections.Counter[str] = collections.Counter()
        self.landed_at: float | None = None  # wall time something last landed
        self.idle_rounds = 0  # rounds of re-sends since something last landed
        self.subscription: str = "not yet"  # "requested", "granted QoS 1", "refused 0x87"
        self.refused_by: int | None = None  # the SUBACK's failure code, if the broker refused
        self._logged: set[str] = set()

    # ------------------------------------------------------------ judging

    def judge(self, payload: bytes) -> LandedAck | None:
        """The acknowledgement, if it is to be believed; None (counted, logged once per
        kind) if not. Believing it changes ``known``; the caller lets the store go."""
        ack = parse_landed(payload)
        if isinstance(ack, str):
            self._refuse("malformed", f"a malformed landed acknowledgement ({ack})")
            return None
        if ack.gateway != self.gateway:
            self._refuse("other_gateway", f"an acknowledgement for {ack.gateway!r}")
            return None
        if self.key is not None and not landed_mac_ok(ack, self.key):
            self._refuse(
                "bad_hmac",
                f"an acknowledgement from {ack.ingest!r} without a valid HMAC "
                "(uplink.landed_key): not from the cloud ingest",
            )
            return None
        if ack.epoch != self.epoch:
            # A replaced store's (its retained acknowledgement outlives it): nothing
            # of ours, nothing suspicious.
            self.acks["other_epoch"] += 1
            return None
        top = max((hi for _, hi in ack.landed), default=0)
        if top > self.sent_high:
            self._refuse(
                "out_of_range",
                f"an acknowledgement from {ack.ingest!r} names seqs up to {top}, but this "
                f"gateway has sent only up to {self.sent_high}: forged or misrouted",
            )
            return None
        self.acks["accepted"] += 1
        for lo, hi in ack.landed:
            self.known.add(lo, hi)
        self.known.cap(KNOWN_RANGES)
        return ack

    def _refuse(self, kind: str, why: str) -> None:
        self.acks[kind] += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s; ignored, nothing let go (counted as landed_acks{%s})", why, kind)

    def covers(self, first: int, last: int) -> bool:
        return self.known.covers(first, last)

    def sent(self, last_seq: int) -> None:
        self.sent_high = max(self.sent_high, last_seq)

    # ------------------------------------------------------------ timing

    def landed(self) -> None:
        """Something awaiting was let go: the cloud is taking data again."""
        self.landed_at = time.time()
        self.idle_rounds = 0

    def resent(self) -> None:
        """A round of re-sends went out; if nothing lands before the next, wait longer."""
        self.idle_rounds += 1

    def timeout(self) -> float:
        if self.idle_rounds == 0:
            return self.base_timeout
        return float(min(self.timeout_max, self.base_timeout * 2.0 ** min(self.idle_rounds, 30)))

    def check_every(self) -> float:
        """How often the uplink looks for messages past their timeout."""
        return max(0.2, min(5.0, self.base_timeout / 4))
