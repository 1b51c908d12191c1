"""The campus coordinator: the interconnect, the utility's ramp rule and the campus battery, over buildings it sees
as one controllable load each.

Each building reports its import, the most it may draw at the caps in force (its *bound*, peaks included), and per
priority group what its running jobs hold of that bound, their floor and what they would draw uncapped, with what
its stopped jobs' returns would add and what its floors could add; the coordinator answers with a budget: a ceiling
on that bound and, where the campus falls faster than the ramp rule allows and the battery cannot take the rest, a
floor under its import. Grid shaping is the flat controller's (dimmer.py, layer 1) on the campus's own readings,
the PCC meter checked against the buildings' meters (plausibility.py); the room it leaves the buildings' bounds is
split by priority (`allocate`), the returns getting what is left with the battery where it is now.
docs/controller.md ("The hierarchy") has the whole of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dimmer.control.campus_battery import bess_room, campus_level, soc_pull_w
from dimmer.control.ffr import FastFrequencyResponse
from dimmer.control.filters import LowPass
from dimmer.control.plausibility import MISSING, OK, PccCheck
from dimmer.control.ramp_room import RampRoom, ReturnHold
from dimmer.site import BessRatings

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class BuildingReports:
    """What each building last told its parent (arrays over buildings; `(n_buildings, n_groups)` by priority group,
    lowest priority first). Every load is in the bound's currency: the most the racks may draw, peaks included. A
    building not heard from has t_s = -inf."""

    t_s: FloatArray
    import_w: FloatArray  # its meter, NaN where it has none
    bound_w: FloatArray  # the most its racks may draw at their caps in force (with its overhead and BBU recharge)
    prior_w: FloatArray  # the share of the bound that is the prior's (a swing's peak no reading measured)
    measured: npt.NDArray[np.bool_]  # every running rack's peak is measured
    return_w: FloatArray  # what its stopped jobs would add back when they run again, on
    return_gpus: FloatArray  # ... this many GPUs
    base_w: FloatArray  # what no cap moves: racks without a running job (stopped jobs as they are now), overhead
    group_w: FloatArray  # (n_b, n_g): each group's running jobs' share of the bound
    floor_w: FloatArray  # (n_b, n_g): ... at their lowest caps
    demand_w: FloatArray  # (n_b, n_g): ... as they would draw uncapped (a capped rack: at its rated power)
    back_w: FloatArray  # what its stopped jobs' returns would add to the bound
    fill_w: FloatArray  # what floors on its running, uncapped job racks and stopped jobs' GPUs could add


@dataclass(frozen=True)
class Budgets:
    t_s: float
    ceiling_w: FloatArray  # the most each building's bound may reach
    floor_w: FloatArray  # the least import asked of it (NaN: none)
    bess_setpoint_w: float
    # how long the battery holds this setpoint if no other comes: until every building, its budget lapsed, has come
    # down to its safe budget (the budgets counted on the battery: reverting sooner takes the import over the limit)
    bess_hold_s: float = 0.0


@dataclass(frozen=True)
class CoordinatorSettings:
    period_s: float
    pcc_margin_frac: float
    ramp_margin_frac: float
    forecast_tau_s: float
    bess_level_s: float
    bess_soc_target_frac: float
    bess_soc_recovery_s: float
    bess_reserve_frac: float
    fill_deadband_frac: float
    goodput_worth_j_per_gpu_s: float
    stale_s: float
    lease_s: float  # how long a building holds a budget it was sent
    pcc_check_frac: float  # the PCC meter's check against the buildings' meters (plausibility.py)
    pcc_learn_tau_s: float
    pcc_stuck_s: float
    behind_meter_generation_w: float
    slack_frac: float  # a ceiling stands this share of the building's most above its bound: room for its readings


def allocate(room_w: float, base_w: FloatArray, bound_w: FloatArray, floor_w: FloatArray, demand_w: FloatArray
             ) -> FloatArray:  # fmt: skip
    """Each building's share of `room_w`, by priority group (arrays `(n_b, n_g)`, lowest priority first; `base_w`
    `(n_b,)` what no cap moves, which the room holds first). Room over what the buildings' bounds now hold goes to
    the groups that would draw more, highest priority first; room short of it is cut from the groups, lowest
    priority first, no lower than their floors (the caller meets what is left). Within a group, in proportion to
    each building's want or give, so no building's running jobs lose room to another's rise."""
    alloc: FloatArray = bound_w.copy()
    left = room_w - float(base_w.sum() + bound_w.sum())
    grow = left > 0
    order = range(bound_w.shape[1] - 1, -1, -1) if grow else range(bound_w.shape[1])
    left = abs(left)
    for g in order:
        if left <= 0:
            break
        step = np.maximum(demand_w[:, g] - bound_w[:, g] if grow else bound_w[:, g] - floor_w[:, g], 0.0)
        total = float(step.sum())
        if total <= 0:
            continue
        take = min(left, total)
        alloc[:, g] += (step if grow else -step) * (take / total)
        left -= take
    return alloc


