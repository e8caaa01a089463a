"""pubcomp: exactly-once sensor telemetry from field gateways to Spark."""

__version__ = "0.1.0"
