"""``pubcomp gateway run``: the store, the intake, the drivers, the ingress, the uplink
and the health server, as tasks on one event loop.

Start order follows the data: the store opens (and recovers), the intake
starts, the ingress binds, the uplink resumes its session, the drivers start;
then READY=1. Stop order is the reverse of the data's path: producers stop
(drivers, ingress), the intake commits what it holds, the uplink ends with a
DISCONNECT that keeps the session, the store closes; exit 0.

The chores (clock, sample, watchdog, prune, status link) and the sensors'
supervisors never end on their own: one that does is logged with its
traceback at once and makes the gateway unhealthy (``Chores``), so the
watchdog ping stops and systemd restarts the service (issue 25: a dead chore
used to go unseen).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from typing import Any, Literal

from pubcomp.sensors.api import ClockFix
from pubcomp.sensors.pins import make_factory
from pubcomp.sync.client import ConnectOptions, TLSOptions
from pubcomp.sync.errors import StoreError
from pubcomp.sync.groupcommit import GroupCommit
from pubcomp.sync.packets import MQTT_5, MQTT_311
from pubcomp.sync.store import Store
from pubcomp.sync.uplink import Uplink, UplinkConfig
from pubcomp.sync.wire import parse_key

from ..sync.faults import crash_point
from ..sync.running import Stop, cancel_all, run_until_stopped
from .clock import ClockWatch, correct_waiting, kernel_check
from .commitlog import CommitLog
from .config import GatewayConfig
from .drivers import Drivers
from .fleetstatus import StatusPublisher
from .health import HealthServer
from .ingress import Ingress
from .intake import Intake
from .nodeoffer import OfferServer
from .nodesets import state_dir
from .notify import Notifier
from .ratelog import Summary, SummaryFilter
from .release_apply import Boot, ReleaseApply, reexec, status_without_releases
from .status import store_headline
from .wear import Wear

log = logging.getLogger(__name__)

CLOCK_POLL_S = 10.0
SAMPLE_S = 2.0  # backlog history and STATUS= line (stretched if counting the backlog is slow)
SEEN_KEEP_S = 7 * 24 * 3600  # node message keys kept for dedup: retries never come later
PRUNE_WITHIN_S = 5.0  # forgetting old keys is never urgent: it rides a commit within this
LEDGER_WITHIN_S = 1.0  # a $ledger record rides a commit within this
PROBE_TIMEOUT_S = 5.0
# What is wrong, for decisions (the watchdog's); each comes with a sentence for people.
Problem = Literal["task", "chore", "store_probe", "store_unwritable", "commit"]


class Chores:
    """Tasks that must run as long as the gateway does: one that ends (an exception, or
    a return) is logged once with its traceback and named by ``problems()``, which
    ``Gateway.healthy()`` reports. What asyncio.TaskGroup would give, without its
    cancelling the rest: delivery goes on until the watchdog restarts the service."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any]] = []
        self.dead: dict[str, str] = {}
        self.stopping = False  # set at the gateway's stop: chores then end as asked

    def start(self, name: str, coro: Any) -> asyncio.Task[Any]:
        return self.watch(asyncio.create_task(coro, name=name))

    def watch(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self.tasks.append(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self.stopping:  # a stop
            return
        exc = task.exception()
        why = f"{type(exc).__name__}: {exc}" if exc is not None else "returned"
        self.dead[task.get_name()] = why
        log.error("chore %s died (%s): the gateway is unhealthy", task.get_name(), why,
                  exc_info=exc)  # fmt: skip

    def problems(self) -> list[str]:
        return [f"{name} chore died: {why}" for name, why in self.dead.items()]


def connect_options(cfg: GatewayConfig) -> ConnectOptions:
    up = cfg.uplink
    return ConnectOptions(
        client_id=cfg.client_id(),
        version=MQTT_5 if up.protocol == "5" else MQTT_311,
        keepalive=up.keepalive,
        username=up.username,
        password_text=up.password.get_secret_value() if up.password else None,
        tls=TLSOptions(up.ca_file, up.cert_file, up.key_file),
    )


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        *,
        notifier: Notifier | None = None,
        clock: ClockWatch | None = None,
        boot: Boot | None = None,
    ) -> None:
        self.cfg = cfg
        self.notifier = notifier or Notifier()
        self.started = time.time()
        if boot is not None:  # the start's release step opened the store (release_apply.py)
            self.store = boot.store
            self.first_new_seq = boot.first_new_seq
        else:
            quota = int(cfg.store.quota_mb * 1e6) if cfg.store.quota_mb else None
            self.store = Store(
                cfg.store.path,
                gateway_id=cfg.id,
                quota_bytes=quota,
                policy=cfg.store.policy,
                hold_if_unwritable=True,  # deliver what it holds (degraded) rather than exit
            )
            self.first_new_seq = self.store.given_seq()  # readings above: stamped by this run
        self.wear = Wear(cfg.store.flash_endurance_tbw)
        self.clock = clock or (boot.clock if boot is not None else ClockWatch(kernel_check()))
        audit = CommitLog(cfg.store.commit_log) if cfg.store.commit_log else None
        self.commit_log = audit
        # One group commit for everything the gateway writes: node messages, sensor
        # readings and the uplink's session transitions share transactions and fsyncs.
        self.commits = GroupCommit(self.store, commit_delay=cfg.store.commit_delay_ms / 1000)
        self.intake = Intake(
            self.store,
            commits=self.commits,
            sensor_delay=cfg.store.sensor_delay_ms / 1000,
            max_hold=cfg.store.commit_delay_max_ms / 1000,
            on_commit=None if audit is None else lambda rs: audit(rs, cfg.id),
        )
        # Log lines a client can cause, one per kind a minute (ratelog.py): the card's
        # space is not the attacker's to spend.
        self.events = Summary()
        self.ingress: Ingress | None = None
        if cfg.ingress.enabled and cfg.nodes:
            hashes = {n.id: n.password_hash for n in cfg.nodes}
            self.ingress = Ingress(
                self.intake, hashes, cfg.ingress, clock=self.clock, events=self.events,
                updates=OfferServer(state_dir(cfg), events=self.events),
            )  # fmt: skip
        up = cfg.uplink
        self.uplink = Uplink(
            self.store,
            up.broker,
            connect_options(cfg),
            UplinkConfig(
                up.topic_prefix,
                up.qos,
                up.batch,
                up.max_bytes,
                linger=up.linger_ms / 1000,
                drain_on_stop=up.drain_on_stop_s,
                max_refusals=up.max_refusals,
                end_to_end=up.end_to_end,
                landed_timeout=up.landed_timeout_s,
                landed_key=(parse_key(up.landed_key.get_secret_value()) if up.landed_key else None),
            ),
            commits=self.commits,
        )
        self.drivers = Drivers(
            list(cfg.sensors), lambda: make_factory(cfg.gpio), self.intake, self.clock, self.on_fix
        )
        self.health = HealthServer(cfg.health.host, cfg.health.port, self.snapshot, self.healthy)
        self.boot = boot
        self.release: ReleaseApply | None = None
        if boot is not None and boot.rdir is not None:
            self.release = ReleaseApply(boot, self, self.commits)
        self.status_link: StatusPublisher | None = None
        if cfg.status.enabled:  # the gateway's health, to the cloud broker (fleetstatus.py)
            # Releases come on the same connection (retained: the newest at each connect).
            self.status_link = StatusPublisher(
                cfg,
                self.snapshot,
                started=self.started,
                subscriptions=self.release.topics() if self.release else (),
                on_message=self.release.on_message if self.release else None,
            )
        elif self.release is not None:
            log.warning("status.enabled is false: no release can reach this gateway")
        self.ready = False
        self.ready_at: float | None = None
        self.reexec: str | None = None  # why this process is to be replaced by a new one
        self._stop: asyncio.Event | None = None
        # The backlog peaks when the uplink connects again: record it then, not 2 s later.
        self.uplink.on_connect = self.health.record
        self.ingress_port: int | None = None
        self.health_port: int | None = None
        self._critical: dict[str, asyncio.Task[Any]] = {}
        self.chores = Chores()
        self._store_ok = True
        self._store_error: str | None = None
        self._probe: asyncio.Future[Any] | None = None

    # ------------------------------------------------------------ running

    def restart(self, why: str) -> None:
        """Stop cleanly, then replace this process by a new one (a release's switch or
        rollback: release_apply.py says why a re-exec)."""
        self.reexec = why
        if self.status_link is not None:
            self.status_link.restarting = True
        if self._stop is not None:
            self._stop.set()

    def nodes_connected(self) -> list[str]:
        if self.ingress is None:
            return []
        return [n.id for n in self.cfg.nodes if self.ingress.stats[n.id].connected]

    async def run(self, stop: asyncio.Event) -> int:
        self._stop = stop
        # asyncio's own repeated lines (a write to a dead socket, an accept that failed)
        # summarised like ours.
        asyncio_filter = SummaryFilter(self.events)
        logging.getLogger("asyncio").addFilter(asyncio_filter)
        uplink_stop = asyncio.Event()
        self._critical["commit"] = asyncio.create_task(self.commits.run(), name="commit")
        if self.ingress is not None:
            self.ingress_port = await self.ingress.start()
        self.health_port = await self.health.start()
        self._critical["uplink"] = asyncio.create_task(self.uplink.run(uplink_stop), name="uplink")
        for task in self.drivers.tasks():
            self.chores.watch(task)
        self.chores.start("clock", self._clock_loop())
        self.chores.start("sample", self._sample_loop())
        self.chores.start("watchdog", self._watchdog_loop())
        self.chores.start("prune", self._prune_loop())
        self.chores.start("ledger", self._ledger_loop())
        if self.status_link is not None:
            self.chores.start("status", self.status_link.run())
        if self.release is not None:
            self.chores.start("release", self.release.run())
        self.notifier.ready(self.status_line())
        self.ready, self.ready_at = True, time.monotonic()
        log.info(
            "gateway %s running: ingress port %s, health port %s, %d sensors, %d nodes",
            self.cfg.id,
            self.ingress_port,
            self.health_port,
            len(self.cfg.sensors),
            len(self.cfg.nodes),
        )
        try:
            await stop.wait()
        finally:
            if self.reexec:  # sd_notify's reload protocol: READY=1 comes from the new process
                self.notifier.reloading(f"{self.reexec}: committing and disconnecting")
            else:
                self.notifier.stopping("stopping: committing and disconnecting")
            self.chores.stopping = True
            if self.status_link is not None:
                await self.status_link.close()  # its goodbye whole, not cut by a cancel
            await cancel_all(self.chores.tasks)
            if self.ingress is not None:
                await self.ingress.close()
            # A clean stop's record, before the uplink's last drain may take it along; it
            # also makes the next start's skipped block exact (sync/store/outbox.py).
            await self._ledger_record()
            uplink_stop.set()
            try:
                await asyncio.wait_for(
                    self._critical["uplink"], self.cfg.uplink.drain_on_stop_s + 10
                )
            except (TimeoutError, Exception) as exc:
                log.warning("uplink did not end cleanly: %r", exc)
            # Last: what the producers and the uplink left pending is committed.
            self.commits.close()
            await asyncio.gather(self._critical["commit"], return_exceptions=True)
            await self.health.close()
            self.drivers.close()
            self.store.close()
            if self.commit_log is not None:
                self.commit_log.close()
            self.notifier.close()
            self.events.flush()
            logging.getLogger("asyncio").removeFilter(asyncio_filter)
            log.info("gateway %s stopped", self.cfg.id)
        return 0

    def on_fix(self, fix: ClockFix) -> None:
        self._apply_shift(self.clock.on_fix(fix))

    def _apply_shift(self, shift: float | None) -> None:
        if shift is None:
            return

        def correct(db: Any) -> int:
            n = correct_waiting(self.store, db, self.first_new_seq, shift)
            log.info("clock synced: corrected %d waiting readings by %+.3f s", n, shift)
            return n

        # An op in the group commit: it follows every reading queued before it.
        self.commits.submit_nowait(correct, within=0)

    async def _clock_loop(self) -> None:
        while True:
            await asyncio.sleep(CLOCK_POLL_S)
            self._apply_shift(self.clock.poll())

    async def _sample_loop(self) -> None:
        while True:
            began = time.monotonic()
            st = await asyncio.to_thread(self.store.stats)
            took = time.monotonic() - began
            self.health.record(st["backlog"])
            self.wear.sample(self.store.io.fsyncs)
            if self.status_link is not None:
                self.status_link.sampled(st)
            self.notifier.status(self.status_line(st))
            self.events.flush()  # the summaries of repeated log lines that are due
            # Counting a large backlog reads the whole outbox: keep that under 5 % of the time.
            await asyncio.sleep(max(SAMPLE_S, 20 * took))

    async def _prune_loop(self) -> None:
        while True:
            try:
                # An op in the group commit, as every write of the gateway (rule 6).
                await self.commits.submit(
                    lambda db: self.store.prune_seen_in(db, SEEN_KEEP_S), within=PRUNE_WITHIN_S
                )
            except StoreError as exc:  # a dying card: the keys wait for the next round
                log.warning("forgetting old message keys failed: %s", exc)
            await asyncio.sleep(3600)

    async def _ledger_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.ledger.interval_s)
            await self._ledger_record()

    async def _ledger_record(self) -> None:
        """ONE op of the group commit builds the $ledger record, appends it to the outbox
        and deletes the events it took (sync/store/ledger.py): told exactly once."""
        if self.store.held:
            return  # nothing can be written: the events wait in the store
        try:
            seq = await self.commits.submit(self.store.ledger_record_in, within=LEDGER_WITHIN_S)
            crash_point("ledger_committed", str(seq))
            log.debug("ledger: record %d appended", seq)
        except Exception as exc:  # a full or dying card: the events wait for the next one
            log.warning("ledger: the record was not written: %r", exc)

    async def _watchdog_loop(self) -> None:
        """WATCHDOG=1 at half the timeout, only while the loop, its tasks and the store are well.

        The pings come from the event loop itself, so a wedged loop stops them.
        """
        interval = self.notifier.watchdog_interval or 10.0
        while True:
            await self._probe_store(min(PROBE_TIMEOUT_S, interval))
            problems = self._problems()
            why = [text for _, text in problems]
            # A store that cannot be written is the one problem a restart cannot mend, and
            # a restart would end the delivery of what it holds: the pings go on.
            ok = not problems
            if (ok or [k for k, _ in problems] == ["store_unwritable"]) and (
                self.notifier.watchdog_interval
            ):
                self.notifier.watchdog()
            if not ok:
                log.error("unhealthy, withholding the watchdog ping: %s", "; ".join(why))
                self.notifier.status("UNHEALTHY: " + "; ".join(why))
            await asyncio.sleep(interval)

    async def _probe_store(self, timeout: float) -> None:
        """Can we take the store's write lock? (A hung disk or a stuck commit says no.)"""
        if self._probe is not None and not self._probe.done():
            self._store_ok, self._store_error = False, "store probe still running (disk hung?)"
            return
        self._probe = asyncio.ensure_future(asyncio.to_thread(self.store.probe))
        try:
            await asyncio.wait_for(asyncio.shield(self._probe), timeout)
            self._store_ok, self._store_error = True, None
        except TimeoutError:
            self._store_ok, self._store_error = False, f"store probe took over {timeout:g} s"
        except Exception as exc:
            self._store_ok, self._store_error = False, f"store probe failed: {exc}"

    def healthy(self) -> tuple[bool, list[str]]:
        """(healthy?, why not: one sentence a problem) for /healthz and the status."""
        why = [text for _, text in self._problems()]
        return not why, why

    def _problems(self) -> list[tuple[Problem, str]]:
        """Each problem as (kind, sentence): decisions read the kind, people the sentence."""
        out: list[tuple[Problem, str]] = [
            ("task", f"{name} task ended: {t.exception() if not t.cancelled() else 'cancelled'}")
            for name, t in self._critical.items()
            if t.done()
        ]
        out += [("chore", text) for text in self.chores.problems()]
        if not self._store_ok:
            out.append(("store_probe", self._store_error or "store unhealthy"))
        ws = self.store.write_state
        if not ws.writable:  # a dying card, said plainly (not as the last commit's error)
            out.append(("store_unwritable", f"{ws.text}: refusing new readings"))
        elif self.commits.stats.last_error:
            out.append(("commit", f"last commit failed: {self.commits.stats.last_error}"))
        return out

    # ------------------------------------------------------------- status

    def status_line(self, st: dict[str, Any] | None = None) -> str:
        m = self.uplink.metrics(st)
        age = m["oldest_age_s"]
        dying = store_headline({"store": self._write_state(), "uplink": m})
        return (
            (f"{dying}; " if dying else "")
            + f"uplink {m['state']}, backlog {m['backlog']}"
            + (f" (oldest {age:.0f} s)" if age is not None else "")
            + f", clock {self.clock.source}"
        )

    def _write_state(self) -> dict[str, Any]:
        ws = self.store.write_state
        bad = None
        if not ws.writable:
            bad = {
                "kind": ws.kind,
                "text": ws.text,
                "since": ws.since,
                "last_error": ws.last_error,
                "last_error_at": ws.last_error_at,
            }
        return {
            "writable": ws.writable,
            "unwritable": bad,
            "write_errors": ws.errors,
            "refused_while_unwritable": ws.refused_readings,
        }

    async def snapshot(self, st: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything the gateway shows; ``st``: store figures just read (else read now)."""
        if st is None:
            st = await asyncio.to_thread(self.store.stats)
        up = self.uplink.metrics(st)
        up["connected"] = up["state"] == "connected"
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(self.cfg.store.path))).free
        it = self.intake.stats
        nodes = {}
        if self.ingress is not None:
            for n in self.cfg.nodes:
                ns = self.ingress.stats[n.id]
                nodes[n.id] = {
                    "connected": ns.connected,
                    "last_seen": ns.last_seen,
                    "messages": ns.messages,
                    "readings": ns.readings,
                    "duplicates": ns.duplicates,
                    "rejected": dict(ns.rejected),
                    "software": ns.software,  # node updates (gateway/nodeoffer.py)
                }
        return {
            "gateway": self.cfg.id,
            "fleet": self.cfg.fleet,
            "time": time.time(),
            "started": self.started,
            "uptime_s": round(time.time() - self.started, 1),
            "healthy": self.healthy()[0],
            "health_problems": self.healthy()[1],
            "clock": {
                "source": self.clock.source,
                "synced": self.clock.synced,
                "corrections": self.clock.corrections,
                "gps_rejected": self.clock.gps_rejected,
            },
            "uplink": up,
            "intake": {
                "committed_readings": it.committed_readings,
                "commits": self.commits.stats.commits,
                "duplicates": it.duplicates,
                "refused_full": it.refused_full,
                "refused_unwritable": it.refused_unwritable,
                "sensor_readings_refused": it.counters["sensor_readings_refused"],
                "sensor_readings_refused_unwritable": it.counters[
                    "sensor_readings_refused_unwritable"
                ],
                "sensor_readings_lost": it.counters["sensor_readings_lost"],
                "queued": self.intake.queued,
                "last_error": it.last_error,
            },
            "store": self._write_state()
            | {
                "path": st["store"],
                "epoch": st["epoch"],
                "store_bytes": st["store_bytes"],
                "file_bytes": st["file_bytes"],
                "quota_bytes": st["quota_bytes"],
                "disk_free_bytes": free,
                "counters": st["counters"],
                "commits": self.store.io.commits,
                "checkpoints": self.store.io.checkpoints,
            },
            "flash": self.wear.figures(self.store.io.fsyncs),
            "sensors": {sid: s.as_dict() for sid, s in self.drivers.status.items()},
            "nodes": nodes,
            "ingress_port": self.ingress_port,
            "listeners": {ls.name: ls.as_dict() for ls in self.ingress.listeners}
            if self.ingress is not None
            else {},
            "ingress": self.ingress.figures() if self.ingress is not None else None,
            "log_lines_suppressed": self.events.suppressed_total,
            "release": self._release_status(),
        }

    def _release_status(self) -> dict[str, Any] | None:
        if self.release is not None:
            return self.release.status()
        if self.boot is not None and self.boot.problems:  # releases were applied here
            return status_without_releases(self.boot)
        return None


def run(cfg: GatewayConfig, boot: Boot | None = None) -> int:
    """Run until SIGTERM or SIGINT; the exit code for the process. A release's switch or
    rollback ends the run cleanly, then this process is replaced (``reexec``)."""
    gateway: Gateway | None = None

    async def work(stop: Stop) -> int:
        nonlocal gateway
        gateway = Gateway(cfg, boot=boot)
        code = await gateway.run(stop)
        if gateway.reexec and stop.signal is not None:
            # Asked to stop while stopping to start again (``systemctl stop`` during a
            # switch): stop. The next start takes the release on where its state says.
            log.warning(
                "%s during the %s: stopping, not starting again",
                signal.Signals(stop.signal).name,
                gateway.reexec,
            )
            gateway.reexec = None
        return code

    code = 0
    with contextlib.suppress(KeyboardInterrupt):
        code = run_until_stopped(work)
    if gateway is not None and gateway.reexec:
        reexec()
    return code
