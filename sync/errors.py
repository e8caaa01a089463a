"""Why a connection to a broker is over, as one family (in the manner of httpx's
``_exceptions.py``): a caller that means "this connection is done, reconnect"
catches ``TransportError`` (with ``OSError`` and ``TimeoutError`` from the socket)
and needs no list of every way it can end.

- ``ConnectionClosed``: the peer closed it.
- ``ConnectRefused``: the CONNACK refused it (its reason says whether trying again
  can help: sync/uplink.py ``permanent``).
- ``ProtocolError`` (sync/codec.py): the peer sent bytes that break MQTT's rules.
- ``SessionError`` (sync/session.py): the peer broke a session rule.
"""

from __future__ import annotations


class TransportError(Exception):
    """A connection to a broker is over (see the module docstring)."""
