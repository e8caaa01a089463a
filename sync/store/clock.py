"""Clock correction: timestamps of waiting readings taken on a wrong clock, shifted once
the clock is known (gateway/clock.py decides when and by how much, and what the flags
mean; this room only rewrites what may still be rewritten)."""

from __future__ import annotations

import sqlite3
from datetime import datetime

from ..wire import encode_readings, wire_time
from .outbox import Outbox
from .packing import decode_body, marks_of, pack_body


class ClockCorrection(Outbox):
    def shift_times_in(
        self, db: sqlite3.Connection, after_seq: int, shift_s: float, flag: str, add_flag: str
    ) -> int:
        """Correct the timestamps of waiting readings flagged ``flag`` (not yet ``add_flag``)
        by ``shift_s``, and add ``add_flag``; returns how many were corrected.

        Only readings above ``after_seq`` and not yet in a message (nor being taken into
        one: ``_untouchable_seq``) are touched: a message's payload must stay
        byte-identical for its DUP resends. What the flags mean, and whether to count
        the correction, is the caller's business.
        """
        low = max(after_seq, self._untouchable_seq(db))
        # The row holding seq low + 1 may begin at or below low: start from it.
        start = db.execute("SELECT MAX(seq) FROM outbox WHERE seq <= ?", (low + 1,)).fetchone()[0]
        rows = db.execute(
            "SELECT seq, body FROM outbox WHERE seq >= ? AND marks LIKE ?",
            (start or low + 1, f"%{flag}%"),
        ).fetchall()
        fixed, updates = 0, []
        for seq, body in rows:
            readings = decode_body(body)
            changed = False
            for i, r in enumerate(readings):
                names, ts = r["flags"], r["ts"]
                if seq + i <= low or flag not in names or add_flag in names or ts is None:
                    continue
                t = datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() + shift_s
                r["ts"], r["flags"] = wire_time(t), [*names, add_flag]
                fixed, changed = fixed + 1, True
            if changed:
                updates.append((marks_of(readings), pack_body(encode_readings(readings)), seq))
        db.executemany("UPDATE outbox SET marks = ?, body = ? WHERE seq = ?", updates)
        return fixed
