# The node firmware's pure logic, run by the real MicroPython interpreter
# (WebAssembly port, tests/firmware/run_mpy.mjs). Prints "PASS <name>" per
# check, "MEASURE <name> <value>" per figure, and "DONE" at the end; an
# assertion error stops the run with a traceback.
import gc
import json
import os
import sys
import time

sys.path.insert(0, "/lib")
os.chdir("/flash")


def rm_tree(path):
    try:
        names = os.listdir(path)
    except OSError:
        return
    for n in names:
        p = path + "/" + n
        try:
            os.remove(p)
        except OSError:
            rm_tree(p)
    os.rmdir(path)


from pubnode import bootcount, config, leds  # noqa: E402
from pubnode import message as M  # noqa: E402
from pubnode.outbox import Outbox  # noqa: E402
from pubnode.ring import Ring  # noqa: E402
from pubnode.sensors.adc import scaled  # noqa: E402
from pubnode.spill import SpillLog  # noqa: E402


def drain(queue):
    """Send-and-acknowledge everything owed, as the link would: the seqs, in order."""
    seqs = []
    while queue.peek() is not None:
        seqs.append(queue.peek()[M.SEQ])
        queue.ack()
    return seqs


def msg(boot, seq, n=3):
    return M.new(boot, seq, None, time.ticks_ms(), [("s%d" % i, seq + i / 16, "C") for i in range(n)])


def check_ring():
    r = Ring(10)
    assert r.push(msg(1, 0)) == [] and r.push(msg(1, 1)) == [] and r.push(msg(1, 2)) == []
    out = r.push(msg(1, 3))  # 12 readings > 10: the oldest goes
    assert [m[M.SEQ] for m in out] == [0], out
    assert r.readings == 9 and len(r) == 3
    assert [r.pop()[M.SEQ] for _ in range(3)] == [1, 2, 3]
    assert r.peek() is None and r.readings == 0
    big = r.push(msg(1, 9, n=12))  # bigger than the ring: kept alone, nothing else
    assert big == [] and len(r) == 1
    print("PASS ring")


def check_message():
    t = time.mktime((2026, 11, 21, 12, 0, 5, 0, 0))
    assert M.iso(t + 0.25) == "2026-11-21T12:00:05.250Z", M.iso(t + 0.25)
    m = M.new(7, 42, t, 0, [("t-probe", 21.5, "C"), ("battery", None, "V")])
    assert m[M.FLAT] == ("t-probe", 215000, "C", "battery", None, "V")  # small ints, not floats
    back = M.from_record(M.record(m))
    assert back[:3] == (7, 42, t) and back[M.FLAT] == m[M.FLAT], back
    assert M.readings(back) == [("t-probe", 21.5, "C"), ("battery", None, "V")]
    assert M.readings(M.new(1, 1, None, 0, [("x", 0.1, None), ("y", -3.0625, None)])) == [
        ("x", 0.1, None), ("y", -3.0625, None)]
    body = json.loads(M.payload("node-7", m, 8, 0))
    assert body == {
        "v": 1, "node": "node-7", "boot": 7, "seq": 42, "ts": "2026-11-21T12:00:05.000Z",
        "readings": [{"sensor": "t-probe", "value": 21.5, "unit": "C"},
                     {"sensor": "battery", "value": None, "unit": "V"}],
    }, body
    # No clock: the gateway stamps the time; dt says how old the readings are.
    now = time.ticks_ms()
    m2 = M.new(8, 0, None, time.ticks_add(now, -2500), [("x", 1, None)])
    body = json.loads(M.payload("node-7", m2, 8, now))
    assert body["ts"] is None and body["readings"][0]["dt"] == 2.5, body
    # A message carried from an earlier boot: its ticks mean nothing now, so no dt.
    body = json.loads(M.payload("node-7", m2, 9, now))
    assert "dt" not in body["readings"][0], body
    print("PASS message")


def check_bootcount():
    for p in ("boot.txt", "boot.txt.tmp"):
        try:
            os.remove(p)
        except OSError:
            pass
    first = bootcount.next_boot()
    assert first >= 64 and first % 64 == 0, first  # a new node starts at random, not at 1
    assert bootcount.next_boot() == first + 1
    assert open("boot.txt").read() == str(first + 1)
    # Cut between removing boot.txt and renaming the temp file (FAT): the temp survives.
    os.rename("boot.txt", "boot.txt.tmp")
    assert bootcount.next_boot() == first + 2
    with open("boot.txt", "w") as f:
        f.write("12\x00\x00")  # torn or garbage: never restart at a small number
    b = bootcount.next_boot()
    assert b != 13 and b >= 64, b
    print("PASS bootcount")


