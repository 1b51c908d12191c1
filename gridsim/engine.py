"""Couples the plant and a controller tick by tick.

The engine owns the loop and the clock. Each plant tick (default 0.1 s): workload demand -> GPUs (caps, floors,
ramps, lag) -> capacitor trays -> rack BBUs -> domain loads -> breakers -> campus battery -> grid import ->
frequency. Each control period (default 1 s): telemetry (window average, delay, noise, dropouts) -> Observation ->
Controller.step -> Actions, applied after the actuation latency. Recording keeps every campus-level aggregate at
every tick, domains above rack level and the jobs at every control period, and a bounded sample of racks.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.control import Controller, make_controller
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel
from gridsim.errors import ActionsError
from gridsim.events import job_mask, pcc_schedule
from gridsim.faults import Faults, Telemetry
from gridsim.period import PeriodBlock
from gridsim.plant.breakers import BreakerBank
from gridsim.plant.gpu import GpuBank
from gridsim.plant.grid import FrequencyReplay, load_frequency_csv
from gridsim.plant.storage import CampusBess, CapacitorTrays, RackBbus
from gridsim.plant.voltage import VoltageDipEvent  # voltage
from gridsim.plant.workload import Workload
from gridsim.ridethrough import VoltagePlant, VoltageRecord  # voltage
from gridsim.scenario import (
    CurtailEvent,
    DerateEvent,
    FrequencyReplayEvent,
    FrequencyStepEvent,
    JobEvent,
    LoadedScenario,
)
from gridsim.tick import TICK_SERIES as TICK_SERIES  # (re-exported: the scenario loader and users read it here)
from gridsim.tick import TickLoop, domain_gather

FloatArray = npt.NDArray[np.float64]


@dataclass
class SimResult:
    """Everything a run produced: the time axes, the series, the accounting; `summary` is filled by metrics."""

    scenario: str
    controller: str
    seed: int
    site: SiteModel
    tick_s: float
    duration_s: float
    t_s: FloatArray  # (n_ticks,)
    tick: dict[str, FloatArray]  # TICK_SERIES, each (n_ticks,)
    period_t_s: FloatArray  # (n_periods,)
    period: dict[str, FloatArray]  # (n_periods, n) series: domains, jobs, sampled racks
    recorded_domains: npt.NDArray[np.int64]
    recorded_racks: npt.NDArray[np.int64]
    trips: list[tuple[float, str]]
    accounting: dict[str, FloatArray]
    storage: dict[str, float]
    step_ms: FloatArray
    wall_s: float
    band_hz: tuple[float, float]
    nominal_hz: float
    events_log: list[tuple[float, str]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    voltage: VoltageRecord | None = None  # voltage: the PCC voltage and UPS transfers (gridsim/ridethrough.py)
    breakers: dict[str, float] = field(default_factory=dict)  # TickLoop.breaker_totals: the breakers' heat

    def to_pandas(self) -> Any:
        import pandas as pd

        return pd.DataFrame({"t_s": self.t_s, **self.tick})


# What each per-rack field of Actions may hold besides finite numbers, by its contract: (field, NaN allowed, +inf
# allowed, what is expected). NaN is "no change" for caps and floors (GpuBank.command keeps the value in force, and
# an actuation fault uses it so); +inf is "backup only" for a BBU threshold and "up to the shelf's rated recharge"
# for a recharge limit (RackBbus.step clips it to the rating). Anything else non-finite -- a NaN threshold made
# `stored_j` NaN, then the grid import, and no breaker ever saw an overload -- is refused before it reaches the
# plant. docs/models.md ("What the engine accepts from a controller") holds the table.
_RACK_FIELDS = (
    ("rack_cap_w", True, False, "a finite per-GPU cap in W, or NaN for no change"),
    ("rack_floor_w", True, False, "a finite per-GPU floor in W, or NaN for no change"),
    ("rack_bbu_threshold_w", False, True, "a threshold in W, or inf for backup only (never NaN or -inf)"),
    ("rack_bbu_recharge_w", False, True, "a recharge limit in W, or inf for the shelf's rating (never NaN or -inf)"),
)


def check_actions(act: Actions, n_racks: int, n_jobs: int) -> tuple[str, str] | None:
    """(field, what was expected and what came) for the first field of `act` the plant refuses; None if all pass.

    The fast path is one np.isfinite and one any() per array: a control period's check costs microseconds.
    """
    for name, nan_ok, inf_ok, expected in _RACK_FIELDS:
        a = np.asarray(getattr(act, name))
        if a.shape != (n_racks,):
            return name, f"an array of shape ({n_racks},), one value per rack (got shape {a.shape})"
        finite = np.isfinite(a)
        if finite.all():
            continue
        bad = ~finite
        if nan_ok:
            bad &= ~np.isnan(a)
        if inf_ok:
            bad &= a != np.inf
        if bad.any():
            i = int(np.argmax(bad))
            n_bad = int(np.count_nonzero(bad))
            return name, f"{expected} (rack {i} is {float(a[i])!r}, and {n_bad} of {n_racks} racks are not)"
    sp = act.bess_setpoint_w
    if math.isinf(sp):  # NaN is documented as "hold idle" (CampusBess.step); inf is no power a battery has
        return "bess_setpoint_w", f"a finite setpoint in W, or NaN for idle (got {sp!r})"
    for name in ("gpu_ramp_up_w_per_s", "gpu_ramp_down_w_per_s"):
        v = getattr(act, name)
        if not v >= 0.0:  # NaN fails too
            return name, f"a ramp limit >= 0 W/s, or inf for none (got {v!r})"
    js = np.asarray(act.job_suspend)
    if js.shape != (n_jobs,) or js.dtype != np.bool_:
        return "job_suspend", f"a boolean array of shape ({n_jobs},) (got {js.dtype} of shape {js.shape})"
    return None


_domain_gather = domain_gather  # (its tests import it from here)


def _record_domain_index(site: SiteModel, racks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    rack_level = int(site.domain_level.max())
    upper = np.flatnonzero(site.domain_level < rack_level)
    is_rack = site.domain_level == rack_level
    rack_domains = np.flatnonzero(is_rack & np.isin(site.domain_rack_start, racks))
    return np.concatenate([upper, rack_domains]).astype(np.int64)


def run(
    loaded: LoadedScenario,
    controller: str | None = None,
    seed: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Run the scenario with `controller` (default: the scenario's) and `seed` (default: the scenario's)."""
    sc = loaded.scenario
    site = loaded.site()
    name = controller or sc.controller.name
    seed = sc.seed if seed is None else seed
    ctrl: Controller = make_controller(name, site, sc.controllers.get(name, {}), source=loaded.source)
    return Simulation(loaded, site, ctrl, seed).run(progress)


