"""The dimmer controller: progressive, job-aware capping coordinated with every level of storage.

Layers, each vectorised over the tree (docs/controller.md has the equations):
1. Grid shaping: the grid target G follows a low-passed campus demand (and a load its caps hold back as far as the
   ramp allows), moves no faster than the utility ramp limit and stays under the interconnect limit; the campus
   battery supplies the difference within its power and SoC window, with a slow SoC recovery. The ramp rule itself
   is held as the utility measures it (ramp_room.py: the least and most the import may be held at, from its last
   two windows): the battery first keeps the import inside that room, then a cut at the campus (demand too high) or
   a floor (demand falling faster than the grid may follow); a stopped job's return is held for at the exchange
   rate of goodput for energy.
2. Progressive capping: every domain's load envelope (the RMS of recent periods; at the interconnect, a hard
   limit, the most its racks may draw under the caps in force, since 1 s readings hide a swing's peaks) against
   its rating gives a cut that grows smoothly from a soft threshold, with an emergency path near a trip (an
   overload a breaker that reports itself cool can carry is cut at the ramp instead); cuts go to the lowest
   priority first as one cap per job. Caps fall at once and rise slowly, with hysteresis.
3. Trough filling: GPU power floors, raised only when the battery cannot absorb a fall, released at the ramp limit.
4. Rack storage: BBUs are backup units first (rack_storage.py): backup only unless a domain is planned over its
   soft threshold, then they take the excess before a cap does, within a ride-through reserve and a depth-weighted
   cycle budget; recharged slowly, only with room.
5. Safety: stale or missing telemetry (a lost reading held for stale_s first) moves the caps it concerns down to
   a safe level, never up; the planned load of every domain is checked against its rating before the actions leave.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from dimmer.control import register
from dimmer.control.allocation import JobGpus, grant, job_gpus_per_domain, plan_groups, shed, shed_past_the_draw
from dimmer.control.campus_battery import bess_room, campus_level, soc_pull_w
from dimmer.control.cap_landing import CapLanding
from dimmer.control.dimmer_params import DimmerParams
from dimmer.control.ffr import FastFrequencyResponse
from dimmer.control.filters import LowPass, Window, progressive_cut_w
from dimmer.control.peak_readings import PeakReadings
from dimmer.control.plausibility import HIGH, PHRASES, PccCheck
from dimmer.control.rack_math import RackMath, clip_float, nan_to_num, same_bits
from dimmer.control.rack_storage import BbuPolicy
from dimmer.control.ramp_room import RampRoom, ReturnHold
from dimmer.control.ride_through import RideThrough
from dimmer.control.start_room import start_ceiling_w
from dimmer.errors import from_validation_error
from dimmer.observation import Actions, Observation, Reason
from dimmer.site import SiteModel

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.intp]

MAX_REASONS = 32  # per step; the rest are counted in one summary reason


class DimmerController:
    name = "dimmer"

    def __init__(self, site: SiteModel, params: DimmerParams) -> None:
        self.site = site
        self.p = params
        gpu = site.gpu
        self.eta = site.rectifier_eff
        self.rm = RackMath(site)  # the site's rack arithmetic, its constants worked out once
        self.job_racks = site.rack_job >= 0
        self.gpus = job_gpus_per_domain(site)  # (n_domains, n_jobs)
        self.job_gpus = JobGpus(self.gpus)  # (the same, with what the allocation reads of it kept)
        self.groups = plan_groups(site)  # by priority, then by each job's own throughput curve
        self.running_rack = (site.rack_job >= 0) & ~site.rack_is_spare
        self.job_rack = np.where(site.rack_job >= 0, site.rack_job, 0)
        # the running racks grouped by job (stable: rack order within a job), for per-job reductions in one pass
        # each (ufunc.at took 0.6 ms a call at 14,080 racks)
        running = np.flatnonzero(self.running_rack)
        self._run_order = running[np.argsort(site.rack_job[running], kind="stable")]
        run_jobs = site.rack_job[self._run_order]
        self._run_starts = np.flatnonzero(np.r_[True, run_jobs[1:] != run_jobs[:-1]]) if running.size else running
        self._run_jobs = run_jobs[self._run_starts]
        self.safe_cap_w = max(gpu.min_cap_w, params.safe_cap_frac * gpu.rated_w)
        n_env = max(1, round(params.envelope_s / params.period_s))
        self.domain_env = Window(site.n_domains, n_env)
        self.rack_env = Window(site.n_racks, n_env)
        # cap rises granted over the last envelope window, newest first (W per domain): the RMS sees them late
        self.recent_rise_w = np.zeros((n_env, site.n_domains))
        # which of its rows hold a rise, as far as this controller wrote them (_rises_unseen: worked out afresh for
        # rows written from outside, a restored state)
        self._rise_rows: BoolArray = np.zeros(n_env, dtype=bool)
        self._rise_rows_of = self.recent_rise_w
        self.rise_unseen_frac = 1.0 - np.arange(n_env) / n_env
        # the level's share unseen of each rise, by its reading count (and the window's length)
        self._unseen_frac: dict[tuple[int, int], FloatArray] = {}
        # ... and over the newest half of the window (a domain's level against its rating, below)
        self.n_recent = max(1, n_env // 2)
        self.rise_unseen_recent_frac = np.maximum(1.0 - np.arange(n_env) / self.n_recent, 0.0)
        self.forecast = LowPass(params.forecast_tau_s)
        self.bus_level = campus_level(
            params.period_s, params.bess_level_s, site.ramp_window_s, params.fill_deadband_frac * site.pcc_limit_w
        )
        self.bbus = BbuPolicy(site, params.bbu_cycle_budget_per_day, params.bbu_reserve_s,
                              params.bbu_recharge_full_tau_s, self.rm)  # fmt: skip
        self.tray_refill_w = site.rack_storage.tray_refill_w()  # (each rack's, over its load while its tray refills)
        self.job_run_since_s = np.full(site.n_jobs, -math.inf)  # when each job last began running (inf: not now)
        self.long_env_w = np.full(site.n_racks, np.nan)  # each rack's peak reading, held over return_hold_s
        self.ran_at_w = np.full(site.n_racks, np.nan)  # that hold when the rack's job last ran (NaN: not seen)
        self.ceiled_from_w = np.full(site.n_jobs, np.nan)  # each stopped job's cap before its start ceiling
        self.long_env_at_s = np.full(site.n_racks, -math.inf)  # when each rack's reading last reached its hold
        self.peaks = PeakReadings(site.n_racks, params.flat_frac, params.return_hold_full_s)
        self.prev_bound_excess_w = math.inf  # the racks' bound over the grid ceiling last period
        self.prev_pcc_limit_w: float | None = None
        self.prev_limit_fall_w = 0.0  # how far the limit fell in the period before
        self.was_blind = False  # the last step had no trusted PCC reading
        self.bess_was_online = True
        self.prev_guard_w = np.full(site.n_racks, np.inf)  # each rack's guard threshold last period (inf: none)
        self.bound_cover_w = 0.0  # the battery's share of the racks' bound above the grid ceiling, ramped in
        self.rack_last_w = np.full(site.n_racks, np.nan)
        self.rack_seen_t_s = np.full(site.n_racks, -np.inf)  # when each rack's last good reading was taken
        self.pace_level_w = np.full(site.n_domains, np.inf)  # a paced domain's planned level last period
        self.prev_rack_cap_w = np.full(site.n_racks, gpu.rated_w)
        # (a site whose caps go through a BMC: its writes are taken to land as late as such writes do until one lands)
        prior_s = params.cap_delay_oob_s if site.cap_path == "oob" else 0.0
        self.landing = CapLanding(
            site.n_racks, gpu.rated_w, params.cap_delay_s, params.cap_landing_max_s, prior_s=prior_s
        )
        # (_caps_in_force's inputs, as copies, and what it worked out of them: never written to by the step)
        self._caps_kept: tuple[FloatArray, FloatArray, FloatArray, FloatArray] | None = None
        # state
        self.cap_w = np.full(site.n_jobs, gpu.rated_w)
        self.floor_w = np.zeros(site.n_racks)
        self.grid_target_w: float | None = None
        self.bound_w = self.prior_w = math.nan  # (see step: what a parent is told)
        self.return_w = self.return_gpus = 0.0
        self.all_measured = False
        self.rack_bound_w = np.zeros(site.n_racks)
        self.rack_down = np.zeros(site.n_racks, dtype=bool)
        self.ramp_room = RampRoom(site.ramp_window_s, params.period_s)  # the import's history, as the rule reads it
        self.return_hold = ReturnHold(params.goodput_worth_j_per_gpu_s)
        self.t_last_s: float | None = None
        self.first_t_s = 0.0  # the time of this controller's first step (after a restore: its first since)
        all_gpus = float(np.sum(site.rack_active_gpus[site.rack_job >= 0])) or 1.0
        ramp_w_per_s = site.ramp_limit_w_per_min / 60.0
        # floors come down no faster than the grid may: the ramp limit spread over every job GPU
        spread = ramp_w_per_s * params.ramp_margin_frac * self.eta / all_gpus
        default_release = spread if math.isfinite(spread) else gpu.rated_w
        self.floor_release_w_per_s = params.floor_release_w_per_s or default_release
        self.pcc_check = PccCheck(
            site.pcc_limit_w,
            params.pcc_check_frac,
            params.pcc_learn_tau_s,
            params.pcc_stuck_s,
            generation_w=params.behind_meter_generation_w,
        )
        self.rack_max_w = self.rm.rack_max_w
        self.ffr = FastFrequencyResponse.for_site(site, params, self.rack_max_w)  # None: no frequency response
        self.ride = RideThrough.for_site(site, params)  # voltage ride-through (ride_through.py); None: off
        # rack -> the domains above it (CSR rows), for the floors' bound
        self._rack_domains = self.rm.rack_domains

    # -- helpers ---------------------------------------------------------------------------------------------------

    def rack_back_w(self) -> FloatArray:
        """Each rack's bound as at the last step, with its stopped job back where it last ran, at most at its rated
        power, or at that where it has not run since this controller started: a stopped job's caps are held for its
        return, and a parent planning on them would hold them there. Worked out only when a parent asks."""
        back = np.where(
            np.isfinite(self.ran_at_w),
            np.fmin(self.rack_max_w, self.ran_at_w * (1.0 + self.p.hidden_peak_frac)),
            self.rack_max_w,
        )
        out: FloatArray = np.where(self.rack_down, np.fmax(back, self.rack_bound_w), self.rack_bound_w)
        return out

    def _bess_lean_w(self, obs: Observation, plan_w: float) -> float:
        """What the battery could give for `bess_lean_horizon_s` from its charge above its floor (W; at most plan_w)."""
        b = self.site.bess
        if plan_w <= 0 or not math.isfinite(obs.bess_soc_frac):
            return 0.0
        above_j = max(obs.bess_soc_frac - b.soc_min_frac, 0.0) * b.energy_j * math.sqrt(b.round_trip_eff)
        return min(plan_w, above_j / self.p.bess_lean_horizon_s)

    def _rack_caps(self) -> FloatArray:
        """Each rack's per-GPU cap: its job's, or rated for racks with no job."""
        if not self.site.n_jobs:
            return np.full(self.site.n_racks, self.site.gpu.rated_w)
        out: FloatArray = np.where(self.job_racks, self.cap_w[self.job_rack], self.site.gpu.rated_w)
        return out

    def _caps_in_force(self, reported_w: FloatArray) -> tuple[FloatArray, FloatArray]:
        """(each rack's cap as this controller holds it, what each rack draws at the higher of that and the cap its
        GPUs report enforcing: a rack whose writes are lost, or whose firmware ignores them, draws to the cap it
        has, not the one it was sent), kept while neither moves to the bit (most periods)."""
        kept = self._caps_kept
        if kept is None or not (same_bits(self.cap_w, kept[0]) and same_bits(reported_w, kept[1])):
            rack_caps = self._rack_caps()
            enforced_w = np.where(np.isfinite(reported_w), reported_w, self.site.gpu.rated_w)
            at_caps = self.rm.rack_power_w(np.maximum(rack_caps, enforced_w))
            kept = (self.cap_w.copy(), np.array(reported_w, dtype=np.float64), rack_caps, at_caps)
            self._caps_kept = kept
        return kept[2], kept[3]

    def _job_reduce(self, ufunc: np.ufunc, rack_values: FloatArray | BoolArray, out: FloatArray | BoolArray) -> None:
        """out[j] = ufunc(out[j], ufunc over job j's running racks of rack_values), in place (ufunc.at's result)."""
        if self._run_order.size:
            seg = ufunc.reduceat(rack_values[self._run_order], self._run_starts)
            out[self._run_jobs] = ufunc(out[self._run_jobs], seg)

    def _at_risk(self, unknown: BoolArray, bound_rack: FloatArray, overhead_w: float, soft: FloatArray) -> BoolArray:
        """The racks, of those whose reading is `unknown` this period, that could take a domain past its soft level,
        drawing the most they may (their rack maximum: with no reading, neither the load nor that the caps hold is
        known) with every other rack at its bound (for the jobs' caps and the racks' own). Where none can,
        the safe cap and a held rise guard nothing: a rack meter 4 s late that lost two readings in a row sent a job on
        a half-loaded site to the safe cap for 60 % of a run, and one reading in twenty lost held a 100-rack job's cap
        for good (12 % of its GPU time)."""
        worst = self.rm.domain_load_w(np.where(unknown, self.rack_max_w, bound_rack))
        worst[0] += overhead_w
        over = worst > soft
        at_risk: BoolArray = unknown & (self._rack_domains @ over.astype(np.float64) > 0)
        return at_risk

    def _catch_up(self, rack_cap: FloatArray, held_to_w: FloatArray, step_w: float) -> FloatArray:
        """`rack_cap` with the racks held under their jobs' caps last period (`held_to_w`: a stale rack at the safe
        cap, a late one not raised) brought back toward them by `step_w` of draw in all this period. Their bound
        already counts them at their jobs' caps, but the grid has not seen them there: after a meter network
        outage every rack of a site would come back at once."""
        prev = self.prev_rack_cap_w
        behind = (prev < held_to_w) & (rack_cap > prev)
        if not behind.any() or not math.isfinite(step_w):
            return rack_cap
        back_to = np.minimum(rack_cap, held_to_w)  # (a rise of its job's this period is the grant's, not counted)
        total_w = float(np.sum(np.where(behind, self.rm.rack_power_w(back_to) - self.rm.rack_power_w(prev), 0.0)))
        if total_w <= step_w:
            return rack_cap
        out: FloatArray = np.where(behind, prev + step_w / total_w * (back_to - prev), rack_cap)
        return out

    def _domain_rise_w(self, up: FloatArray) -> FloatArray:
        """What per-GPU cap rises `up` (per job) add to each domain (W; none where no job rises)."""
        if not up.any():
            return np.zeros(self.site.n_domains)
        out: FloatArray = self.gpus @ up / self.eta
        return out

    def _rises_unseen(self) -> bool:
        """Some cap rise of the last envelope window is in `recent_rise_w` (a row not all zero)."""
        if self._rise_rows_of is not self.recent_rise_w:
            self._rise_rows = np.any(self.recent_rise_w != 0.0, axis=1)
            self._rise_rows_of = self.recent_rise_w
        return bool(self._rise_rows.any())

    def _caps_bind(self, gpu_env_w: FloatArray) -> bool:
        """Some running job's cap holds it below what it would draw: its racks' envelope reaches the cap (a cap
        above the job's peak costs it nothing and must not block the battery's recharge)."""
        site, gpu = self.site, self.site.gpu
        capped = self.cap_w < gpu.rated_w
        if not capped.any():
            return False
        job_peak = np.zeros(site.n_jobs)
        self._job_reduce(np.maximum, gpu_env_w, job_peak)
        return bool(np.any(capped & (job_peak >= self.cap_w - self.p.cap_rise_w_per_s * self.p.period_s)))

    def _job_hidden_frac(
        self, gpu_env_w: FloatArray, rack_caps: FloatArray, rack_peak_w: FloatArray, rack_trough_w: FloatArray
    ) -> FloatArray:
        """Per job, the share of its peak its readings may hide: `hidden_peak_frac` where its racks' window shows a
        swing, none where every one of its racks read flat across the window (spread within `flat_frac`; the
        window's peak and trough each rack read, NaN where none)."""
        site, p = self.site, self.p
        # (a reading above the rack's cap in force tells nothing of how it swings now: a rack cut from a flat 1,400 W
        # to 1,352 W read a 48 W spread across its window, its own cut taken for a swing)
        peak = np.fmin(self.rm.gpu_draw_for_rack_w(rack_peak_w), rack_caps)
        trough = self.rm.gpu_draw_for_rack_w(rack_trough_w)
        spread = peak - trough  # (finite only where both are: elsewhere no spread is known)
        if not np.isfinite(spread).all():
            spread = np.where(np.isfinite(peak) & np.isfinite(trough), spread, np.inf)
        swings = ~(spread <= p.flat_frac * np.fmax(gpu_env_w, 0.0))
        job_swings = np.zeros(site.n_jobs, dtype=bool)
        self._job_reduce(np.logical_or, swings, job_swings)
        out: FloatArray = np.where(job_swings, p.hidden_peak_frac, 0.0)
        return out

    def _pace_cuts(
        self,
        cut: FloatArray,
        env: FloatArray,
        soft: FloatArray,
        limit: FloatArray,
        over: BoolArray,
        obs: Observation,
        ramp_step: float,
        fall_room_w: float,
    ) -> tuple[FloatArray, BoolArray]:
        """(cuts, which domains are paced). A domain over its rating but within pace_max_frac of it, whose breaker
        reports a thermal state under the emergency level, has its planned level brought down by its share of a ramp
        step a period (shared by excess among the paced domains of each level), not in one step.

        A thermal breaker trips on I^2 t, not on a reading over its rating: cut in one step, a site whose rows start
        17-22 % over theirs dropped 1.4 MW in the first second (the BBUs took another 1.4 MW for one second), and
        its first minute broke a 1 MW/min ramp limit. A breaker that heats to thermal_emergency_frac meanwhile, one
        that reports no state, and an overload past pace_max_frac are cut at once; the interconnect is never
        paced. Nor does a level's pace take the import down further than the ramp rule's room leaves it
        (`fall_room_w`): a paced cut is the controller's choice, and where the load falls by itself (an RL job
        going to its rollouts) the two together broke the rule (oversubscribed-row at seeds 1-3: 14-18 s)."""
        site = self.site
        paced = over.copy()
        if paced[1:].any():  # (no domain over its rating below the campus: none paced)
            paced &= (env < self.p.pace_max_frac * limit) & np.isfinite(obs.domain_thermal_frac)
        paced[0] = False
        if not (paced.any() and math.isfinite(ramp_step)):
            self.pace_level_w = np.full(site.n_domains, np.inf)
            return cut, np.zeros(site.n_domains, dtype=bool)
        excess = np.where(paced, np.maximum(env - soft, 0.0), 0.0)
        level_excess = np.zeros(int(site.domain_level.max()) + 1)
        np.add.at(level_excess, site.domain_level, excess)
        share = excess / np.maximum(level_excess[site.domain_level], 1e-9)
        # (from last period's level, not from the envelope where that is lower: a swing's trough would ratchet it;
        # nor from the domain at its caps where a cut elsewhere took it lower: that step spent the ramp room this
        # level would use, and starting from it took oversubscribed-row 5.4 s past its ramp limit)
        level_w = np.where(np.isfinite(self.pace_level_w), self.pace_level_w, env) - ramp_step * share
        paced_cut = np.where(paced, np.minimum(cut, np.maximum(env - level_w, 0.0)), 0.0)
        level_cut = np.zeros_like(level_excess)
        np.add.at(level_cut, site.domain_level, paced_cut)
        paced_cut *= np.minimum(1.0, fall_room_w / np.maximum(level_cut, 1e-9))[site.domain_level]
        self.pace_level_w = np.where(paced, np.maximum(level_w, env - cut), np.inf)
        out: FloatArray = np.where(paced, paced_cut, cut)
        return out, paced

    def _live_gpus(self, live_rack: BoolArray) -> FloatArray:
        """(n_jobs,) running GPUs of each job on racks that count at their cap."""
        out = np.bincount(
            self.site.rack_job[live_rack], self.site.rack_active_gpus[live_rack], minlength=self.site.n_jobs
        ).astype(np.float64)
        return out

    def _bound_floors(
        self, floor_w: FloatArray, base_gpu_w: FloatArray, load_env: FloatArray, limit: FloatArray, bess_w: float
    ) -> FloatArray:
        """Floors brought back toward each rack's planned draw so that no domain is planned over its limit by them.

        A floor is lifted from the rack's draw before the fall, which the lift's own bound (soft threshold less the
        RMS envelope) does not see, so a floor can hold a row above a rating its caps were set against. What the
        floors add to the plan is affine in each floor's excess over the rack's planned draw, so scaling every
        excess by the smallest share of room among the domains above its rack keeps each domain within its room.
        The campus is planned net of the battery setpoint against its limit in force.
        """
        site = self.site
        job_racks = self.job_racks
        excess_gpu = np.where(job_racks, np.maximum(floor_w - base_gpu_w, 0.0), 0.0)
        if not excess_gpu.any():
            return floor_w
        base_rack = np.where(job_racks, self.rm.rack_power_w(base_gpu_w), load_env)
        base = self.rm.domain_load_w(base_rack)
        base[0] -= bess_w
        # (+0.0 on every rack without an excess: summed only from the first that has one to the last)
        added = self.rm.domain_load_w(site.rack_active_gpus * excess_gpu / self.eta, only_at=np.flatnonzero(excess_gpu))
        room = np.maximum(limit - base, 0.0)
        short = added > room
        share = np.where(short, room / np.maximum(added, 1e-9), 1.0)  # (1 where not short, under 1 where it is)
        # the smallest share among the domains above each rack (every rack is under the campus: no empty segment)
        rack_share = self.rm.ancestor_min(share, short)
        out: FloatArray = np.where(excess_gpu > 0, base_gpu_w + rack_share * excess_gpu, floor_w)
        return out

    # -- the step --------------------------------------------------------------------------------------------------

    def step(self, obs: Observation) -> Actions:
        site, p, gpu = self.site, self.p, self.site.gpu
        dt = p.period_s if self.t_last_s is None else max(obs.t_s - self.t_last_s, 1e-3)
        if self.t_last_s is None:
            self.first_t_s = obs.t_s
        self.t_last_s = obs.t_s
        reasons: list[Reason] = []

        # Telemetry we trust. A reading lost in one period (a real meter network loses ~1 % of them) is not yet
        # missing: its rack holds its last good value while that is younger than stale_s, and only then is it
        # flagged (a lost reading sent its job to the safe cap: 12 % of goodput on a site near no limit). A rack
        # without a fresh reading this period may not have its cap raised.
        fresh = np.isfinite(obs.rack_power_w) & (obs.rack_age_s <= p.stale_s)
        all_fresh = bool(fresh.all())  # (every reading arrived: the masks below are all one way)
        self.rack_last_w = (
            np.array(obs.rack_power_w, dtype=np.float64) if all_fresh
            else np.where(fresh, obs.rack_power_w, self.rack_last_w)
        )  # fmt: skip
        # The hold is timed from when the last good reading was taken, by our clock: a source that reports a NaN
        # as a fresh reading (its age does not grow) would otherwise have its last value held for ever.
        seen_t_s = obs.t_s - obs.rack_age_s if all_fresh else np.where(fresh, obs.t_s - obs.rack_age_s, -np.inf)
        self.rack_seen_t_s = np.maximum(self.rack_seen_t_s, seen_t_s)
        # A rack not yet heard from whose source says its reading is recent (one lost in the first periods) is
        # where a rack whose reading was lost after it was heard is: planned at the most it may draw, having no
        # last value, its cap not raised, and flagged once stale_s has passed since this controller started with
        # nothing from it (late-lossy-meters at seed 1: one reading of 59 lost in the first period sent a
        # 3,776-GPU job to the safe cap, 0.16 % of the run's GPU time). And a source whose latest reading is
        # reported older than stale_s (a device never read) is stale at once, whatever we held.
        if all_fresh:  # (each rack's last reading is this period's: none unheard)
            rack_ok = (obs.rack_age_s <= p.stale_s) & (obs.t_s - self.rack_seen_t_s <= p.stale_s)
            unknown = ~rack_ok
            rack_w = self.rack_last_w
        else:
            unheard = ~np.isfinite(self.rack_last_w)
            held = np.where(unheard, obs.t_s - self.first_t_s, obs.t_s - self.rack_seen_t_s) <= p.stale_s
            rack_ok = (obs.rack_age_s <= p.stale_s) & held
            unknown = ~rack_ok | unheard
            rack_w = np.where(np.isfinite(self.rack_last_w), self.rack_last_w, self.rack_max_w)
        dom_ok = np.isfinite(obs.domain_power_w) & (obs.domain_age_s <= p.stale_s)
        # (the campus's reading is the PCC's, below, with the racks' sum its check: where every other meter reads,
        # only the campus's sum is wanted)
        if dom_ok[1:].all():
            racks_sum_w = self.rm.campus_load_w(rack_w)
            domain_w = obs.domain_power_w.astype(np.float64)
        else:
            from_racks = self.rm.domain_load_w(rack_w)
            racks_sum_w = float(from_racks[0])
            domain_w = np.where(dom_ok, obs.domain_power_w, from_racks)
        pcc_ok = math.isfinite(obs.pcc_power_w) and obs.pcc_age_s <= p.stale_s
        # the campus domain is the PCC: its meter and breaker carry the import, net of the battery behind it; the
        # reading is held to what the racks report, and where it is missing or implausible the racks stand in
        bess_now_w = obs.bess_power_w if obs.bess_online and math.isfinite(obs.bess_power_w) else 0.0
        unknown_w = float(self.rack_max_w @ unknown.astype(np.float64)) if unknown.any() else 0.0
        pcc = self.pcc_check.update(obs.pcc_power_w, pcc_ok, racks_sum_w, bess_now_w, unknown_w, obs.pcc_limit_w, dt)
        domain_w[0] = pcc.used_w
        if pcc.implausible:
            what = PHRASES[pcc.status]
            reasons.append(Reason("safety", what, domain=0, value_w=obs.pcc_power_w - pcc.estimate_w))

        self.domain_env.push(domain_w)
        # the racks' own load (before their BBUs): what the GPUs draw, what the BBUs must follow
        load_ok = rack_ok & np.isfinite(obs.rack_load_w)
        load_w = obs.rack_load_w if load_ok.all() else np.where(load_ok, obs.rack_load_w, np.nan)
        rack_peak_w = self.rack_env.update(load_w)
        rack_trough_w = self.rack_env.trough()
        peak_known = np.isfinite(rack_peak_w)
        load_env = rack_peak_w if peak_known.all() else np.where(peak_known, rack_peak_w, rack_w)
        peak_seen = self.peaks.update(obs.rack_load_peak_w, obs.t_s, load_ok, load_w, rack_trough_w)
        limit = np.asarray(obs.domain_limit_w, dtype=np.float64).copy()

        # Readings lag the caps by a period or two: what the racks can draw under the caps in force now bounds
        # every estimate below, or a cut already made would be made again every period until the readings catch up.
        job_racks = self.job_racks
        # (a rack whose cut is still on its way counts at the cap sent: cap_landing.py)
        in_flight = self.landing.in_flight(obs.t_s, dt, obs.rack_cap_w)
        any_in_flight = bool(in_flight.any())
        reported_w = np.where(in_flight, self.landing.sent_w, obs.rack_cap_w) if any_in_flight else obs.rack_cap_w
        rack_caps, at_caps = self._caps_in_force(reported_w)  # (this period's are decided below)
        gpu_env = self.rm.gpu_draw_for_rack_w(load_env)
        under_caps = np.where(job_racks, self.rm.rack_power_w(np.minimum(gpu_env, rack_caps)), load_env)
        under_caps_w = self.rm.domain_load_w(under_caps)

        # What each rack may draw before its BBU this period. 1 s readings hide a swing's peaks, and a job that
        # stopped (a checkpoint stall, a crash) may return in one tick. So a job rack counts at its highest reading
        # of the last return_hold_s (a peak hold that decays with that time constant, so a stall's rack keeps what
        # it drew while running) plus the share of it a swing's peak may hide (hidden_peak_frac), never above what
        # it can draw under its cap. The interconnect is held on this bound; the battery charges only under it.
        n_jobs = site.n_jobs
        job_rack_now = self.running_rack
        # (a stopped job's hold does not decay: it may return at any time, and only its BBUs can shield that; nor
        # does a running job's within return_hold_full_s of its last peak: a dip in its work is no lasting fall,
        # and a rack under a cut that stays counted at its cap keeps the cut on its own job, not the one above it)
        decay: float | FloatArray = math.exp(-dt / p.return_hold_s) if p.return_hold_s > 0 else 0.0
        decay = np.where(obs.t_s - self.long_env_at_s < p.return_hold_full_s, 1.0, decay)
        if n_jobs and not obs.job_running.all():
            decay = np.where((self.running_rack & obs.job_running[self.job_rack]) | ~self.running_rack, decay, 1.0)
        decayed_w = self.long_env_w * decay
        reached = ~(load_env < decayed_w)  # (and a first reading, or one after a lost hold)
        self.long_env_at_s = np.where(reached & np.isfinite(load_env), obs.t_s, self.long_env_at_s)
        self.long_env_w = np.fmax(load_env, decayed_w)
        self.peaks.hold(decay)

        # (a cap binds where the job's peaks reach it, which its means may not show: counted as free, a cap held
        # at a swing's peak let the battery recharge into the room the job needed to come back, and meter-spike's
        # job stayed capped 360 s after the spike, 0.51 % of its GPU time)
        # (worked out once, where it is asked)
        @functools.cache
        def caps_bind() -> bool:
            if not np.any(self.cap_w < gpu.rated_w):
                return False  # (no job capped: none held back, and no envelope to work out)
            return self._caps_bind(np.fmax(gpu_env, self.rm.gpu_draw_for_rack_w(self.peaks.held_w)))

        # (never above what the rack can draw under its cap: readings lag a cut, and would have it made again)
        held_peak_w = self.long_env_w * (1.0 + p.hidden_peak_frac)
        hidden = np.fmin(at_caps, np.fmax(held_peak_w, load_env))
        bound_rack = np.where(job_rack_now, hidden, load_env)
        # What the racks whose cuts are still on their way may draw over the caps sent until the cuts land: the
        # battery, which acts now, covers it, and a rack's reading is judged against it (not the caps, which would
        # otherwise cut again every period until the first cut shows, out of band for 40 s)
        late_rack_w: FloatArray | float = 0.0
        # (and no cap rises on room that only those cuts make, nor on room a rise still on its way has taken: the
        # readings show neither until it lands. A job given that room at once had its rise land with the cuts, past
        # the limit, under a battery too small to cover both: a curtailment under caps 15 s late, 518 kW over it)
        unseen_move_dom_w: FloatArray | None = None
        rising_w = 0.0  # (what rises still on their way add to the campus once they land)
        if any_in_flight:
            enforced_w = np.where(np.isfinite(obs.rack_cap_w), obs.rack_cap_w, gpu.rated_w)
            at_sent_w, at_enforced_w = self.rm.rack_power_w(rack_caps), self.rm.rack_power_w(enforced_w)
            now_w = np.fmin(np.maximum(at_sent_w, at_enforced_w), np.fmax(held_peak_w, load_env))
            moving = job_rack_now & in_flight
            late_rack_w = np.where(moving, np.maximum(now_w - hidden, 0.0), 0.0)
            rising_rack_w = np.where(moving, np.maximum(at_sent_w - at_enforced_w, 0.0), 0.0)
            unseen_move_dom_w = self.rm.domain_load_w(late_rack_w + rising_rack_w)
            rising_w = float(np.sum(rising_rack_w))
        late_w = float(np.sum(late_rack_w))
        # racks that count at their caps: a cap change moves their bound
        live_rack = job_rack_now & (at_caps <= held_peak_w)
        # A job rack whose job is not running (a stall, a crash, a restart) is held by its BBU near what it draws
        # now, as far as the BBU's power and reserve allow: a return then reaches the grid one period's increment
        # at a time while the battery charges, and costs the BBU a second or two of the surge, not a cycle.
        guard_w = np.full(site.n_racks, np.inf)
        guard_extra_w = np.zeros(site.n_racks)
        guarded_st: tuple[IntArray, FloatArray] | None = None  # (the stopped racks, and their bounds unshielded)
        returning_w = 0.0  # what the guards hold back of jobs that run again: the caps must make room for it
        down = np.zeros(site.n_racks, dtype=bool)  # job racks whose job is not running
        stopped = down  # and those, with the racks of jobs that ran again only in the last few periods
        bridged_w = np.zeros(site.n_racks)  # what their BBUs may carry of a return
        return_w = return_gpus = 0.0  # what the racks of stopped jobs would add back, on how many GPUs
        if n_jobs:
            down = job_rack_now & ~obs.job_running[self.job_rack]
            # A job the scheduler has released (obs.job_ended) is no return to hold the import up for: a job that
            # had finished kept no-battery-start's floors up at the exchange rate's whole budget, 10.5 % of the
            # site's energy for a return that never came. Its racks still count at what they drew (a job started on
            # them may draw it again at once: mass-restart's jobs, all started again together, met a battery
            # charging under a bound that had forgotten them, 0.8 s over the limit).
            may_return = down if obs.job_ended is None else down & ~obs.job_ended[self.job_rack]
            if may_return.any():
                back_w = np.where(may_return, np.maximum(nan_to_num(self.long_env_w) - load_env, 0.0), 0.0)
                return_w = float(back_w.sum())
                return_gpus = float(site.rack_active_gpus[may_return].sum())
            # (and for four periods after its job runs again: the readings show a return a period late, and the
            # battery may still be charging under the bound the BBU held)
            self.job_run_since_s = np.where(obs.job_running, np.fmin(self.job_run_since_s, obs.t_s), np.inf)
            settling = obs.t_s - self.job_run_since_s < 4.0 * p.period_s
            stopped = job_rack_now & (~obs.job_running | settling)[self.job_rack]
            self.ran_at_w = np.where(job_rack_now & ~stopped, self.long_env_w, self.ran_at_w)
            if stopped.any():  # (worked out for the stopped racks only: every figure here is its own rack's)
                st = np.flatnonzero(stopped)
                caps_st, bound_st, load_st = at_caps[st], bound_rack[st], load_w[st]
                # (from this period's reading: the envelope still holds the draw from before the stop for its window)
                now_w = np.fmin(
                    caps_st, np.where(np.isfinite(load_st), load_st, load_env[st]) * (1.0 + p.hidden_peak_frac)
                )
                shield = self.bbus.can_hold(obs.rack_bbu_soc_frac, bound_rack, st)
                # a rack whose job runs again is held where its guard was (not at its rising reading) until the cut
                # against the unguarded bound makes room: the guard then rises only by the room the battery leaves
                back_rack = (obs.job_running & settling)[self.job_rack[st]]  # (its job runs again, a few periods back)
                prev_guard_st = self.prev_guard_w[st]
                settle = back_rack & np.isfinite(prev_guard_st)
                now_w = np.where(settle, np.fmin(now_w, prev_guard_st), now_w)
                shielded_w = np.fmin(np.fmax(now_w, bound_st - self.bbus.power_w[st]), caps_st)
                extra_st = np.where(shield, np.maximum(bound_st - shielded_w, 0.0), 0.0)
                guard_extra_w[st] = extra_st
                # the guard holds no lower than the BBU's wear allowance affords if the rack came back at its caps (a
                # start it bridged on a short run would spend days of cycles); the start ceiling makes room for the rest
                if shield.any():
                    at = st[shield]
                    bridged_w[at] = np.fmin(self.bbus.affordable_w(p.period_s, at), self.bbus.power_w[at])
                guard_w[st] = np.where(shield, np.fmax(shielded_w, caps_st - bridged_w[st]), np.inf)
                returning = np.zeros(site.n_racks)  # (the whole vector summed, as before: the same sum)
                returning[st] = np.where(shield & back_rack, extra_st, 0.0)
                returning_w = float(np.sum(returning))
                bound_rack[st] = np.where(shield, shielded_w, bound_st)
                guarded_st = (st, bound_st)
        # the campus also carries what no rack meter sees (the overhead the PCC shows; the fit's where the meter reads
        # high: the top of the band it is then read as is no load, and counted here it cut meter-spike's jobs 399 kW
        # at the meter's first 2x reading, 0.30 % of their GPU time in all) and the BBUs' recharge
        pcc_w = pcc.estimate_w if pcc.status == HIGH else float(domain_w[0])
        overhead_w = max(pcc_w + bess_now_w - racks_sum_w, 0.0)
        campus_bound_w = float(np.sum(bound_rack)) + overhead_w + float(self.bbus.recharge_w.sum())
        # ... of which the racks whose peak readings show their swing's peak draw only their held peak: the rest is
        # the prior's, which the battery may take on at the ramp while the caps leave it be (a first reading 15 %
        # above the mean cut a job a measured 1,100 W peak never put near the limit)
        measured_rack = np.fmin(at_caps, np.fmax(self.peaks.held_w, load_env))
        running_racks = job_rack_now & ~stopped
        prior_rack = np.where(peak_seen & running_racks, np.maximum(bound_rack - measured_rack, 0.0), 0.0)
        unmeasured_w = float(np.sum(prior_rack))
        # the caps are set against the bound without the guards of jobs that run again (the guards only bridge the
        # periods the readings and the cut take to arrive); the battery charges under the guarded bound
        cut_bound_w = campus_bound_w + returning_w

        # 1. grid shaping ---------------------------------------------------------------------------------------
        discharge_w, discharge_plan_w, charge_w = bess_room(site.bess, obs.bess_soc_frac, obs.bess_online,
                                                            p.bess_reserve_frac)  # fmt: skip
        bus_w = float(domain_w[0]) + bess_now_w
        # the ramp rule in force: the site's, or lower where the utility asks it for now (an OpenADR event: the
        # Observation's, docs/utility.md)
        ramp_w_per_min = site.ramp_limit_w_per_min
        if obs.ramp_limit_w_per_min < ramp_w_per_min:  # (NaN: none asked)
            ramp_w_per_min = obs.ramp_limit_w_per_min
        ramp_step = ramp_w_per_min / 60.0 * p.ramp_margin_frac * dt
        # the limit as it will be when these actions act: a curtailment ramping the limit down is planned against
        # where it will be limit_lead_periods from now, not where it was read. A ramp is a fall two periods in a
        # row (the smaller of the two is its rate); a step has already arrived and is not extrapolated.
        pcc_limit_w = obs.pcc_limit_w
        fall_w = 0.0 if self.prev_pcc_limit_w is None else max(self.prev_pcc_limit_w - pcc_limit_w, 0.0)
        fall_rate_w = min(fall_w, self.prev_limit_fall_w)
        pcc_limit_w -= fall_rate_w * p.limit_lead_periods
        # The caps plan further along it, as far as a cap written now may take to land (out of band, tens of
        # seconds); the battery, which acts now, on the limit as it will be when it does.
        cap_lead_w = fall_rate_w * max(self.landing.delay_s(obs.t_s) / dt + 1.0 - p.limit_lead_periods, 0.0)
        self.prev_pcc_limit_w, self.prev_limit_fall_w = obs.pcc_limit_w, fall_w
        grid_cap = pcc_limit_w * p.pcc_margin_frac
        bus_now_w = bus_w
        if pcc_ok and self.was_blind:
            self.bus_level.restart()  # the readings it holds are from before the blackout, or stale repeats
        # (with no fresh reading the level is the racks' estimate the check stands in with, not the last reading
        # held: a meter stale through a curtailment had the battery discharge 0.5 MW toward a level 0.8 MW above the
        # load, past the ramp rule; pcc-stale with its ramp limit 30 % lower, 31 s over it)
        level_w = self.bus_level.update(bus_w)
        bus_w = level_w if math.isfinite(level_w) else bus_w
        # The level is a mean of the last readings, so the cap rises of the last few periods are only partly in it
        # (a rise granted j + 1 periods ago is in j + 1 of them): the load at the present caps is the level plus the
        # rest. Compared with the bare level, a load following the target up the ramp looked a few steps behind it,
        # so the target waited for it and the caps were granted the lag again: a job start climbed at 0.6 of the
        # ramp the utility allows.
        n_seen = max(self.bus_level.count, 1)
        lag = self.recent_rise_w[:, 0]
        unseen_frac = self._unseen_frac.get((n_seen, lag.shape[0]))  # (a few counts, each worked out once)
        if unseen_frac is None:
            unseen_frac = np.clip(1.0 - (np.arange(lag.shape[0]) + 1.0) / n_seen, 0.0, 1.0)
            self._unseen_frac[n_seen, lag.shape[0]] = unseen_frac
        # (and the rises still on their way, which no reading shows yet: out of band, tens of seconds of them; a job
        # start under caps 20 s late rose 6 MW in a minute against a 1.5 MW/min rule, was cut whole, and again)
        bus_caps_w = bus_w + float(unseen_frac @ lag) + rising_w
        forecast = float(self.forecast.update(np.array([bus_w]), dt)[0])
        if self.bus_level.warming:
            # the first readings only learn the level: seeded from one reading (a compute phase, say) the target
            # would see the level it then finds as a fall to absorb or fill
            self.forecast.value = np.array([bus_w])
            forecast = bus_w
            self.grid_target_w = None
        b = site.bess
        soc_pull = soc_pull_w(b, obs.bess_soc_frac, obs.bess_online, p.bess_soc_target_frac, p.bess_soc_recovery_s,
                              p.ramp_margin_frac, ramp_w_per_min, site.ramp_window_s)  # fmt: skip
        if soc_pull > 0 and caps_bind():
            soc_pull = 0.0  # recharge from surplus only, never with power a capped job could use
        battery_back = obs.bess_online and not self.bess_was_online and site.bess.energy_j > 0
        self.bess_was_online = obs.bess_online
        if (pcc_ok and self.was_blind) or battery_back:
            # Back from a blackout (the readings went stale), or a battery back on line: what the grid did meanwhile
            # — a fallback to safe caps, a battery that reverted — is history the ramp rule has already measured.
            # Pulling the import back to the old target now would be a second step; the target starts again from
            # the import as it is.
            self.grid_target_w = None
            self.forecast.value = np.array([bus_w])
            forecast = bus_w
            self.bound_cover_w = 0.0
        self.was_blind = not pcc_ok
        # the ramp rule as the utility measures it: the room the import's last two windows leave a level held from now
        # (the import as the plan would have it: a frequency response ordered is added back, ffr.py)
        self.ramp_room.push(float(domain_w[0]) + (self.ffr.order_w if self.ffr is not None else 0.0))
        ramp_budget_w = p.ramp_margin_frac * ramp_w_per_min * site.ramp_window_s / 60.0
        room_lo_w, room_hi_w = self.ramp_room.bounds(ramp_budget_w)
        # The margin keeps a share of the rule for the unplanned and the battery's SoC recovery: the battery holds a
        # fall to it, since what it takes is stored, but the floors, which burn what they hold, fill only as far
        # as the rule itself asks, less what it may see of a step inside a period (where they burn, the battery
        # already charges at its limit, so the recovery has no share to take, and a battery that reverts then is a
        # step no margin covers; docs/controller.md)
        rule_budget_w = ramp_w_per_min * site.ramp_window_s / 60.0
        rule_lo_w = self.ramp_room.bounds(max(rule_budget_w - self.ramp_room.straddle_w(), ramp_budget_w))[0]
        # (a stopped job's return: the battery at its plan takes what it can of the rise)
        with_return_w = max(bus_w, bus_now_w) + return_w - max(discharge_plan_w, bess_now_w)
        climb_w_per_s = ramp_budget_w / site.ramp_window_s
        held_lo_w = self.return_hold.level_w(return_w, return_gpus, with_return_w, rule_lo_w, ramp_budget_w,
                                             climb_w_per_s, dt)  # fmt: skip
        if math.isfinite(obs.import_floor_w):
            held_lo_w = max(held_lo_w, obs.import_floor_w)  # the parent's floor: its ramp rule, met here
        room_lo_w = max(room_lo_w, held_lo_w)
        # what this site tells a parent of itself (a building to its campus coordinator): the most its racks may draw
        # at the caps in force (in all, and each rack), the prior's share of it (peaks no reading measured), whether
        # every running rack's peak is measured, what its stopped jobs would add back on how many GPUs, and which
        # racks' jobs are stopped (rack_back_w: each rack with its stopped job back)
        self.bound_w, self.prior_w, self.return_w, self.return_gpus = cut_bound_w, unmeasured_w, return_w, return_gpus
        self.rack_bound_w, self.rack_down = bound_rack, down
        unmeasured_rack = running_racks & ~peak_seen
        measured_all = not unmeasured_rack.any()  # (every running rack's peak measured)
        # ... or, for the margin below, known: a rack whose bound is its caps in force draws no more than they let
        # it, whatever its readings show (a job capped flat at its peak shows no swing, and no peak reading can)
        bound_known = not (unmeasured_rack & (bound_rack < at_caps)).any()
        self.all_measured = measured_all
        prev = bus_w if self.grid_target_w is None else self.grid_target_w
        target = forecast + soc_pull
        # A load its caps hold back would rise if they let it: the grid target follows it up as far as the ramp
        # allows, to where the load is and never ahead of it (a target above the load is met by charging or by
        # floors). Following a low-pass of the capped load instead, the target lagged it by the ramp times the
        # low-pass's time constant and the caps could rise only by what it gained: a job start climbed at
        # ramp / (1 + forecast_tau_s / period_s), 0.07 of 1.5 MW/min, and lost 25 % of goodput.
        held_back = self.grid_target_w is not None and caps_bind()
        if math.isfinite(ramp_step):
            if held_back:
                target = max(target, min(prev + ramp_step, max(bus_caps_w, bus_now_w)))
            target = min(max(target, prev - ramp_step), prev + ramp_step)
        target = min(target, grid_cap)
        self.grid_target_w = target
        gap = bus_w - target  # > 0: the battery must give; < 0: it must take
        # charging only under what the racks may draw (their caps, not the readings that hide the peaks)
        charge_w = min(charge_w, max(grid_cap - cut_bound_w - late_w, 0.0))
        bess_w = clip_float(gap, -charge_w, discharge_w)
        # The battery first keeps the import inside the rule's room: it gives what a level above it would bring (as far
        # as its plan allows; the caps take the rest) and takes what a fall below it would (the floors the rest).
        # (A level from the readings and the 6 s mean: the higher where a fall is judged, so an iteration's trough
        # reading is no fall; the lower where a rise is, so its peak is no rise.)
        bess_w = max(bess_w, min(min(bus_w, bus_now_w) - room_hi_w, discharge_plan_w))
        # (never holding the import up past the interconnect's ceiling; and a charge taken only to hold it up is
        # room a capped job may take back: the job's rise then replaces the charge at the same import)
        room_lo_w = min(room_lo_w, grid_cap)
        unheld_w = bess_w
        bess_w = min(bess_w, max(max(bus_w, bus_now_w) - room_lo_w, -charge_w))
        # Never charge into the interconnect limit, and give what it takes to stay under it: a load coming back (a
        # restart, a return from backup) must not meet a battery still charging for the fall before it.
        bess_w = max(bess_w, min(max(bus_now_w, bus_w) - grid_cap, discharge_w))
        # and against the peaks the readings hide (the racks at their caps): the battery before the caps, as far as
        # its plan allows (the caps take the rest, and all of it as the battery nears its reserve)
        # That bound is a worst case, not a reading: the battery takes it on at the ramp the grid may follow (a step
        # of its own would be a ramp violation), the caps meanwhile; a reading over the limit is met at once above.
        # It carries at most the planned share of what the ramp rule lets one window change by: a battery reverts to
        # 0 W when its controller goes silent (SunSpec WSetRvrtTms), and that step must stay within the rule.
        cover_w = min(cut_bound_w + late_w - grid_cap, discharge_plan_w, ramp_budget_w)
        ramp_in = ramp_step if math.isfinite(ramp_step) else math.inf
        # (the prior's share is left to the cover only while the cover gains on it: a limit falling faster than the
        # ramp, a curtailment, outruns it, and the caps must lead it as the readings cannot)
        gaining = cut_bound_w - grid_cap - self.prev_bound_excess_w < ramp_in
        self.prev_bound_excess_w = cut_bound_w - grid_cap
        all_measured = gaining and bool(running_racks.any()) and measured_all
        if not gaining:
            unmeasured_w = 0.0
        # The level the caps are planned on. Where every running rack's peak is measured (all_measured), the prior's
        # share of the bound on the racks of jobs no cap holds is a margin over peaks the readings show: the bound is
        # held to the limit (the cut below), and what is left of it without that share to the margin under it. Those
        # jobs cannot rise, and a drift in their peaks shows in the next readings. A capped job's racks count at
        # their bound, at the caps in force: a rise shows in their readings a period late, out of band 40 s late.
        # Counted whole, the prior on a job at its rated cap held the jobs under it where no peak went: h100-sync-ckpt's
        # lowest-priority job sat at the lowest cap for four minutes 470 kW under the limit (6.41 -> 3.53 % lost), and
        # prometheus-campus's RL and evaluation jobs at 920 W and 200 W (1.69 -> 1.47 %). Only once the ramp rule's
        # room is measured, two windows of readings: the first action's cut on the prior alone is then still in the
        # window, and the battery's cover of the caps risen meanwhile took the import down past the rule with it
        # (prometheus-campus: 7 s over the ramp limit). And only while the battery's plan has not begun to taper
        # toward its reserve: the battery still covers the whole bound over the margin, and a campus that kept
        # planning on less drained it before a curtailment it was needed for (utility-events, another seed: 0.2 s
        # over the limit as it fell). Covering only the planning level instead, tried, cost the faults whose
        # readings are wrong up to 8 points of goodput (meter-drift 6.2 -> 14.1 %). A rack counted at its caps is
        # known as well as a measured one: asking for its peak reading, a job capped flat (no swing to show) kept
        # the margin from every other job's prior, for good (trace-campus-curtail's RL job at 462 W) or in the
        # periods its readings fell flat (curtailment's finetune at 785 W, every 79 s: each time a cut that took
        # minutes to rise back), and curtailment's fault sites lost 4.7 % of their GPU time; now 3.4 %. (Taking such
        # racks as measured everywhere, the ceiling of the bound check at the limit itself too, tried, took the
        # library's curtailment 10.7 s over its limit as the battery neared its reserve.)
        margin_bound_w = cut_bound_w
        known = gaining and bool(running_racks.any()) and bound_known
        if known and self.ramp_room.seen >= 2 * self.ramp_room.n and discharge_plan_w >= discharge_w:
            free_prior_w = float(prior_rack @ (rack_caps >= gpu.rated_w))
            margin_bound_w = max(cut_bound_w - free_prior_w, cut_bound_w - (pcc_limit_w - grid_cap))
        self.bound_cover_w = max(min(cover_w, self.bound_cover_w + ramp_in), 0.0)
        bess_w = max(bess_w, min(self.bound_cover_w, cover_w))
        held_up_w = max(unheld_w - bess_w, 0.0)  # (what is left of it once the limit and the bound are met)
        # (less what the battery may still give by then beyond what it gives now, as far as it may cover the bound:
        # it acts at once, and a lead it could cover cut caps that were never needed: oob-curtail, its writes taken
        # to land 40 s late, 0.16 -> 4.3 %)
        bess_more_w = max(min(discharge_plan_w, ramp_budget_w) - bess_w, 0.0)
        limit[0] = min(float(limit[0]), pcc_limit_w - max(cap_lead_w - bess_more_w, 0.0))
        # What the battery leaves above the rule's room is cut, on the level (a swing's peak reading is no rise; a
        # job start shows in the level within two readings) and never past what the caps in force allow.
        grid_cut = max(min(bus_now_w, bus_w, float(under_caps_w[0])) - bess_w - room_hi_w, 0.0)
        # and what it leaves below is filled (the higher of the level and the latest reading: the level's window
        # still holds readings from before the floors it asked for, and would ask for them again)
        fill_lo_w = min(max(rule_lo_w, held_lo_w), room_lo_w)
        fill_w = max(fill_lo_w - (max(bus_w, bus_now_w) - bess_w), 0.0)
        # (a fall within a sliver of the limit passes: a floor set from a reading lifts the troughs under it)
        fill_deadband_w = p.fill_deadband_frac * obs.pcc_limit_w
        # fast frequency response (ffr.py): the droop's order laid on the plan, the battery first, then the caps
        if self.ffr is not None:
            order_w = self.ffr.order(obs.grid_freq_hz, ramp_step)
            bess_w, ffr_cut_w = self.ffr.split(order_w, bess_w, discharge_w, charge_w)
            grid_cut += ffr_cut_w
            limit[0] -= max(self.ffr.bess_w, 0.0)  # (the battery's share is not room for the caps to rise into)
            if order_w:
                reasons.append(self.ffr.reason())

        # 2. progressive capping --------------------------------------------------------------------------------
        # Breakers heat with I^2 t: below the campus each domain is held on the RMS of its load over recent
        # iterations (a swing's peaks above the rating do not trip a thermal breaker, its mean square does). The
        # interconnect limits the power itself, so the campus is held on its peak.
        env = self.domain_env.rms()
        env = np.fmin(env, under_caps_w)
        # the campus: the readings' peak, and the most its racks may draw, as they will be once the battery moves
        # to its new setpoint (on the level above where every peak is measured)
        seen_w = min(self.domain_env.peak_of(0) + bess_now_w, cut_bound_w) - bess_w
        env[0] = max(margin_bound_w - bess_w, seen_w)
        reporting = np.isfinite(obs.domain_thermal_frac)
        soft = np.where(reporting, p.reporting_soft_frac, p.soft_frac) * limit
        # at the PCC the battery holds the level up to the grid target's ceiling; caps dim only the rest
        soft[0] = p.pcc_margin_frac * limit[0]
        cut = progressive_cut_w(env, soft, limit)
        # (a breaker's thermal state, where it reports one: NaN compares as no emergency, as a state of 0 would)
        hot = obs.domain_thermal_frac >= p.thermal_emergency_frac
        over = env >= p.emergency_frac * limit
        emergency = over | hot
        emergency[0] = seen_w >= p.emergency_frac * limit[0]  # the bound is a worst case, not a reading
        if emergency.any():
            cut = np.where(emergency, np.maximum(cut, env - soft), cut)
        # (how far the import may fall from its level now, as the ramp rule measures it)
        fall_room_w = max(min(bus_w, bus_now_w) - bess_w - room_lo_w - late_w, 0.0)  # (less the cuts on their way)
        cut, paced = self._pace_cuts(cut, env, soft, limit, over & ~hot, obs, ramp_step, fall_room_w)
        # the campus is cut to its bound below, once the jobs' other cuts are known; here the readings and the ramp
        cut[0] = max(grid_cut, seen_w - soft[0] if emergency[0] else 0.0)
        release = soft - (p.soft_frac - p.release_frac) * limit
        release[0] = soft[0] - 0.5 * (p.soft_frac - p.release_frac) * limit[0]

        # 4. rack storage: over a soft threshold the BBUs (within their reserve and wear budget) take the excess
        # before a cap does; what they relieve is not cut from the jobs (an emergency cuts regardless)
        cutting = cut > 0
        if cutting.any():
            rack_room = self.bbus.relief_scale(np.maximum(env + np.where(cutting, np.inf, 0.0), 0.0), release) >= 1.0
        else:  # (no cut: every domain's room is its envelope's)
            rack_room = self.bbus.relief_scale(np.maximum(env, 0.0), release) >= 1.0
        ramp_rise_w = ramp_step * p.bbu_recharge_ramp_frac if math.isfinite(ramp_step) else math.inf
        # (a paced cut is no reason to discharge: the BBUs' relief would be a step of its own, on and off)
        scale = self.bbus.relief_scale(np.where(paced, 0.0, env) if paced.any() else env, soft)
        # a guarded rack's BBU takes only what the interconnect could not: the room left under the limit once the
        # battery has its setpoint is shared by the guarded racks, in proportion to what the guard holds back
        extra_sum_w = float(guard_extra_w.sum())
        if extra_sum_w > 0:
            # (with the battery where it is, if that charges more: its setpoint takes a response time to arrive)
            spare_w = max(grid_cap - (campus_bound_w - min(bess_w, bess_now_w)), 0.0)
            allow = np.minimum(guard_extra_w * spare_w / extra_sum_w, guard_extra_w)
            guard_w = np.where(np.isfinite(guard_w) & (spare_w < extra_sum_w), guard_w + allow, np.inf)
        threshold, recharge, relief_rack = self.bbus.step(
            dt, obs.rack_bbu_soc_frac, bound_rack, scale, rack_room, ramp_rise_w, guard_w
        )
        self.prev_guard_w = np.where(np.isfinite(guard_w), guard_w, np.inf)
        # What a stopped rack may draw at its breakers: what its guard lets through, or its whole bound where the
        # guard was lifted (the battery takes the return at the interconnect, but not under a row), not the shielded
        # level the interconnect's plan took. A rack with a stale reading beside one whose job had just come back was
        # judged as if that BBU still held it: a row's worst case 234 kW on its 220 kW rating, the stale rack kept
        # at its rated cap (the stateful machine).
        breaker_rack_w = bound_rack
        if guarded_st is not None:
            st, bound_st = guarded_st
            breaker_rack_w = bound_rack.copy()
            breaker_rack_w[st] = np.fmin(bound_st, guard_w[st])
        if relief_rack.any():  # (+0.0 on every rack that does not relieve)
            relief = self.rm.domain_load_w(relief_rack, only_at=np.flatnonzero(relief_rack))
            cut_campus = cut[0]
            cut = np.where(emergency, cut, np.maximum(cut - relief, 0.0))
            cut[0] = cut_campus  # the ramp's cut is on the level, which the BBUs' peak shaving does not move
        else:  # (no BBU relieves: every cut stands as it is, none below zero)
            relief = np.zeros(site.n_domains)
        # A rise granted k periods ago is in only the last k readings of the window, so the RMS shows a share of it:
        # the headroom is what is left once the rest is counted, or caps would climb past the release level for as
        # many periods as the window takes to catch up.
        # (The campus is held on its peak, which shows a rise one reading later: nothing to count there.)
        rises = self._rises_unseen()  # (none in the window: none unseen, and the window stays as it is)
        unseen_w = self.rise_unseen_frac @ self.recent_rise_w if rises else np.zeros(site.n_domains)
        unseen_w[0] = 0.0
        # A domain counts at the higher of its window's RMS and its newest half window's (each with the rises it has
        # not yet shown): the RMS lags a step in the load by the window, and caps rose on the old readings past the
        # rating once they left it, to be cut again (the stateful machine at its long profile: a row stepped from 25 %
        # to full load read 125 kW of RMS against 200 kW, and was planned at 223 kW on its 220 kW rating).
        unseen_recent_w = self.rise_unseen_recent_frac @ self.recent_rise_w if rises else np.zeros(site.n_domains)
        recent_w = np.fmin(self.domain_env.rms_recent(self.n_recent), under_caps_w) + unseen_recent_w
        seen_level_w = np.fmax(env + unseen_w, recent_w)
        headroom = np.maximum(release - seen_level_w, 0.0)
        # the campus may rise as far as the grid target plus what the battery can plan to give: a long peak leans
        # on the battery, and as its charge nears the reserve the plan tapers and the caps come back
        # (the grid target follows the load the caps allow, so the campus may also rise one ramp step a period)
        ramp_allow = ramp_step if math.isfinite(ramp_step) else math.inf
        # (or to the top of the rule's room, where that is higher: the rule gives a held-back load the room, not a step)
        # (and the battery may give what it can keep giving: the caps need not wait in the band under the release
        # level with the battery idle; its bound cover then carries what rises above the interconnect's margin)
        # (never while it charges: a charge it would have to stop first is room only a period later)
        # (nor while a job is stopped or a few periods back: the battery meets a return within a tick, and a return
        # met faster spends the ramp rule's room the next windows need: prometheus-campus, 1.9 -> 2.6 % lost)
        leaning = bess_w >= 0 and not bool(np.any(stopped))
        lean_w = max(self._bess_lean_w(obs, discharge_plan_w) - bess_w, 0.0) if leaning else 0.0
        headroom[0] = min(
            max(float(release[0]) - float(env[0]) + lean_w, 0.0),
            max(max(target + ramp_allow, room_hi_w) + discharge_plan_w - bus_caps_w, 0.0),
        )
        headroom = np.where(cut > 0, 0.0, headroom)
        if unseen_move_dom_w is not None:
            headroom = np.maximum(headroom - unseen_move_dom_w, 0.0)

        rack_at_risk: BoolArray | None = None  # (set where a reading is late or stale: _at_risk)
        n_jobs = site.n_jobs
        if n_jobs:
            job_peak = np.full(n_jobs, gpu.min_cap_w)
            self._job_reduce(np.maximum, gpu_env, job_peak)
            # A capped job is cut from its cap. Readings are window means, which understate a fast swing's peak, so
            # cutting a capped job from its mean reading would drop the cap below the peak it was holding and cut far
            # more than asked; an uncapped job is cut from its highest reading. But a cap above all the job may draw
            # (its peak and the share a swing may hide; none where its readings are flat, a load that does not
            # swing) holds nothing: cut from there, or the first cuts are spent above the draw and a rack over its
            # rating waits a window more for its cut (found by the stateful machine at its long profile).
            hidden_frac = self._job_hidden_frac(gpu_env, rack_caps, rack_peak_w, rack_trough_w)
            job_peak_bound = np.minimum(gpu.rated_w, job_peak * (1.0 + hidden_frac))
            effective = np.where(
                self.cap_w < gpu.rated_w, np.minimum(self.cap_w, job_peak_bound), np.minimum(gpu.rated_w, job_peak)
            )
            room = np.maximum(effective - gpu.min_cap_w, 0.0)
            reduction, unmet = shed(cut, self.job_gpus, room, self.groups, self.eta)
            reduction, unmet = shed_past_the_draw(self.rm, self.running_rack, self.job_rack, self.groups, cut,
                                                  reduction, unmet, effective, room, hidden_frac, gpu_env)  # fmt: skip
            new_cap = np.where(reduction > 0, effective - reduction, self.cap_w)
            # the interconnect against its bound: the live racks at these caps, after the battery and the BBUs
            cap_change = new_cap - self.cap_w
            live_gpus = self._live_gpus(live_rack) if cap_change.any() else None  # (no change: it moves nothing)
            bound_w = cut_bound_w + (0.0 if live_gpus is None else float(live_gpus @ cap_change)) / self.eta
            # (the measured bound against the battery now, the prior's against the cover the battery is taking on.
            # Where every job rack's peak is measured, both against the limit itself: the prior's excess over the
            # measured peaks, the share a swing may hide, is a margin on what is measured, and pcc_margin_frac's
            # under the limit as well counted the unmeasured twice: gb-frequency-event's fine-tuning job was held
            # 230 W under its rated cap for a 1.2 MW prior its peaks never reached, 0.24 % of goodput. Where one is
            # not, the prior is all that is known of the peak, and the margin stands.)
            # (what the peaks and the caps bound is the racks' load; above it each swinging rack's supply carries its
            # tray's refill after a rise, at the swing's peak, and a rack counted at its caps is that close: held at
            # the limit itself, the import went that far over it at every peak, a battery lost under a job capped at
            # its peaks 3 kW over a 0.85 MW limit 0.7 s of each 2 s iteration, for good. (Left to a BBU whose
            # threshold shaves it, tried: a tick over the limit the period its relief ended.) Only against the
            # measured bound: the prior's excess over it is a margin of its own, and so is a held peak reading's
            # decay. Counted on every running rack, or on the prior's term too, tried: up to 0.9 points more GPU time
            # lost on the curtailment faults and trace-campus-curtail, and caps cut and risen again every few periods
            # against the prior's term, for no second over a limit)
            ceiling_w = pcc_limit_w if all_measured else float(soft[0])
            measured_ceiling_w = ceiling_w
            if all_measured:
                refill_w = float(self.tray_refill_w @ (running_racks & (bound_rack >= at_caps)))
                measured_ceiling_w = max(ceiling_w - refill_w, float(soft[0]))
            # (the prior's term not where every running rack's peak is measured and the site's battery can no longer
            # cover it (off line, at its reserve): the measured bound is every rack at its peak at once, and the
            # prior's excess over it no load a reading missed. Held to a cover of nothing, bess-trip-headroom, its
            # battery tripped, kept a job 290 kW under a limit no peak came near for the rest of the run: 0.37 points
            # of its GPU time, where the uncontrolled site holds every limit. Dropped where the battery covers it,
            # tried: the caps rose on its cover, and utility-events at seed 1 drained its battery before a
            # curtailment, 2.2 s over the falling limit; where a site has none, a building of dimmer-campus's held to
            # its budget, commands-delayed on two buildings went 0.6 s over the campus's limit)
            over_w = bound_w - unmeasured_w - bess_w - measured_ceiling_w
            if not all_measured or discharge_plan_w > 0 or site.bess.energy_j <= 0:
                over_w = max(over_w, bound_w - max(bess_w, cover_w) - ceiling_w)
            over_w -= float(relief[0])
            if over_w > 0:
                live_gpus = self._live_gpus(live_rack) if live_gpus is None else live_gpus
                more, left = shed(np.array([over_w]), live_gpus[None, :], np.maximum(new_cap - gpu.min_cap_w, 0.0),
                                  self.groups, self.eta)  # fmt: skip
                new_cap = new_cap - more
                reduction = reduction + more
                unmet[0] += float(left[0])
                cut[0] += over_w
                bound_w -= float(live_gpus @ more) / self.eta
            import_w = bound_w - (cut_bound_w - margin_bound_w) - bess_w - held_up_w - float(relief[0])
            # (the lean only as far as the bound check will allow next period, with the battery's cover one ramp step
            # on: a rise faster than the cover would be cut again from the lowest-priority job, a transfer, not room)
            next_bess_w = min(bess_w + ramp_allow, max(discharge_plan_w, bess_w))
            bound_room_w = max(ceiling_w + next_bess_w + float(relief[0]) - bound_w, 0.0)
            # (and none in a period the bound cut: a lower-priority job would rise while a higher one was cut)
            lean_room_w = min(lean_w, bound_room_w) if cut[0] <= 0 else 0.0
            headroom[0] = min(headroom[0], max(float(release[0]) - import_w, 0.0) + lean_room_w)
            # rise: slowly, within headroom, never for a job with untrusted telemetry that matters
            # (with no campus reading every job goes to the safe cap; a job with a late or stale rack that could take
            # a domain past its soft level (_at_risk) does not rise, and a stale one alone goes to the safe cap: the job
            # sent there climbed back at the slow rise for 12 s after each reading two seconds overdue, 2.1 % of the
            # GPU time of a site whose rack meters were 3 s late and lost 8 % of their readings. A rack unheard for
            # twice stale_s is no lost reading: its job follows it to the safe cap, as a synchronous job runs at its
            # slowest rack's pace and its other racks' power above it buys nothing (a row's meters gone for good
            # cost 12 % of GPU time under a curtailment, against 7 % with the job at the safe cap)
            stale_job = np.zeros(n_jobs, dtype=bool)
            late_job = np.zeros(n_jobs, dtype=bool)
            if not pcc_ok:
                stale_job[:] = True
                late_job[:] = True
            elif not all_fresh or not rack_ok.all():
                rack_at_risk = self._at_risk(~rack_ok | ~fresh, breaker_rack_w + late_rack_w, overhead_w, soft)
                risky = rack_at_risk & self.running_rack
                late_job[site.rack_job[risky]] = True
                unheard_s = obs.t_s - np.maximum(self.rack_seen_t_s, self.first_t_s)  # (by our clock, from our start)
                gone = risky & ~rack_ok & (unheard_s > 2.0 * p.stale_s)
                stale_job[site.rack_job[gone]] = True
            rise = np.minimum(p.cap_rise_w_per_s * dt, gpu.rated_w - new_cap)
            # (a cut this period lowers where it goes back to by the cut, rather than ending its way back: a 2 kW cut
            # at the campus in the period of its start sent gb-frequency-event's finetune up at the slow rise, 30 s)
            self.ceiled_from_w = np.where(
                new_cap >= self.ceiled_from_w - reduction, np.nan, self.ceiled_from_w - reduction
            )
            back_up = obs.job_running & np.isfinite(self.ceiled_from_w)
            rise = np.where(back_up, np.fmax(rise, nan_to_num(self.ceiled_from_w - new_cap)), rise)
            want = np.maximum(np.where((reduction > 0) | late_job, 0.0, rise), 0.0)
            up = grant(headroom, self.job_gpus, want, self.groups, self.eta)
            # A capped job may take the band between the release and soft levels too, as far as the soft level: a
            # rise that stops under it draws no cut, so no cut-and-rise cycle. The band is the hysteresis of a job
            # cut from above; a job cut once and held under the release level stays where that cut left it however
            # little it asked for (site-99pct: halls and rows at 99 % as an RMS, one 1 s reading over them at the
            # first period, and the job capped 6 W under its peak to the end: 0.12 % of goodput).
            # Under a domain, what is left of the band under the soft level, not its width: one over it that its
            # BBUs relieve has no cut, and rose on into the relief (the stateful machine at its long profile: 250
            # kW on a 220 kW row). A job back from its start ceiling has the campus's too, its whole width: it is
            # where a cut from above would have left it, had it come back at its old cap.
            more_want = np.where(reduction <= 0, np.maximum(want - up, 0.0), 0.0)
            rise_w = self._domain_rise_w(up)
            for from_ceiling in (True, False) if back_up.any() else (False,):
                asking = np.where(back_up == from_ceiling, more_want, 0.0)
                if not np.any(asking > 0):
                    continue  # (nothing asked: the grant is none)
                band_left_w = np.maximum(soft - np.maximum(release, seen_level_w), 0.0)
                # (the campus's own band only for a job back from its start ceiling: the campus's headroom is
                # also the ramp rule's room, which a band on top of it would overrun)
                band_left_w[0] = max(float(soft[0] - release[0]), 0.0) if from_ceiling else 0.0
                if unseen_move_dom_w is not None:
                    band_left_w = np.maximum(band_left_w - unseen_move_dom_w, 0.0)
                band_w = np.where(cut > 0, 0.0, headroom - rise_w + band_left_w)
                more = grant(np.maximum(band_w, 0.0), self.job_gpus, asking, self.groups, self.eta)
                up = up + more
                if more.any():
                    rise_w = self._domain_rise_w(up)
            if rises or rise_w.any():
                # (shifted in place: np.roll's rows without a new (n_env, n_domains) array each period)
                self.recent_rise_w[1:] = self.recent_rise_w[:-1]
                self.recent_rise_w[0] = rise_w
                self._rise_rows[1:] = self._rise_rows[:-1]
                self._rise_rows[0] = bool(rise_w.any())
                self._rise_rows_of = self.recent_rise_w
            new_cap = new_cap + up
            # a stopped job is held where its return fits what is left under the soft levels, with the battery's
            # charge where it is: the return arrives within a tick, the battery's release a period later (at the
            # campus, under the bound's own ceiling: the return at its caps is a bound as the racks' is)
            unceiled_w = new_cap
            if down.any() and not obs.job_running.all():
                planned_w = env + self.recent_rise_w[0]
                planned_w[0] = import_w + held_up_w + self.recent_rise_w[0][0]
                room_w = soft - planned_w
                room_w[0] = ceiling_w - planned_w[0]  # (the campus's under the bound's own ceiling)
                # a stopped job comes back to what its racks drew when it last ran (their held peak, with the peaks
                # the readings hide), at most its caps; to its caps where it has not run since this controller began
                return_to_w = np.where(np.isfinite(self.ran_at_w), self.ran_at_w * (1.0 + p.hidden_peak_frac), np.inf)
                new_cap = start_ceiling_w(
                    site,
                    new_cap,
                    obs.job_running,
                    down,
                    np.fmin(load_env, bound_rack),
                    np.where(np.isfinite(guard_w), np.clip(at_caps - guard_w, 0.0, bridged_w), 0.0),
                    room_w,
                    self.job_gpus,
                    self.groups,
                    self.eta,
                    return_to_w,
                    self.rm,
                )
            # once it runs again, it goes back to the cap the ceiling took from it as fast as the headroom allows
            # (not at the slow rise: the ceiling was for the tick of its return, which the battery has now met)
            self.ceiled_from_w = np.where(
                new_cap < unceiled_w, np.fmax(self.ceiled_from_w, unceiled_w), self.ceiled_from_w
            )
            # 5. safety: stale telemetry moves a cap down to the safe level, never up
            new_cap = np.where(stale_job, np.minimum(new_cap, self.safe_cap_w), new_cap)
            new_cap = gpu.clamp_cap_w(new_cap)
            self._explain_caps(reasons, cut, emergency & ~paced, new_cap, stale_job, unmet)
            self.cap_w = new_cap
        rack_cap = self._rack_caps()
        stale_rack = ~rack_ok | (not pcc_ok)
        if rack_at_risk is not None and stale_rack.any() and pcc_ok:
            stale_rack &= rack_at_risk  # (only a rack that could take a domain past its soft level: _at_risk)
        if stale_rack.any():
            rack_cap = np.where(stale_rack, np.minimum(rack_cap, self.safe_cap_w), rack_cap)
            if pcc_ok and n_jobs:
                n_safe = np.bincount(site.rack_job[stale_rack & self.job_racks], minlength=n_jobs)
                n_safe[stale_job] = 0  # (a job sent there whole has its reason already: _explain_caps)
                for j in np.flatnonzero(n_safe)[:MAX_REASONS]:
                    what = f"stale telemetry: {n_safe[j]} rack(s) of {site.job_name[j]} at or below the safe level"
                    reasons.append(Reason("safety", what, job=int(j)))
        # (nor does a rack's cap rise, with or without a job, in a period its reading did not arrive, nor any rack's
        # while the PCC's is missing: a job may rise while a rack that cannot matter is late, and the rack catches up
        # only on a reading of its own and the campus's)
        if not pcc_ok:
            rack_cap = np.minimum(rack_cap, self.prev_rack_cap_w)
        elif not all_fresh:
            rack_cap = np.where(fresh, rack_cap, np.minimum(rack_cap, self.prev_rack_cap_w))
        rack_cap = self._catch_up(rack_cap, rack_caps, ramp_allow)
        self.prev_rack_cap_w = rack_cap
        self.landing.sent(obs.t_s, rack_cap, obs.rack_cap_w)

        # 3. trough filling -----------------------------------------------------------------------------------------
        # Fill only under domains with room: a floor on a rack whose breaker is being relieved would burn energy
        # against its own cap. Domains with a cut (the campus aside, whose cut is the grid's) exclude their racks.
        # Nor on a running job that is capped: there a floor only lifts the swing's troughs toward the cap, burning
        # energy against the cut that made the fall. A crashed, stopped or idle job's racks may be filled.
        # (nor while the campus itself is cut: a floor would burn energy in the room its caps are clearing, as under
        # a curtailment that falls faster than the ramp rule lets the import follow)
        filling = fill_w > fill_deadband_w and cut[0] <= 0
        n_fill = 0.0
        if filling:  # (the racks that may be filled, only where there is a fall to fill)
            cutting = cut > 0
            cutting[0] = False
            # a floor starts from the swing's trough (the least recent reading), not from a reading: floored from a
            # 1 s mean, the troughs below it are filled and the level the next reading shows is lifted by the floor
            trough_w = rack_trough_w
            draw_now = self.rm.gpu_draw_for_rack_w(np.where(np.isfinite(trough_w), np.fmin(trough_w, rack_w), rack_w))
            capped_running = np.zeros(site.n_racks, dtype=bool)
            if n_jobs:
                job_held = obs.job_running & (self.cap_w < gpu.rated_w)
                capped_running = job_racks & job_held[self.job_rack]
            fillable = job_racks & ~capped_running
            if cutting.any():
                fillable &= ~(self._rack_domains @ cutting.astype(np.float64) > 0)
            n_fill = float(np.sum(site.rack_active_gpus, where=fillable))
        floor_release = self.floor_release_w_per_s * dt
        # (and, with no job stopped, as far as the rule's room lets the import fall: what it stands above the least the
        # room's margin leaves is released at once, spread over the GPUs a floor holds; to the rule's own bound, the
        # fill level, noisy-falls with its ramp limit 30 % lower went 0.5 s over it. At the slow rate alone, a
        # checkpoint's floors were still up minutes after it, and a job that then stopped under them burned 1.6 MW
        # holding a fall no rule asked to hold. While a job is stopped the import's height is room its return will
        # want: there the floors come down at the slow rate, as before (released at once, prometheus-campus's
        # frontier run came back into an import that cost 1.2 points of GPU time; released at once after the return
        # hold let go, bess-offline with its ramp limit 30 % lower lost 2.2 % where it had lost 0.1 %)
        floored = self.floor_w > 0
        if floored.any() and return_w <= 0:
            spare_w = min(bus_w, bus_now_w) - bess_w - max(fill_lo_w, room_lo_w) - fill_deadband_w
            if spare_w > 0:
                n_floored = float(np.sum(site.rack_active_gpus, where=floored))
                floor_release = max(floor_release, spare_w * self.eta / max(n_floored, 1.0))
        if filling and n_fill > 0:
            lift = fill_w * self.eta / n_fill
            # no domain is filled past its soft threshold: bound the lift by each domain's room over its fill GPUs
            fill_gpus = self.rm.domain_load_w(np.where(fillable, site.rack_active_gpus, 0).astype(np.float64))
            # (at the campus against the readings: a floor holds a rack below what it drew running, so it does not
            # raise the bound the interconnect is held on; _bound_floors keeps the plan under the limit)
            env_fill = env.copy()
            env_fill[0] = seen_w
            room_w = np.maximum(soft - env_fill, 0.0)
            inside = fill_gpus > 0
            if inside.any():
                lift = min(lift, float(np.min(room_w[inside] * self.eta / fill_gpus[inside])))
            released = np.maximum(self.floor_w - floor_release, 0.0)
            self.floor_w = np.where(fillable, np.maximum(self.floor_w, draw_now) + lift, released)
            reasons.append(Reason("trough", "demand falling faster than the grid may ramp down", value_w=fill_w))
        else:
            self.floor_w = np.maximum(self.floor_w - floor_release, 0.0)  # released at the ramp limit
        self.floor_w = np.minimum(self.floor_w, rack_cap)  # a floor never holds a GPU above its cap
        # what each job rack is planned to draw under its cap without a floor: the base every floor is measured from
        planned_gpu = np.where(job_racks, np.minimum(gpu_env, rack_cap), 0.0)
        self.floor_w = self._bound_floors(self.floor_w, planned_gpu, load_env, limit, bess_w)
        floor = gpu.clamp_floor_w(self.floor_w)

        if relief_rack.any():
            what = f"BBUs of {int(np.count_nonzero(relief_rack))} rack(s) relieve a domain over its soft threshold"
            reasons.append(Reason("rack-storage", what, value_w=float(relief_rack.sum())))

        # planned load of every domain under these caps and floors, for the audit and the safety check
        planned_rack = np.where(job_racks, self.rm.rack_power_w(np.maximum(planned_gpu, floor)), load_env)
        planned = self.rm.domain_load_w(planned_rack)
        over = (planned > obs.domain_limit_w) & ~paced
        carried = over & (relief > 0)  # the BBUs under it take the excess this period: load was left, not shed
        if carried.any():
            what = f"{int(carried.sum())} domain(s) planned over rating: their BBUs carry the excess"
            reasons.append(Reason("safety", what, value_w=float((planned - obs.domain_limit_w)[carried].sum())))
        if (over & ~carried).any():
            what = f"{int((over & ~carried).sum())} domain(s) planned over rating: no sheddable load left"
            reasons.append(Reason("safety", what))
        if paced.any():
            what = f"{int(paced.sum())} domain(s) over rating brought under it at the ramp (their breakers report cool)"
            reasons.append(Reason("capping", what, value_w=float(cut[paced].sum())))

        # a guard holds no lower than its rack at the caps it now has, less what its BBU may afford to bridge (the
        # caps of a job that runs again may have risen past those the guard was set under)
        guarded = np.isfinite(threshold)
        if guarded.any():
            guarded &= (relief_rack <= 0) & (bridged_w < self.bbus.power_w)
        if guarded.any():
            threshold = np.where(guarded, np.fmax(threshold, self.rm.rack_power_w(rack_cap) - bridged_w), threshold)
        act = Actions(
            rack_cap_w=rack_cap,
            rack_floor_w=floor,
            bess_setpoint_w=bess_w,
            rack_bbu_threshold_w=threshold,
            rack_bbu_recharge_w=recharge,
            job_suspend=np.zeros(n_jobs, dtype=bool),
            planned_domain_w=planned,
            reasons=tuple(reasons),
        )
        return act if self.ride is None else self.ride.apply(obs, act, dt)  # voltage ride-through

    def _explain_caps(
        self,
        reasons: list[Reason],
        cut: FloatArray,
        emergency: BoolArray,
        new_cap: FloatArray,
        stale_job: BoolArray,
        unmet: FloatArray,
    ) -> None:
        for d in np.flatnonzero(cut > 0)[:MAX_REASONS]:
            layer = "emergency" if emergency[d] else ("grid" if d == 0 else "capping")
            what = f"cut {cut[d] / 1e3:.0f} kW at {self.site.domain_name[d]}"
            reasons.append(Reason(layer, what, domain=int(d), value_w=float(cut[d])))
        for j in np.flatnonzero(new_cap < self.cap_w):
            what = f"cap {self.site.job_name[j]} to {new_cap[j]:.0f} W per GPU"
            reasons.append(Reason("capping", what, job=int(j), value_w=float(new_cap[j])))
        for j in np.flatnonzero(stale_job):
            reasons.append(Reason("safety", "stale telemetry: cap held at or below the safe level", job=int(j)))
        if unmet.max(initial=0.0) > 0:
            d = int(np.argmax(unmet))
            reasons.append(Reason("safety", "no sheddable load left for the cut", domain=d, value_w=float(unmet[d])))


@register("dimmer")
def _make_dimmer(site: SiteModel, params: Mapping[str, Any]) -> DimmerController:
    try:
        p = DimmerParams.model_validate(dict(params))
    except ValidationError as exc:
        raise from_validation_error("controller", exc, ("params",)) from None
    return DimmerController(site, p)
