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

Signals: SIGTERM / SIGINT stop the loop after writing safe caps; SIGHUP reloads the config (the old one stays if
the new one is invalid) and reopens the audit log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import math
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from dimmer.control import Controller, make_controller
from dimmer.daemon.config import LoadedConfig, load_config, parse_address, safe_cap_load_warnings
from dimmer.daemon.metrics import AuditLog, DaemonMetrics, RecentDurations, reasons_json, rle, write_reasons
from dimmer.daemon.state import controller_state, load_into, restore_state, save_from
from dimmer.errors import DimmerError, InputError
from dimmer.observation import Actions, Observation, Reason
from dimmer.site import SiteModel

log = logging.getLogger("dimmer.daemon")

FloatArray = npt.NDArray[np.float64]


# -- modes -------------------------------------------------------------------------------------------------------------


class Mode(enum.Enum):
    STARTING = "starting"  # waiting for every device's first reading (at most stale_s): nothing written yet
    RUNNING = "running"  # every period: read, decide, write what the controller decided (within the safety net)
    FAILSAFE = "failsafe"  # the controller failed this period: safe caps written, reads go on, retried next period
    STOPPING = "stopping"  # shutting down: safe caps written once, state saved, devices closed; no way back


ALLOWED: dict[Mode, frozenset[Mode]] = {
    Mode.STARTING: frozenset({Mode.RUNNING, Mode.FAILSAFE, Mode.STOPPING}),
    Mode.RUNNING: frozenset({Mode.FAILSAFE, Mode.STOPPING}),
    Mode.FAILSAFE: frozenset({Mode.RUNNING, Mode.STOPPING}),
    Mode.STOPPING: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A mode change the state machine does not allow (a bug, never a runtime condition)."""


class ModeMachine:
    def __init__(self, on_change: Callable[[Mode, Mode], None] | None = None) -> None:
        self.mode = Mode.STARTING
        self._on_change = on_change

    def to(self, new: Mode) -> None:
        """Move to `new`; staying in the same mode is a no-op; a transition not in ALLOWED raises."""
        if new is self.mode:
            return
        if new not in ALLOWED[self.mode]:
            raise IllegalTransition(f"{self.mode.value} -> {new.value}")
        old, self.mode = self.mode, new
        if self._on_change is not None:
            self._on_change(old, new)


# -- devices -----------------------------------------------------------------------------------------------------------


class ReadingLike(Protocol):
    values: Mapping[str, Any]
    t_s: float
    ok: bool
    error: str | None


@dataclass
class DeviceHandle:
    """One configured device with its bookkeeping: the last good reading, consecutive failures, the flag."""

    name: str
    kind: str
    device: Any  # SunSpecMeter | SunSpecBattery | RackDevice | SiteDevice
    read_only: bool
    domain: int = -1  # meters: the domain metered
    racks: slice = field(default_factory=lambda: slice(0, 0))  # racks devices: the racks served
    last: ReadingLike | None = None  # the last good reading
    fresh_t_s: float = math.nan  # when its values were last known new (update_count moved), monotonic
    last_count: float = math.nan  # the device's update_count at the last good read (NaN: it has none)
    stuck: bool = False  # answering, but its update_count (a meter: its value) has not moved for too long
    value_w: float = math.nan  # meters: the last power read, and when it last changed (monotonic)
    value_t_s: float = math.nan
    failures: dict[str, int] = field(default_factory=lambda: {"read": 0, "write": 0})  # in a row, by operation
    flagged: bool = False
    offline: bool = False  # a battery answering, but reporting itself off line (as of its last good reading)


BusFactory = Callable[[Any], Any]  # DeviceSpec -> RegisterBus


def tcp_bus_factory() -> BusFactory:
    """One ModbusTcpBus per (host, port): every device at an endpoint shares its connection."""
    from dimmer.daemon.bus import ModbusTcpBus

    buses: dict[tuple[str, int], Any] = {}

    def make(spec: Any) -> Any:
        key = (spec.host, spec.port)
        if key not in buses:
            buses[key] = ModbusTcpBus(
                spec.host, spec.port, timeout_s=spec.timeout_s, retries=spec.retries, backoff_s=spec.backoff_s
            )
        return buses[key]

    return make


def build_devices(
    loaded: LoadedConfig, bus_factory: BusFactory, clock: Callable[[], float] = time.monotonic
) -> list[DeviceHandle]:
    from dimmer.daemon.devices import RackDevice, RackLimits, SiteDevice, SunSpecBattery, SunSpecMeter

    site = loaded.site
    gpu = site.gpu
    out: list[DeviceHandle] = []
    for name, spec in zip(loaded.device_names, loaded.config.devices, strict=True):
        bus = bus_factory(spec)
        dev: Any
        handle = DeviceHandle(name=name, kind=spec.kind, device=None, read_only=spec.read_only)
        if spec.kind == "meter":
            dev = SunSpecMeter(bus, spec.unit, base=spec.base, name=name, clock=clock)
            handle.domain = site.domain_index(spec.domain)
        elif spec.kind == "battery":
            dev = SunSpecBattery(
                bus,
                spec.unit,
                base=spec.base,
                name=name,
                read_only=spec.read_only,
                max_power_w=site.bess.power_w,
                clock=clock,
            )
        elif spec.kind == "racks":
            first, n = int(spec.first_rack or 0), int(spec.n_racks or 0)
            recharge_max_w = site.rack_storage.bbu_power_w[first : first + n].copy()
            limits = RackLimits(gpu.min_cap_w, gpu.rated_w, recharge_max_w, loaded.config.safety.lease_s)
            dev = RackDevice(bus, spec.unit, first, n, name=name, read_only=spec.read_only, limits=limits, clock=clock)
            handle.racks = slice(first, first + n)
        else:
            dev = SiteDevice(bus, spec.unit, site.n_domains, site.n_jobs, name=name, clock=clock)
        handle.read_only = spec.read_only or spec.kind in ("meter", "site")  # meters and the site device: read only
        handle.device = dev
        out.append(handle)
    return out


# -- snapshot -> observation -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """The last good reading of every device, frozen at one instant (`t_mono_s`, the daemon's monotonic clock)."""

    t_mono_s: float
    t_s: float  # the controller's clock (monotonic since start, times the clock speed)
    readings: tuple[ReadingLike | None, ...]  # by device, in config order; None: never read
    fresh_t_s: tuple[float, ...]  # by device: when its values were last new (a stuck update_count ages them)


def _arr(values: Mapping[str, Any], key: str, n: int) -> FloatArray:
    v = values.get(key)
    if v is None:
        return np.full(n, np.nan)
    a = np.asarray(v, dtype=np.float64).reshape(-1)
    return a if a.size == n else np.full(n, np.nan)


def _num(values: Mapping[str, Any], key: str) -> float:
    v = values.get(key)
    try:
        return float(v) if v is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


class ObservationBuilder:
    """Turns a snapshot into an Observation: values with their ages; NaN (never zero) where nothing was measured."""

    def __init__(self, loaded: LoadedConfig, handles: list[DeviceHandle], speed: float) -> None:
        self.site = loaded.site
        self.limit_w = loaded.limit_w
        self.stale_s = loaded.config.safety.stale_s
        self.handles = handles
        self.speed = speed
        self.last_pcc_limit_w = math.nan  # a limit is held at its last known value while the site device is out
        self.last_domain_limit_w = np.full(self.site.n_domains, np.nan)
        self.last_ramp_w_per_min = math.nan
        self.last_job_running = np.ones(self.site.n_jobs, dtype=bool)

    def build(self, snap: Snapshot) -> Observation:
        site, n_r, n_d = self.site, self.site.n_racks, self.site.n_domains
        rack_power = np.full(n_r, np.nan)
        rack_load = np.full(n_r, np.nan)
        rack_age = np.full(n_r, np.inf)
        rack_cap = np.full(n_r, np.nan)
        rack_floor = np.full(n_r, np.nan)
        rack_soc = np.full(n_r, np.nan)
        rack_energized = np.ones(n_r, dtype=bool)
        domain_power = np.full(n_d, np.nan)
        domain_age = np.full(n_d, np.inf)
        thermal = np.full(n_d, np.nan)
        pcc_w, pcc_age = math.nan, math.inf
        freq = math.nan
        soc, bess_w, online = math.nan, math.nan, False
        have_pcc_meter = False
        for h, r, t_fresh in zip(self.handles, snap.readings, snap.fresh_t_s, strict=True):
            if r is None:
                continue
            age = max(snap.t_mono_s - t_fresh, 0.0) * self.speed
            v = r.values
            if h.kind == "racks":
                sl, n = h.racks, h.racks.stop - h.racks.start
                rack_power[sl] = _arr(v, "power_w", n)
                rack_load[sl] = _arr(v, "load_w", n)
                rack_age[sl] = age
                rack_cap[sl] = _arr(v, "cap_w", n)
                rack_floor[sl] = _arr(v, "floor_w", n)
                rack_soc[sl] = _arr(v, "bbu_soc_frac", n)
                en = _arr(v, "energized", n)
                rack_energized[sl] = ~(en < 0.5)  # unknown counts as energized
            elif h.kind == "site":
                dp = _arr(v, "domain_power_w", n_d)
                fresh_d = np.isfinite(dp) & ~np.isfinite(domain_power)  # meters (below) take precedence
                domain_power = np.where(fresh_d, dp, domain_power)
                domain_age = np.where(fresh_d, age, domain_age)
                lim = _arr(v, "domain_limit_w", n_d)
                self.last_domain_limit_w = np.where(np.isfinite(lim), lim, self.last_domain_limit_w)
                if age <= self.stale_s:
                    thermal = _arr(v, "domain_thermal_frac", n_d)
                    freq = _num(v, "grid_freq_hz")
                pl = _num(v, "pcc_limit_w")
                if math.isfinite(pl):
                    self.last_pcc_limit_w = pl
                rl = _num(v, "ramp_limit_w_per_min")
                if math.isfinite(rl):
                    self.last_ramp_w_per_min = rl
                jr = _arr(v, "job_running", site.n_jobs)
                self.last_job_running = np.where(np.isfinite(jr), jr > 0.5, self.last_job_running)
            elif h.kind == "meter":
                p = _num(v, "power_w")
                domain_power[h.domain] = p
                domain_age[h.domain] = age if math.isfinite(p) else math.inf
                if h.domain == 0:
                    pcc_w, pcc_age, have_pcc_meter = p, (age if math.isfinite(p) else math.inf), True
            elif h.kind == "battery" and age <= self.stale_s:
                soc = _num(v, "soc_frac")
                bess_w = _num(v, "power_w")
                on = _num(v, "online")
                online = bool(on > 0.5) if math.isfinite(on) else math.isfinite(soc)
        if not have_pcc_meter and math.isfinite(domain_power[0]):
            pcc_w, pcc_age = float(domain_power[0]), float(domain_age[0])
        limit = np.fmin(self.limit_w, self.last_domain_limit_w)
        pcc_limit = float(np.fmin(self.limit_w[0], self.last_pcc_limit_w))
        ramp = float(np.fmin(site.ramp_limit_w_per_min, self.last_ramp_w_per_min))
        return Observation(
            t_s=snap.t_s,
            rack_power_w=rack_power,
            rack_load_w=rack_load,
            rack_age_s=rack_age,
            rack_cap_w=rack_cap,
            rack_floor_w=rack_floor,
            rack_bbu_soc_frac=rack_soc,
            rack_energized=rack_energized,
            domain_power_w=domain_power,
            domain_age_s=domain_age,
            domain_limit_w=limit,
            domain_thermal_frac=thermal,
            pcc_power_w=pcc_w,
            pcc_age_s=pcc_age,
            pcc_limit_w=pcc_limit,
            ramp_limit_w_per_min=ramp,
            grid_freq_hz=freq,
            bess_soc_frac=soc if online else math.nan,
            bess_power_w=bess_w,
            bess_online=online,
            job_running=self.last_job_running.copy(),
        )


# -- the safety net ----------------------------------------------------------------------------------------------------


def safe_actions(site: SiteModel, safe_cap_w: float, last_cap_w: FloatArray | None) -> Actions:
    """What every fail-safe writes: caps at the safe level (never above a lower cap already written), no floors,
    the battery idle, BBUs as backup only."""
    cap = np.full(site.n_racks, safe_cap_w)
    if last_cap_w is not None:
        cap = np.fmin(cap, last_cap_w)
    return Actions(
        rack_cap_w=site.gpu.clamp_cap_w(cap),
        rack_floor_w=np.zeros(site.n_racks),
        bess_setpoint_w=0.0,
        rack_bbu_threshold_w=np.full(site.n_racks, np.inf),
        # within the BBU's rating, as every write must be (RackLimits)
        rack_bbu_recharge_w=np.minimum(site.rack_storage.bbu_recharge_w, site.rack_storage.bbu_power_w),
        job_suspend=np.zeros(site.n_jobs, dtype=bool),
    )


def enforce_safety(
    site: SiteModel,
    act: Actions,
    obs: Observation,
    safe_cap_w: float,
    stale_s: float,
    last_cap_w: FloatArray | None = None,
    hold_after_s: float = math.inf,
) -> tuple[Actions, int]:
    """Whatever the controller: caps in the GPU's range, stale racks (all of them if the PCC is stale) at or below
    the safe cap, floors at or below caps, BBU thresholds >= 0, the battery within its rating. A rack whose reading
    is older than `hold_after_s` (not stale yet, but no longer arriving) keeps at most the cap last written
    (`last_cap_w`): between a reading stopping and the stale limit, no cap rises on it. Returns the actions and the
    racks held."""
    gpu = site.gpu
    cap = np.asarray(act.rack_cap_w, dtype=np.float64)
    cap = np.where(np.isfinite(cap), cap, safe_cap_w)
    if last_cap_w is not None:
        late = ~np.isfinite(obs.rack_power_w) | (obs.rack_age_s > hold_after_s)
        if not (math.isfinite(obs.pcc_power_w) and obs.pcc_age_s <= hold_after_s):
            late = np.ones(site.n_racks, dtype=bool)
        cap = np.where(late, np.minimum(cap, last_cap_w), cap)
    stale = ~(np.isfinite(obs.rack_power_w) & (obs.rack_age_s <= stale_s))
    if not (math.isfinite(obs.pcc_power_w) and obs.pcc_age_s <= stale_s):
        stale = np.ones(site.n_racks, dtype=bool)
    held = stale & (cap > safe_cap_w)
    cap = gpu.clamp_cap_w(np.where(stale, np.minimum(cap, safe_cap_w), cap))
    floor = np.asarray(act.rack_floor_w, dtype=np.float64)
    floor = np.minimum(gpu.clamp_floor_w(np.nan_to_num(floor, nan=0.0)), cap)
    floor = np.where(stale, 0.0, floor)
    bess = act.bess_setpoint_w if math.isfinite(act.bess_setpoint_w) else 0.0
    bess = float(np.clip(bess, -site.bess.power_w, site.bess.power_w))
    thr = np.asarray(act.rack_bbu_threshold_w, dtype=np.float64)
    thr = np.maximum(np.where(np.isnan(thr), np.inf, thr), 0.0)  # below 0 W means the same as 0 W: always shave
    rech = np.clip(np.nan_to_num(act.rack_bbu_recharge_w, nan=0.0), 0.0, site.rack_storage.bbu_power_w)
    out = Actions(
        rack_cap_w=cap,
        rack_floor_w=floor,
        bess_setpoint_w=bess,
        rack_bbu_threshold_w=thr,
        rack_bbu_recharge_w=rech,
        job_suspend=act.job_suspend,
        gpu_ramp_up_w_per_s=act.gpu_ramp_up_w_per_s,
        gpu_ramp_down_w_per_s=act.gpu_ramp_down_w_per_s,
        planned_domain_w=act.planned_domain_w,
        reasons=act.reasons,
    )
    return out, int(held.sum())


# -- systemd -----------------------------------------------------------------------------------------------------------


class SystemdNotifier:
    """sd_notify without libsystemd: datagrams to $NOTIFY_SOCKET ("@..." is the abstract namespace). No-op if unset."""

    def __init__(self, address: str | None = None) -> None:
        addr = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self.address: str | None = None
        self._sock: socket.socket | None = None
        if addr:
            self.address = "\0" + addr[1:] if addr.startswith("@") else addr
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    def notify(self, message: str) -> bool:
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto(message.encode(), self.address)
        except OSError as exc:
            log.debug("sd_notify %s failed: %s", message, exc)
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# -- the daemon --------------------------------------------------------------------------------------------------------


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


@dataclass
class _Write:
    handle: DeviceHandle
    what: dict[str, Any]
    run: Callable[[], Any]


class Daemon:
    """The read -> decide -> write loop for one config. `run()` until `request_stop()` (or a signal)."""

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
    ) -> None:
        self.config_path = config_path
        self.dry_run = dry_run
        self.speed = speed
        self.on_cycle = on_cycle
        self.max_cycles = max_cycles
        self.clock = clock  # monotonic seconds; the devices' readings are stamped with the same clock
        self._own_buses = bus_factory is None  # ours: a reload opens new connections and closes the old ones
        self._bus_factory = bus_factory or tcp_bus_factory()
        self.notifier = notifier or SystemdNotifier()
        self.loaded = loaded
        self.metrics = DaemonMetrics(loaded.site, loaded.device_names, loaded.config.daemon.metrics_rack_domains)
        self.metrics.set_mode(Mode.STARTING.value)
        self.machine = ModeMachine(self._mode_changed)
        self.controller: Controller = self._make_controller(loaded)
        self.handles = build_devices(loaded, self._bus_factory, clock)
        self.builder = ObservationBuilder(loaded, self.handles, speed)
        self.audit = AuditLog(loaded.audit_path)
        if metrics_address == "config":
            text = loaded.config.daemon.metrics_address
            self._metrics_address: tuple[str, int] | None = parse_address(text) if text else None
        else:
            self._metrics_address = metrics_address if isinstance(metrics_address, tuple) else None
        self.metrics_port: int | None = None
        self.last_cap_w: FloatArray | None = None  # caps last written (or decided, in dry-run)
        self.n_cycles = 0
        self.n_overruns = 0
        self.n_writes = 0
        self.last: CycleResult | None = None
        self.cycle_s = RecentDurations()  # wall seconds of the latest cycles
        self.wrote = False  # this process has written a setpoint (only then does a stop write safe caps)
        self._stop: asyncio.Event | None = None  # created in run(), on the running loop
        self._stop_requested = False
        self._write_safe_on_stop = True
        self._reload_requested = False
        self._t0_mono = clock()
        self._restored = False
        state_path = loaded.state_path
        if state_path is not None:
            self._restored = load_into(self.controller, loaded.site, state_path, loaded.config.daemon.state_max_age_s)

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
        t = self.loaded.config.daemon.read_timeout_s
        return (t if t is not None else 0.5 * self.loaded.config.daemon.period_s) / self.speed

    def _mode_changed(self, old: Mode, new: Mode) -> None:
        log.log(logging.WARNING if new is Mode.FAILSAFE else logging.INFO, "mode %s -> %s", old.value, new.value)
        self.metrics.set_mode(new.value)
        if new is Mode.FAILSAFE:
            self.metrics.failsafe.inc()

    def request_stop(self, write_safe: bool = True) -> None:
        """Stop after the current cycle; write safe caps first unless `write_safe` is False (or dry-run)."""
        self._stop_requested = True
        self._write_safe_on_stop = self._write_safe_on_stop and write_safe
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
            try:
                self.metrics_port = self.metrics.serve(self._metrics_address)
                log.info("metrics on http://%s:%d/metrics", self._metrics_address[0], self.metrics_port)
            except OSError as exc:
                raise DimmerError(f"metrics endpoint {self._metrics_address}: {exc}") from None
        self._t0_mono = self.clock()
        log.info(
            "started: %d devices, controller %s, period %g s%s%s",
            len(self.handles),
            self.controller.name,
            self.loaded.config.daemon.period_s,
            " (dry run: nothing is written)" if self.dry_run else "",
            f", clock x{self.speed:g}" if self.speed != 1.0 else "",
        )
        for warning in safe_cap_load_warnings(self.loaded):
            log.warning("safe cap: %s", warning)
        self.notifier.notify("READY=1\nSTATUS=running")
        next_t = time.monotonic()
        try:
            while not self._stop.is_set():
                if self._reload_requested:
                    self._reload_requested = False
                    await self.reload()
                started = time.monotonic()
                await self.cycle()
                self.notifier.notify("WATCHDOG=1")
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
        timeout = self.timeout_wall_s * (10.0 if self.mode is Mode.STARTING else 1.0)
        try:
            r: ReadingLike = await asyncio.wait_for(h.device.read(), timeout=timeout)
        except TimeoutError:
            self._failed(h, "read", f"no answer within {timeout * self.speed:g} s")
            return None
        except Exception as exc:  # read() should never raise; a bug in a device must not stop the loop
            self._failed(h, "read", f"{type(exc).__name__}: {exc}")
            return None
        if not r.ok:
            self._failed(h, "read", r.error or "read failed")
            return None
        self._succeeded(h, "read")
        return r

    def _note_reading(self, h: DeviceHandle, r: ReadingLike) -> None:
        """Keep `r` as the device's last good reading. A device with an update counter (dimmer-rack-v1,
        dimmer-site-v1) whose counter has not moved is answering with old values: they age from the last move."""
        h.last = r
        if h.kind == "meter":
            self._note_meter(h, r)
            return
        if h.kind == "battery":
            self._note_battery(h, r)
        count = _num(r.values, "update_count")
        if not math.isfinite(count) or count != h.last_count or not math.isfinite(h.fresh_t_s):
            h.fresh_t_s = r.t_s
            if h.stuck:
                log.info("device %s: updating again", h.name)
            h.stuck = False
        elif not h.stuck and (r.t_s - h.fresh_t_s) * self.speed > self.loaded.config.safety.stale_s:
            h.stuck = True
            log.warning("device %s: update_count stuck at %.0f: its readings are stale", h.name, count)
        h.last_count = count

    def _note_meter(self, h: DeviceHandle, r: ReadingLike) -> None:
        """A SunSpec meter has no update counter: a reading that has not changed by one count for longer than
        frozen_meter_s is a frozen meter (a campus load moves every iteration), and its value ages from its last
        change."""
        value = _num(r.values, "power_w")
        if not math.isfinite(h.value_t_s) or value != h.value_w:
            h.value_w, h.value_t_s = value, r.t_s
        frozen_s = (r.t_s - h.value_t_s) * self.speed
        if frozen_s > self.loaded.config.safety.frozen_meter_s:
            if not h.stuck:
                log.warning("device %s: reading frozen at %.0f W for %.1f s: treated as stale", h.name, value, frozen_s)
            h.stuck = True
            h.fresh_t_s = h.value_t_s
        else:
            if h.stuck:
                log.info("device %s: updating again", h.name)
            h.stuck = False
            h.fresh_t_s = r.t_s

    def _note_battery(self, h: DeviceHandle, r: ReadingLike) -> None:
        """A battery that answers but reports itself off line (802 State, 701 ConnSt) is not planned on: say so
        when it goes, and when it comes back."""
        on = _num(r.values, "online")
        if math.isnan(on):
            return
        offline = on < 0.5
        if offline and not h.offline:
            log.warning("device %s: reports itself off line: the controller no longer plans on it", h.name)
        elif h.offline and not offline:
            log.info("device %s: on line again: planned on again", h.name)
        h.offline = offline

    def _failed(self, h: DeviceHandle, op: str, error: str) -> None:
        h.failures[op] += 1
        self.metrics.comm_errors.labels(device=h.name, op=op).inc()
        if h.failures[op] >= self.loaded.config.safety.fail_after and not h.flagged:
            h.flagged = True
            self.metrics.device_up.labels(device=h.name).set(0)
            log.warning("device %s flagged: %d failed %ss in a row (last: %s)", h.name, h.failures[op], op, error)
        else:
            log.debug("device %s: %s failed: %s", h.name, op, error)

    def _succeeded(self, h: DeviceHandle, op: str) -> None:
        h.failures[op] = 0
        if h.flagged and max(h.failures.values()) < self.loaded.config.safety.fail_after:
            log.info("device %s answers again", h.name)
            self.metrics.device_up.labels(device=h.name).set(1)
            h.flagged = False

    def _has_data(self, h: DeviceHandle) -> bool:
        """The device has answered with published values (an update counter still at 0 has published nothing)."""
        if h.last is None:
            return False
        count = _num(h.last.values, "update_count")
        return not math.isfinite(count) or count > 0

    async def cycle(self) -> CycleResult | None:
        """One read -> decide -> write cycle; None while STARTING waits for the devices' first readings."""
        t_start = self.clock()
        fresh = await asyncio.gather(*(self._read(h) for h in self.handles))
        for h, r in zip(self.handles, fresh, strict=True):
            if r is not None:
                self._note_reading(h, r)
        now = self.clock()
        snap = Snapshot(
            t_mono_s=now,
            t_s=(now - self._t0_mono) * self.speed,
            readings=tuple(h.last for h in self.handles),
            fresh_t_s=tuple(h.fresh_t_s for h in self.handles),
        )
        site, safety = self.loaded.site, self.loaded.config.safety
        safe_cap = self.loaded.safe_cap_w
        if self.mode is Mode.STARTING:
            # Do not decide on a half-read site (a device not read yet looks like a rack at full power, and the
            # controller would cut everything): wait for every device, at most stale_s, writing nothing meanwhile.
            missing = [h.name for h in self.handles if not self._has_data(h)]
            if missing:
                if snap.t_s < safety.stale_s:
                    self.audit.write({"event": "starting", "t_s": round(snap.t_s, 3), "waiting_for": missing})
                    return None
                log.warning("starting without readings from %s after %g s", ", ".join(missing), safety.stale_s)
        obs = self.builder.build(snap)

        error: str | None = None
        t_step = time.perf_counter()
        try:
            act = self.controller.step(obs)
            self.machine.to(Mode.RUNNING)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error("controller %s failed, fail-safe caps this period: %s", self.controller.name, error)
            log.debug("%s", traceback.format_exc())
            self.machine.to(Mode.FAILSAFE)
            act = safe_actions(site, safe_cap, self.last_cap_w)
            act = dataclasses.replace(act, reasons=(Reason("safety", f"controller failed: {error}"),))
        step_s = time.perf_counter() - t_step
        hold_after_s = safety.hold_after_periods * self.loaded.config.daemon.period_s
        act, held = enforce_safety(site, act, obs, safe_cap, safety.stale_s, self.last_cap_w, hold_after_s)
        if held and error is None:
            reason = Reason("safety", f"stale telemetry: {held} rack cap(s) held at the safe level")
            act = dataclasses.replace(act, reasons=(*act.reasons, reason))
        head = f"controller {self.controller.name}" if error is None else "fail-safe"
        writes = [] if self.dry_run else self._plan_writes(act, head)
        results = await asyncio.gather(*(self._do_write(w) for w in writes))
        self.last_cap_w = act.rack_cap_w
        ok = sum(1 for r in results if r is None)
        self.wrote = self.wrote or ok > 0
        cycle_s = self.clock() - t_start
        self.n_cycles += 1
        self.n_writes += ok
        self.cycle_s.append(cycle_s)
        self._publish(obs, act, cycle_s, step_s)
        self.audit.write(
            {
                "cycle": self.n_cycles,
                "t_s": round(obs.t_s, 3),
                "mode": self.mode.value,
                "dry_run": self.dry_run,
                "cycle_s": round(cycle_s, 4),
                **({"error": error} if error else {}),
                "reasons": reasons_json(act.reasons),
                "decided": self._decided(act),
                "writes": [
                    {**w.what, "ok": r is None, **({"error": r} if r else {})}
                    for w, r in zip(writes, results, strict=True)
                ],
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

    def _decided(self, act: Actions) -> dict[str, Any]:
        return {
            "cap_w": rle(act.rack_cap_w),
            "floor_w": rle(act.rack_floor_w),
            "bess_setpoint_w": round(act.bess_setpoint_w, 1),
        }

    def _plan_writes(self, act: Actions, head: str) -> list[_Write]:
        """Every write `act` asks for, each with the reason it is made (`head`: what decided; metrics.write_reasons)."""
        safety = self.loaded.config.safety
        lease = safety.lease_s
        out: list[_Write] = []
        for h in self.handles:
            if h.read_only:
                continue
            if h.kind == "racks":
                sl = h.racks
                cap, floor = act.rack_cap_w[sl], act.rack_floor_w[sl]
                thr, rech = act.rack_bbu_threshold_w[sl], act.rack_bbu_recharge_w[sl]
                dev = h.device
                what = {
                    "device": h.name,
                    "racks": [sl.start, sl.stop - sl.start],
                    "cap_w": rle(cap),
                    "floor_w": rle(floor),
                    "bbu_threshold_w": [_round(np.min(thr)), _round(np.max(thr))],
                    "lease_s": lease,
                }

                def run(dev: Any = dev, cap: Any = cap, floor: Any = floor, thr: Any = thr, rech: Any = rech) -> Any:
                    return dev.write(cap, floor, thr, rech, lease)

                out.append(_Write(h, what, run))
            elif h.kind == "battery":
                sp, dev = act.bess_setpoint_w, h.device
                what = {"device": h.name, "setpoint_w": round(sp, 1), "revert_s": safety.battery_revert_s}

                def run_b(dev: Any = dev, sp: float = sp) -> Any:
                    return dev.write_setpoint(sp, safety.battery_revert_s)

                out.append(_Write(h, what, run_b))
        racks = [w.handle.racks if w.handle.kind == "racks" else None for w in out]
        for w, why in zip(out, write_reasons(self.loaded.site, racks, act.reasons, head), strict=True):
            w.what = {"device": w.what["device"], "reason": why, **w.what}
        return out

    async def _do_write(self, w: _Write) -> str | None:
        """Run one write; None if it succeeded, else the error (counted, flagged when repeated, never raised)."""
        from dimmer.daemon.bus import DeviceError, WriteNotAllowed

        try:
            await asyncio.wait_for(w.run(), timeout=self.timeout_wall_s)
        except TimeoutError:
            err = f"no answer within {self.timeout_wall_s * self.speed:g} s"
        except WriteNotAllowed as exc:  # nothing was sent: a bug upstream of the device, not a failing device
            err = f"{type(exc).__name__}: {exc}"
            log.warning("write to %s refused before sending: %s", w.handle.name, exc)
            self.metrics.writes_refused.labels(device=w.handle.name).inc()
            return err
        except DeviceError as exc:
            err = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a bug in a device's codec must not stop the loop either
            err = f"{type(exc).__name__}: {exc}"
            log.error("write to %s raised %s", w.handle.name, err)
        else:
            self.metrics.writes.labels(device=w.handle.name).inc()
            self._succeeded(w.handle, "write")
            return None
        self._failed(w.handle, "write", err)
        return err

    def _publish(self, obs: Observation, act: Actions, cycle_s: float, step_s: float) -> None:
        m, site = self.metrics, self.loaded.site
        m.cycles.inc()
        m.cycle.observe(cycle_s)
        m.step.observe(step_s)
        reported = np.where(np.isfinite(obs.rack_cap_w), obs.rack_cap_w, act.rack_cap_w)
        enforced = site.domain_load_w(site.rack_power_w(reported))
        m.observe_domains(obs.domain_power_w, act.planned_domain_w, enforced, obs.domain_limit_w)
        m.pcc.set(obs.pcc_power_w)
        m.pcc_limit.set(obs.pcc_limit_w)
        m.bess_soc.set(obs.bess_soc_frac)
        m.bess_power.set(obs.bess_power_w)
        m.bess_setpoint.set(act.bess_setpoint_w)
        m.cap_min.set(float(np.min(act.rack_cap_w)) if site.n_racks else math.nan)
        m.cap_mean.set(float(np.mean(act.rack_cap_w)) if site.n_racks else math.nan)
        m.count_reasons(act.reasons)

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
        if doc is not None and type(ctrl) is type(self.controller):
            with contextlib.suppress(ValueError, TypeError, KeyError):
                restore_state(ctrl, new.site, doc, max_age_s=math.inf)
        if self._own_buses:
            await self._close_buses()
            self._bus_factory = factory
        self.loaded, self.controller, self.handles = new, ctrl, handles
        self.builder = ObservationBuilder(new, handles, self.speed)
        self.last_cap_w = None if new.site.n_racks != old.site.n_racks else self.last_cap_w
        if new.config.daemon.metrics_address != old.config.daemon.metrics_address:
            log.warning("SIGHUP: the metrics address changes only on a restart")
        self.metrics.rebind(new.site, new.device_names, new.config.daemon.metrics_rack_domains)
        self.audit.path = new.audit_path
        self.audit.reopen()
        log.info("SIGHUP: config reloaded from %s", self.config_path)
        for warning in safe_cap_load_warnings(new):
            log.warning("safe cap: %s", warning)
        self.audit.write({"event": "reload", "ok": True})
        return True

    async def _close_buses(self) -> None:
        seen: set[int] = set()
        for h in self.handles:
            bus = getattr(h.device, "bus", None)
            if bus is None or id(bus) in seen:
                continue
            seen.add(id(bus))
            with contextlib.suppress(Exception):
                await bus.close()

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
            writes = self._plan_writes(act, "stop")
            results = await asyncio.gather(*(self._do_write(w) for w in writes))
            n_ok = sum(r is None for r in results)
            log.info("stopping: safe caps written to %d of %d devices", n_ok, len(writes))
            self.audit.write(
                {
                    "event": "stop",
                    "mode": Mode.STOPPING.value,
                    "writes": [
                        {**w.what, "ok": r is None, **({"error": r} if r else {})}
                        for w, r in zip(writes, results, strict=True)
                    ],
                }
            )
        self._save_state()
        await self._close_buses()
        self.audit.close()
        self.metrics.close()
        self.notifier.close()
        log.info("stopped after %d cycles (%d overruns)", self.n_cycles, self.n_overruns)


def _round(x: Any) -> float | str:
    v = float(x)
    return round(v, 1) if math.isfinite(v) else ("inf" if v > 0 else ("-inf" if v < 0 else "nan"))


async def run_daemon(
    config_path: Path, *, dry_run: bool = False, install_signals: bool = True, **kwargs: Any
) -> Daemon:
    """Load `config_path` and run the daemon until stopped (SIGTERM/SIGINT); returns the stopped daemon."""
    loaded = load_config(config_path)
    daemon = Daemon(loaded, config_path=config_path, dry_run=dry_run, **kwargs)
    if install_signals:
        daemon.install_signal_handlers()
    await daemon.run()
    return daemon