class Simulation:
    def __init__(
        self,
        loaded: LoadedScenario,
        site: SiteModel,
        ctrl: Controller,
        seed: int,
        period_advance: bool | None = None,
    ) -> None:
        """`period_advance`: take a control period's ticks at once where nothing discrete happens inside it
        (gridsim/period.py; the same numbers to the bit); False runs every tick one by one; None (the default) takes
        periods at once where that pays, on sites small enough that a tick's cost is numpy's per-call overhead."""
        sc = loaded.scenario
        self.loaded = loaded
        self.sc = sc
        self.period_advance = period_advance
        if period_advance is None:
            self.period_advance = PeriodBlock.pays(site.n_racks, round(sc.engine.control_period_s / sc.engine.tick_s))
        self.period_block: PeriodBlock | None = None  # the last run's (what it took and refused)
        self.site = site
        self.ctrl = ctrl
        self.seed = seed
        # workload, telemetry, the racks' fixed spread (spawn keys 0, 1, 2: adding the third moved neither other)
        streams = np.random.SeedSequence(seed).spawn(3)
        self.rng_telemetry = np.random.default_rng(streams[1])
        jobs = [
            j.model_copy(update={"trace_path": str(loaded.resolve(j.trace_path))}) if j.trace_path else j
            for j in sc.jobs
        ]
        self.workload = Workload(
            site,
            jobs,
            sc.background,
            np.random.default_rng(streams[0]),
            loaded.source,
            rack_rng=np.random.default_rng(streams[2]),
        )
        # what the scheduler knows of a stopped job: one the scenario starts again later is pending (requeued, as
        # after mass-restart's outage), not ended; each job's last start event (-inf: none)
        self.last_start_s = np.full(site.n_jobs, -math.inf)
        for ev in sc.events:
            if isinstance(ev, JobEvent) and ev.kind == "start":
                m = job_mask(site, ev)
                self.last_start_s[m] = np.fmax(self.last_start_s[m], ev.at_s)
        self.gpus = GpuBank(site, sc.gpu)
        self.trays = CapacitorTrays(site)
        self.bbus = RackBbus(site)
        self.bess = CampusBess(site)
        self.breakers = BreakerBank(site, sc.breakers)
        self.dt = sc.engine.tick_s
        self.n_ticks = sc.n_ticks
        self.ticks_per_period = round(sc.engine.control_period_s / self.dt)
        self.pcc = pcc_schedule(site, sc.events)
        self.faults = Faults(site, list(sc.events))
        dips = [e for e in sc.events if isinstance(e, VoltageDipEvent)]  # voltage
        self.voltage = VoltagePlant(site, sc.grid.source, sc.grid.ride_through, sc.ups, dips, self.n_ticks, self.dt)

        # Rack -> AC power is affine in the per-GPU draw: rack_w = gain * draw + fixed.
        zero = site.rack_power_w(np.zeros(site.n_racks))
        self.rack_gain = site.rack_power_w(np.ones(site.n_racks)) - zero
        self.rack_fixed = zero
        # Running racks of each job, grouped so one reduceat gives each job's slowest rack.
        running = (site.rack_job >= 0) & ~site.rack_is_spare
        order = np.argsort(site.rack_job[running], kind="stable")
        self.job_racks = np.flatnonzero(running)[order]
        counts = np.bincount(site.rack_job[self.job_racks], minlength=site.n_jobs)
        self.job_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        # Placement gives every job at least one running rack, so no reduceat segment is empty.
        self.job_first_rack = self.job_racks[self.job_starts] if site.n_jobs else self.job_starts

        # Telemetry ring buffer of rack grid-side power, one row per tick.
        tel = sc.telemetry
        self.window_ticks = max(1, round(tel.window_s / self.dt))
        self.delay_ticks = round(tel.delay_s / self.dt)
        self.peak_every = max(1, round(tel.peak_sample_s / self.dt)) if tel.peak_sample_s > 0 else 0
        self.ring = np.zeros((self.window_ticks + self.delay_ticks, site.n_racks))
        self.ring_load = np.zeros_like(self.ring)
        self.ring_grid = np.zeros(self.window_ticks + self.delay_ticks)
        self.rack_last_ok_s = np.zeros(site.n_racks)

        # Replayed frequency records, read when the run is built (the scenario's validation read them too) and laid on
        # the tick axis once: each replay reaches before its at_s and past its end (it relaxes to nominal there).
        replays = []
        for i, ev in enumerate(sc.events):
            if isinstance(ev, FrequencyReplayEvent):
                path = loaded.resolve(ev.path)
                ft, fhz = load_frequency_csv(
                    path, loaded.source, f"events[{i}].path", ev.sample_s, ev.values, sc.grid.nominal_hz
                )
                replays.append(FrequencyReplay(ft, fhz, ev.at_s, sc.grid.nominal_hz, ev.settle_tau_s))
        t_axis = np.arange(self.n_ticks, dtype=np.float64) * self.dt
        self.replay_dev_hz: FloatArray | None = (
            np.sum([r.dev_hz_array(t_axis) for r in replays], axis=0) if replays else None
        )

        n_rec = min(sc.engine.record_racks, site.n_racks)
        self.rec_racks = np.unique(np.linspace(0, site.n_racks - 1, n_rec).round().astype(np.int64))
        self.rec_domains = _record_domain_index(site, self.rec_racks)

    # -- control -------------------------------------------------------------------------------------------------

    def observe(self, t_s: float, k: int, freq_hz: float) -> Observation:
        site, tel = self.site, self.sc.telemetry
        rows = self.ring.shape[0]
        # Rows written at ticks k-delay-window+1 .. k-delay (ring index = tick % rows). A delayed meter's first
        # readings are of the site before the run, which is the site as it starts: tick 0, not the ring's zeros
        # (read as a campus at 0 MW, a 2 s delay had the battery discharge 4 MW to "follow" the first real reading).
        ticks = np.arange(k - self.delay_ticks - self.window_ticks + 1, k - self.delay_ticks + 1)
        idx = np.maximum(ticks, 0) % rows
        # rows in time order; when that is the ring's own order (a window of whole rings), a view reads them in the
        # same order a copy would, without copying the window
        rings: slice | npt.NDArray[np.int64] = idx
        if idx.size == rows and idx[0] == 0 and idx[-1] == rows - 1:
            rings = slice(0, rows)
        rack_w = self.ring[rings].mean(axis=0)
        load_w = self.ring_load[rings].mean(axis=0)
        # the highest of the window's samples, newest first, one every peak_sample_s
        peak_w = self.ring_load[idx[:: -self.peak_every]].max(axis=0) if self.peak_every else None
        grid_w = float(self.ring_grid[idx].mean())
        domain_w = site.domain_load_w(rack_w)
        domain_w[0] = grid_w  # the PCC meter: net of the battery
        if tel.noise_frac > 0:
            rack_w = rack_w * (1 + tel.noise_frac * self.rng_telemetry.standard_normal(site.n_racks))
            load_gain = 1 + tel.noise_frac * self.rng_telemetry.standard_normal(site.n_racks)
            load_w = load_w * load_gain
            peak_w = None if peak_w is None else peak_w * load_gain  # (one meter: its error is the same)
            domain_w = domain_w * (1 + tel.noise_frac * self.rng_telemetry.standard_normal(site.n_domains))
        # rack_w, load_w and peak_w are this call's own arrays (a mean, a max, a product): marked in place
        dark = self.faults.racks_dark(t_s)
        if tel.dropout_prob > 0 or dark is not None:
            arrived = np.ones(site.n_racks, dtype=bool)
            if tel.dropout_prob > 0:
                arrived &= self.rng_telemetry.random(site.n_racks) >= tel.dropout_prob
            if dark is not None:  # host agents down: their racks' readings stop arriving
                arrived &= ~dark
            lost = ~arrived
            rack_w[lost] = np.nan
            load_w[lost] = np.nan
            if peak_w is not None:
                peak_w[lost] = np.nan
            # a rack's age is its latest reading's that arrived: it grows while none does (a dark rack reported 1 s
            # old for as long as its agent was down, so a controller holding a lost reading for its age held it for
            # ever)
            self.rack_last_ok_s[arrived] = t_s
        else:
            self.rack_last_ok_s.fill(t_s)
        age = t_s - self.rack_last_ok_s + tel.delay_s
        seen = Telemetry(
            rack_w, load_w, age, domain_w, np.full(site.n_domains, tel.delay_s), grid_w, tel.delay_s, peak_w
        )
        self.faults.telemetry(t_s, seen)
        return Observation(
            t_s=t_s,
            rack_power_w=seen.rack_w,
            rack_load_w=seen.load_w,
            rack_age_s=seen.rack_age_s,
            rack_cap_w=self.gpus.cap_w.copy(),
            rack_floor_w=self.gpus.floor_w.copy(),
            rack_bbu_soc_frac=self.bbus.soc_frac,  # a new array each read
            rack_energized=self.breakers.rack_energized(),
            domain_power_w=seen.domain_w,
            domain_age_s=seen.domain_age_s,
            domain_limit_w=self.breakers.rating_w.copy(),
            domain_thermal_frac=self.breakers.thermal_frac(),
            pcc_power_w=seen.pcc_w,
            pcc_age_s=seen.pcc_age_s,
            pcc_limit_w=self.pcc.at(t_s),
            ramp_limit_w_per_min=site.ramp_limit_w_per_min,
            grid_freq_hz=freq_hz,
            bess_soc_frac=self.bess.soc_frac if self.bess.online else math.nan,
            bess_power_w=self.bess.power_w,
            bess_online=self.bess.online,
            job_running=self.workload.job_running(),
            job_ended=self.workload.job_ended() & (self.last_start_s <= t_s),
            rack_load_peak_w=seen.load_peak_w,
            pcc_voltage_pu=self.voltage.observed(k),  # voltage
        )

    def apply(self, t_s: float, act: Actions) -> None:
        self.gpus_ramp_limited = math.isfinite(act.gpu_ramp_up_w_per_s) or math.isfinite(act.gpu_ramp_down_w_per_s)
        self.gpus.command(t_s, act.rack_cap_w, act.rack_floor_w, act.gpu_ramp_up_w_per_s, act.gpu_ramp_down_w_per_s)
        self.bbu_threshold_w = act.rack_bbu_threshold_w
        self.bbu_recharge_w = act.rack_bbu_recharge_w
        self.bess_setpoint_w = act.bess_setpoint_w
        self.job_suspend = act.job_suspend

    # -- the loop ------------------------------------------------------------------------------------------------

    def run(self, progress: Callable[[float], None] | None = None) -> SimResult:
        site, sc, dt = self.site, self.sc, self.dt
        n, tpp = self.n_ticks, self.ticks_per_period
        n_jobs = site.n_jobs
        loop = TickLoop(self)
        block = self.period_block = PeriodBlock(loop)
        step_ms = loop.step_ms

        self.apply(0.0, Actions.hands_off(site))
        pending: deque[tuple[float, Actions]] = deque()
        latency = sc.engine.actuation_latency_s
        events = sorted(sc.events, key=lambda e: e.at_s)
        ev_i = 0
        events_log: list[tuple[float, str]] = []
        wall0 = time.perf_counter()
        last_progress = wall0

        k = 0
        while k < n:
            t = k * dt
            # timed events
            while ev_i < len(events) and events[ev_i].at_s <= t + 1e-9:
                ev = events[ev_i]
                ev_i += 1
                events_log.append((t, ev.kind))
                if isinstance(ev, JobEvent):
                    mask = job_mask(site, ev)
                    if ev.kind == "crash":
                        self.workload.interrupt(mask, "failure")
                    elif ev.kind == "start":
                        self.workload.start(mask)
                    else:
                        self.workload.stop(mask)
                elif isinstance(ev, DerateEvent):
                    dmask = np.zeros(site.n_domains, dtype=bool)
                    dmask[site.domain_index(ev.domain)] = True
                    self.breakers.derate(dmask, ev.factor)
                elif isinstance(ev, FrequencyStepEvent):
                    loop.ext_load_w += ev.load_mw * 1e6
                elif isinstance(ev, CurtailEvent | FrequencyReplayEvent):
                    pass  # the PCC schedule and the replayed deviation (self.replay_dev_hz) already hold it

            # control
            if k % tpp == 0 and k > 0:
                p = k // tpp
                obs = self.observe(t, k - 1, loop.freq_hz)
                t0 = time.perf_counter()
                act = self.ctrl.step(obs)
                step_ms[p] = (time.perf_counter() - t0) * 1e3
                refused = check_actions(act, site.n_racks, n_jobs)
                if refused is not None:
                    raise ActionsError(self.ctrl.name, *refused, t_s=t, tick=k)
                act, fault_delay = self.faults.actuation(t, act)
                if latency + fault_delay > 0:
                    pending.append((t + latency + fault_delay, act))
                else:
                    self.apply(t, act)
            while pending and pending[0][0] <= t + 1e-9:
                self.apply(t, pending.popleft()[1])

            # plant: the whole control period at once where nothing discrete happens inside it, else one tick
            if k % tpp == 0 and self.period_advance:
                quiet_until_s = min(
                    events[ev_i].at_s if ev_i < len(events) else math.inf,
                    pending[0][0] if pending else math.inf,
                )
                if block.advance(k, quiet_until_s):
                    k += tpp
                else:
                    loop.tick_at(k)
                    k += 1
            else:
                loop.tick_at(k)
                k += 1
            if progress is not None and k % tpp == 0:
                now = time.perf_counter()
                if now - last_progress > 0.5:
                    progress(k / n)
                    last_progress = now

        wall = time.perf_counter() - wall0
        if progress is not None:
            progress(1.0)
        storage = loop.storage_totals()
        trips = [(float(ts), site.domain_name[d]) for ts, d in self.breakers.trip_log]
        return SimResult(
            scenario=sc.name,
            controller=self.ctrl.name,
            seed=self.seed,
            site=site,
            tick_s=dt,
            duration_s=n * dt,
            t_s=np.arange(n, dtype=np.float64) * dt,
            tick=loop.tick,
            period_t_s=loop.period_t,
            period=loop.period,
            recorded_domains=self.rec_domains,
            recorded_racks=self.rec_racks,
            trips=trips,
            accounting=self.workload.accounting(),
            storage=storage,
            breakers=loop.breaker_totals(),
            step_ms=step_ms,
            wall_s=wall,
            band_hz=(sc.metrics.band_lo_hz, sc.metrics.band_hi_hz),
            nominal_hz=sc.grid.nominal_hz,
            events_log=events_log,
            voltage=self.voltage.record(),  # voltage
        )
