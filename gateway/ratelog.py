"""Logs a hostile or broken client cannot fill: an event logged once, then summarised.

A field gateway logs to an SD card (journald, or a file). An event a client
can cause at will (a refused login, a protocol error, a refused connection)
must not cost a line each: 1,000 refusals of a 16 kB user name were 16.5 MB
of log before (issue 25). ``Summary.log(key, ...)`` logs the first event of
a kind at once; the next ones within ``interval`` are only counted, and the
first one after it (or ``flush()``, which the gateway calls every few
seconds) logs one line for them all: "... (and 1,234 more like this in the
last 60 s)". The key is a kind of event (a refusal's reason), never a
client's own words, so the table stays small; past ``max_keys`` kinds, new
ones share one key.

``SummaryFilter`` does the same for a library's logger (asyncio's "socket.send()
raised exception." and accept errors), keyed by the first line of the message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

INTERVAL_S = 60.0
MAX_KEYS = 256
_OTHER = ("(other kinds)",)


@dataclass
class _Kind:
    since: float  # the window began (the last line written for this kind)
    suppressed: int = 0
    last: tuple[logging.Logger, int, str, tuple[Any, ...]] | None = field(default=None)


class Summary:
    """At most one line per kind of event per ``interval`` (plus a summary of the rest)."""

    def __init__(
        self,
        interval: float = INTERVAL_S,
        max_keys: int = MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval, self.max_keys, self._clock = interval, max_keys, clock
        self._kinds: dict[Hashable, _Kind] = {}
        self.suppressed_total = 0  # lines not written (pubcomp_log_lines_suppressed_total)

    def allow(self, key: Hashable) -> int | None:
        """None: count this event, write nothing. Else write it, saying how many were
        held back since the last line of its kind (0 for the first)."""
        now = self._clock()
        kind = self._kinds.get(key)
        if kind is None:
            if len(self._kinds) >= self.max_keys:
                return self.allow(_OTHER) if key != _OTHER else None
            self._kinds[key] = _Kind(now)
            return 0
        if now - kind.since < self.interval:
            kind.suppressed += 1
            self.suppressed_total += 1
            return None
        held, kind.suppressed, kind.since, kind.last = kind.suppressed, 0, now, None
        return held

    def log(
        self,
        logger: logging.Logger,
        level: int,
        key: Hashable,
        msg: str,
        *args: Any,
        exc_info: Any = None,
    ) -> None:
        held = self.allow(key)
        if held is None:
            kind = self._kinds.get(key) or self._kinds.get(_OTHER)
            if kind is not None:
                kind.last = (logger, level, msg, args)
            return
        if held:
            msg += " (and %d more like this in the last %.0f s)"
            args = (*args, held, self.interval)
        logger.log(level, msg, *args, exc_info=exc_info)

    def flush(self) -> None:
        """Write the summary of every kind whose window is over and that held lines back."""
        now = self._clock()
        for kind in self._kinds.values():
            if kind.suppressed and kind.last is not None and now - kind.since >= self.interval:
                logger, level, msg, args = kind.last
                logger.log(
                    level,
                    msg + " (the last of %d like this in the last %.0f s)",
                    *args,
                    kind.suppressed,
                    now - kind.since,
                )
                kind.suppressed, kind.since, kind.last = 0, now, None


class SummaryFilter(logging.Filter):
    """For a library's logger: the first record of a kind passes, repeats within the
    interval are dropped, and the next one to pass says how many were."""

    def __init__(self, summary: Summary | None = None) -> None:
        super().__init__()
        self.summary = summary or Summary()

    def filter(self, record: logging.LogRecord) -> bool:
        first_line = str(record.msg).split("\n", 1)[0][:120]
        held = self.summary.allow((record.name, record.levelno, first_line))
        if held is None:
            return False
        if held:
            record.msg = f"{record.msg} (and {held} more like this in the last " + (
                f"{self.summary.interval:.0f} s)"
            )
        return True