def check_spill_fifo_and_recovery():
    rm_tree("sp1")
    log = SpillLog("sp1", segments=3, segment_bytes=400)
    for s in range(5):
        log.append(msg(3, s))
    assert log.pending == 5 and log.peek()[M.SEQ] == 0
    log.ack()
    log.ack()
    assert log.peek()[M.SEQ] == 2
    # A reboot: a new instance over the same files finds the same head and order.
    log = SpillLog("sp1", segments=3, segment_bytes=400)
    assert log.pending == 3 and log.pending_readings == 9, (log.pending, log.pending_readings)
    seqs = drain(log)
    assert seqs == [2, 3, 4], seqs
    assert SpillLog("sp1", segments=3, segment_bytes=400).pending == 0
    print("PASS spill_fifo_and_recovery")


def check_spill_torn_tail():
    rm_tree("sp2")
    log = SpillLog("sp2", segments=2, segment_bytes=4096)
    log.append(msg(4, 0))
    log.append(msg(4, 1))
    path = "sp2/%d.log" % (log.gen % 2)
    with open(path, "ab") as f:
        f.write(b'M [4, 2, null, [["s0", 2')  # power cut mid-record
    log = SpillLog("sp2", segments=2, segment_bytes=4096)
    assert log.torn == 1 and log.pending == 2, (log.torn, log.pending)
    log.append(msg(4, 3))  # starts on a fresh line
    log = SpillLog("sp2", segments=2, segment_bytes=4096)
    seqs = drain(log)
    assert seqs == [0, 1, 3], seqs
    print("PASS spill_torn_tail")


def check_spill_full_drops_oldest():
    rm_tree("sp3")
    log = SpillLog("sp3", segments=3, segment_bytes=300)
    for s in range(40):
        log.append(msg(5, s))
    assert log.dropped > 0 and log.dropped % 3 == 0
    kept = drain(log)
    assert kept == list(range(40 - len(kept), 40)), kept  # the newest, in order
    assert log.dropped // 3 + len(kept) == 40
    total = 0
    for n in os.listdir("sp3"):
        total += os.stat("sp3/" + n)[6]
    assert total <= 3 * 300 + 200, total  # the log stays within its segments
    print("PASS spill_full_drops_oldest")


def check_outbox_modes():
    ob = Outbox(Ring(6), None, "off")
    for s in range(4):
        ob.put(msg(6, s))
    assert ob.dropped == 6 and ob.peek()[M.SEQ] == 2
    rm_tree("sp4")
    ob = Outbox(Ring(6), SpillLog("sp4", 4, 4096), "overflow")
    for s in range(5):
        ob.put(msg(6, s))
    assert ob.log.pending == 3 and len(ob.ring) == 2 and ob.lost == 0
    order = drain(ob)
    assert order == [0, 1, 2, 3, 4], order
    ob.put(msg(6, 5))
    ob.spill_all()  # before deep sleep
    assert len(ob.ring) == 0 and SpillLog("sp4", 4, 4096).peek()[M.SEQ] == 5
    rm_tree("sp5")
    ob = Outbox(Ring(6), SpillLog("sp5", 4, 4096), "always")
    ob.put(msg(6, 0))
    assert len(ob.ring) == 0 and ob.log.pending == 1
    try:
        Outbox(Ring(6), None, "always")
        raise AssertionError("always without a log was accepted")
    except ValueError:
        pass
    print("PASS outbox_modes")


