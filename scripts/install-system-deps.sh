#!/usr/bin/env bash
# Installs the Debian packages pubcomp's demo and tests need, only when missing.
# Run as root (CI and fresh machines are); otherwise it prints the command to run.
set -euo pipefail

need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v openssl >/dev/null 2>&1 || need+=(openssl)   # test certificates for mqtts://
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)   # verifies the unit files
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)   # Spark (pipeline/)
command -v node >/dev/null 2>&1 || need+=(nodejs)   # MicroPython's WebAssembly port (firmware tests)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v chromium >/dev/null 2>&1 || need+=(chromium)   # the status page's browser test (--headless)
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)   # the power-cut test file system
command -v promtool >/dev/null 2>&1 || need+=(prometheus)   # promtool checks and unit-tests the alert rules
[ -e /usr/lib/x86_64-linux-gnu/libfuse3.so.3 ] || ldconfig -p 2>/dev/null | grep -q libfuse3.so.3 || need+=(libfuse3-3)

if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "pubcomp needs these Debian packages: ${need[*]}" >&2
    echo "run: sudo apt-get update && sudo apt-get install -y ${need[*]}" >&2
    exit 1
fi
echo "installing Debian packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The Debian packages start a system-wide broker on port 1883 (mosquitto) and a
# Prometheus server on port 9090 (prometheus, which brings promtool); the tests
# start their own broker on free ports and run promtool only, so need neither.
