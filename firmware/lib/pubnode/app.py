# The node's main loop: sample on schedule, keep what is owed, send it in order.
#
# One message per sampling round, with a (boot, seq) fixed when it is taken; a
# message leaves the outbox only when its PUBACK has arrived. The watchdog is
# fed from this loop only, so a hang anywhere (a sensor, the socket, the flash)
# reboots the node.
#
# Software from the gateway (update.py) is fetched a chunk per pass of the same
# loop, between readings, so sampling, sending and the watchdog carry on; a
# verified set is staged and tried at the next boot (pubboot.py, passed in as
# ``bootsel``), and committed here once the gateway has acknowledged a reading.
import gc
import time

import machine

from . import auth, bootcount, config, image, sensors
from .leds import StatusLed
from .link import Link, PinnedTls
from . import message
from .outbox import Outbox
from .ring import Ring
from .spill import SpillLog
from .update import FETCH, IDLE, READY, Updater
from .wifi import Wifi

STATUS_EVERY_MS = 60000
NTP_RETRY_MS = 3600000
CLOCK_VALID_YEAR = 2025


def clock_set():
    return time.gmtime()[0] >= CLOCK_VALID_YEAR


class Node:
    def __init__(self, cfg, wifi=None, bootsel=None):
        self.cfg = cfg
        self.boot = bootcount.next_boot()
        # bootsel: pubboot (which set runs, its trial); without it no updates are taken.
        self.bootsel = bootsel
        self.sw = bootsel.version if bootsel is not None else 0
        up = cfg["update"]
        self.updater = None
        if up["enabled"] and bootsel is not None:
            node = cfg["node"]
            key = auth.node_key(node["password"], node["id"])
            self.updater = Updater(
                node["id"], key, self.sw, bootsel.bad, image=bootsel.image,
                image_bad=bootsel.image_bad, image_sink=image.sink,
            )  # fmt: skip
        self.trial_until = None
        if bootsel is not None and (bootsel.trial or bootsel.image_trial):
            self.trial_until = time.ticks_add(time.ticks_ms(), int(up["trial_s"] * 1000))
            what = "image %d" % bootsel.image if bootsel.image_trial else "version %d" % self.sw
            print("update: trying %s: it must deliver a reading within %d s"
                  % (what, up["trial_s"]))  # fmt: skip
        self.hello_on = -1  # link.connects when the last hello went out
        self.next_hello = time.ticks_ms()
        self.asked = None  # (connects, ticks) of the chunk request awaiting its answer
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
            updates=self.updater is not None,
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
            if self.trial_until is not None:
                self.commit()
        return ok

    # ------------------------------------------------------------ software updates

    def commit(self):
        """The set (or image) on trial connected and had a reading acknowledged: keep it."""
        b = self.bootsel
        if b.image_trial:
            b.commit_image()  # mark_app_valid_cancel_rollback: the bootloader keeps it
            what = "image %d" % b.image
            if self.updater is not None:
                self.updater.image = b.image
        if b.trial:
            b.commit()
            what = "version %d" % self.sw
        self.trial_until = None
        print("update: %s committed: connected, and the gateway acknowledged a reading"
              % what)  # fmt: skip
        if self.updater is not None:
            self.updater.changed = True  # tell the gateway at once

    def check_trial(self):
        if self.trial_until is None or time.ticks_diff(time.ticks_ms(), self.trial_until) < 0:
            return
        what = "image %d" % self.bootsel.image if self.bootsel.image_trial else "version %d" % self.sw
        print("update: %s delivered no reading in %d s: restarting into the one before it"
              % (what, self.cfg["update"]["trial_s"]))  # fmt: skip
        self.restart()

    def restart(self):
        self.outbox.spill_all()  # what RAM holds survives only in the flash log
        self.link.close()
        machine.reset()

    def update_step(self):
        """One step of a software update: take the answers, ask the next thing."""
        u, link = self.updater, self.link
        if u is None or not link.up:
            return
        link.poll()
        for msg in link.take():
            u.take(msg)
            self.asked = None
        if not link.up or not link.subscribed:
            return
        now = time.ticks_ms()
        if u.state == READY:
            if self.outbox.log is not None or self.outbox.peek() is None:
                kind = u.kind
                v = u.apply(self.bootsel.stage, self.bootsel.stage_image)
                if kind == "image":
                    print("update: image %d written and set to boot; restarting to try it" % v)
                else:
                    print("update: version %d staged beside version %d; restarting to try it"
                          % (v, self.sw))  # fmt: skip
                self.restart()
            return
        if link.connects != self.hello_on or u.changed or time.ticks_diff(now, self.next_hello) >= 0:
            # On each connect, after news, and every check_s: what runs, what is held.
            if link.request(u.hello(self.trial_until is not None, self.boot)):
                self.hello_on = link.connects
                self.next_hello = time.ticks_add(now, int(self.cfg["update"]["check_s"] * 1000))
                self.asked = (link.connects, now)  # the gateway answers every hello
            return
        if u.state != FETCH:
            return
        a = self.asked
        wait = self.cfg["gateway"]["timeout_s"] * 1000
        if a is None or a[0] != link.connects or time.ticks_diff(now, a[1]) > wait:
            if link.request(u.request()):
                self.asked = (link.connects, now)

    def updating(self):
        """An answer awaited, or more to fetch or tell."""
        u = self.updater
        if u is None or not self.link.up:
            return False
        return self.asked is not None or u.changed or u.state != IDLE

    def update_text(self):
        u = self.updater
        if u is None:
            return "off"
        if u.state == IDLE:
            return "idle"
        done, total = u.progress()
        return "%s v%d %d/%d" % (u.state, u.version, done, total)

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
            "tls %d cert_refused %d led %s sw %d%s update %s"
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
                self.sw,
                " (trial)" if self.trial_until is not None else "",
                self.update_text(),
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
            self.check_trial()
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
                    self.update_step()
            self.show_state()
            if time.ticks_diff(now, next_status) >= 0:
                print(self.status())
                next_status = time.ticks_add(now, STATUS_EVERY_MS)
            if self.outbox.peek() is None or not self.link.up:
                wait = time.ticks_diff(next_sample, time.ticks_ms())
                if self.updating():
                    wait = 2  # an answer is on its way: look again soon
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
            # What is left of the wake goes to a software update, a few chunks a wake.
            while self.updater is not None and time.ticks_diff(deadline, time.ticks_ms()) > 0:
                self.feed()
                if not self.link.up:
                    break
                self.update_step()
                if not self.updating():
                    break
                time.sleep_ms(2)
        self.outbox.spill_all()  # RAM does not survive deep sleep; the flash log does
        print(self.status())
        self.link.close()
        machine.deepsleep(int(self.cfg["interval_s"] * 1000))
