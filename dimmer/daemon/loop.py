"""The daemon: a fixed-period cycle of read every device -> one snapshot -> Observation -> Controller.step -> write.

One cycle (period_s, default 1 s):

1. read every device concurrently (`asyncio.gather`), each bounded by a timeout; a device's bus retries and
   reconnects on its own, a read that still fails counts against the device (flagged after `fail_after` in a row);
2. freeze one timestamped `Snapshot` of the last good reading of every device;
3. build the `Observation`: each value from its device with its age (now - the reading's time); a value nobody
   measured is NaN, never zero;
4. `Controller.step` (an exception puts the daemon in FAILSAFE for that cycle: safe caps, reads go on, the
   controller is tried again next period);
5. the daemon's own safety net, whatever the controller: caps within the GPU's range, a rack with stale telemetry
   (or the whole site when the interconnect meter is stale) at or below the safe cap, never raised by it;
6. write every setpoint concurrently (rack caps, floors, BBU thresholds with a lease; the battery setpoint with a
   revert timeout), never to a read-only device, nothing at all in dry-run;
7. publish metrics, append the audit record, notify the systemd watchdog, save the state every N cycles.

At start the controller's state comes from the state file through `state.vet_state_file` only. A state file that is
there and refused (said once, in the log and the audit) puts the controller at the safe cap, and a `StartRamp` holds
every cap at most the safe cap at the first write, rising from there at the controller's cap rise rate (at most half
the ramp limit over every GPU), instead of rated at once.

Signals: SIGTERM / SIGINT stop the loop after writing safe caps; SIGHUP reloads the config (the old one stays if
the new one is invalid) and reopens the audit log.

The parts live in their own modules, each re-exported here: `modes` (the mode machine), `handles` (the devices and
the bookkeeping of their reads and writes), `observe` (snapshot -> Observation), `safety` (the safety net),
`writes` (planning and running the writes), `notify` (systemd), `metrics` and `audit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.control import Controller, make_controller
from dimmer.daemon.audit import AuditLog, decided_json, reasons_json
from dimmer.daemon.building_role import BuildingRole
from dimmer.daemon.config import LoadedConfig, load_config, metrics_address_of, safe_cap_load_warnings
from dimmer.daemon.handles import (
    BusFactory,
    DeviceHandle,
    ReadingLike,
    build_devices,
    close_buses,
    device_status,
    freeze_startup_heap,
    has_data,
    judge_meters,
    note_reading,
    read_device,
    tcp_bus_factory,
)
from dimmer.daemon.metrics import DaemonMetrics, RecentDurations
from dimmer.daemon.modes import ALLOWED, IllegalTransition, Mode, ModeMachine
from dimmer.daemon.netguard import ConnectionLimits
from dimmer.daemon.notify import SystemdNotifier, watchdog_error
from dimmer.daemon.observe import ObservationBuilder, Snapshot
from dimmer.daemon.safety import NonFiniteLog, StartRamp, decide, enforce_safety, safe_actions, safety_net
from dimmer.daemon.state import (
    controller_state,
    hold_caps_at_most,
    restore_state,
    save_from,
    start_without_state,
    vet_state_file,
)
from dimmer.daemon.utility_ven import UtilityVen
from dimmer.daemon.writes import Write, audit_entries, do_write, plan_writes
from dimmer.errors import DimmerError, InputError
from dimmer.observation import Actions, Observation, Reason

__all__ = [
    "ALLOWED",
    "DISCOVERY_TIMEOUT_FACTOR",
    "BusFactory",
    "CycleResult",
    "Daemon",
    "DeviceHandle",
    "IllegalTransition",
    "Mode",
    "ModeMachine",
    "ObservationBuilder",
    "ReadingLike",
    "Snapshot",
    "StartRamp",
    "SystemdNotifier",
    "Write",
    "build_devices",
    "enforce_safety",
    "run_daemon",
    "safe_actions",
    "tcp_bus_factory",
]

log = logging.getLogger("dimmer.daemon")

FloatArray = npt.NDArray[np.float64]

# STARTING's reads discover every device's layout (SunSpec model chains, connections): ten times the read timeout
DISCOVERY_TIMEOUT_FACTOR = 10.0


@dataclass(frozen=True)
class CycleResult:
    """What one cycle saw and did (for a status line and tests)."""

    n: int
    mode: Mode
    obs: Observation
    actions: Actions
    cycle_s: float  # wall seconds, read to last write
    step_s: float
    writes_ok: int
    writes_failed: int


class Daemon:
    """The read -> decide -> write loop for one config. `run()` until `request_stop()` (or a signal).

    Under systemd (`NOTIFY_SOCKET`), READY=1 at start, WATCHDOG=1 after every cycle that completed, STOPPING=1 at
    the stop. A watchdog interval (`WATCHDOG_USEC`) the period cannot be kept inside is an InputError here, at
    construction (and a reload that would break it is refused)."""

    def __init__(
        self,
        loaded: LoadedConfig,
        *,
        config_path: Path | None = None,
        dry_run: bool = False,
        bus_factory: BusFactory | None = None,
        speed: float = 1.0,
        metrics_address: tuple[str, int] | str | None = "config",
        on_cycle: Callable[[CycleResult], None] | None = None,
        notifier: SystemdNotifier | None = None,
        max_cycles: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_started: Callable[[Daemon], None] | None = None,
    ) -> None:
        self.config_path = config_path
        self.dry_run = dry_run
        self.speed = speed
        self.on_cycle = on_cycle
        self.max_cycles = max_cycles
        self.clock = clock  # monotonic seconds; the devices' readings are stamped with the same clock
        self.notifier = notifier or SystemdNotifier()
        watchdog_error = self._watchdog_error(loaded)
        if watchdog_error is not None:
            self.notifier.close()
            raise watchdog_error
        self._own_buses = bus_factory is None  # ours: a reload opens new connections and closes the old ones
        self._bus_factory = bus_factory or tcp_bus_factory()
        self.loaded = loaded
        self.metrics = DaemonMetrics(
            loaded.site, loaded.device_names, loaded.config.daemon.metrics_rack_domains, clock=clock, speed=speed
        )
        self.metrics.set_mode(Mode.STARTING.value)
        self.machine = ModeMachine(self._mode_changed)
        self.controller: Controller = self._make_controller(loaded)
        self.on_started = on_started
        # a building daemon: its budget from its coordinator, its report to it (building_role.py)
        self.building = BuildingRole(loaded, clock, speed) if loaded.role == "building" else None
        self.handles = build_devices(loaded, self._bus_factory, clock)
        self._publish_devices()
        self.builder = ObservationBuilder(loaded, self.handles, speed)
        self.audit = AuditLog(loaded.audit_path)
        # the utility's OpenADR VTN ([utility]): the limit in force at most its accepted events' (docs/utility.md)
        u = loaded.config.utility
        self.utility = UtilityVen(loaded, audit=self.audit) if u is not None and u.enabled else None
        self._metrics_address = metrics_address_of(loaded, metrics_address)
        self.metrics_port: int | None = None
        self.last_cap_w: FloatArray | None = None  # caps last written (or decided, in dry-run)
        self.n_cycles = 0
        self.n_overruns = 0
        self.n_writes = 0
        self.last: CycleResult | None = None
        self.cycle_s = RecentDurations()  # wall seconds of the latest cycles
        self.cycle_cpu_s = RecentDurations()  # ... and the CPU seconds this process spent in them
        self.wrote = False  # this process has written a setpoint (only then does a stop write safe caps)
        self._stop: asyncio.Event | None = None  # created in run(), on the running loop
        self._stop_requested = False
        self._write_safe_on_stop = True
        self._last_audit: dict[str, Any] | None = None  # the audit log's last record, written as it closes
        self._reload_requested = False
        self._t0_mono = clock()
        self.non_finite = NonFiniteLog()  # what the controller decided that is not a number: said once a minute
        verdict = vet_state_file(self.controller, loaded.site, loaded.state_path, loaded.config.daemon.state_max_age_s)
        self._restored = verdict.restored
        self.start_ramp: StartRamp | None = None  # set while caps rise from the safe cap after a start without state
        if verdict.restored:
            log.info("%s", verdict.why)
        elif verdict.refused:
            self._start_without_state(verdict.why, refused=True)
        else:
            # No file at all: a first start, which begins from the controller's fresh state as it always has. (Held
            # at the safe cap too, a plant running uncontrolled steps down to it and the dimmer controller's grid
            # shaping then breaks the ramp rule as it recovers: docs/daemon.md, "Start without trusted state".)
            log.info("%s: starting fresh", verdict.why)
            self.audit.write({"event": "state", "restored": False, "refused": False, "why": verdict.why})

    def _start_without_state(self, why: str, refused: bool) -> None:
        """No trusted state: the controller at the safe cap, every cap at most that at the first write and rising at
        the controller's rate. One line in the log (a warning when a state was there and refused) and the audit."""
        loaded = self.loaded
        safe = loaded.safe_cap_w
        site = loaded.campus_site  # (a building rises with every GPU of its campus: the ramp rule is the campus's)
        # the controller's cap rise rate, and no faster than half the utility's ramp limit with every GPU rising
        # together (the other half left for the load's own moves): a start must not itself be a ramp violation
        ramp_w_per_s = 0.5 * site.ramp_limit_w_per_min / 60.0 * site.rectifier_eff / max(site.n_gpus, 1)
        rise_w_per_s = min(start_without_state(self.controller, safe), ramp_w_per_s)
        rise_w = rise_w_per_s * loaded.config.daemon.period_s
        self.start_ramp = StartRamp(safe, rise_w, loaded.site.gpu.rated_w)
        ignored = ": ignored" if refused else ""
        line = f"{why}{ignored}; starting at the safe cap {safe:g} W, caps rising at most {rise_w_per_s:g} W/s a GPU"
        log.log(logging.WARNING if refused else logging.INFO, "%s", line)
        self.audit.write({"event": "state", "restored": False, "refused": refused, "why": line})

    # -- setup -------------------------------------------------------------------------------------------------------

    @staticmethod
    def _make_controller(loaded: LoadedConfig) -> Controller:
        cfg = loaded.config
        return make_controller(cfg.controller.name, loaded.site, loaded.controller_params, source=loaded.source)

    @property
    def mode(self) -> Mode:
        return self.machine.mode

    @property
    def period_wall_s(self) -> float:
        return self.loaded.config.daemon.period_s / self.speed

    @property
    def timeout_wall_s(self) -> float:
        return self.loaded.config.daemon.read_timeout_in_force_s / self.speed

    def _watchdog_error(self, loaded: LoadedConfig) -> InputError | None:
        """Why `loaded` cannot run inside the systemd watchdog (one WATCHDOG=1 a cycle), or None when it can."""
        return watchdog_error(self.notifier.watchdog_s, loaded, self.speed, DISCOVERY_TIMEOUT_FACTOR)

    def _mode_changed(self, old: Mode, new: Mode) -> None:
        log.log(logging.WARNING if new is Mode.FAILSAFE else logging.INFO, "mode %s -> %s", old.value, new.value)
        self.metrics.set_mode(new.value)
        if new is Mode.FAILSAFE:
            self.metrics.failsafe.inc()

    def request_stop(self, write_safe: bool = True, last_audit: dict[str, Any] | None = None) -> None:
        """Stop after the current cycle; write safe caps first unless `write_safe` is False (or dry-run).
        `last_audit`, if given, is the audit log's last record: written as the log closes, after the record of a
        cycle that was in flight when the stop was asked for."""
        self._stop_requested = True
        self._write_safe_on_stop = self._write_safe_on_stop and write_safe
        if last_audit is not None:
            self._last_audit = last_audit
        if self._stop is not None:
            self._stop.set()

    def request_reload(self) -> None:
        self._reload_requested = True

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    # -- the loop ------------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        if self._metrics_address is not None:
            spec = self.loaded.config.daemon
            limits = ConnectionLimits(spec.metrics_max_connections, spec.metrics_idle_timeout_s)
            # ListenError (an InputError: exit status 2) when it cannot listen: "cannot listen on host:port: why"
            self.metrics_port = self.metrics.serve(self._metrics_address, limits)
            log.info("metrics on http://%s:%d/metrics", self._metrics_address[0], self.metrics_port)
        if self.building is not None:
            # ListenError (exit status 2) when it cannot listen: "cannot listen on host:port: why"
            port = await self.building.start()
            b = self.building
            log.info("building %s: dimmer-building-v1 served on %s:%d", b.part.name, b.host, port)
        if self.utility is not None:
            await self.utility.start()
        if self.on_started is not None:
            self.on_started(self)
        self._t0_mono = self.clock()
        log.info(
            "started: %d devices, controller %s, period %g s%s%s%s",
            len(self.handles),
            self.controller.name,
            self.loaded.config.daemon.period_s,
            " (dry run: nothing is written)" if self.dry_run else "",
            f", clock x{self.speed:g}" if self.speed != 1.0 else "",
            f", systemd watchdog {self.notifier.watchdog_s:g} s" if self.notifier.watchdog_s is not None else "",
        )
        for warning in safe_cap_load_warnings(self.loaded):
            log.warning("safe cap: %s", warning)
        self.notifier.notify("READY=1\nSTATUS=running")
        freeze_startup_heap()
        next_t = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._reload_requested:
                    self._reload_requested = False
                    await self.reload()
                started = time.monotonic()
                await self.cycle()
                self.notifier.watchdog()  # only here: a cycle that raised or hangs notifies nothing
                if self.max_cycles is not None and self.n_cycles >= self.max_cycles:
                    break
                period = self.period_wall_s
                next_t += period
                now = time.monotonic()
                if now - started > period:
                    self.n_overruns += 1
                    self.metrics.overruns.inc()
                if next_t < now:  # an overrun: start the next cycle now, do not try to catch up
                    next_t = now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=max(next_t - time.monotonic(), 0.0))
        finally:
            await self.shutdown()

    async def _read(self, h: DeviceHandle) -> ReadingLike | None:
        # the first read finds every device's layout (SunSpec discovery, connections): give it ten periods' time
        timeout = self.timeout_wall_s * (DISCOVERY_TIMEOUT_FACTOR if self.mode is Mode.STARTING else 1.0)
        return await read_device(h, timeout, self.speed, self.loaded.config.safety.fail_after, self.metrics)

    def _publish_devices(self) -> None:
        self.metrics.set_devices([device_status(h) for h in self.handles], self.loaded.config.safety.stale_s)

    async def cycle(self) -> CycleResult | None:
        """One read -> decide -> write cycle; None while STARTING waits for the devices' first readings."""
        t_start, cpu_start = self.clock(), time.process_time()
        fresh = await asyncio.gather(*(self._read(h) for h in self.handles))
        site, safety = self.loaded.site, self.loaded.config.safety
        for h, r in zip(self.handles, fresh, strict=True):
            if r is not None:
                note_reading(h, r, safety, self.speed)
        judge_meters(self.handles, site, self.loaded.limit_w, safety, self.speed)
        self._publish_devices()
        now = self.clock()
        snap = Snapshot(
            t_mono_s=now,
            t_s=(now - self._t0_mono) * self.speed,
            readings=tuple(h.last for h in self.handles),
            fresh_t_s=tuple(h.fresh_t_s for h in self.handles),
        )
        safe_cap = self.loaded.safe_cap_w
        if self.mode is Mode.STARTING:
            # Do not decide on a half-read site (a device not read yet looks like a rack at full power, and the
            # controller would cut everything): wait for every device, at most stale_s, writing nothing meanwhile.
            missing = [h.name for h in self.handles if not has_data(h)]
            if missing:
                if snap.t_s < safety.stale_s:
                    self.audit.write({"event": "starting", "t_s": round(snap.t_s, 3), "waiting_for": missing})
                    return None
                log.warning("starting without readings from %s after %g s", ", ".join(missing), safety.stale_s)
        obs = self.builder.build(snap)
        if self.utility is not None:
            obs = self.utility.observe(obs)
        if self.building is not None:
            obs = self.building.observe(obs, self.builder.last_pcc_limit_w)

        t_step = time.perf_counter()
        act, error = decide(self.controller, obs, site, safe_cap, self.last_cap_w)
        if self.building is not None and error is None:
            self.building.report(self.controller, obs, act)
        self.machine.to(Mode.RUNNING if error is None else Mode.FAILSAFE)
        step_s = time.perf_counter() - t_step
        period_s = self.loaded.config.daemon.period_s
        act = safety_net(
            site,
            act,
            obs,
            safe_cap,
            safety,
            period_s,
            self.last_cap_w,
            explain=error is None,
            non_finite=self.non_finite,
            controller=self.controller.name,
            now_s=time.monotonic(),  # wall time: the log's rate limit is for whoever reads it
        )
        ramp = self.start_ramp
        if ramp is not None:
            act = ramp.apply(act)
            hold_caps_at_most(self.controller, ramp.ceiling_w)
            if error is None:  # a period on fail-safe caps is no step up: the ceiling waits with them
                ramp.advance()
            if not ramp.active:
                log.info("start without trusted state: caps free of the start ramp (rated reached)")
                self.start_ramp = None
        head = f"controller {self.controller.name}" if error is None else "fail-safe"
        writes, results = await self._write(act, head) if not self.dry_run else ([], [])
        self.last_cap_w = act.rack_cap_w
        ok = sum(1 for r in results if r is None)
        self.wrote = self.wrote or ok > 0
        cycle_s = self.clock() - t_start
        self.n_cycles += 1
        self.n_writes += ok
        self.cycle_s.append(cycle_s)
        self.cycle_cpu_s.append(time.process_time() - cpu_start)  # (this process's own work, whatever else runs)
        self.metrics.publish(obs, act, cycle_s, step_s)
        self.audit.write(
            {
                "cycle": self.n_cycles,
                "t_s": round(obs.t_s, 3),
                "mode": self.mode.value,
                "dry_run": self.dry_run,
                "cycle_s": round(cycle_s, 4),
                **({"error": error} if error else {}),
                "reasons": reasons_json(act.reasons),
                "decided": decided_json(act),
                "writes": audit_entries(writes, results),
                "flagged": [h.name for h in self.handles if h.flagged],
                "stale": [h.name for h in self.handles if h.stuck],
                "offline": [h.name for h in self.handles if h.offline],
            }
        )
        every = self.loaded.config.daemon.state_every
        if self.n_cycles % every == 0:
            self._save_state()
        res = CycleResult(self.n_cycles, self.mode, obs, act, cycle_s, step_s, ok, len(results) - ok)
        self.last = res
        if self.on_cycle is not None:
            self.on_cycle(res)
        return res

    async def _write(self, act: Actions, head: str) -> tuple[list[Write], list[str | None]]:
        """Every write `act` asks for, run concurrently; each outcome (None: it went through, else the error)."""
        writes = plan_writes(self.handles, act, head, self.loaded.site, self.loaded.config.safety)
        fail_after = self.loaded.config.safety.fail_after
        results = await asyncio.gather(
            *(do_write(w, self.timeout_wall_s, self.speed, fail_after, self.metrics) for w in writes)
        )
        return writes, list(results)

    # -- state, reload, shutdown ---------------------------------------------------------------------------------------

    def _save_state(self) -> None:
        path = self.loaded.state_path
        if path is not None:
            save_from(self.controller, self.loaded.site, path)

    async def reload(self) -> bool:
        """Re-read the config file; apply it if valid, keep the old one (and say why) if not."""
        if self.config_path is None:
            log.warning("SIGHUP: no config file to reload")
            return False
        try:
            new = load_config(self.config_path)
            watchdog_error = self._watchdog_error(new)
            if watchdog_error is not None:
                raise watchdog_error
            if (new.role, new.part and new.part.name) != (self.loaded.role, self.loaded.part and self.loaded.part.name):
                raise InputError(str(self.config_path), "building", "the same role and building as the running one")
        except InputError as exc:
            log.error("SIGHUP: new config rejected, keeping the running one: %s", exc)
            self.audit.write({"event": "reload", "ok": False, "error": str(exc)})
            return False
        old = self.loaded
        try:
            ctrl = self._make_controller(new)
            factory = tcp_bus_factory() if self._own_buses else self._bus_factory
            handles = build_devices(new, factory, self.clock)
        except DimmerError as exc:
            log.error("SIGHUP: new config could not be applied, keeping the running one: %s", exc)
            return False
        # carry the controller's filters over when the new controller can take them (same class and site)
        doc = controller_state(self.controller, old.site)
        carried = False
        if doc is not None and type(ctrl) is type(self.controller):
            with contextlib.suppress(ValueError, TypeError, KeyError):
                restore_state(ctrl, new.site, doc, max_age_s=math.inf)
                carried = True
        if self._own_buses:
            await close_buses(self.handles)
            self._bus_factory = factory
        self.loaded, self.controller, self.handles = new, ctrl, handles
        if doc is not None and not carried:  # the filters were lost: as a start without state, from the safe cap
            self._start_without_state("SIGHUP: the controller's state does not fit the new config", refused=True)
        self.builder = ObservationBuilder(new, handles, self.speed)
        self.last_cap_w = None if new.site.n_racks != old.site.n_racks else self.last_cap_w
        if new.config.daemon.metrics_address != old.config.daemon.metrics_address:
            log.warning("SIGHUP: the metrics address changes only on a restart")
        if self.utility is not None:
            self.utility.rebind(new)
        if new.config.utility != old.config.utility:
            log.warning("SIGHUP: [utility] changes only on a restart")
        self.metrics.rebind(new.site, new.device_names, new.config.daemon.metrics_rack_domains)
        self._publish_devices()
        self.audit.path = new.audit_path
        self.audit.reopen()
        log.info("SIGHUP: config reloaded from %s", self.config_path)
        for warning in safe_cap_load_warnings(new):
            log.warning("safe cap: %s", warning)
        self.audit.write({"event": "reload", "ok": True})
        return True

    async def shutdown(self) -> None:
        """STOPPING: safe caps written once (unless dry-run), the state saved, devices and endpoints closed."""
        if self.mode is Mode.STOPPING:
            return
        self.machine.to(Mode.STOPPING)
        self.notifier.notify("STOPPING=1")
        # safe caps, if this process has written anything: a daemon stopped before its first write leaves the
        # devices as it found them (under their own leases)
        if self._write_safe_on_stop and not self.dry_run and self.wrote:
            act = safe_actions(self.loaded.site, self.loaded.safe_cap_w, self.last_cap_w)
            act = dataclasses.replace(act, reasons=(Reason("safety", "daemon stopping: safe caps, battery idle"),))
            writes, results = await self._write(act, "stop")
            n_ok = sum(r is None for r in results)
            log.info("stopping: safe caps written to %d of %d devices", n_ok, len(writes))
            self.audit.write({"event": "stop", "mode": Mode.STOPPING.value, "writes": audit_entries(writes, results)})
        self._save_state()
        await close_buses(self.handles)
        if self.utility is not None:
            await self.utility.stop()
        if self.building is not None:
            await self.building.stop()
        if self._last_audit is not None:
            self.audit.write(self._last_audit)
        self.audit.close()
        self.metrics.close()
        self.notifier.close()
        log.info("stopped after %d cycles (%d overruns)", self.n_cycles, self.n_overruns)


async def run_daemon(config_path: Path, *, dry_run: bool = False, install_signals: bool = True, **kwargs: Any) -> Any:
    """Load `config_path` and run the daemon until stopped (SIGTERM/SIGINT); returns the stopped daemon: a
    `Daemon`, or a `CoordinatorDaemon` for a config whose devices are buildings (docs/daemon.md, "The hierarchy")."""
    loaded = load_config(config_path)
    if loaded.role == "coordinator":
        from dimmer.daemon.coordinator_daemon import CoordinatorDaemon

        coordinator = CoordinatorDaemon(loaded, dry_run=dry_run)
        if install_signals:
            coordinator.install_signal_handlers()
        await coordinator.run()
        return coordinator
    daemon = Daemon(loaded, config_path=config_path, dry_run=dry_run, **kwargs)
    if install_signals:
        daemon.install_signal_handlers()
    await daemon.run()
    return daemon
