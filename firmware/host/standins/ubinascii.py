from binascii import *  # noqa: F403 - MicroPython's ubinascii is CPython's binascii
