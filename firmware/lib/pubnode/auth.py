# HMAC-SHA256 for the gateway's software offers (MicroPython has hashlib, not hmac).
#
# The node's update key is derived from the password `pubcomp node provision`
# gave it, so no other secret has to reach the board and no public-key
# cryptography has to run on it; the gateway side holds the same derived key
# (gateway/nodeupdate.py: update_key). Inputs are domain-separated so a MAC
# made for one kind of message never verifies as another.
import hashlib

try:
    from binascii import hexlify
except ImportError:
    from ubinascii import hexlify

BLOCK = 64
KEY_CONTEXT = b"pubcomp node update key v1\x00"
MANIFEST = b"pubcomp manifest v1\x00"
CHUNK = b"pubcomp chunk v1\x00"
CHUNK_MAC_BYTES = 16  # 128 bits per chunk: a forgery still needs 2^128 tries


class Mac:
    """HMAC-SHA256 (RFC 2104) under one key; the pads are made once."""

    def __init__(self, key):
        if len(key) > BLOCK:
            key = hashlib.sha256(key).digest()
        key = key + b"\x00" * (BLOCK - len(key))
        self.ipad = bytes([b ^ 0x36 for b in key])
        self.opad = bytes([b ^ 0x5C for b in key])

    def digest(self, *parts):
        inner = hashlib.sha256(self.ipad)
        for p in parts:
            inner.update(p)
        outer = hashlib.sha256(self.opad)
        outer.update(inner.digest())
        return outer.digest()

    def hexdigest(self, *parts):
        return hexlify(self.digest(*parts))


def node_key(password, node_id):
    """The node's update key: HMAC-SHA256(password, context + node id)."""
    return Mac(password.encode()).digest(KEY_CONTEXT, node_id.encode())


def chunk_header(version, index, offset):
    return ("%d %d %d\n" % (version, index, offset)).encode()


def equal(a, b):
    """Compare two MACs without stopping at the first difference."""
    if len(a) != len(b):
        return False
    diff = 0
    for i in range(len(a)):
        diff |= a[i] ^ b[i]
    return diff == 0
