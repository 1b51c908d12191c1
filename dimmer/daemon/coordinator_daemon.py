"""The campus coordinator as a daemon, over building daemons (docs/daemon.md, "The hierarchy").

Every `period_s` it reads the interconnect (a campus meter or the site device), the campus battery and every
building's `dimmer-building-v1` registers, concurrently; runs the `dimmer-campus` coordinator (coordinator.py, the
same object the simulator runs) on them; and writes each building its budget, with a lease, and the battery its
setpoint, with its revert timeout. A building report's time is when its update counter last moved, on this
daemon's clock: a building daemon that answers with old values ages like one that does not answer, and a building
not heard from within `stale_s` is planned at the most its racks can draw. Nothing it decides that is not a number
is written; a budget write that fails is retried next period, and a building that misses its budgets holds the last
one until its lease ends (building_server.py), then falls to its safe budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dimmer.control.building_report import n_priority_groups
from dimmer.control.building_split import building_parts
from dimmer.control.campus import campus_params, make_coordinator
from dimmer.control.coordinator import Budgets, BuildingReports
from dimmer.daemon.audit import AuditLog
from dimmer.daemon.config import LoadedConfig, metrics_address_of
from dimmer.daemon.handles import (
    BusFactory,
    DeviceHandle,
    build_devices,
    close_buses,
    device_status,
    freeze_startup_heap,
    has_data,
    judge_meters,
    note_reading,
    read_device,
    tcp_bus_factory,
    value_array,
    value_num,
)
from dimmer.daemon.metrics import DaemonMetrics, RecentDurations
from dimmer.daemon.netguard import ConnectionLimits
from dimmer.daemon.observe import ObservationBuilder, Snapshot
from dimmer.daemon.utility_ven import UtilityVen, bess_headroom_w
from dimmer.daemon.writes import Write, audit_entries, do_write, plan_writes
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel

log = logging.getLogger("dimmer.coordinator")
BATTERY_REVERT_MAX_S = 3600.0  # (the config's own limit on battery_revert_s)


@dataclass(frozen=True)
class CoordinatorCycle:
    """What one coordinator cycle saw and did (for a status line and tests)."""

    n: int
    obs: Observation
    reports: BuildingReports
    budgets: Budgets
    cycle_s: float
    step_s: float
    writes_ok: int
    writes_failed: int


class CoordinatorDaemon:
    def __init__(
        self,
        loaded: LoadedConfig,
        *,
        speed: float = 1.0,
        bus_factory: BusFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_cycle: Callable[[CoordinatorCycle], None] | None = None,
        metrics_address: tuple[str, int] | str | None = "config",
        dry_run: bool = False,
        max_cycles: int | None = None,
    ) -> None:
        self.loaded, self.speed, self.clock = loaded, speed, clock
        self.on_cycle, self.dry_run, self.max_cycles = on_cycle, dry_run, max_cycles
        site = loaded.site
        p, building = campus_params(loaded.controller_params, loaded.source)
        self.params = p = p.model_copy(update={"parent_period_s": loaded.config.daemon.period_s})
        self.parts = building_parts(site)
        self.coordinator = make_coordinator(site, self.parts, p, building)
        self.n_groups = n_priority_groups(site)
        # what carries the battery's setpoint to plan_writes: racks it never writes, built once (14,080 at 1M GPUs)
        self._hands_off = Actions.hands_off(site)
        self._own_buses = bus_factory is None
        self.handles = build_devices(loaded, bus_factory or tcp_bus_factory(), clock)
        specs = zip(self.handles, loaded.config.devices, strict=True)
        by_name = {spec.building: h for h, spec in specs if spec.kind == "building"}
        self.buildings: list[DeviceHandle] = [by_name[part.name] for part in self.parts]
        self.metrics = DaemonMetrics(site, loaded.device_names, clock=clock, speed=speed)
        self.builder = ObservationBuilder(loaded, self.handles, speed)
        self.audit = AuditLog(loaded.audit_path)
        # the campus faces the utility here, not in its buildings: the limit and ramp rule it budgets under are at
        # most what the utility's accepted events ask (docs/utility.md)
        u = loaded.config.utility
        self.utility = UtilityVen(loaded, audit=self.audit) if u is not None and u.enabled else None
        self._site_ramp_w_per_min = self.coordinator.ramp_limit_w_per_min
        self._metrics_address = metrics_address_of(loaded, metrics_address)
        self.metrics_port: int | None = None
        self.n_cycles = self.n_overruns = self.n_writes = 0
        self.cycle_s = RecentDurations()
        self.cycle_cpu_s = RecentDurations()
        self.last: CoordinatorCycle | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._t0_mono = clock()

    @property
    def period_wall_s(self) -> float:
        return self.loaded.config.daemon.period_s / self.speed

    @property
    def timeout_wall_s(self) -> float:
        return self.loaded.config.daemon.read_timeout_in_force_s / self.speed

    def request_stop(self) -> None:
        self._stop_requested = True
        if self._stop is not None:
            self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        # (SIGHUP's default would end the process: a `systemctl reload` must not take the campus's budgets away)
        said = "SIGHUP: a coordinator does not reload its config; restart it to apply one"
        loop.add_signal_handler(signal.SIGHUP, lambda: log.warning(said))

    async def run(self) -> None:
        self._stop = asyncio.Event()
        if self._stop_requested:
            self._stop.set()
        if self._metrics_address is not None:
            spec = self.loaded.config.daemon
            limits = ConnectionLimits(spec.metrics_max_connections, spec.metrics_idle_timeout_s)
            self.metrics_port = self.metrics.serve(self._metrics_address, limits)
        self.metrics.set_mode("running")
        if self.utility is not None:
            await self.utility.start()
        self._t0_mono = self.clock()
        log.info(
            "coordinator started: %d buildings, period %g s, lease %g s",
            len(self.buildings),
            self.loaded.config.daemon.period_s,
            self.params.lease_s,
        )
        freeze_startup_heap()
        next_t = time.monotonic()
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                await self.cycle()
                if self.max_cycles is not None and self.n_cycles >= self.max_cycles:
                    break
                next_t += self.period_wall_s
                now = time.monotonic()
                if now - started > self.period_wall_s:
                    self.n_overruns += 1
                    self.metrics.overruns.inc()
                next_t = max(next_t, now)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=max(next_t - time.monotonic(), 0.0))
        finally:
            self.metrics.set_mode("stopping")
            if self.utility is not None:
                await self.utility.stop()
            if self._own_buses:
                await close_buses(self.handles)
            self.audit.close()
            self.metrics.close()
            log.info("coordinator stopped after %d cycles (%d overruns)", self.n_cycles, self.n_overruns)

    async def cycle(self) -> CoordinatorCycle:
        t_start, cpu_start = self.clock(), time.process_time()
        safety = self.loaded.config.safety
        fail_after = safety.fail_after
        fresh = await asyncio.gather(
            *(read_device(h, self.timeout_wall_s, self.speed, fail_after, self.metrics) for h in self.handles)
        )
        for h, r in zip(self.handles, fresh, strict=True):
            if r is not None:
                note_reading(h, r, safety, self.speed)
        # a meter has no update counter: it is fresh while its reading moves (without this its age stayed NaN and
        # the coordinator never planned on the interconnect's meter)
        judge_meters(self.handles, self.loaded.site, self.loaded.limit_w, safety, self.speed)
        self.metrics.set_devices([device_status(h) for h in self.handles], safety.stale_s)
        now = self.clock()
        snap = Snapshot(
            t_mono_s=now,
            t_s=(now - self._t0_mono) * self.speed,
            readings=tuple(h.last for h in self.handles),
            fresh_t_s=tuple(h.fresh_t_s for h in self.handles),
        )
        obs = self.builder.build(snap)
        reports = self.reports(snap)
        if self.utility is not None:
            obs = self.utility.observe(obs)
            self.utility.flexibility_w = sheddable_w(reports, obs, self.loaded.site)
            self.coordinator.ramp_limit_w_per_min = min(self._site_ramp_w_per_min, obs.ramp_limit_w_per_min)
        t_step = time.perf_counter()
        budgets = self.coordinator.step(
            obs.t_s, obs.pcc_power_w, obs.pcc_age_s, obs.pcc_limit_w, obs.bess_soc_frac, obs.bess_power_w,
            obs.bess_online, reports, obs.grid_freq_hz,
        )  # fmt: skip
        step_s = time.perf_counter() - t_step
        writes, results = ([], []) if self.dry_run else await self._write(budgets)
        ok = sum(r is None for r in results)
        cycle_s = self.clock() - t_start
        self.n_cycles += 1
        self.n_writes += ok
        self.cycle_s.append(cycle_s)
        self.cycle_cpu_s.append(time.process_time() - cpu_start)  # (this process's own work, whatever else runs)
        names = [part.name for part in self.parts]
        self.metrics.publish_coordinator(
            obs, budgets.bess_setpoint_w, names, budgets.ceiling_w, reports.bound_w, cycle_s, step_s
        )
        heard = np.isfinite(reports.t_s) & (obs.t_s - reports.t_s <= safety.stale_s)
        self.audit.write(
            {
                "cycle": self.n_cycles,
                "t_s": round(obs.t_s, 3),
                "role": "coordinator",
                "cycle_s": round(cycle_s, 4),
                "pcc_w": obs.pcc_power_w,
                "budgets_w": [round(x, 1) for x in budgets.ceiling_w.tolist()],
                "floors_w": [round(x, 1) if math.isfinite(x) else None for x in budgets.floor_w.tolist()],
                "bess_setpoint_w": round(budgets.bess_setpoint_w, 1),
                "unheard": [n for n, h in zip(names, heard.tolist(), strict=True) if not h],
                "writes": audit_entries(writes, results),
            }
        )
        res = CoordinatorCycle(self.n_cycles, obs, reports, budgets, cycle_s, step_s, ok, len(results) - ok)
        self.last = res
        if self.on_cycle is not None:
            self.on_cycle(res)
        return res

    def reports(self, snap: Snapshot) -> BuildingReports:
        """Every building's last report, dated when its update counter last moved (-inf: never heard)."""
        n_b, n_g = len(self.buildings), self.n_groups
        t = np.full(n_b, -np.inf)
        scalars = {k: np.full(n_b, np.nan) for k in ("import_w", "bound_w", "prior_w")}
        zeros = {k: np.zeros(n_b) for k in ("return_w", "return_gpus", "base_w", "back_w", "fill_w")}
        groups = {k: np.zeros((n_b, n_g)) for k in ("group_w", "floor_w", "demand_w")}
        measured = np.zeros(n_b, dtype=bool)
        for i, h in enumerate(self.buildings):
            r = h.last
            if r is None or not has_data(h) or not math.isfinite(h.fresh_t_s):
                continue
            v = r.values
            t[i] = snap.t_s - max(snap.t_mono_s - h.fresh_t_s, 0.0) * self.speed
            for k, arr in scalars.items():
                arr[i] = value_num(v, k)
            for k, arr in zeros.items():
                arr[i] = np.nan_to_num(value_num(v, k))
            for k, arr2 in groups.items():
                arr2[i] = np.nan_to_num(value_array(v, k, n_g))
            measured[i] = value_num(v, "measured") > 0.5
        # a report with no bound is no report: planned at its worst case like one never heard
        t = np.where(np.isfinite(scalars["bound_w"]), t, -np.inf)
        return BuildingReports(t_s=t, measured=measured, **scalars, **zeros, **groups)

    async def _write(self, b: Budgets) -> tuple[list[Write], list[str | None]]:
        lease = self.params.lease_s
        writes: list[Write] = []
        for i, h in enumerate(self.buildings):
            ceiling, floor = float(b.ceiling_w[i]), float(b.floor_w[i])
            if h.read_only or not math.isfinite(ceiling):
                continue  # (never a value that is not a number: the building keeps its lease, then its safe budget)

            def run(dev: Any = h.device, c: float = ceiling, f: float = floor) -> Any:
                return dev.write_budget(c, f, lease)

            what = {"device": h.name, "ceiling_w": round(ceiling, 1), "lease_s": lease}
            writes.append(Write(h, what, run))
        if math.isfinite(b.bess_setpoint_w):
            site = self.loaded.site
            act = replace(self._hands_off, bess_setpoint_w=b.bess_setpoint_w)
            battery = [h for h in self.handles if h.kind == "battery"]
            # the battery holds the setpoint until the buildings have come down to their safe budgets
            safety = self.loaded.config.safety
            revert_s = min(max(safety.battery_revert_s, b.bess_hold_s), BATTERY_REVERT_MAX_S)
            held = safety.model_copy(update={"battery_revert_s": revert_s})
            writes += plan_writes(battery, act, "coordinator", site, held)
        else:
            log.warning("battery setpoint not a number: not written (the battery reverts on its own timeout)")
        results = await asyncio.gather(
            *(do_write(w, self.timeout_wall_s, self.speed, self.loaded.config.safety.fail_after, self.metrics)
              for w in writes)
        )  # fmt: skip
        return writes, list(results)


def sheddable_w(reports: BuildingReports, obs: Observation, site: SiteModel) -> float:
    """What the campus could shed from its import now, as its buildings report it: each running job group's share
    of its building's bound above that group at its lowest caps, plus the campus battery's discharge headroom (the
    coordinator has no rack readings: `utility_ven.available_flexibility_w` is the flat daemon's). NaN when no
    building has reported."""
    heard = np.isfinite(reports.t_s)
    if not heard.any():
        return math.nan
    shed = float(np.sum(np.maximum(reports.group_w[heard] - reports.floor_w[heard], 0.0)))
    return shed + bess_headroom_w(site, obs)
