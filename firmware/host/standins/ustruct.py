from struct import *  # noqa: F403 - MicroPython's ustruct is CPython's struct
