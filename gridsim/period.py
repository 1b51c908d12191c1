"""The plant advanced a control period at a time: the period's ticks as (ticks x racks) arrays (issue 13, part 4).

Between two control steps nothing reaches the plant from outside, and most periods nothing discrete happens inside
one: no scenario event, no actuation due, no fault starting or ending, no job changing state, no breaker tripping,
caps and floors settled, no ramp limit. Then the tick path's work falls in two kinds:

- what depends only on the tick's own inputs (rack demand from the workload's levels, the GPUs' draw, rack power,
  the domains' loads, every series the run records): computed once for all the period's ticks, row by row the same
  operations on the same numbers, so every value is the tick path's to the bit (a sum over racks is numpy's pairwise
  sum of each row, as `np.add.reduce` of the row; a cumulative sum along the ticks adds in the ticks' order);
- what carries a state from tick to tick (the trays' low-pass and charge, BBUs that move, the campus battery, the
  breakers' thermal state, the frequency model, the background's noise): stepped tick by tick, with the same
  operations as the tick path (most by calling the same `step`), over arrays the block already holds.

So the period path is not an approximation of the tick path: it is the tick path's arithmetic, rearranged. The tests
(tests/test_period_advance.py) hold it to equality with the tick path, bit for bit, on scenarios that exercise each
reason to fall back.

`PeriodBlock.advance` refuses a period (returns False, with the plant as it found it) where a precondition fails,
and where, having computed the period, a breaker would trip inside it: it then puts back what it changed and the
engine runs the period tick by tick.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from gridsim.plant import gpu_period, workload_period
from gridsim.scenario import BackupTransferEvent
from gridsim.tick import TickLoop

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

_TRAY_ARRAYS = ("_lp_w", "energy_j", "power_w", "upstream_w")
_BBU_ARRAYS = ("stored_j", "discharge_w", "recharge_w", "upstream_w")


# Above this many (tick, rack) cells a period's arrays outgrow the caches a tick's arrays stay in, and a tick's cost
# is its arithmetic, not numpy's per-call overhead: the tick path is then as fast or faster (measured on a 2-core
# EPYC VM: 1,920 racks x 10 ticks 30 % faster a period at a time, 4,480 racks 9 % slower, 14,080 racks up to 1.8x).
MAX_CELLS = 32_768


class PeriodBlock:
    """A control period's ticks at once, on the state of `loop` (which runs them one by one when this refuses)."""

    @staticmethod
    def pays(n_racks: int, ticks_per_period: int) -> bool:
        """Whether taking periods at once is worth it on a site of `n_racks` (the default of Simulation)."""
        return n_racks * ticks_per_period <= MAX_CELLS

    def __init__(self, loop: TickLoop) -> None:
        self.loop = loop
        sim = loop.sim
        self.islands = [f for f in sim.faults.faults if isinstance(f.event, BackupTransferEvent)]
        self.taken = 0  # periods advanced here
        self.refused: dict[str, int] = {}  # periods run tick by tick, by why

    def _refusal(self, k0: int, quiet_until_s: float) -> str:
        """Why the period starting at tick k0 must run tick by tick, of what needs nothing computed to know; "" if
        nothing: nothing from outside, nothing timed, nothing settling."""
        loop = self.loop
        sim, n_ticks, dt = loop.sim, loop.tpp, loop.dt
        if k0 == 0 or k0 + n_ticks > loop.n or loop.freq_model is None:
            return "first or last period"
        t_first, t_last = k0 * dt, (k0 + n_ticks - 1) * dt
        if quiet_until_s <= t_last + 1e-9:
            return "event or actuation inside"
        if not loop.all_on or loop.energized is not loop.energized_seen or sim.breakers._any_tripped:
            return "breaker open"
        if sim.gpus_ramp_limited:
            return "gpu ramp limit"
        if sim.voltage.active:  # a UPS decision each tick from the PCC voltage (gridsim/ridethrough.py)
            return "voltage model"
        if not sim.gpus._primed:
            return "first or last period"
        if not (sim.trays._primed and sim.trays._dt_s == dt and sim.breakers._dt_s == dt):
            return "first or last period"
        if sim.faults.faults:
            if sim.faults._next_change_s <= t_last + 1e-9:
                return "storage fault begins or ends inside"
            if any(f.start_s <= t_last + 1e-9 and f.end_s > t_first for f in self.islands):
                return "on backup power"
        return ""

    def _refuse(self, why: str) -> bool:
        self.refused[why] = self.refused.get(why, 0) + 1
        return False

    def advance(self, k0: int, quiet_until_s: float) -> bool:
        """Advance the plant over the control period starting at tick k0 (events and actions of tick k0 applied);
        True when done, False (the plant untouched) when the engine must run the period tick by tick."""
        why = self._refusal(k0, quiet_until_s)
        if why:
            return self._refuse(why)
        loop = self.loop
        sim, n_ticks, dt = loop.sim, loop.tpp, loop.dt
        wl, gpus = sim.workload, sim.gpus
        # The job speed of the period's first tick is the one the last tick left; every later tick's is the one the
        # tick path computes after the tick before, from that tick's caps.
        speed_in = loop.job_speed
        steps = np.empty((n_ticks, sim.site.n_jobs))
        steps[0] = speed_in
        gpu_snap = None
        caps: FloatArray | None = None
        floors: FloatArray | None = None
        if gpu_period.static(gpus, (k0 + n_ticks) * dt):  # caps and floors stand over the period
            loop.update_job_speed(loop.demand)
            steps[1:] = loop.job_speed
        else:
            gpu_snap = gpu_period.snapshot(gpus)
            caps, floors = gpu_period.actuate_ticks(gpus, k0, n_ticks, dt)
            speed, floors_zero, binds = gpu_period.speeds_after(
                caps, floors, loop.peak_w, sim.job_racks, sim.job_starts, sim.site
            )
            steps[1:] = speed[:-1]
        np.maximum(steps, 0.0, out=steps)
        np.minimum(steps, 1.0, out=steps)
        steps *= wl._prog_f
        steps *= dt
        wl_snap = workload_period.snapshot(wl)
        demand = workload_period.advance_ticks(wl, dt, steps, sim.job_suspend)
        plant = None
        if demand is not None:
            undo = self._snapshot()
            plant = self._plant(demand, caps, floors)
            if plant is None:  # a breaker trips inside the period: the tick path logs it at its tick
                self._restore(undo)
                workload_period.restore(wl, wl_snap)
        if plant is None:
            if gpu_snap is not None:
                gpu_period.restore(gpus, gpu_snap)
            loop.job_speed = speed_in
            return self._refuse("a job changes state inside" if demand is None else "a breaker trips inside")
        assert demand is not None
        burn_off: BoolArray | bool = loop.floors_zero
        if caps is not None:  # the engine's reading of the caps after the period's last tick
            loop.gpus_seen = gpus.version
            loop.floors_zero = bool(floors_zero[-1])
            loop.caps_bind = bool(binds[-1])
            loop.job_speed = speed[-1] if binds[-1] else loop.full_speed
            burn_off = floors_zero
        self._record(k0, demand, caps, burn_off, *plant)
        self.taken += 1
        return True

    # -- rollback --------------------------------------------------------------------------------------------------

    def _snapshot(self) -> tuple[Any, ...]:
        sim = self.loop.sim
        trays, bbus, bess = sim.trays, sim.bbus, sim.bess
        return (
            [getattr(trays, a).copy() for a in _TRAY_ARRAYS],
            (trays.energy_in_j, trays.energy_out_j),
            [getattr(bbus, a).copy() for a in _BBU_ARRAYS],
            (bbus.energy_in_j, bbus.energy_out_j, bbus.idle),
            (bess.stored_j, bess.power_w, bess.energy_in_j, bess.energy_out_j, bess._dt_s, bess._decay),
        )

    def _restore(self, snap: tuple[Any, ...]) -> None:
        sim = self.loop.sim
        trays, bbus, bess = sim.trays, sim.bbus, sim.bess
        tray_arrays, tray_j, bbu_arrays, bbu_s, bess_s = snap
        for name, a in zip(_TRAY_ARRAYS, tray_arrays, strict=True):
            np.copyto(getattr(trays, name), a)
        trays.energy_in_j, trays.energy_out_j = tray_j
        for name, a in zip(_BBU_ARRAYS, bbu_arrays, strict=True):
            np.copyto(getattr(bbus, name), a)
        bbus.energy_in_j, bbus.energy_out_j, bbus.idle = bbu_s
        bess.stored_j, bess.power_w, bess.energy_in_j, bess.energy_out_j, bess._dt_s, bess._decay = bess_s

    # -- the plant -------------------------------------------------------------------------------------------------

    def _plant(self, demand: FloatArray, caps: FloatArray | None, floors: FloatArray | None) -> tuple[Any, ...] | None:
        """GPUs, trays, BBUs, domains, battery, breakers over the period's ticks; None where a breaker trips.
        `caps`, `floors`: each tick's (n_ticks, n_racks), or None where the bank's stand over the period."""
        loop = self.loop
        sim, n_ticks, dt = loop.sim, loop.tpp, loop.dt
        gpus, trays, bbus, breakers = sim.gpus, sim.trays, sim.bbus, sim.breakers
        energized = loop.energized
        # GpuBank.step with no ramp limit, its actuation done (gpu_period.actuate_ticks)
        draw = np.maximum(demand, gpus.floor_w if floors is None else floors)
        np.minimum(draw, gpus.cap_w if caps is None else caps, out=draw)
        np.multiply(draw, energized, out=draw)
        rack_w = sim.rack_gain * draw
        rack_w += sim.rack_fixed
        tray_w = trays.step_ticks(dt, rack_w)
        # the BBUs: backup only and full over the whole period moves nothing (RackBbus._all_idle, each tick)
        thr, rec = sim.bbu_threshold_w, sim.bbu_recharge_w
        idle = (
            float(np.minimum.reduce(thr, initial=math.inf)) == math.inf
            and not math.isnan(float(np.minimum.reduce(rec, initial=math.inf)))
            and bool(np.isfinite(np.add.reduce(tray_w, axis=1)).all())
            and bool(np.array_equal(bbus.stored_j, bbus._max_j))
        )
        bbu_w: FloatArray | None = None
        stored: FloatArray | None = None
        if idle:
            grid_rack_w = tray_w + 0.0
            grid_rack_w *= energized
        else:
            grid_rack_w = np.empty_like(rack_w)
            stored = np.empty_like(rack_w)
            bbu_w = np.zeros(n_ticks)
            for i in range(n_ticks):
                np.copyto(grid_rack_w[i], bbus.step(dt, tray_w[i], thr, rec, energized))
                np.copyto(stored[i], bbus.stored_j)
                if not bbus.idle:
                    bbu_w[i] = float(np.add.reduce(bbus.discharge_w) - np.add.reduce(bbus.recharge_w))
        # site.domain_load_w of every tick, as the tick path computes it
        n_racks = sim.site.n_racks
        csum = np.zeros((n_ticks, n_racks + 1))
        np.cumsum(grid_rack_w, axis=1, out=csum[:, 1:])
        lo, r0 = loop.lo, loop.r0
        n_tail = sim.site.n_domains - lo
        domain_w = np.empty((n_ticks, sim.site.n_domains))
        head = domain_w[:, :lo]
        np.take(csum, loop.d_stop, axis=1, out=head)
        head -= np.take(csum, loop.d_start, axis=1)
        np.subtract(csum[:, r0 + 1 : r0 + 1 + n_tail], csum[:, r0 : r0 + n_tail], out=domain_w[:, lo:])
        campus = domain_w[:, 0].tolist()
        bess_w, grid_w, bess_soc = [], [], []
        for i in range(n_ticks):
            b = sim.bess.step(dt, sim.bess_setpoint_w)
            bess_w.append(b)
            grid_w.append(campus[i] - b)
            bess_soc.append(sim.bess.soc_frac)
        domain_w[:, 0] = grid_w
        # BreakerBank.step with nothing tripped: the thermal state tick by tick, then whether anything trips
        r2 = domain_w * breakers._inv_rating
        np.square(r2, out=r2)
        breakers.heat(r2)  # (an I²t curve's drive; nothing on other curves)
        theta = np.empty_like(r2)
        th = breakers.theta
        for i in range(n_ticks):
            np.subtract(th, r2[i], out=theta[i])
            theta[i] *= breakers._decay
            theta[i] += r2[i]
            th = theta[i]
        if bool(np.any(theta >= breakers._k2)) or bool(np.any(r2 >= breakers._ii2)):
            return None
        np.copyto(breakers.theta, theta[-1])
        np.copyto(gpus.draw_w, draw[-1])
        if idle:
            np.copyto(bbus.upstream_w, grid_rack_w[-1])
            if not bbus.idle:
                bbus.discharge_w.fill(0.0)
                bbus.recharge_w.fill(0.0)
                bbus.idle = True
        return draw, rack_w, grid_rack_w, domain_w, campus, bess_w, grid_w, bess_soc, bbu_w, stored

    # -- recording -------------------------------------------------------------------------------------------------

    def _record(
        self,
        k0: int,
        demand: FloatArray,
        caps: FloatArray | None,
        burn_off: BoolArray | bool,
        draw: FloatArray,
        rack_w: FloatArray,
        grid_rack_w: FloatArray,
        domain_w: FloatArray,
        campus: list[float],
        bess_w: list[float],
        grid_w: list[float],
        bess_soc: list[float],
        bbu_w: FloatArray | None,
        stored: FloatArray | None,
    ) -> None:
        """The frequency model over the period, then what the tick path records each tick, as slices."""
        loop = self.loop
        sim, n_ticks, dt = loop.sim, loop.tpp, loop.dt
        ks = slice(k0, k0 + n_ticks)
        fm = loop.freq_model
        assert fm is not None
        ext = loop.ext_load_w
        replay = sim.replay_dev_hz
        extra = replay[ks].tolist() if replay is not None else [0.0] * n_ticks
        freq = [fm.step(g + ext, x) for g, x in zip(grid_w, extra, strict=True)]
        loop.freq_hz = freq[-1]

        rows = loop.rows
        first = max(0, n_ticks - rows)  # a ring shorter than the period keeps its last ticks
        ring_rows = np.arange(k0 + first, k0 + n_ticks) % rows
        sim.ring[ring_rows] = grid_rack_w[first:]
        sim.ring_load[ring_rows] = rack_w[first:]
        sim.ring_grid[ring_rows] = grid_w[first:]
        acc = loop.domain_w_acc
        for row in domain_w[:, sim.rec_domains] if loop.gather_rec else domain_w:
            acc += row  # tick after tick (a reduce along the ticks may add them in another order)

        tick = loop.tick
        gain = sim.rack_gain
        tick["demand_w"][ks] = np.add.reduce(gain * demand, axis=1) + loop.fixed_on
        tick["load_w"][ks] = np.add.reduce(rack_w, axis=1)
        tick["campus_w"][ks] = campus
        tick["bess_w"][ks] = bess_w
        tick["grid_w"][ks] = grid_w
        pcc = sim.pcc
        tick["pcc_limit_w"][ks] = [pcc.at(k * dt) for k in range(k0, k0 + n_ticks)] if loop.pcc_ramps else pcc.base_w
        tick["freq_hz"][ks] = freq
        tick["bess_soc_frac"][ks] = bess_soc
        # nothing burns above the draw where every floor is 0 after the tick (and no ramp limit: a precondition)
        if burn_off is True:
            tick["floor_burn_w"][ks] = 0.0
        else:
            burn = np.maximum(draw - np.minimum(demand, sim.gpus.cap_w if caps is None else caps), 0.0)
            tick["floor_burn_w"][ks] = np.where(burn_off, 0.0, np.add.reduce(loop.active_over_eff * burn, axis=1))
        tick["bbu_w"][ks] = 0.0 if bbu_w is None else bbu_w
        if stored is None:  # nothing moved: one read of the charge stands for every tick (TickLoop.read_soc)
            loop.read_soc()
            if loop.any_bbu:
                tick["bbu_soc_min_frac"][ks] = loop.bbu_soc_min
                tick["bbu_soc_mean_frac"][ks] = loop.bbu_soc_mean
        else:  # RackBbus.soc_frac of every tick's charge
            bbus = sim.bbus
            soc = np.full_like(stored, bbus.soc_max_frac)
            np.divide(stored, bbus.capacity_j, out=soc, where=bbus._has_capacity)
            np.clip(soc, bbus.soc_min_frac, bbus.soc_max_frac, out=soc)
            loop.rack_soc = soc[-1].copy()
            loop.soc_fresh = True
            loop.soc_turns_due = True
            if loop.any_bbu:
                with_bbu = np.ascontiguousarray(soc[:, loop.has_bbu])  # rows summed as a rack array is summed
                tick["bbu_soc_min_frac"][ks] = with_bbu.min(axis=1)
                tick["bbu_soc_mean_frac"][ks] = with_bbu.mean(axis=1)
                loop.bbu_soc_min = tick["bbu_soc_min_frac"][k0 + n_ticks - 1]
                loop.bbu_soc_mean = tick["bbu_soc_mean_frac"][k0 + n_ticks - 1]

        # the last tick's arrays, which the period record and the next tick read
        np.copyto(loop.demand, demand[-1])
        np.copyto(loop.rack_w, rack_w[-1])
        np.copyto(loop.domain_w, domain_w[-1])
        loop.grid_rack_w = grid_rack_w[-1].copy()
        loop.draw = sim.gpus.draw_w
        loop.end_period(k0 + n_ticks - 1)
