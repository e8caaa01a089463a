"""The pipeline's exceptions, as one family (in the manner of httpx's ``_exceptions.py``
and sync/errors.py): a caller that means "the pipeline refused this" catches
``PipelineError``.

- ``PipelineError``
  - ``IngestOptionsError`` (also a ``ValueError``): ``pubcomp ingest run`` was given
    options that cannot work together (pipeline/ingest.py); the command says so in
    one line and exits 2.

What is not here, and why:

- a bad message is not an exception that leaves its reader: the ingest files it under
  ``_rejected/`` with the reason, the fleet watch counts it (design: bad input is
  counted, the process keeps running);
- a broken connection is sync/'s ``TransportError`` (sync/errors.py), retried by
  ``sync/running.reconnecting``; a full or failing store of the ingest's receive
  records is the store's ``StoreError``;
- a function called against its contract (``landing.seal`` on bytes without a receive
  record, a writer name with a ``/``) raises ``ValueError``: a bug to fix, not a
  condition to handle;
- a warehouse that is not one is found before Spark starts and said as a line
  (``pipeline/commands.py``, ``warehouse_problem``), not raised.
"""

from __future__ import annotations


class PipelineError(Exception):
    """The pipeline refused something (see the module docstring)."""


class IngestOptionsError(PipelineError, ValueError):
    """Options of the ingest that cannot work together (one line: which, and why)."""