class CampusCoordinator:
    def __init__(
        self,
        building_max_w: FloatArray,
        pcc_limit_w: float,
        ramp_limit_w_per_min: float,
        ramp_window_s: float,
        bess: BessRatings,
        s: CoordinatorSettings,
        ffr: FastFrequencyResponse | None = None,
    ) -> None:
        self.max_w = np.asarray(building_max_w, dtype=np.float64)
        self.ramp_limit_w_per_min, self.ramp_window_s = ramp_limit_w_per_min, ramp_window_s
        self.bess, self.s = bess, s
        self.level = campus_level(s.period_s, s.bess_level_s, ramp_window_s, s.fill_deadband_frac * pcc_limit_w)
        self.forecast = LowPass(s.forecast_tau_s)
        self.ramp_room = RampRoom(ramp_window_s, s.period_s)
        self.return_hold = ReturnHold(s.goodput_worth_j_per_gpu_s)
        self.target_w: float | None = None
        self.alloc_w = np.zeros(self.max_w.shape)  # each building's share of the room last period
        self.t_last_s: float | None = None
        # the last ceiling each building was sent while it was heard, and when: its contract if it is lost
        self.sent_w = np.full(self.max_w.shape, np.inf)
        self.sent_t_s = np.full(self.max_w.shape, -np.inf)
        self.last_cut_w = self.last_fill_w = 0.0  # (for the reasons)
        # the PCC reading (its freshness, the battery) at each step, by time: the reports checked against it are older
        self.readings_at: dict[float, tuple[float, bool, float]] = {}
        self.pcc_check = PccCheck(pcc_limit_w, s.pcc_check_frac, s.pcc_learn_tau_s, s.pcc_stuck_s,
                                  generation_w=s.behind_meter_generation_w)  # fmt: skip
        self.pcc_status = MISSING
        self.cover_w = 0.0  # the battery's cover of the bound over the margin, taken on at the ramp
        # the campus's fast frequency response (ffr.py), on the interconnect's rating: here, not in the buildings,
        # since the battery and the split of the room are the coordinator's (None: off)
        self.ffr = ffr
        self.ffr_top_w: float | None = None  # the bounds' room when the caps' share of an order began (_ffr_room)

    def _ffr_room(self, room_w: float, bound_w: float) -> float:
        """The room under the frequency response's cut: the buildings' bounds as they stood when the caps' share of
        the order began, less that share, until the battery covers the order again (ffr.split's `caps_w`). Held from
        that start, not cut once from the bounds reported and held by a milliwatt as flat does on its readings: the
        reports are a period old and the bounds came back (on two buildings with no battery, a 0.6 MW order lowered
        the mean import by 0.05 MW so, 0.22 MW held)."""
        if self.ffr is None or self.ffr.caps_w <= 0:
            self.ffr_top_w = None
            return room_w
        if self.ffr_top_w is None:
            self.ffr_top_w = bound_w
        return min(room_w, self.ffr_top_w - self.ffr.caps_w)

    def safe_ceiling_w(self, pcc_limit_w: float) -> FloatArray:
        """What a building may draw with no parent: its share (by its most) of the interconnect's margin."""
        out: FloatArray = pcc_limit_w * self.s.pcc_margin_frac * self.max_w / max(float(self.max_w.sum()), 1.0)
        return out

    def safe_fall_w_per_s(self) -> FloatArray:
        """How fast a building without a parent comes down to its safe budget: its share of the ramp rule."""
        return lapse_fall_w_per_s(self.max_w, self.ramp_limit_w_per_min, self.s.ramp_margin_frac)

    def step(
        self,
        t_s: float,
        pcc_power_w: float,
        pcc_age_s: float,
        pcc_limit_w: float,
        bess_soc_frac: float,
        bess_power_w: float,
        bess_online: bool,
        rep: BuildingReports,
        grid_freq_hz: float = math.nan,
    ) -> Budgets:
        s = self.s
        dt = s.period_s if self.t_last_s is None else max(t_s - self.t_last_s, 1e-3)
        self.t_last_s = t_s
        # A building not heard from within stale_s is planned at its worst case: the most its contract lets it draw,
        # the last ceiling it was sent while it was heard until that budget's lease ends, then its safe budget (a
        # building keeps its budget for the lease, then falls to the safe one); never heard, every GPU at rated
        heard = (t_s - rep.t_s) <= s.stale_s
        safe = self.safe_ceiling_w(pcc_limit_w)
        leased = (t_s - self.sent_t_s) <= s.lease_s
        worst = np.minimum(np.where(leased, np.fmax(self.sent_w, safe), safe), self.max_w)
        worst = np.where(np.isfinite(rep.t_s), worst, self.max_w)
        bound = np.where(heard & np.isfinite(rep.bound_w), rep.bound_w, worst)
        imp = np.where(heard & np.isfinite(rep.import_w), rep.import_w, bound)
        base = np.where(heard, rep.base_w, bound)
        groups = np.where(heard[:, None], rep.group_w, 0.0)
        floors = np.where(heard[:, None], np.minimum(rep.floor_w, rep.group_w), 0.0)
        demand = np.where(heard[:, None], np.maximum(rep.demand_w, rep.group_w), 0.0)
        back = np.where(heard, rep.back_w, 0.0)
        fill_cap = np.where(heard, rep.fill_w, 0.0)
        bess_now = bess_power_w if bess_online and math.isfinite(bess_power_w) else 0.0
        pcc_ok = math.isfinite(pcc_power_w) and pcc_age_s <= s.stale_s
        buildings_w = float(imp.sum())
        # The PCC meter against the buildings' meters, one meter against many as in the flat controller's check
        # (plausibility.py), each PCC reading matched to the reports taken at its time (the reports are a period
        # older, and a swinging campus read a period apart differs by the swing). Its fit is the unmetered load
        # (transformers, the campus's own); while the meter is implausible the buildings' sum stands in for it.
        self.readings_at[t_s] = (pcc_power_w, pcc_ok, bess_now)
        taken = rep.t_s
        # (only where every building's meter read: a sum with a hole in it is no estimate to learn from)
        matched = heard.all() and np.all(taken == taken[0]) and bool(np.all(np.isfinite(rep.import_w)))
        then = self.readings_at.get(float(taken[0])) if matched else None
        if then is not None:
            verdict = self.pcc_check.update(then[0], then[1], float(rep.import_w.sum()), then[2], 0.0, pcc_limit_w, dt)
            self.pcc_status = verdict.status
        for old in [k for k in self.readings_at if k < t_s - 2.0 * s.stale_s]:
            del self.readings_at[old]
        gain, offset_w = self.pcc_check.fit()
        estimate_bus = gain * buildings_w + offset_w
        overhead_w = max(estimate_bus - buildings_w, 0.0)
        trusted = pcc_ok and self.pcc_status in (OK, MISSING)
        bus_now = (pcc_power_w + bess_now) if trusted else estimate_bus
        level = self.level.update(bus_now)
        bus_w = level if math.isfinite(level) else bus_now
        forecast = float(self.forecast.update(np.array([bus_w]), dt)[0])
        if self.level.warming:
            self.forecast.value = np.array([bus_w])
            forecast, self.target_w = bus_w, None
        grid_cap = pcc_limit_w * s.pcc_margin_frac
        discharge, discharge_plan, charge = bess_room(self.bess, bess_soc_frac, bess_online, s.bess_reserve_frac)
        ramp_step = self.ramp_limit_w_per_min / 60.0 * s.ramp_margin_frac * dt
        budget = s.ramp_margin_frac * self.ramp_limit_w_per_min * self.ramp_window_s / 60.0
        # (the import as the plan would have it: a frequency response ordered is added back, as flat: ffr.py)
        self.ramp_room.push(bus_now - bess_now + (self.ffr.order_w if self.ffr is not None else 0.0))
        lo, hi = self.ramp_room.bounds(budget)
        ret_w, ret_gpus = float(rep.return_w[heard].sum()), float(rep.return_gpus[heard].sum())
        with_return = max(bus_w, bus_now) + ret_w - max(discharge_plan, bess_now)
        climb = budget / self.ramp_window_s
        # (the floors to the margin's bound, with the battery: the flat controller fills only to the rule's own, but
        # a coordinator's floor is a building's a link and a building period later, and the margin covers that lag)
        lo = max(lo, self.return_hold.level_w(ret_w, ret_gpus, with_return, lo, budget, climb, dt))
        # jobs held back by their caps: a capped rack's demand is its rated power, so any is one
        slack = s.slack_frac * self.max_w
        held_back = float(np.sum(np.maximum(base + demand.sum(axis=1) - bound, 0.0))) > 1e-3 * float(self.max_w.sum())
        soc_pull = soc_pull_w(self.bess, bess_soc_frac, bess_online, s.bess_soc_target_frac, s.bess_soc_recovery_s,
                              s.ramp_margin_frac, self.ramp_limit_w_per_min, self.ramp_window_s)  # fmt: skip
        if soc_pull > 0 and held_back:
            soc_pull = 0.0  # recharge from surplus only, never with power a capped job could use
        # (the room is a level for the bounds, given afresh each period: the room given last period is not counted
        # again; a building may take up to its share in a tick, and the share is what the ramp leaves now)
        bus_caps = max(bus_w, bus_now)
        prev = bus_w if self.target_w is None else self.target_w
        target = forecast + soc_pull
        if math.isfinite(ramp_step):
            if self.target_w is not None and held_back:
                target = max(target, min(prev + ramp_step, bus_caps))
            target = min(max(target, prev - ramp_step), prev + ramp_step)
        target = min(target, grid_cap)
        self.target_w = target
        bound_total = float(bound.sum()) + overhead_w
        # the measured share of it (the buildings' peak readings) is held against the limit itself where every
        # building measures its peaks, the prior's share against the margin, with the battery's cover (as flat)
        prior_total = float(np.where(heard, np.nan_to_num(rep.prior_w), 0.0).sum())
        measured_ceiling = pcc_limit_w if bool(np.all(heard & rep.measured)) else grid_cap
        charge = min(charge, max(grid_cap - bound_total, 0.0))
        bess_w = float(np.clip(bus_w - target, -charge, discharge))
        bess_w = max(bess_w, min(min(bus_w, bus_now) - hi, discharge_plan))
        lo = min(lo, grid_cap)
        bess_w = min(bess_w, max(max(bus_w, bus_now) - lo, -charge))
        bess_w = max(bess_w, min(max(bus_w, bus_now) - grid_cap, discharge))
        # (the battery covers the prior's share of the bound over the margin, as far as its plan and one window's
        # ramp budget allow: a battery that reverts to 0 W must leave a step the rule allows; it takes the cover on
        # at the ramp, as flat: taken at once, its step moved the import into the rule's low side, for floors)
        cover_w = max(min(discharge_plan, budget), 0.0)
        need_w = min(bound_total - grid_cap, cover_w)
        self.cover_w = max(min(need_w, self.cover_w + ramp_step), 0.0)
        bess_w = max(bess_w, min(self.cover_w, need_w))
        # The room for the buildings' bounds: the ramp rule's (the import may rise to the target's next step, or the
        # top of the rule's room, less what the battery leaves; what it leaves above the room is cut) and the
        # interconnect's (the measured bound against the limit, the prior's against the margin, with the battery
        # one ramp step on, as flat)
        cut_w = max(min(bus_w, bus_now) - bess_w - hi, 0.0)
        plan_bess_w, ffr_bess_w = bess_w, 0.0
        if self.ffr is not None:
            # the droop's order laid on the plan: the battery first, what it cannot give of a reduction a cut of the
            # buildings' room below (lowest priority first, by allocate); its share is no room for a bound to rise
            # into, as flat: the interconnect's room counts the plan's battery
            bess_w = self.ffr.split(self.ffr.order(grid_freq_hz, ramp_step), bess_w, discharge, charge)[0]
            ffr_bess_w = max(self.ffr.bess_w, 0.0)
        rise_w = max(max(target + ramp_step, hi) + discharge_plan - bus_caps, 0.0) if cut_w <= 0 else -cut_w
        # (the plan's: taking the response's share off a room worked out with it took the cover's term down too,
        # and cut the lowest priorities by 3 MW on prometheus-ffr with the battery giving all the order)
        next_bess = min(plan_bess_w + ramp_step, max(discharge_plan, plan_bess_w))
        # (the cover as far as it will have come next period: counted whole, a limit falling faster than it ramps
        # in, a curtailment, outran it: commands-delayed on two buildings, 8 s over the limit)
        limit_room = min(
            measured_ceiling + next_bess + prior_total,
            grid_cap + max(next_bess, min(self.cover_w + ramp_step, cover_w)),
        )
        room = min(bound_total + rise_w, limit_room) - overhead_w
        room = self._ffr_room(room, bound_total - overhead_w)
        # a stopped job's return arrives within a tick, the battery's turn from charging a period later: the
        # returns get what is left with the battery where it is now
        return_room = grid_cap + min(bess_w, bess_now) - ffr_bess_w
        alloc = base + allocate(room, base, groups, floors, demand).sum(axis=1)
        # (the ceilings' slack included: a building's start ceiling holds its stopped jobs' caps so their return
        # fits its ceiling, so the ceilings are the room a return has)
        return_top = min(room, return_room - overhead_w - float(slack[heard].sum()))
        total_back = float(back.sum())
        if total_back > 0:
            alloc = alloc + back * min(max(return_top - float(alloc.sum()), 0.0) / total_back, 1.0)
        # what no building asked for is spread by what each could still draw (a peak a reading had not shown is
        # then no cut), within the room, and where a return is pending within what its room leaves
        spare = max((room if total_back <= 0 else return_top) - float(alloc.sum()), 0.0)
        could = np.where(heard, np.maximum(self.max_w - alloc, 0.0), 0.0)
        if spare > 0 and float(could.sum()) > 0:
            alloc = alloc + could * min(spare / float(could.sum()), 1.0)
        self.alloc_w = np.where(heard, alloc, self.alloc_w)
        # the slack comes out of the interconnect's room, never on top of it: at the limit, a building's bound may
        # not rise past its share (on top, two 8-rack buildings' slack took the import 2 kW over the limit)
        free_w = max(limit_room - overhead_w - float(alloc.sum()) + max(cover_w - next_bess, 0.0), 0.0)
        slack_w = float(slack[heard].sum())
        if slack_w > free_w:
            slack = slack * (free_w / slack_w)
        ceiling = np.where(heard, alloc + slack, safe)
        over_w = max(bound_total - overhead_w - room, 0.0)
        # (against the plan's battery, as flat: the order's fall is the ramp room's already, no fall to fill)
        fill_w = max(lo - (max(bus_w, bus_now) - plan_bess_w), 0.0)
        if fill_w <= s.fill_deadband_frac * pcc_limit_w:
            fill_w = 0.0
        total_fill = float(fill_cap.sum())
        floor = np.full(ceiling.shape, np.nan)
        if fill_w > 0 and total_fill > 0:
            give = fill_cap * min(fill_w / total_fill, 1.0)
            floor = np.where(give > 0, imp + give, np.nan)
        self.last_cut_w, self.last_fill_w = over_w, fill_w
        self.sent_w = np.where(heard, ceiling, self.sent_w)
        self.sent_t_s = np.where(heard, t_s, self.sent_t_s)
        fall = (ceiling - safe) / self.safe_fall_w_per_s()
        hold_s = s.lease_s + float(np.max(np.maximum(fall, 0.0), initial=0.0)) + 2.0 * s.period_s
        return Budgets(t_s, ceiling, floor, bess_w, hold_s if math.isfinite(hold_s) else s.lease_s)