def check_drops_reported():
    """Which messages the node gave up rides the next message it sends ("dropped"),
    the same entries on every retry of that message, forgotten at its PUBACK."""
    ob = Outbox(Ring(6), None, "off")
    for s in range(5):
        ob.put(msg(6, s))  # 15 readings into 6: seqs 0, 1 and 2 overflow
    d = ob.drops
    assert d.entries == [[6, "ring_overflow", 0, 2]], d.entries
    head = ob.peek()
    first = d.attach((head[M.BOOT], head[M.SEQ]))
    assert first == [{"boot": 6, "reason": "ring_overflow", "seqs": [[0, 2]]}], first
    ob.put(msg(6, 5))  # while 3 is in flight: 3 overflows, a new entry (not attached)
    assert d.attach((head[M.BOOT], head[M.SEQ])) == first  # a retry carries the same
    body = json.loads(M.payload("n", head, 6, time.ticks_ms(), first))
    assert body["dropped"] == first and "dropped" not in json.loads(M.payload("n", head, 6, 0))
    d.acked()
    assert d.entries == [[6, "ring_overflow", 3, 3]], d.entries
    rm_tree("sp6")
    ob = Outbox(Ring(6), SpillLog("sp6", segments=3, segment_bytes=300), "always")
    for s in range(40):
        ob.put(msg(7, s))
    lost = [e for e in ob.drops.entries if e[1] == "spill_full"]
    assert lost and lost[0][2] == 0 and ob.log.dropped == 3 * (lost[-1][3] + 1), lost
    print("PASS drops_reported")


def blinks(state):
    n, prev = 0, 0
    for ms in range(0, leds.CYCLE_MS, 10):
        on = leds.level_at(state, ms)
        n += on and not prev
        prev = on
    return n


def check_leds():
    got = {s: blinks(s) for s in ("no_wifi", "no_gateway", "bad_cert", "buffer_full", "ok")}
    want = {"no_wifi": 1, "no_gateway": 2, "bad_cert": 3, "buffer_full": 10, "ok": 1}
    assert got == want, got
    assert leds.level_at("sending", 1999) == 1
    print("PASS leds")


def check_config():
    base = {"gateway": {"host": "gw"}, "node": {"id": "n1", "password": "p"}}
    c = config.merged(base)
    assert c["gateway"]["port"] == 1883 and c["spill"]["mode"] == "overflow"
    for bad, word in (
        ({"node": {"id": "n1", "password": "p"}}, "gateway.host"),
        (dict(base, gatway={}), "gatway"),
        (dict(base, gateway={"host": "gw", "prot": 1}), "gateway.prot"),
        (dict(base, deep_sleep=True, spill={"mode": "off"}), "deep_sleep"),
        (dict(base, sensors=[{"kind": "bme280", "name": "x"}]), "sensors[0].kind"),
    ):
        try:
            config.merged(bad)
            raise AssertionError("accepted: %r" % bad)
        except config.ConfigError as e:
            assert word in str(e), (word, str(e))
    print("PASS config")


# A certificate made by `pubcomp gateway make-cert --gateway gw-wasm-check` (ECDSA P-256):
# its DER form is 462 bytes with this SHA-256 (from CPython's ssl.PEM_cert_to_DER_cert).
PEM = (
    "-----BEGIN CERTIFICATE-----\nMIIByjCCAW+gAwIBAgIUShnPiKR7bIE3ELoK8hhv6uu6+w0wCgYIKoZIzj0EAwIw\n"
    "GDEWMBQGA1UEAwwNZ3ctd2FzbS1jaGVjazAeFw0yNjExMjMxNjQ1MTlaFw0zNjEx\n"
    "MjAxNjUwMTlaMBgxFjAUBgNVBAMMDWd3LXdhc20tY2hlY2swWTATBgcqhkjOPQIB\n"
    "BggqhkjOPQMBBwNCAATemBaipLlLC0SWSBegCMy3znfJRjrTbsM55RGDsonTJMnl\n"
    "DXZCAmclsnxmYbWKMx+yzC2/BL3qCJo5WtngFUFAo4GWMIGTMBgGA1UdEQQRMA+C\n"
    "DWd3LXdhc20tY2hlY2swEgYDVR0TAQH/BAgwBgEB/wIBADAOBgNVHQ8BAf8EBAMC\n"
    "AoQwEwYDVR0lBAwwCgYIKwYBBQUHAwEwHQYDVR0OBBYEFBxzKhcI9Xa4AtOirMwT\n"
    "4rFCsTxlMB8GA1UdIwQYMBaAFBxzKhcI9Xa4AtOirMwT4rFCsTxlMAoGCCqGSM49\n"
    "BAMCA0kAMEYCIQCOWCuMVMIWZVSftF6JCK1lHbq76gQl8MEbcv5NgOkn4QIhAJwx\n"
    "gvHPGw0vLGMGWwAz5Sj99pzfH3ry+uz9Bzdp7gBT\n-----END CERTIFICATE-----\n"
)
DER_SHA256 = "fef936cbe91e6f2eec61d471c99c4759bebb3cd314b33628866c2af7562b686d"


