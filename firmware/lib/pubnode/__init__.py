# pubcomp node firmware: the library that main.py runs (MicroPython; no typing, no dataclasses).
VERSION = "0.1.0"
