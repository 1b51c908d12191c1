"""Rack BBUs as what they are: backup units first, a relief of last resort before a cap, within a wear budget.

A BBU shelf is sized and rated to carry its rack through an outage (OCP ORv3: the rack at full draw for 90 s), and
its Li-ion cells are rated for thousands of full cycles, not the tens of thousands a year that shaving every
iteration's peak costs (a 2 s swing is 43,200 micro-cycles a day; on the Xu et al. depth-stress curve a 0.3 %
cycle weighs 0.7 % of a full one, 300 full cycles a day). So here the BBUs:

- never follow the swing: their threshold is +inf (backup only) unless a domain above the rack is planned over its
  soft threshold; then the threshold holds the rack at its share of that threshold (its bound scaled by soft /
  planned load of its most loaded domain), so the BBUs take the excess before a cap does. While relieving a BBU
  does not recharge, so one relief is one monotone discharge: one cycle of its depth, not one per iteration;
- keep a ride-through reserve: `reserve_s` seconds of the rack's present load, counted as the outage would use it
  (the whole store, after discharge losses; the same reckoning as gridsim's `min_bbu_ride_through_s`), and never
  less than the shelf's shaving floor;
- spend at most `cycle_budget_per_day` depth-weighted cycles a day each: an allowance refilled continuously (at
  most one day's worth banked), charged with every half cycle the reported SoC closes, whoever caused it (counted
  at gridsim's own threshold, `SOC_TURN_HYSTERESIS`, so no cycle the wear metric counts goes unpaid); neither a
  relief nor a guard on a stopped job's racks (the controller's) asks more of a shelf in a period than
  `affordable_w`, the depth the allowance left buys, and a guarded rack is not relieved (its job may come back
  within the period far over the bound its idle readings give, and the shelf would take the surge);
- recharge only while every domain above has room, at an allowance that rises slowly (a share of the utility's
  ramp a period, spread over the racks that recharge) and tapers as a shelf nears full, so the recharge never steps
  the grid: 576 shelves starting at 13 kW at once would be a 7.5 MW step.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.control.rack_math import RackMath, nan_to_num
from dimmer.site import SiteModel
from dimmer.wear import DAY_S, SOC_TURN_HYSTERESIS, depth_for_weight, depth_weight

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class HalfCycles:
    """Depth-weighted half cycles of every rack's reported SoC, counted as its runs turn (vectorised over racks).

    A run that reverses by more than `hysteresis` closes a half cycle of its depth (at half a cycle's weight).
    Counting each reversal on its own never pairs a small cycle inside a large one as rainflow does, so it charges
    at least what rainflow would: the safe side for a budget.
    """

    def __init__(self, n: int, window_frac: float, hysteresis: float = SOC_TURN_HYSTERESIS) -> None:
        self.window = max(window_frac, 1e-9)
        self.h = hysteresis
        self.turn = np.full(n, np.nan)  # SoC at the last turning point
        self.extreme = np.full(n, np.nan)  # the run's furthest value since it
        self.direction = np.zeros(n, dtype=np.int8)  # +1 rising, -1 falling, 0 not yet moved
        # the SoC the last update took, and the state it left: the same SoC again moves nothing (a run neither
        # turns nor starts nor reaches further on the values it has already taken), so it is not worked through
        self._last_soc: FloatArray | None = None
        self._left: tuple[FloatArray, FloatArray, npt.NDArray[np.int8]] | None = None

    def update(self, soc: FloatArray) -> FloatArray:
        """Take this period's SoC (NaN: unknown, skipped); return each rack's weight closed now (full cycles)."""
        left, last = self._left, self._last_soc
        if (
            left is not None
            and last is not None
            and self.h > 0
            and left[0] is self.turn
            and left[1] is self.extreme
            and left[2] is self.direction
            and soc.dtype == np.float64
            and soc.shape == last.shape
        ):
            # (a shelf whose SoC is as last period's, to the bit, is as it was: each rack's run is its own, so only
            # the shelves that moved are worked through, where they are fewer than half)
            moved = np.ascontiguousarray(soc).view(np.int64) != last.view(np.int64)
            n_moved = int(np.count_nonzero(moved))
            if n_moved == 0:
                return np.zeros(soc.shape)  # (the shelves' SoC as last period: every run as it was)
            if n_moved <= soc.shape[0] // 2:
                at = np.flatnonzero(moved)
                closed = np.zeros(soc.shape)
                closed[at] = self._update_at(soc, at)
                last[at] = soc[at]  # (our own copy)
                self._left = (self.turn, self.extreme, self.direction)
                return closed
        closed = self._update(soc)
        self._last_soc = np.array(soc, dtype=np.float64, order="C")
        self._left = (self.turn, self.extreme, self.direction)
        return closed

    def _update_at(self, soc: FloatArray, at: npt.NDArray[np.intp]) -> FloatArray:
        """`_update` of the racks `at` alone (the others' runs as they are); their weights closed now."""
        whole = (self.turn, self.extreme, self.direction)
        self.turn, self.extreme, self.direction = whole[0][at], whole[1][at], whole[2][at]
        closed = self._update(soc[at])
        turn, extreme, direction = whole[0].copy(), whole[1].copy(), whole[2].copy()
        turn[at], extreme[at], direction[at] = self.turn, self.extreme, self.direction
        self.turn, self.extreme, self.direction = turn, extreme, direction
        return closed

    def _update(self, soc: FloatArray) -> FloatArray:
        known = np.isfinite(soc)
        fresh = known & ~np.isfinite(self.turn)
        self.turn = np.where(fresh, soc, self.turn)
        self.extreme = np.where(fresh, soc, self.extreme)
        d, ext = self.direction, self.extreme
        turned = known & (((d > 0) & (soc <= ext - self.h)) | ((d < 0) & (soc >= ext + self.h)))
        if turned.any():
            closed = np.where(turned, 0.5 * depth_weight(np.abs(ext - self.turn) / self.window), 0.0)
        else:
            closed = np.zeros(soc.shape)
        self.turn = np.where(turned, ext, self.turn)
        self.direction = np.where(turned, -d, d).astype(np.int8)
        start = known & (self.direction == 0) & (np.abs(soc - ext) >= self.h)
        self.direction = np.where(start, np.sign(soc - ext), self.direction).astype(np.int8)
        up, down = known & (self.direction > 0), known & (self.direction < 0)
        self.extreme = np.where(turned, soc, np.where(up, np.fmax(ext, soc), np.where(down, np.fmin(ext, soc), ext)))
        out: FloatArray = closed
        return out

    def open_depth(self) -> FloatArray:
        """Depth (share of the window) of the run under way; 0 where none."""
        out: FloatArray = nan_to_num(np.abs(self.extreme - self.turn) / self.window, nan=0.0)
        return out


def _sel(a: npt.NDArray[Any], at: npt.NDArray[np.intp] | None) -> npt.NDArray[Any]:
    """A per-rack array at the racks `at` (all of it where None)."""
    return a if at is None else a[at]


class BbuPolicy:
    """The BBU thresholds and recharge allowances of every rack, vectorised over racks."""

    def __init__(
        self,
        site: SiteModel,
        cycle_budget_per_day: float,
        reserve_s: float,
        recharge_full_tau_s: float,
        rm: RackMath | None = None,
    ):
        rs = site.rack_storage
        self.has = rs.bbu_energy_j > 0
        self._all_have = bool(self.has.all())
        self.energy_j = rs.bbu_energy_j.astype(np.float64)
        self.power_w = rs.bbu_power_w.astype(np.float64)
        self.rated_recharge_w = np.minimum(rs.bbu_recharge_w, rs.bbu_power_w).astype(np.float64)
        self.soc_min, self.soc_max = rs.bbu_soc_min_frac, rs.bbu_soc_max_frac
        self.discharge_eff = math.sqrt(rs.bbu_round_trip_eff)
        self.budget = float(cycle_budget_per_day)  # full cycles a day, each rack
        # cycles left to spend: none banked at the start, so no run, however short, spends more than its share of
        # the day (a day banked at most)
        self.allowance = np.zeros(site.n_racks)
        self.cycles = HalfCycles(site.n_racks, self.soc_max - self.soc_min)
        self.reserve_s = reserve_s
        self._reserve_j = self.energy_j * self.discharge_eff  # what each shelf gives an outage, all of it
        self.full_tau_s = recharge_full_tau_s
        self.recharge_w = np.zeros(site.n_racks)
        self.given_w = np.zeros(site.n_racks)  # the relief planned last period: the SoC read now may not show it
        self.rm = RackMath(site) if rm is None else rm  # (its ancestor_min: the least share above each rack)

    def reserve_soc(self, load_w: FloatArray, at: npt.NDArray[np.intp] | None = None) -> FloatArray:
        """The SoC each shelf keeps: `reserve_s` of its rack's present load as an outage draws it, at least the
        shaving floor. `at`: `load_w` is those racks' only, in that order."""
        need = self.reserve_s * np.maximum(load_w, 0.0)
        if self._all_have:
            need /= _sel(self._reserve_j, at)
        else:
            need = np.divide(need, _sel(self._reserve_j, at), out=np.zeros_like(load_w), where=_sel(self.has, at))
        out: FloatArray = np.minimum(np.maximum(need, self.soc_min), self.soc_max)  # (np.clip's, without its wrapper)
        return out

    def affordable_w(self, dt_s: float, at: npt.NDArray[np.intp] | None = None) -> FloatArray:
        """Per rack: the most its shelf may give over the next period (W, at its output) with the cycle that opens,
        closed by the recharge after it, within the allowance left: a discharge under way extends its own cycle; a
        new one first pays for the recharge it interrupts. `at`: those racks only, in that order (each rack's
        figure is its own, worked out alone: the same bits)."""
        c = self.cycles
        direction, has, energy_j = _sel(c.direction, at), _sel(self.has, at), _sel(self.energy_j, at)
        open_depth = nan_to_num(np.abs(_sel(c.extreme, at) - _sel(c.turn, at)) / c.window, nan=0.0)  # (open_depth)
        falling = direction < 0
        unpaid = np.where(direction > 0, 0.5 * depth_weight(open_depth), 0.0)  # the recharge a new fall turns
        reach = depth_for_weight(np.maximum(_sel(self.allowance, at) - unpaid, 0.0))
        unseen = _sel(self.given_w, at) * dt_s / np.where(has, energy_j * self.discharge_eff * c.window, np.inf)
        depth = np.maximum(reach - np.where(falling, open_depth, 0.0) - unseen, 0.0)
        out: FloatArray = np.where(has, depth * c.window * energy_j * self.discharge_eff / max(dt_s, 1e-3), 0.0)
        return out

    def can_hold(self, soc: FloatArray, bound_w: FloatArray, at: npt.NDArray[np.intp] | None = None) -> BoolArray:
        """Where a shelf can take a rack's surge for a period or two: present, SoC known and above its reserve.
        `at`: those racks only (`soc` and `bound_w` every rack's), in that order."""
        if at is not None:
            soc, bound_w = soc[at], bound_w[at]
        soc_k = nan_to_num(soc, nan=-1.0)
        out: BoolArray = _sel(self.has, at) & (soc_k > self.reserve_soc(nan_to_num(bound_w, nan=0.0), at))
        return out

    def relief_scale(self, planned_w: FloatArray, soft_w: FloatArray) -> FloatArray:
        """Per rack: soft / planned load of the most loaded domain above it, where that is under 1 (1 elsewhere)."""
        over = planned_w > soft_w
        if not over.any():
            return np.ones(self.has.shape[0])
        share = np.where(over, soft_w / np.maximum(planned_w, 1e-9), 1.0)  # (1 where not over, under 1 where over)
        return self.rm.ancestor_min(share, over)

    def step(
        self,
        dt_s: float,
        soc: FloatArray,
        bound_w: FloatArray,
        scale: FloatArray,
        room: BoolArray,
        recharge_rise_w: float,
        guard_w: FloatArray | None = None,
    ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """(threshold W, recharge allowance W, relief W each rack's BBU is counted on) for this period.

        `soc` as reported (NaN unknown: no relief, no recharge); `bound_w` the most each rack may draw before its
        BBU this period (the reserve is kept for it, too); `scale` from relief_scale; `room` where every domain
        above the rack may take more load; `recharge_rise_w` how much the racks' total recharge may grow this
        period; `guard_w` a threshold each rack's BBU holds even when not relieving (inf: none): a rack whose job
        is not running may come back faster than a period, and a threshold above its usual draw costs nothing
        until it does (kept only above the reserve).
        """
        known = np.isfinite(soc) & self.has
        spent = self.cycles.update(soc if self._all_have else np.where(self.has, soc, np.nan))
        refill = self.budget * dt_s / DAY_S
        self.allowance = np.minimum(self.allowance + refill - spent, self.budget)
        reserve = self.reserve_soc(nan_to_num(bound_w, nan=0.0))
        soc_k = nan_to_num(soc, nan=self.soc_min)
        guard = np.full_like(bound_w, np.inf) if guard_w is None else guard_w
        asked = scale < 1.0
        if asked.any():
            # the relief under way, closed by the recharge that follows it, is a whole cycle of its depth
            falling = np.flatnonzero(self.cycles.direction < 0)
            opened = np.zeros(soc.shape)  # (a rack's own figure: worked out where its shelf falls, 0 elsewhere)
            if falling.size:
                c = self.cycles
                opened[falling] = depth_weight(nan_to_num(np.abs(c.extreme[falling] - c.turn[falling]) / c.window))
            can_give = known & (soc_k > reserve) & (self.allowance - opened > 0)
            # (not a guarded rack: its job is stopped or not yet started, and may come back within the period to
            # far over the bound its idle readings give; a relief threshold there took the surge of a start, 0.44 %
            # of the shelf in one period where the relief planned 0.45 kW, prometheus-campus's finetune at 180 s)
            relieve = can_give & asked & ~np.isfinite(guard)
        else:  # (no domain asks for relief: no shelf gives it)
            relieve = np.zeros(soc.shape, dtype=bool)
        # (a guard holds only above the reserve; none held: none to drop)
        guard = guard.copy() if (guard == np.inf).all() else np.where(known & (soc_k > reserve), guard, np.inf)
        if relieve.any():
            at = np.flatnonzero(relieve)  # (each figure below is its rack's own: worked out where it relieves)
            energy_left_w = (soc_k[at] - reserve[at]) * self.energy_j[at] * self.discharge_eff / max(dt_s, 1e-3)
            # and no more in a period than the allowance left buys: stopping the relief only once the cycle under
            # way has cost the allowance let each shelf's last period of relief overrun it (commands-delayed: 1.04
            # depth-weighted cycles a day, interruption-storm 1.27, prometheus-campus 1.57, on a budget of 1)
            afford_w = self.affordable_w(dt_s, at)
            bound_at = bound_w[at]
            excess_w = np.maximum(bound_at - np.maximum(bound_at * scale[at], 0.0), 0.0)
            relief: FloatArray = np.zeros(bound_w.shape)
            relief[at] = np.minimum(np.minimum(excess_w, self.power_w[at]), np.minimum(energy_left_w, afford_w))
            relief = np.maximum(relief, 0.0)
            relieve = relieve & (relief > 0)
            threshold = np.where(relieve, bound_w - relief, guard)
        else:  # (no shelf relieves: none is asked what it may afford)
            relief, threshold = np.zeros(bound_w.shape), guard
        self.given_w = relief

        # recharge: with room, never while relieving; rises slowly, tapers to 0 as a shelf fills. A shelf under its
        # reserve recharges without room (the caps make it): ride-through comes before goodput
        want = soc_k < self.soc_max - 1e-4
        if want.any():  # (every shelf full: none recharges)
            want &= known & (room | (soc_k < reserve)) & ~relieve
        if want.any():
            taper_w = np.maximum(self.soc_max - soc_k, 0.0) * self.energy_j / self.full_tau_s
            top_w = np.minimum(self.rated_recharge_w, taper_w)
            n_want = int(np.count_nonzero(want))
            rise = recharge_rise_w / n_want
            rise = rise if math.isfinite(rise) else float(np.max(self.rated_recharge_w, initial=0.0))
            self.recharge_w = np.where(want, np.minimum(self.recharge_w + rise, top_w), 0.0)
        else:
            self.recharge_w = np.zeros(soc.shape)
        return threshold, self.recharge_w.copy(), relief
