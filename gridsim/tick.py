"""The plant's tick path: one plant tick at a time, its recording, and the record of each control period.

`TickLoop` holds what a run carries from tick to tick (the series being written, the per-tick buffers, what is kept
while its inputs stand still) so that the engine's loop (gridsim/engine.py: events, control, actuation) and the
period-at-a-time advance (gridsim/period.py) work on one state. The engine calls `tick(k)` for a tick the period
advance does not take; both end a control period with `end_period`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from dimmer.site import SiteModel
from gridsim.plant.grid import FrequencyModel
from gridsim.scenario import StorageFault
from gridsim.wear import SocTurningPoints

if TYPE_CHECKING:
    from gridsim.engine import Simulation

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


def domain_gather(site: SiteModel) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int, int]:
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


# a breaker counts as over its rating above 1 % of it (in current: θ > 1.01²), a meter class's accuracy: one held at
# its rating by a controller settles at θ = 1 from either side, and a knife edge would count its every period
OVERLOAD_HEAT_FRAC = 1.01**2


class TickLoop:
    """A run's state between ticks, and the tick path. Built by `Simulation.run`, one per run."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        site, sc = sim.site, sim.sc
        self.n, self.tpp, self.dt = sim.n_ticks, sim.ticks_per_period, sim.dt
        n, tpp = self.n, self.tpp
        n_periods = (n + tpp - 1) // tpp
        n_jobs = site.n_jobs
        self.tick = {key: np.zeros(n) for key in TICK_SERIES}
        rec_d, rec_r = sim.rec_domains, sim.rec_racks
        self.period = {
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
        self.period_t = np.zeros(n_periods)
        # BBU wear and ride-through: every rack's SoC turning points, and the least time any rack's stored
        # energy could carry its load (over racks and periods)
        self.bbu_turns = SocTurningPoints(sim.bbus.soc_frac)
        self.has_bbu = sim.bbus.capacity_j > 0
        self.bbu_eff = math.sqrt(sim.bbus.round_trip_eff)
        self.min_ride_through_s = math.inf
        # the breakers' thermal state at period ends (a state with a time constant of minutes: a period's
        # sample is its value): the hottest any reached, and how long some breaker ran above its rating's
        self.max_heat_frac = 0.0
        self.overload_s = 0.0
        self.any_bbu = bool(self.has_bbu.any())
        self.bbu_window = sim.bbus.soc_max_frac - sim.bbus.soc_min_frac
        if not self.any_bbu:
            self.tick["bbu_soc_min_frac"][:] = np.nan
            self.tick["bbu_soc_mean_frac"][:] = np.nan
        self.step_ms = np.full(n_periods, np.nan)  # the first period runs hands-off: no telemetry yet

        self.ext_load_w = 0.0
        self.freq_model: FrequencyModel | None = None
        self.freq_hz = sc.grid.nominal_hz
        self.full_speed = np.ones(n_jobs)
        self.peak_w = sim.workload.rack_peak_w()  # constant over the run
        self.job_speed = self.full_speed
        self.energized = np.ones(site.n_racks, dtype=bool)
        self.rows = sim.ring.shape[0]
        self.active_over_eff = site.rack_active_gpus / site.rectifier_eff
        # per-tick buffers: nothing of a tick's size is allocated in the loop
        self.demand = np.zeros(site.n_racks)
        self.rack_w = np.zeros(site.n_racks)
        self.demand_w = np.zeros(site.n_racks)
        self.draw = np.zeros(site.n_racks)
        self.grid_rack_w = np.zeros(site.n_racks)
        self.domain_csum = np.zeros(site.n_racks + 1)  # [0, cumsum of the racks' grid-side power]
        self.domain_hi = np.zeros(site.n_domains)
        self.domain_w = np.zeros(site.n_domains)
        self.d_start, self.d_stop, self.lo, self.r0 = domain_gather(site)
        lo, r0, n_tail = self.lo, self.r0, site.n_domains - self.lo
        self.head_w, self.head_hi = self.domain_w[:lo], self.domain_hi[:lo]
        self.tail_w, self.csum_tail = self.domain_w[lo:], self.domain_csum[r0 + 1 : r0 + 1 + n_tail]
        self.csum_prev = self.domain_csum[r0 : r0 + n_tail]
        # only the recorded domains' loads are averaged over the period: gather those when they are few
        self.gather_rec = rec_d.size < site.n_domains // 2
        self.domain_w_acc = np.zeros(rec_d.size if self.gather_rec else site.n_domains)
        self.domain_rec = np.zeros(rec_d.size)
        self.pcc_ramps, self.pcc_base = sim.pcc.varies, sim.pcc.base_w
        # What is kept from tick to tick while its inputs stand still: which racks are energized (and the fixed part
        # of their demand), the GPUs' caps and floors (gpus.version), the BBUs' charge (bbus.idle: nothing moved).
        # A storage fault writes the BBUs' charge from outside, so with one in the scenario the charge is re-read.
        self.energized_seen: npt.NDArray[np.bool_] | None = None
        self.all_on = True
        self.fixed_on = 0.0
        self.gpus_seen = -1
        self.floors_zero = False
        self.caps_bind = False
        self.storage_faults = any(isinstance(f.event, StorageFault) for f in sim.faults.faults)
        self.rack_soc = sim.bbus.soc_frac
        self.soc_fresh = False
        self.soc_turns_due = True
        self.k2_rec = sim.breakers.pickup_k[rec_d] ** 2
        self.bbu_soc_min = self.bbu_soc_mean = math.nan

    def see_energized(self) -> None:
        """Re-read which racks are energized (the first tick, and after a breaker opens or closes)."""
        self.energized_seen = self.energized
        self.all_on = bool(self.energized.all())
        self.fixed_on = float(np.add.reduce(self.sim.rack_fixed * self.energized))

    def update_job_speed(self, demand: FloatArray) -> None:
        """Throughput of each job: its slowest running rack (after the GPUs' step, for the next tick)."""
        sim = self.sim
        gpus = sim.gpus
        if gpus.version != self.gpus_seen:
            self.gpus_seen = gpus.version
            self.floors_zero = float(np.max(gpus.floor_w, initial=0.0)) <= 0.0
            self.caps_bind = bool(sim.job_racks.size) and bool(np.any(gpus.cap_w < self.peak_w))
        if sim.gpus_ramp_limited:
            held_w = gpus.power_limit_w(demand)
            binds = bool(sim.job_racks.size) and bool(np.any(held_w < self.peak_w))
        else:
            held_w = gpus.cap_w
            binds = self.caps_bind
        if binds:
            rack_speed = gpus.rack_speed_frac(self.peak_w, held_w)
            self.job_speed = np.minimum.reduceat(rack_speed[sim.job_racks], sim.job_starts)
        else:
            self.job_speed = self.full_speed  # no cap binds anywhere

    def tick_at(self, k: int) -> None:
        """Plant tick k: storage faults, workload, GPUs, trays, BBUs, domains, battery, breakers, frequency, then
        the tick's recording (and the period's, when k ends one)."""
        sim, dt = self.sim, self.dt
        t = k * dt
        sim.faults.storage(t, sim.trays, sim.bbus, sim.bess)
        energized = self.energized
        if energized is not self.energized_seen:  # the first tick
            self.see_energized()
        all_on = self.all_on
        demand, rack_w, domain_w = self.demand, self.rack_w, self.domain_w
        gain, fixed = sim.rack_gain, sim.rack_fixed
        sim.workload.advance(dt, self.job_speed, sim.job_suspend, energized)
        sim.workload.rack_demand_w(demand)
        draw = sim.gpus.step(t, dt, demand, energized)
        np.multiply(gain, draw, out=rack_w)
        rack_w += fixed
        if not all_on:
            rack_w *= energized
        tray_w = sim.trays.step(dt, rack_w, None if all_on else energized)
        threshold_w, recharge_w = sim.bbu_threshold_w, sim.bbu_recharge_w
        if sim.voltage.active:  # a UPS carrying its share from the BBUs (gridsim/ridethrough.py)
            threshold_w, recharge_w = sim.voltage.bbu_commands(threshold_w, recharge_w, tray_w)
        grid_rack_w = sim.bbus.step(dt, tray_w, threshold_w, recharge_w, energized)
        bess_w = sim.bess.step(dt, sim.bess_setpoint_w)
        # site.domain_load_w, into this tick's buffers
        np.cumsum(grid_rack_w, out=self.domain_csum[1:])
        np.take(self.domain_csum, self.d_stop, out=self.head_w)
        np.take(self.domain_csum, self.d_start, out=self.head_hi)
        self.head_w -= self.head_hi
        np.subtract(self.csum_tail, self.csum_prev, out=self.tail_w)  # one rack each, in order: slices, not gathers
        campus_w = float(domain_w[0])
        grid_w = campus_w - bess_w
        if sim.faults.faults and sim.faults.islanded(t):
            grid_w = 0.0  # on backup power: the racks run, the grid sees nothing
        if sim.voltage.active:  # the PCC voltage, and the UPS decision for the next tick (gridsim/ridethrough.py)
            sim.voltage.step(k, t, dt, grid_w, campus_w, tray_w)
        # The campus domain is the PCC: the battery sits behind it, so its breaker and meter carry the net import.
        domain_w[0] = grid_w
        if k == 0:
            sim.breakers.warm(domain_w)
        sim.breakers.step(t, dt, domain_w)
        self.energized = energized = sim.breakers.rack_energized()  # the same array until a breaker opens or closes
        if energized is not self.energized_seen:
            self.see_energized()
        if self.freq_model is None:
            self.freq_model = FrequencyModel(sim.sc.grid, grid_w, dt)
        extra = float(sim.replay_dev_hz[k]) if sim.replay_dev_hz is not None else 0.0
        self.freq_hz = freq_hz = self.freq_model.step(grid_w + self.ext_load_w, extra)
        self.update_job_speed(demand)

        # telemetry and recording
        row = k % self.rows
        sim.ring[row] = grid_rack_w
        sim.ring_load[row] = rack_w
        sim.ring_grid[row] = grid_w
        if self.gather_rec:
            np.take(domain_w, sim.rec_domains, out=self.domain_rec)
            self.domain_w_acc += self.domain_rec
        else:
            self.domain_w_acc += domain_w
        # Sums, not `gain @ demand`: numpy's @ on a long vector is BLAS's dot, which splits it over threads
        # (OpenBLAS: above 10,000 racks): its last bit then depends on the machine's core count, and on a busy
        # machine a threaded dot of 14k racks took a millisecond a tick.
        demand_w = self.demand_w
        np.multiply(gain, demand, out=demand_w)
        if not self.all_on:
            demand_w *= energized
        tick = self.tick
        tick["demand_w"][k] = float(np.add.reduce(demand_w)) + self.fixed_on
        tick["load_w"][k] = np.add.reduce(rack_w)
        tick["campus_w"][k] = campus_w
        tick["bess_w"][k] = bess_w
        tick["grid_w"][k] = grid_w
        tick["pcc_limit_w"][k] = sim.pcc.at(t) if self.pcc_ramps else self.pcc_base
        tick["freq_hz"][k] = freq_hz
        tick["bess_soc_frac"][k] = sim.bess.soc_frac
        if self.floors_zero and not sim.gpus_ramp_limited:
            # draw = min(demand, cap) (or 0 where not energized): nothing burns above it
            tick["floor_burn_w"][k] = 0.0
        else:
            burn = np.maximum(draw - np.minimum(demand, sim.gpus.cap_w), 0.0)
            tick["floor_burn_w"][k] = float(np.add.reduce(self.active_over_eff * burn))
        bbus = sim.bbus
        if bbus.idle:
            tick["bbu_w"][k] = 0.0
        else:
            tick["bbu_w"][k] = float(np.add.reduce(bbus.discharge_w) - np.add.reduce(bbus.recharge_w))
        self.read_soc()
        if self.any_bbu:
            tick["bbu_soc_min_frac"][k] = self.bbu_soc_min
            tick["bbu_soc_mean_frac"][k] = self.bbu_soc_mean
        self.draw, self.grid_rack_w = draw, grid_rack_w
        if (k + 1) % self.tpp == 0 or k == self.n - 1:
            self.end_period(k)

    def read_soc(self) -> None:
        """The BBUs' state of charge after a tick, re-read unless nothing moved since it was last read."""
        if not (self.sim.bbus.idle and self.soc_fresh and not self.storage_faults):
            self.rack_soc = self.sim.bbus.soc_frac  # a property that computes: shared with the period record
            self.soc_fresh = True
            self.soc_turns_due = True
            if self.any_bbu:
                bbu_soc = self.rack_soc[self.has_bbu]
                self.bbu_soc_min = bbu_soc.min()
                self.bbu_soc_mean = bbu_soc.mean()

    def end_period(self, k: int) -> None:
        """Record the control period that tick k ends (from the state after tick k)."""
        sim, site, period, tpp = self.sim, self.sim.site, self.period, self.tpp
        rec_d, rec_r = sim.rec_domains, sim.rec_racks
        p = k // tpp
        cnt = (k % tpp) + 1
        self.period_t[p] = (p * tpp) * self.dt
        period["domain_w"][p] = (self.domain_w_acc if self.gather_rec else self.domain_w_acc[rec_d]) / cnt
        self.domain_w_acc[:] = 0.0
        period["domain_thermal_frac"][p] = sim.breakers.theta[rec_d] / self.k2_rec  # thermal_frac()[rec_d]
        hottest = float(sim.breakers.theta.max(initial=0.0))
        self.max_heat_frac = max(self.max_heat_frac, hottest)
        if hottest > OVERLOAD_HEAT_FRAC:
            self.overload_s += cnt * self.dt
        period["domain_limit_w"][p] = sim.breakers.rating_w[rec_d]
        if site.n_jobs:
            first = sim.job_first_rack
            period["job_cap_w"][p] = sim.gpus.cap_w[first]
            period["job_floor_w"][p] = sim.gpus.floor_w[first]
            period["job_speed_frac"][p] = self.job_speed
            period["job_state"][p] = sim.workload.job_state
        period["rack_w"][p] = self.grid_rack_w[rec_r]
        period["rack_cap_w"][p] = sim.gpus.cap_w[rec_r]
        rack_soc = self.rack_soc
        period["bbu_soc_min_frac"][p] = rack_soc.min() if site.n_racks else np.nan
        if self.soc_turns_due:  # (a second update with the same SoC changes nothing: skipped)
            self.bbu_turns.update(rack_soc)
            self.soc_turns_due = False
        rack_w = self.rack_w
        loaded_r = rack_w > 0
        if loaded_r.any():
            ride = np.where(self.has_bbu, sim.bbus.stored_j * self.bbu_eff, 0.0)[loaded_r] / rack_w[loaded_r]
            self.min_ride_through_s = min(self.min_ride_through_s, float(ride.min()))
        period["bbu_soc_mean_frac"][p] = rack_soc.mean() if site.n_racks else np.nan

    def breaker_totals(self) -> dict[str, float]:
        """The run's breaker heat, at its end: the hottest thermal state any breaker reached (1.0: the steady
        state at its rating) and the time some breaker was above OVERLOAD_HEAT_FRAC (1 % over its rating)."""
        return {"max_heat_frac": self.max_heat_frac, "overload_s": self.overload_s}

    def storage_totals(self) -> dict[str, float]:
        """The run's storage bookkeeping, at its end."""
        sim = self.sim
        bess, bbus = sim.bess, sim.bbus
        storage = {
            "bess_energy_in_j": float(np.sum(bess.energy_in_j)),
            "bess_energy_out_j": float(np.sum(bess.energy_out_j)),
            "bess_loss_j": float(np.sum(bess.loss_j)),
            "bess_equivalent_cycles": float(np.sum(bess.equivalent_cycles())),
            "bbu_energy_in_j": float(np.sum(bbus.energy_in_j)),
            "bbu_energy_out_j": float(np.sum(bbus.energy_out_j)),
            "bbu_loss_j": float(np.sum(bbus.loss_j)),
            "tray_energy_in_j": float(np.sum(sim.trays.energy_in_j)),
            "tray_energy_out_j": float(np.sum(sim.trays.energy_out_j)),
            "bbu_fault_drained_j": sim.faults.drained_j,
            "bbu_usable_j": float(np.sum(self.bbu_window * bbus.capacity_j)),
        }
        worst = float(self.bbu_turns.cycles_per_rack(self.bbu_window).max(initial=0.0))
        storage["bbu_equivalent_cycles_max"] = worst if self.any_bbu else math.nan
        storage["bbu_min_ride_through_s"] = self.min_ride_through_s if self.any_bbu else math.nan
        return storage