def check_tls_config():
    import hashlib
    from binascii import hexlify

    base = {"gateway": {"host": "gw", "tls": True, "ca": PEM}, "node": {"id": "n", "password": "p"}}
    c = config.merged(base)
    der = config.pem_to_der(c["gateway"]["ca"])
    assert len(der) == 462 and hexlify(hashlib.sha256(der).digest()).decode() == DER_SHA256
    assert config.pem_to_der(PEM.replace("\n", "\r\n")) == der  # a file saved on Windows
    for gw, word in (
        ({"host": "gw", "tls": True}, "gateway.tls needs gateway.ca"),
        ({"host": "gw", "tls": True, "ca": "not a certificate"}, "PEM certificate"),
        ({"host": "gw", "tls": True, "ca": PEM.replace("MIIB", "####")}, "gateway.ca"),
        ({"host": "gw", "ca": PEM}, "gateway.tls is false"),
    ):
        try:
            config.merged(dict(base, gateway=gw))
            raise AssertionError("accepted: %r" % gw)
        except config.ConfigError as e:
            assert word in str(e), (word, str(e))
    print("PASS tls_config")


def check_adc():
    assert scaled(32768, 3.3 / 65535, 0) == 1.65
    assert scaled(1000, 0.01, -2.5) == 7.5
    print("PASS adc")


for check in (
    check_ring,
    check_message,
    check_bootcount,
    check_spill_fifo_and_recovery,
    check_spill_torn_tail,
    check_spill_full_drops_oldest,
    check_outbox_modes,
    check_drops_reported,
    check_leds,
    check_config,
    check_tls_config,
    check_adc,
):
    check()
# RAM held by a 500-reading buffer full of typical rounds (3 readings each),
# measured across runs so that the garbage of building it is collected.
# --- next run ---
gc.collect()
before = gc.mem_alloc()
# --- next run ---
ob = Outbox(Ring(500), None, "off")
names = ("t-probe", "air-t", "air-rh")
seq = 0
while ob.ring.readings + 3 <= 500:
    ob.put(M.new(9, seq, int(time.time()), time.ticks_ms(), [(n, 20.0 + seq / 16, "C") for n in names]))
    seq += 1
# --- next run ---
gc.collect()
print("MEASURE ram_bytes_500_readings %d" % (gc.mem_alloc() - before))
print("MEASURE readings_in_buffer %d" % ob.ring.readings)
# Flash written per reading in spill "always" mode: each message and its ack record.
rm_tree("sp6")
log = SpillLog("sp6", 4, 32768)
start = log.bytes_written
for s in range(200):
    log.append(M.new(9, s, int(time.time()), 0, [(n, 20.0 + s / 16, "C") for n in names]))
    log.ack()
print("MEASURE spill_bytes_per_reading %.1f" % ((log.bytes_written - start) / 600))
# RAM the TLS settings keep for the node's life: the config with gateway.ca (PEM) and
# the DER bytes handed to ssl, against the same config without TLS. (mbedTLS's own
# handshake and record buffers are not in this port: a board's status line shows them.)
PLAIN = json.dumps({"gateway": {"host": "192.168.7.1"}, "node": {"id": "n", "password": "p" * 32}})
TLS = json.dumps(
    {
        "gateway": {"host": "192.168.7.1", "port": 8883, "tls": True, "ca": PEM},
        "node": {"id": "n", "password": "p" * 32},
    }
)
# --- next run ---
gc.collect()
before = gc.mem_alloc()
# --- next run ---
held = config.merged(json.loads(PLAIN))
# --- next run ---
gc.collect()
plain_bytes = gc.mem_alloc() - before
held = None
# --- next run ---
gc.collect()
before = gc.mem_alloc()
# --- next run ---
held = config.merged(json.loads(TLS))
held_der = config.pem_to_der(held["gateway"]["ca"])
# --- next run ---
gc.collect()
print("MEASURE ram_bytes_tls_settings %d" % (gc.mem_alloc() - before - plain_bytes))
print("DONE")
