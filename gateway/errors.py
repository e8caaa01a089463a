"""The gateway's exceptions, as one family (in the manner of httpx's ``_exceptions.py``
and sync/errors.py): a caller that means "the gateway part refused this" catches
``GatewayError``; each says in one line what is wrong and where.

- ``GatewayError``
  - ``ConfigError``: the fleet file (gateway/config.py): ``problems``, one
    ready-to-print line each (file:line: key path: why).
  - ``IngressConfigError``: the node ingress cannot start as configured
    (gateway/ingress.py: a TLS file, a port).
  - ``CertError``: a certificate or key for ``pubcomp gateway make-cert`` or
    ``pubcomp node provision`` (gateway/tls.py).
  - ``ProvisionError``: ``pubcomp node provision`` cannot go on (gateway/provision.py).
  - ``ClientStalled``: inside the ingress only, never raised out of it: a node read
    nothing for ``write_timeout_s``, so its connection is closed.

What the gateway meets from the parts below it keeps its own family: the store's
``StoreError`` (sync/store.py) and the uplink's ``TransportError`` (sync/errors.py).
"""

from __future__ import annotations


class GatewayError(Exception):
    """The gateway part refused something (see the module docstring)."""


class ConfigError(GatewayError):
    """One or more problems; ``problems`` are ready-to-print lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class IngressConfigError(GatewayError):
    """The ingress cannot start as configured (one line: the key, the file, why)."""


class CertError(GatewayError):
    """A one-line reason make-cert or provision cannot go on."""


class ProvisionError(GatewayError):
    """One line: the file, the key, what is wrong."""


class ClientStalled(GatewayError):
    """The peer read nothing for write_timeout_s: closed."""
