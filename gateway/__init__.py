"""The gateway daemon: fleet configuration, node ingress, intake, supervisor, health."""
