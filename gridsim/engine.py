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
from gridsim.plant.breakers import BreakerBank
from gridsim.plant.gpu import GpuBank
from gridsim.plant.grid import FrequencyModel, FrequencyReplay, load_frequency_csv
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
    StorageFault,
)
from gridsim.wear import SocTurningPoints

FloatArray = npt.NDArray[np.float64]

# Per-tick campus aggregates, in this order, recorded for every tick.
TICK_SERIES = (
    "demand_w",  # what the racks would draw uncapped, with no floors and no storage
    "load_w",  # what the racks draw after caps, floors and ramp limits
    "campus_w",  # after capacitor trays and BBUs: the campus bus
    "bess_w",  # campus battery, positive = discharging
    "grid_w",  # import at the PCC
    "pcc_limit_w",
    "freq_hz",
    "bess_soc_frac",
    "floor_burn_w",  # power the floors burn above what the GPUs would draw
    "bbu_w",  # every rack BBU together, positive = discharging into its rack, negative = recharging
    "bbu_soc_min_frac",  # the emptiest rack BBU (NaN: no BBUs)
    "bbu_soc_mean_frac",
)


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


def _domain_gather(site: SiteModel) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int, int]:
    """How the engine computes site.domain_load_w: (start, stop) rack indices of the domains before `lo`, gathered,
    and from `lo` on the rack-level domains when they are the last ones and hold one rack each in order, from rack
    `r0` (their load is then csum[r0 + 1 + i] - csum[r0 + i], read as two slices)."""
    start, stop = site.domain_rack_start, site.domain_rack_stop
    n = site.n_domains
    lo = n
    while lo > 0 and stop[lo - 1] == start[lo - 1] + 1 and (lo == n or start[lo] == start[lo - 1] + 1):
        lo -= 1
    r0 = int(start[lo]) if lo < n else 0
    return start[:lo].astype(np.int64), stop[:lo].astype(np.int64), lo, r0


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
    def __init__(self, loaded: LoadedScenario, site: SiteModel, ctrl: Controller, seed: int) -> None:
        sc = loaded.scenario
        self.loaded = loaded
        self.sc = sc
        self.site = site
        self.ctrl = ctrl
        self.seed = seed
        streams = np.random.SeedSequence(seed).spawn(2)
        self.rng_telemetry = np.random.default_rng(streams[1])
        jobs = [
            j.model_copy(update={"trace_path": str(loaded.resolve(j.trace_path))}) if j.trace_path else j
            for j in sc.jobs
        ]
        self.workload = Workload(site, jobs, sc.background, np.random.default_rng(streams[0]), loaded.source)
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
        n_periods = (n + tpp - 1) // tpp
        n_jobs = site.n_jobs

        tick = {key: np.zeros(n) for key in TICK_SERIES}
        rec_d, rec_r = self.rec_domains, self.rec_racks
        period = {
            "domain_w": np.zeros((n_periods, rec_d.size)),
            "domain_thermal_frac": np.zeros((n_periods, rec_d.size)),
            "domain_limit_w": np.zeros((n_periods, rec_d.size)),
            "job_cap_w": np.zeros((n_periods, n_jobs)),
            "job_floor_w": np.zeros((n_periods, n_jobs)),
            "job_speed_frac": np.zeros((n_periods, n_jobs)),
            "job_state": np.zeros((n_periods, n_jobs)),
            "rack_w": np.zeros((n_periods, rec_r.size)),
            "rack_cap_w": np.zeros((n_periods, rec_r.size)),
            "bbu_soc_min_frac": np.zeros(n_periods),
            "bbu_soc_mean_frac": np.zeros(n_periods),
        }
        period_t = np.zeros(n_periods)
        # BBU wear and ride-through: every rack's SoC turning points, and the least time any rack's stored
        # energy could carry its load (over racks and periods)
        bbu_turns = SocTurningPoints(self.bbus.soc_frac)
        has_bbu = self.bbus.capacity_j > 0
        bbu_eff = math.sqrt(self.bbus.round_trip_eff)
        min_ride_through_s = math.inf
        any_bbu = bool(has_bbu.any())
        bbu_window = self.bbus.soc_max_frac - self.bbus.soc_min_frac
        if not any_bbu:
            tick["bbu_soc_min_frac"][:] = np.nan
            tick["bbu_soc_mean_frac"][:] = np.nan
        step_ms = np.full(n_periods, np.nan)  # the first period runs hands-off: no telemetry yet

        self.apply(0.0, Actions.hands_off(site))
        pending: deque[tuple[float, Actions]] = deque()
        latency = sc.engine.actuation_latency_s
        events = sorted(sc.events, key=lambda e: e.at_s)
        ev_i = 0
        replay_dev = self.replay_dev_hz
        ext_load_w = 0.0
        events_log: list[tuple[float, str]] = []

        freq_model: FrequencyModel | None = None
        freq_hz = sc.grid.nominal_hz
        full_speed = np.ones(n_jobs)
        peak_w = self.workload.rack_peak_w()  # constant over the run
        job_speed = full_speed
        rack_ones = np.ones(site.n_racks, dtype=bool)
        energized = rack_ones
        rows = self.ring.shape[0]
        gain, fixed = self.rack_gain, self.rack_fixed
        active_over_eff = site.rack_active_gpus / site.rectifier_eff
        # per-tick buffers: nothing of a tick's size is allocated in the loop
        demand = np.zeros(site.n_racks)
        rack_w = np.zeros(site.n_racks)
        demand_w = np.zeros(site.n_racks)
        domain_csum = np.zeros(site.n_racks + 1)  # [0, cumsum of the racks' grid-side power]
        domain_hi = np.zeros(site.n_domains)
        domain_w = np.zeros(site.n_domains)
        d_start, d_stop, lo, r0 = _domain_gather(site)
        head_w, head_hi = domain_w[:lo], domain_hi[:lo]
        tail_w, csum_tail = domain_w[lo:], domain_csum[r0 + 1 : r0 + 1 + site.n_domains - lo]
        csum_prev = domain_csum[r0 : r0 + site.n_domains - lo]
        # only the recorded domains' loads are averaged over the period: gather those when they are few
        gather_rec = rec_d.size < site.n_domains // 2
        domain_w_acc = np.zeros(rec_d.size if gather_rec else site.n_domains)
        domain_rec = np.zeros(rec_d.size)
        # the series, bound once
        s_demand, s_load, s_campus = tick["demand_w"], tick["load_w"], tick["campus_w"]
        s_bess, s_grid, s_pcc, s_freq = tick["bess_w"], tick["grid_w"], tick["pcc_limit_w"], tick["freq_hz"]
        s_bess_soc, s_burn, s_bbu = tick["bess_soc_frac"], tick["floor_burn_w"], tick["bbu_w"]
        s_bbu_min, s_bbu_mean = tick["bbu_soc_min_frac"], tick["bbu_soc_mean_frac"]
        pcc_ramps, pcc_base = self.pcc.varies, self.pcc.base_w
        # What is kept from tick to tick while its inputs stand still: which racks are energized (and the fixed part
        # of their demand), the GPUs' caps and floors (gpus.version), the BBUs' charge (bbus.idle: nothing moved).
        # A storage fault writes the BBUs' charge from outside, so with one in the scenario the charge is re-read.
        energized_seen: npt.NDArray[np.bool_] | None = None
        all_on = True
        fixed_on = 0.0
        gpus_seen = -1
        floors_zero = False
        caps_bind = False
        storage_faults = any(isinstance(f.event, StorageFault) for f in self.faults.faults)
        rack_soc = self.bbus.soc_frac
        soc_fresh = False
        soc_turns_due = True
        k2_rec = self.breakers.pickup_k[rec_d] ** 2
        bbu_soc_min = bbu_soc_mean = math.nan
        volt_on = self.voltage.active  # voltage
        wall0 = time.perf_counter()
        last_progress = wall0

        for k in range(n):
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
                    ext_load_w += ev.load_mw * 1e6
                elif isinstance(ev, CurtailEvent | FrequencyReplayEvent):
                    pass  # the PCC schedule and the replayed deviation (self.replay_dev_hz) already hold it

            # control
            if k % tpp == 0 and k > 0:
                p = k // tpp
                obs = self.observe(t, k - 1, freq_hz)
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

            # plant
            self.faults.storage(t, self.trays, self.bbus, self.bess)
            if energized is not energized_seen:  # the first tick
                energized_seen = energized
                all_on = bool(energized.all())
                fixed_on = float(np.add.reduce(fixed * energized))
            self.workload.advance(dt, job_speed, self.job_suspend, energized)
            self.workload.rack_demand_w(demand)
            draw = self.gpus.step(t, dt, demand, energized)
            np.multiply(gain, draw, out=rack_w)
            rack_w += fixed
            if not all_on:
                rack_w *= energized
            tray_w = self.trays.step(dt, rack_w, None if all_on else energized)
            bbu_cmd = self.voltage.bbu_commands(self.bbu_threshold_w, self.bbu_recharge_w, tray_w)  # voltage: UPS
            grid_rack_w = self.bbus.step(dt, tray_w, *bbu_cmd, energized)
            bess_w = self.bess.step(dt, self.bess_setpoint_w)
            # site.domain_load_w, into this tick's buffers
            np.cumsum(grid_rack_w, out=domain_csum[1:])
            np.take(domain_csum, d_stop, out=head_w)
            np.take(domain_csum, d_start, out=head_hi)
            head_w -= head_hi
            np.subtract(csum_tail, csum_prev, out=tail_w)  # one rack each, in order: slices, not gathers
            campus_w = float(domain_w[0])
            grid_w = campus_w - bess_w
            if self.faults.faults and self.faults.islanded(t):
                grid_w = 0.0  # on backup power: the racks run, the grid sees nothing
            if volt_on:  # voltage: the PCC voltage, the UPS decision for the next tick (gridsim/ridethrough.py)
                self.voltage.step(k, t, dt, grid_w, campus_w, tray_w)
            # The campus domain is the PCC: the battery sits behind it, so its breaker and meter carry the net import.
            domain_w[0] = grid_w
            self.breakers.step(t, dt, domain_w)
            energized = self.breakers.rack_energized()  # the same array until a breaker opens or closes
            if energized is not energized_seen:
                energized_seen = energized
                all_on = bool(energized.all())
                fixed_on = float(np.add.reduce(fixed * energized))
            if freq_model is None:
                freq_model = FrequencyModel(sc.grid, grid_w, dt)
            extra = float(replay_dev[k]) if replay_dev is not None else 0.0
            freq_hz = freq_model.step(grid_w + ext_load_w, extra)

            # throughput of each job: its slowest running rack
            if self.gpus.version != gpus_seen:
                gpus_seen = self.gpus.version
                floors_zero = float(np.max(self.gpus.floor_w, initial=0.0)) <= 0.0
                caps_bind = bool(self.job_racks.size) and bool(np.any(self.gpus.cap_w < peak_w))
            if self.gpus_ramp_limited:
                held_w = self.gpus.power_limit_w(demand)
                binds = bool(self.job_racks.size) and bool(np.any(held_w < peak_w))
            else:
                held_w = self.gpus.cap_w
                binds = caps_bind
            if binds:
                rack_speed = self.gpus.rack_speed_frac(peak_w, held_w)
                job_speed = np.minimum.reduceat(rack_speed[self.job_racks], self.job_starts)
            else:
                job_speed = full_speed  # no cap binds anywhere

            # telemetry and recording
            row = k % rows
            self.ring[row] = grid_rack_w
            self.ring_load[row] = rack_w
            self.ring_grid[row] = grid_w
            if gather_rec:
                np.take(domain_w, rec_d, out=domain_rec)
                domain_w_acc += domain_rec
            else:
                domain_w_acc += domain_w
            # Sums, not `gain @ demand`: numpy's @ on a long vector is BLAS's dot, which splits it over threads
            # (OpenBLAS: above 10,000 racks): its last bit then depends on the machine's core count, and on a busy
            # machine a threaded dot of 14k racks took a millisecond a tick.
            np.multiply(gain, demand, out=demand_w)
            if not all_on:
                demand_w *= energized
            s_demand[k] = float(np.add.reduce(demand_w)) + fixed_on
            s_load[k] = np.add.reduce(rack_w)
            s_campus[k] = campus_w
            s_bess[k] = bess_w
            s_grid[k] = grid_w
            s_pcc[k] = self.pcc.at(t) if pcc_ramps else pcc_base
            s_freq[k] = freq_hz
            s_bess_soc[k] = self.bess.soc_frac
            if floors_zero and not self.gpus_ramp_limited:
                # draw = min(demand, cap) (or 0 where not energized): nothing burns above it
                s_burn[k] = 0.0
            else:
                burn = np.maximum(draw - np.minimum(demand, self.gpus.cap_w), 0.0)
                s_burn[k] = float(np.add.reduce(active_over_eff * burn))
            bbus_idle = self.bbus.idle
            if bbus_idle:
                s_bbu[k] = 0.0
            else:
                s_bbu[k] = float(np.add.reduce(self.bbus.discharge_w) - np.add.reduce(self.bbus.recharge_w))
            if not (bbus_idle and soc_fresh and not storage_faults):
                rack_soc = self.bbus.soc_frac  # a property that computes: shared with the period record
                soc_fresh = True
                soc_turns_due = True
                if any_bbu:
                    bbu_soc = rack_soc[has_bbu]
                    bbu_soc_min = bbu_soc.min()
                    bbu_soc_mean = bbu_soc.mean()
            if any_bbu:
                s_bbu_min[k] = bbu_soc_min
                s_bbu_mean[k] = bbu_soc_mean

            if (k + 1) % tpp == 0 or k == n - 1:
                p = k // tpp
                cnt = (k % tpp) + 1
                period_t[p] = (p * tpp) * dt
                period["domain_w"][p] = (domain_w_acc if gather_rec else domain_w_acc[rec_d]) / cnt
                domain_w_acc[:] = 0.0
                period["domain_thermal_frac"][p] = self.breakers.theta[rec_d] / k2_rec  # thermal_frac()[rec_d]
                period["domain_limit_w"][p] = self.breakers.rating_w[rec_d]
                if n_jobs:
                    first = self.job_first_rack
                    period["job_cap_w"][p] = self.gpus.cap_w[first]
                    period["job_floor_w"][p] = self.gpus.floor_w[first]
                    period["job_speed_frac"][p] = job_speed
                    period["job_state"][p] = self.workload.job_state
                period["rack_w"][p] = grid_rack_w[rec_r]
                period["rack_cap_w"][p] = self.gpus.cap_w[rec_r]
                period["bbu_soc_min_frac"][p] = rack_soc.min() if site.n_racks else np.nan
                if soc_turns_due:  # (a second update with the same SoC changes nothing: skipped)
                    bbu_turns.update(rack_soc)
                    soc_turns_due = False
                loaded_r = rack_w > 0
                if loaded_r.any():
                    ride = np.where(has_bbu, self.bbus.stored_j * bbu_eff, 0.0)[loaded_r] / rack_w[loaded_r]
                    min_ride_through_s = min(min_ride_through_s, float(ride.min()))
                period["bbu_soc_mean_frac"][p] = rack_soc.mean() if site.n_racks else np.nan
                if progress is not None:
                    now = time.perf_counter()
                    if now - last_progress > 0.5:
                        progress((k + 1) / n)
                        last_progress = now

        wall = time.perf_counter() - wall0
        if progress is not None:
            progress(1.0)
        storage = {
            "bess_energy_in_j": float(np.sum(self.bess.energy_in_j)),
            "bess_energy_out_j": float(np.sum(self.bess.energy_out_j)),
            "bess_loss_j": float(np.sum(self.bess.loss_j)),
            "bess_equivalent_cycles": float(np.sum(self.bess.equivalent_cycles())),
            "bbu_energy_in_j": float(np.sum(self.bbus.energy_in_j)),
            "bbu_energy_out_j": float(np.sum(self.bbus.energy_out_j)),
            "bbu_loss_j": float(np.sum(self.bbus.loss_j)),
            "tray_energy_in_j": float(np.sum(self.trays.energy_in_j)),
            "tray_energy_out_j": float(np.sum(self.trays.energy_out_j)),
            "bbu_fault_drained_j": self.faults.drained_j,
            "bbu_usable_j": float(np.sum(bbu_window * self.bbus.capacity_j)),
        }
        worst = float(bbu_turns.cycles_per_rack(bbu_window).max(initial=0.0))
        storage["bbu_equivalent_cycles_max"] = worst if any_bbu else math.nan
        storage["bbu_min_ride_through_s"] = min_ride_through_s if any_bbu else math.nan
        trips = [(float(ts), site.domain_name[d]) for ts, d in self.breakers.trip_log]
        return SimResult(
            scenario=sc.name,
            controller=self.ctrl.name,
            seed=self.seed,
            site=site,
            tick_s=dt,
            duration_s=n * dt,
            t_s=np.arange(n, dtype=np.float64) * dt,
            tick=tick,
            period_t_s=period_t,
            period=period,
            recorded_domains=rec_d,
            recorded_racks=rec_r,
            trips=trips,
            accounting=self.workload.accounting(),
            storage=storage,
            step_ms=step_ms,
            wall_s=wall,
            band_hz=(sc.metrics.band_lo_hz, sc.metrics.band_hi_hz),
            nominal_hz=sc.grid.nominal_hz,
            events_log=events_log,
            voltage=self.voltage.record(),  # voltage
        )