def lapse_fall_w_per_s(max_w: FloatArray, ramp_limit_w_per_min: float, ramp_margin_frac: float) -> FloatArray:
    """Each building's share (by its most) of the campus's ramp rule, W/s: how fast one whose budget's lease has
    lapsed comes down to its safe budget (every building falling together stays within the rule)."""
    share = max_w / max(float(np.sum(max_w)), 1.0)
    out: FloatArray = share * ramp_limit_w_per_min / 60.0 * ramp_margin_frac
    return out


def lapsed_ceiling_w(
    last_w: FloatArray, safe_w: FloatArray, lapsed_s: FloatArray, fall_w_per_s: FloatArray
) -> FloatArray:
    """The ceiling of a building `lapsed_s` past its budget's lease: from its last budget (NaN: none) down to the safe
    one at `fall_w_per_s`, never above the last; at once with no ramp rule (an infinite rate), or no last budget.
    (At once, two buildings falling to their safe budgets together broke a 1 MW/min rule for 3 s.)"""
    last = np.nan_to_num(last_w, nan=np.inf)
    with np.errstate(invalid="ignore"):
        paced = last - fall_w_per_s * np.maximum(lapsed_s, 0.0)
    paced = np.where(np.isfinite(paced), paced, safe_w)
    out: FloatArray = np.minimum(np.maximum(paced, safe_w), last)
    return out
