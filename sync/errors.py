"""Every error sync/ raises on purpose, in one place (in the manner of httpx's
``_exceptions.py``), so a caller can see what it may catch and why::

    TransportError          a connection to a broker is over: reconnect
    ├── ConnectionClosed    the peer closed it
    ├── ConnectRefused      the CONNACK refused it (``code``: whether trying again can
    │                       help, sync/uplink.py ``permanent``)
    ├── ProtocolError       the peer sent bytes that break MQTT's rules (``reason``)
    └── SessionError        the peer broke a session rule (MQTT-4.8.0-1)

    StoreError              the durable store cannot do what was asked
    ├── StoreFull           the quota or the disk is full: new readings are refused
    ├── CorruptStore        the file fails its integrity check (it is moved aside)
    └── StoreUnwritable     the file system refuses writes (``kind``: read-only, or
                            I/O errors): nothing in the failed commit is durable

    BadLine (ValueError)    a line of a ``pubcomp store import`` file is not a reading

    ReleaseRefused (ValueError)  a release, a keys document or a chunk is not to be
                            taken (``reason``: one of sync/release.py's ``REASONS``,
                            what a gateway counts refusals by)

A caller that means "this connection is done" catches ``TransportError`` (with
``OSError`` and ``TimeoutError`` from the socket) and needs no list of every way a
connection can end; one that must not acknowledge what was not stored catches
``StoreFull`` and ``StoreUnwritable``; a gateway's release apply catches
``ReleaseRefused``, counts it by ``reason`` and keeps what it runs. The modules
that raise them import them from here (``codec``, ``client``, ``session``,
``store``, ``commands``, ``release``).
"""

from __future__ import annotations

from .packets import Reason


class TransportError(Exception):
    """A connection to a broker is over (see the module docstring)."""


class ConnectionClosed(TransportError):
    """The peer closed the connection."""


class ConnectRefused(TransportError):
    """The broker's CONNACK refused the connection; ``code`` is its reason."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"broker refused the connection: {text} (code {code:#04x})")
        self.code = code


class ProtocolError(TransportError):
    """The peer sent bytes that break the MQTT rules; close its connection."""

    def __init__(self, message: str, reason: int = Reason.MALFORMED_PACKET) -> None:
        super().__init__(message)
        self.reason = reason


class SessionError(TransportError):
    """The peer broke a session rule; close the connection (MQTT-4.8.0-1)."""


class StoreError(Exception):
    """The durable store cannot do what was asked (see the module docstring)."""


class StoreFull(StoreError):
    """The quota (or the disk) is full and the policy refuses new readings."""


class CommitStopped(StoreError):
    """The group commit's loop ended (cancelled) before this op's COMMIT returned: it may
    or may not be on disk, so it is not acknowledged; a producer sends it again, and the
    store's keys keep the copy out."""


class CorruptStore(StoreError):
    """The store's file fails to open or its integrity check: it is moved aside."""


class StoreUnwritable(StoreError):
    """The store's file system refuses writes: a dying SD card (ext4 remounted itself
    read-only, or writes fail with I/O errors). Nothing in the failed commit is durable,
    so nothing in it may be acknowledged; reads still work (docs/failure-model.md)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind  # READ_ONLY or IO_ERRORS (sync/store/writes.py)


class BadLine(ValueError):
    """A line of an import file that is not a valid reading."""


class ReleaseRefused(ValueError):
    """A release, keys document or chunk refused (sync/release.py); ``reason`` names
    the rule it broke, the message says it in a sentence."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
