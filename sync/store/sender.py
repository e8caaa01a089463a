"""The sender session as the store keeps it: messages in flight (``out_inflight``),
the broker sessions (``sessions``), delivered messages awaiting landing
(``awaiting_landing``, rule 9) and the dead letters.

1. A packet id is committed with its message before the PUBLISH is written
   (``begin_messages_in``; the uplink sends once its commit returned).
2. A PUBREC is committed (state PUBREL_SENT) before the PUBREL is sent (``apply_in``).
3. PUBCOMP deletes the in-flight row and its readings in one transaction; end to end
   it moves the message to ``awaiting_landing`` instead, until ``landed_in``.
4. Resume order is the in-flight table's ``ord``; a lost session re-queues every
   in-flight message under a new id and counts it (``requeue_lost_in``).

A message whose packet id died (session lost, refused by the broker) keeps its range
and waits as ``QUEUED`` for a new id, ahead of newer readings. The session rules
themselves (which acknowledgement means what) are sync/session.py's.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..session import OutState
from .base import bump
from .outbox import DELETE_ROWS, Outbox, count_readings
from .packing import decode_body


@dataclass(slots=True)
class Message:
    """One in-flight message as the uplink needs it to (re)send."""

    ord: int
    packet_id: int | None  # None while QUEUED
    qos: int
    state: OutState
    topic: str
    first_seq: int
    last_seq: int


class Sender(Outbox):
    """The uplink's session in the store (module docstring)."""

    # ------------------------------------------------------------ reads

    def load_session(self, session: str) -> tuple[bool, int, list[Message]]:
        """(established, last_packet_id, this session's messages in original order)."""
        with self._rlock:
            row = self._rdb.execute(
                "SELECT established, last_packet_id FROM sessions WHERE session = ?", (session,)
            ).fetchone()
            msgs = self._rdb.execute(
                "SELECT ord, packet_id, qos, state, topic, first_seq, last_seq "
                "FROM out_inflight WHERE session = ? ORDER BY ord",
                (session,),
            ).fetchall()
        established, last = (bool(row[0]), row[1]) if row else (False, 0)
        live = [m[1] for m in msgs if m[1] is not None]
        if msgs and msgs[-1][1] is not None:
            last = msgs[-1][1]  # the newest message's id: ids go on from there
        elif live:
            last = max(last, *live)
        return (
            established,
            last,
            [
                Message(o, pid, qos, OutState(state), topic, first, last_seq)
                for o, pid, qos, state, topic, first, last_seq in msgs
            ],
        )

    def awaiting_messages(self) -> int:
        """Messages delivered to the broker and not yet landed in the cloud."""
        with self._rlock:
            return int(self._rdb.execute("SELECT COUNT(*) FROM awaiting_landing").fetchone()[0])

    def dead_letters(self) -> list[dict[str, Any]]:
        """The readings a broker refused for good, oldest first (never deleted)."""
        with self._rlock:
            cur = self._rdb.execute(
                "SELECT seq, id, origin, sensor, ts, value, unit, flags, reason, at "
                "FROM dead_letter ORDER BY seq"
            )
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    # ------------------------------------------------------------ the session's ops

    def session_started_in(self, db: sqlite3.Connection, session: str) -> None:
        db.execute(
            "INSERT INTO sessions (session, established, updated) VALUES (?, 1, ?) "
            "ON CONFLICT(session) DO UPDATE SET established = 1, updated = excluded.updated",
            (session, time.time()),
        )

    def adopt_orphans_in(self, db: sqlite3.Connection, session: str) -> int:
        """Take over messages of another session (the broker or client id changed).

        Their ids mean nothing to this session's broker, so they wait as QUEUED for new
        ids; their readings are counted as resent after session loss. Returns the
        messages taken over.
        """
        rows = db.execute(
            "UPDATE out_inflight SET session = ?, packet_id = NULL, state = 'QUEUED' "
            "WHERE session != ? RETURNING first_seq, last_seq",
            (session, session),
        ).fetchall()
        bump(db, "resent_after_session_loss", count_readings(db, rows))
        return len(rows)

    def begin_messages_in(
        self, db: sqlite3.Connection, session: str, messages: Sequence[Message]
    ) -> list[int]:
        """Rule 1: packet ids (state PUBLISH_SENT) committed before the PUBLISHes are sent.

        A message with ``ord == 0`` is new and is inserted; others are QUEUED messages
        getting a new id. Returns each message's ord: the caller fills them in (with
        state PUBLISH_SENT) once the commit has returned.
        """
        ords = []
        for m in messages:
            if m.ord:
                db.execute(
                    "UPDATE out_inflight SET packet_id = ?, state = 'PUBLISH_SENT', qos = ? "
                    "WHERE ord = ?",
                    (m.packet_id, m.qos, m.ord),
                )
                ords.append(m.ord)
            else:
                row = db.execute(
                    "INSERT INTO out_inflight "
                    "(session, packet_id, state, qos, topic, first_seq, last_seq) "
                    "VALUES (?, ?, 'PUBLISH_SENT', ?, ?, ?, ?) RETURNING ord",
                    (session, m.packet_id, m.qos, m.topic, m.first_seq, m.last_seq),
                ).fetchone()
                ords.append(int(row[0]))
        # sessions.last_packet_id is not rewritten here (one page less per commit): the
        # last id handed out is the newest in-flight message's, which this commits.
        return ords

    def apply_in(
        self,
        db: sqlite3.Connection,
        session: str,
        released: Sequence[int] = (),
        completed: Sequence[int] = (),
        refused: Sequence[tuple[int, int, bool]] = (),
        awaiting: Sequence[int] = (),
    ) -> int:
        """Acknowledgements, in the caller's transaction (rules 2, 3, 6); returns readings
        delivered.

        ``released``: PUBREC received, now PUBREL_SENT. ``completed``: PUBCOMP or
        PUBACK, delete the message and its readings. ``awaiting``: completed by the
        broker like ``completed``, but not yet landed in the cloud (rule 9): the message
        leaves the session and its readings stay, in ``awaiting_landing``. ``refused``:
        (packet id, reason, permanent): the broker refused it; permanent refusals move
        the readings to ``dead_letter``, others wait as QUEUED for a new id.
        """
        delivered = 0
        db.executemany(
            "UPDATE out_inflight SET state = 'PUBREL_SENT' WHERE session = ? AND packet_id = ?",
            [(session, p) for p in released],
        )
        now = time.time()
        # The broker completed them: each leaves the session; its readings wait for
        # their landing (``awaiting``) or go with it.
        for pid, kept in [(p, True) for p in awaiting] + [(p, False) for p in completed]:
            row = _leave_session(db, session, pid)
            if not row:
                continue
            if kept:
                n = count_readings(db, [row])
                db.execute(
                    "INSERT OR REPLACE INTO awaiting_landing VALUES (?, ?, ?, ?)", (*row, n, now)
                )
            else:
                n = sum(r[0] for r in db.execute(DELETE_ROWS, row).fetchall())
            delivered += n
            bump(db, "delivered", n)
            bump(db, "messages_completed", 1)
        for pid, reason, permanent in refused:
            if not permanent:
                db.execute(
                    "UPDATE out_inflight SET packet_id = NULL, state = 'QUEUED' "
                    "WHERE session = ? AND packet_id = ?",
                    (session, pid),
                )
                bump(db, "refused_by_broker", 1)
                continue
            row = _leave_session(db, session, pid)
            if not row:
                continue
            now = time.time()
            dead = [
                (
                    *(seq + i, r["id"], r["origin"], r["sensor"], r["ts"], r["value"], r["unit"]),
                    *(",".join(r["flags"]) or None, reason, now),
                )
                for seq, body in db.execute(
                    "SELECT seq, body FROM outbox WHERE seq BETWEEN ? AND ?", row
                ).fetchall()
                for i, r in enumerate(decode_body(body))
            ]
            db.executemany(
                "INSERT OR REPLACE INTO dead_letter VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", dead
            )
            db.execute(DELETE_ROWS, row).fetchall()
            bump(db, "dead_lettered", len(dead))
        if completed or refused:
            self._keep_seq_floor(db)
        return delivered

    def requeue_lost_in(self, db: sqlite3.Connection, session: str) -> int:
        """The broker lost the session: every message with an id waits for a new one.

        Returns the readings concerned, also counted as ``resent_after_session_loss``;
        the cloud's dedup on reading ids absorbs any copy the broker did deliver.
        """
        rows = db.execute(
            "UPDATE out_inflight SET packet_id = NULL, state = 'QUEUED' "
            "WHERE session = ? AND packet_id IS NOT NULL RETURNING first_seq, last_seq",
            (session,),
        ).fetchall()
        n = count_readings(db, rows)
        bump(db, "resent_after_session_loss", n)
        return n

    # ------------------------------------------------- end to end (rule 9)

    def landed_in(self, db: sqlite3.Connection, ranges: Iterable[tuple[int, int]]) -> int:
        """The cloud has landed these seqs: every awaiting message they cover whole goes,
        with its readings. Returns the readings let go (counted as ``landed``)."""
        gone = 0
        for lo, hi in ranges:
            rows = db.execute(
                "DELETE FROM awaiting_landing WHERE first_seq >= ? AND first_seq <= ? "
                "AND last_seq <= ? RETURNING first_seq, last_seq",
                (lo, hi, hi),
            ).fetchall()
            for row in rows:
                gone += sum(r[0] for r in db.execute(DELETE_ROWS, row).fetchall())
        if gone:
            bump(db, "landed", gone)
            self._keep_seq_floor(db)
        return gone

    def forget_queued_in(self, db: sqlite3.Connection, ords: Sequence[int]) -> int:
        """Queued messages (no packet id) that the cloud has landed meanwhile: they go
        without being sent again. Returns the readings let go (counted as ``landed``)."""
        gone = 0
        for o in ords:
            row = db.execute(
                "DELETE FROM out_inflight WHERE ord = ? AND packet_id IS NULL "
                "RETURNING first_seq, last_seq",
                (o,),
            ).fetchone()
            if row:
                gone += sum(r[0] for r in db.execute(DELETE_ROWS, row).fetchall())
        if gone:
            bump(db, "landed", gone)
            self._keep_seq_floor(db)
        return gone

    def resend_awaiting_in(
        self,
        db: sqlite3.Connection,
        session: str,
        topic: str,
        *,
        delivered_before: float = math.inf,
        landed: Callable[[int, int], bool] | None = None,
        counter: str = "resent_not_landed",
    ) -> list[Message]:
        """Awaiting messages completed before ``delivered_before`` (all by default) that
        ``landed`` does not cover: published again, as new messages (QUEUED, a new
        packet id each) with the same readings, so the same reading ids; the cloud's
        dedup removes any copy. Returns them (oldest first), counted under ``counter``."""
        rows = db.execute(
            "SELECT first_seq, last_seq, readings FROM awaiting_landing "
            "WHERE delivered < ? ORDER BY first_seq",
            (delivered_before,),
        ).fetchall()
        out: list[Message] = []
        again = 0
        for first, last, n in rows:
            db.execute("DELETE FROM awaiting_landing WHERE first_seq = ?", (first,))
            if landed is not None and landed(first, last):
                gone = sum(r[0] for r in db.execute(DELETE_ROWS, (first, last)).fetchall())
                bump(db, "landed", gone)
                continue
            qos = 2
            row = db.execute(
                "INSERT INTO out_inflight (session, packet_id, state, qos, topic, first_seq, "
                "last_seq) VALUES (?, NULL, 'QUEUED', ?, ?, ?, ?) RETURNING ord",
                (session, qos, topic, first, last),
            ).fetchone()
            out.append(Message(int(row[0]), None, qos, OutState.QUEUED, topic, first, last))
            again += n
        bump(db, counter, again)
        if len(out) < len(rows):
            self._keep_seq_floor(db)
        return out


def _leave_session(db: sqlite3.Connection, session: str, packet_id: int) -> tuple[int, int] | None:
    """The message under this packet id leaves the session: its (first, last) seq, or
    None if the session holds no such message (a stray acknowledgement)."""
    row = db.execute(
        "DELETE FROM out_inflight WHERE session = ? AND packet_id = ? "
        "RETURNING first_seq, last_seq",
        (session, packet_id),
    ).fetchone()
    return None if row is None else (int(row[0]), int(row[1]))
