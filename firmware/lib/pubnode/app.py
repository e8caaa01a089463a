# The node's main loop: sample on schedule, keep what is owed, send it in order.
#
# One message per sampling round, with a (boot, seq) fixed when it is taken; a
# message leaves the outbox only when its PUBACK has arrived. The watchdog is
# fed from this loop only, so a hang anywhere (a sensor, the socket, the flash)
# reboots the node.
import gc
import time

import machine

from . import bootcount, config, sensors
from .leds import StatusLed
from .link import Link, PinnedTls
from . import message
from .outbox import Outbox
from .ring import Ring
from .spill import SpillLog
from .wifi import Wifi

STATUS_EVERY_MS = 60000
NTP_RETRY_MS = 3600000
CLOCK_VALID_YEAR = 2025


def clock_set():
    return time.gmtime()[0] >= CLOCK_VALID_YEAR


class Node:
    def __init__(self, cfg, wifi=None):
        self.cfg = cfg
        self.boot = bootcount.next_boot()
        self.seq = 0
        self.rounds = 0
        sp = cfg["spill"]
        log = None
        if sp["mode"] != "off":
            log = SpillLog(sp["dir"], sp["segments"], sp["segment_bytes"])
        self.outbox = Outbox(Ring(cfg["buffer_readings"]), log, sp["mode"])
        gw, node = cfg["gateway"], cfg["node"]
        tls = None
        if gw["tls"]:
            tls = PinnedTls(config.pem_to_der(gw["ca"]), gw["server_hostname"] or gw["host"])
        self.link = Link(
            node["id"],
            node["password"],
            gw["host"],
            gw["port"],
            gw["keepalive_s"],
            gw["timeout_s"],
            tls,
        )
        self.cert_said = False
        self.wifi = wifi or Wifi(cfg["wifi"]["ssid"], cfg["wifi"]["password"])
        self.sensors = []
        self.sensor_errors = 0
        for s in cfg["sensors"]:
            try:
                self.sensors.append(sensors.build(s))
            except (OSError, ValueError) as e:
                self.sensor_errors += 1
                print("sensor %s not started: %r" % (s["name"], e))
        led = cfg["led"]
        pin = machine.Pin(led["pin"], machine.Pin.OUT) if led["pin"] is not None else None
        self.led = StatusLed(pin, led["active_high"])
        self.wdt = machine.WDT(timeout=cfg["wdt_ms"]) if cfg["wdt_ms"] else None
        self.sent = 0
        self.next_ntp = time.ticks_ms()

    # ------------------------------------------------------------ one step each

    def sample(self):
        readings = []
        for s in self.sensors:
            try:
                readings.extend(s.read())
            except OSError as e:
                self.sensor_errors += 1
                print("sensor read failed: %r" % e)
        self.rounds += 1
        if not readings:
            return
        t = int(time.time()) if clock_set() else None
        self.outbox.put(message.new(self.boot, self.seq, t, time.ticks_ms(), readings))
        self.seq += 1

    def sync_clock(self):
        if not self.cfg["ntp"] or time.ticks_diff(time.ticks_ms(), self.next_ntp) < 0:
            return
        self.next_ntp = time.ticks_add(time.ticks_ms(), NTP_RETRY_MS)
        try:
            import ntptime

            ntptime.settime()
        except (ImportError, OSError, OverflowError) as e:
            print("ntp failed: %r" % e)

    def send_one(self):
        """Send the oldest message owed; False when there is none or the link failed."""
        msg = self.outbox.peek()
        if msg is None:
            return False
        self.led.show("sending")
        ok = self.link.send(message.payload(self.cfg["node"]["id"], msg, self.boot, time.ticks_ms()))
        if ok:
            self.outbox.ack()
            self.sent += 1
        return ok

    def show_state(self):
        if not self.wifi.up():
            self.led.show("no_wifi")
        elif self.link.cert_refused:
            self.led.show("bad_cert")
            if not self.cert_said:  # once per run of refusals, then in the status line
                print(
                    "gateway certificate refused: %s; sending nothing to %s:%d until it matches "
                    "gateway.ca (LED: three blinks)"
                    % (self.link.last_error, self.link.host, self.link.port)
                )
                self.cert_said = True
        elif not self.link.up:
            self.led.show("no_gateway")
        elif self.outbox.full():
            self.led.show("buffer_full")
        else:
            self.led.show("ok")
        if self.link.up:
            self.cert_said = False

    def status(self):
        o = self.outbox
        return (
            "boot %d seq %d sent %d pending %d lost %d spill_bytes %d connects %d "
            "link_failures %d sensor_errors %d mem_free %d connect_ms %d connect_heap %d "
            "tls %d cert_refused %d led %s"
            % (
                self.boot,
                self.seq,
                self.sent,
                o.pending_readings,
                o.lost,
                o.log.bytes_written if o.log is not None else 0,
                self.link.connects,
                self.link.failures,
                self.sensor_errors,
                gc.mem_free(),
                self.link.connect_ms,
                self.link.connect_heap,
                self.link.tls is not None,
                self.link.cert_refused,
                self.led.state,
            )
        )

    def feed(self):
        if self.wdt is not None:
            self.wdt.feed()

    # ------------------------------------------------------------ loops

    def done(self):
        limit = self.cfg["rounds"]
        return limit and self.rounds >= limit and self.outbox.peek() is None

    def run(self):
        if self.cfg["deep_sleep"]:
            return self.run_once_and_sleep()
        interval = int(self.cfg["interval_s"] * 1000)
        next_sample = time.ticks_ms()
        next_status = time.ticks_add(next_sample, STATUS_EVERY_MS)
        while not self.done():
            self.feed()
            now = time.ticks_ms()
            limit = self.cfg["rounds"]
            if time.ticks_diff(now, next_sample) >= 0 and not (limit and self.rounds >= limit):
                self.sample()
                next_sample = time.ticks_add(next_sample, interval)
                if time.ticks_diff(now, next_sample) > interval:  # fell behind: skip, don't burst
                    next_sample = time.ticks_add(now, interval)
            if self.wifi.ensure():
                self.sync_clock()
                if self.link.ensure():
                    if not self.send_one():
                        self.link.keepalive()
            self.show_state()
            if time.ticks_diff(now, next_status) >= 0:
                print(self.status())
                next_status = time.ticks_add(now, STATUS_EVERY_MS)
            if self.outbox.peek() is None or not self.link.up:
                wait = time.ticks_diff(next_sample, time.ticks_ms())
                time.sleep_ms(max(1, min(wait, 50)))
        print(self.status())

    def run_once_and_sleep(self):
        """Battery mode: one round, send what the gateway takes, keep the rest in flash."""
        self.sample()
        deadline = time.ticks_add(time.ticks_ms(), self.cfg["gateway"]["timeout_s"] * 1000)
        if self.wifi.wait(self.cfg["wifi"]["timeout_s"]):
            self.sync_clock()
            while time.ticks_diff(deadline, time.ticks_ms()) > 0:
                self.feed()
                if self.link.ensure():
                    if not self.send_one():
                        break
                else:
                    time.sleep_ms(100)
        self.outbox.spill_all()  # RAM does not survive deep sleep; the flash log does
        print(self.status())
        self.link.close()
        machine.deepsleep(int(self.cfg["interval_s"] * 1000))
