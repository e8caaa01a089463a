"""The development kit: the demo and what the demo, bench/ and tests/ share.

Not part of the ``pubcomp`` wheel (pyproject.toml lists the installed packages;
this folder is not one of them): it runs from a checkout, with the repository
root on ``sys.path``. ``python -m devkit.demo`` (``make demo``) and pytest (its
rootdir) put it there; bench/ scripts insert it themselves.

- ``demo``, ``demorig``: ``make demo`` and its sensor bench (a PMS5003 on a
  pseudo-terminal, a DS18B20 sysfs directory);
- ``broker``: a local Mosquitto; ``link``: a TCP proxy that cuts or refuses;
  ``node``: a node board running firmware/host/run_node.py; ``checker``: an
  independent paho-mqtt subscriber counting reading ids;
- ``powercut``: the FUSE file system that loses whatever was not fsynced;
- ``gateway_helpers``, ``ingest_helpers``, ``node_helpers``, ``uplink_helpers``:
  ``pubcomp`` processes and paho nodes for tests and benchmarks; ``procs``: the
  reaper that kills what a failed test left running; ``duckdb_reference``: the
  pipeline's results restated in DuckDB SQL.
"""
