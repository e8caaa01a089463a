#!/usr/bin/env python3
"""Fetch umqtt.simple (micropython-lib) for the firmware tests, pinned by hash.

PyPI's micropython-umqtt.simple 1.3.4 is an sdist without setup.py, so pip
cannot install it; the tests need only its one module, run under CPython with
stand-ins for usocket/machine/network. This downloads the sdist, checks its
sha256, and unpacks umqtt/simple.py into .cache/umqtt/ (once).
"""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
import urllib.request
from pathlib import Path

URL = (
    "https://files.pythonhosted.org/packages/bd/cf/"
    "697e3418b2f44222b3e848078b1e33ee76aedca9b6c2430ca1b1aec1ce1d/"
    "micropython-umqtt.simple-1.3.4.tar.gz"
)
SHA256 = "b6a2520239e3992c63a7de9370ee9b3d9d27819a90359c521f1c0f7ccab8d12f"
MEMBER = "micropython-umqtt.simple-1.3.4/umqtt/simple.py"
DEST = Path(__file__).resolve().parent.parent / ".cache" / "umqtt"


def main() -> int:
    target = DEST / "umqtt" / "simple.py"
    if target.exists():
        return 0
    with urllib.request.urlopen(URL, timeout=60) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != SHA256:
        print(f"fetch-umqtt: sha256 {got} != pinned {SHA256}", file=sys.stderr)
        return 1
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = tar.extractfile(MEMBER)
        assert member is not None, MEMBER
        source = member.read()
    target.parent.mkdir(parents=True, exist_ok=True)
    (target.parent / "__init__.py").write_text("")
    target.write_bytes(source)
    print(f"fetch-umqtt: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
