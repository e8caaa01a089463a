"""The receiver's side: what a QoS 2 receiver's store file holds.

No pubcomp receiver keeps its session in this store any more: the gateway's ingress
dedups node messages by key (producers.py) and the cloud ingest keeps its receive
records in its landing files (pipeline/landing.py). A landing zone written before those
records existed has an ingest state file of this format; the ingest reads its held ids
once (``held_receive_ids``) and never writes the file again.
"""

from __future__ import annotations

import os
import sqlite3

from ..errors import StoreError


def held_receive_ids(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """(session, packet id) of every QoS 2 message a store file's receiver holds
    (``in_qos2``), read without opening the file for writing: a file another program
    or version left, which is never written again. Raises StoreError if it cannot be
    read (the caller need not know the store is SQLite)."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT session, packet_id FROM in_qos2").fetchall()
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise StoreError(str(exc)) from exc
    return [(str(key), int(pid)) for key, pid in rows]
