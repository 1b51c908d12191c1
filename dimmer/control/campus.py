"""`dimmer-campus`: the campus as the product runs it at scale, a coordinator over one controller per building.

Each building runs the flat dimmer controller on its own site (building_split.py): its breakers, BBUs, trays and
GPU caps, under a feed whose limit is the budget its parent grants. The coordinator (coordinator.py) owns the
interconnect, the ramp rule and the campus battery. Between them runs a link with a latency: a building's report
reaches the coordinator `link_latency_s` after it was taken, a budget reaches the building as late, and a budget
holds for `lease_s` from when it was issued; after that the building falls to a safe budget (its share of the
interconnect's margin, under its own breakers' ratings, which it keeps in any case). A building the coordinator has
not heard from within `stale_s` is planned at its worst case. The coordinator runs every `parent_period_s`, the
buildings every control period; outages of the link (`child_lost`) and of the coordinator (`parent_lost`) can be
scheduled, so what the hierarchy costs, and what it does when a level is lost, is measured, not assumed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from pydantic import Field, ValidationError, model_validator

from dimmer.control import register
from dimmer.control.building_report import ReportShape, building_reports
from dimmer.control.building_split import BuildingPart, building_observation, building_parts, merge_actions
from dimmer.control.coordinator import (
    Budgets,
    BuildingReports,
    CampusCoordinator,
    CoordinatorSettings,
    lapsed_ceiling_w,
)
from dimmer.control.dimmer import DimmerController, DimmerParams
from dimmer.control.ffr import FastFrequencyResponse
from dimmer.errors import InputError, from_validation_error
from dimmer.observation import Actions, Observation, Reason
from dimmer.site import SiteModel
from dimmer.siteconfig import Strict

REPORT_FIELDS = tuple(f.name for f in fields(BuildingReports))


class Outage(Strict):
    from_s: float = Field(ge=0)
    to_s: float = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> Outage:
        if self.to_s <= self.from_s:
            raise ValueError("to_s must be after from_s")
        return self


class LinkOutage(Outage):
    building: str  # the building's name (b0, b1, ...)


class CampusParams(Strict):
    """The hierarchy's own settings; `building` holds the flat controller's parameters (DimmerParams) for every
    building, whose campus-wide ones (margins, ramp share, battery, forecast) the coordinator takes too."""

    parent_period_s: float = Field(default=1.0, gt=0)
    link_latency_s: float = Field(default=0.05, ge=0)  # one way
    lease_s: float = Field(default=10.0, gt=0)
    # a ceiling stands this share of the building's most above its bound: room for its readings to move in
    budget_slack_frac: float = Field(default=0.02, ge=0, le=0.5)
    building: dict[str, Any] = Field(default_factory=dict)
    child_lost: list[LinkOutage] = Field(default_factory=list)
    parent_lost: list[Outage] = Field(default_factory=list)


@dataclass
class _Link:
    """Messages in flight: (delivery time, payload), delivered in order."""

    queue: deque[tuple[float, Any]]

    def send(self, at_s: float, payload: Any) -> None:
        self.queue.append((at_s, payload))

    def receive(self, now_s: float) -> list[Any]:
        out = []
        while self.queue and self.queue[0][0] <= now_s + 1e-9:
            out.append(self.queue.popleft()[1])
        return out


class CampusHierarchy:
    name = "dimmer-campus"

    def __init__(self, site: SiteModel, params: CampusParams, building: DimmerParams) -> None:
        self.site, self.p = site, params
        self.parts: list[BuildingPart] = building_parts(site)
        # A site of one building (or none) has nothing to coordinate: its building's controller is the campus's,
        # with the interconnect, the ramp and the battery its own (the flat controller, as one daemon would run it)
        self.single = DimmerController(site, building) if len(self.parts) == 1 else None
        n_b = len(self.parts)
        names = [part.name for part in self.parts]
        for i, lost in enumerate(params.child_lost):
            if lost.building not in names:
                raise InputError("controller", f"params.child_lost[{i}].building", f"one of {', '.join(names)}")
        self.children: list[DimmerController] = []
        if self.single is not None:
            return  # (no coordinator, no link: step() is the flat controller's)
        child = building_params(site, building)
        self.children += [DimmerController(part.site, child) for part in self.parts]
        self.coordinator = make_coordinator(site, self.parts, params, building)
        self.fall_w_per_s = self.coordinator.safe_fall_w_per_s()
        # racks -> their building, for the reports' sums
        rack_building = np.zeros(site.n_racks, dtype=np.int64)
        for i, part in enumerate(self.parts):
            rack_building[part.racks] = i
        self.shape = ReportShape.of(site, rack_building, [part.domain for part in self.parts])
        self.n_groups = self.shape.n_groups
        self.up_link = _Link(deque())  # reports, building -> coordinator
        self.down_link = _Link(deque())  # budgets, coordinator -> buildings
        nan, zero, groups0 = np.full(n_b, np.nan), np.zeros(n_b), np.zeros((n_b, self.n_groups))
        self.reports = BuildingReports(
            t_s=np.full(n_b, -np.inf), import_w=nan, bound_w=nan.copy(), prior_w=nan.copy(),
            measured=np.zeros(n_b, dtype=bool), return_w=zero, return_gpus=zero.copy(), base_w=zero.copy(),
            group_w=groups0, floor_w=groups0.copy(), demand_w=groups0.copy(), back_w=zero.copy(), fill_w=zero.copy(),
        )  # fmt: skip
        self.budget_t_s = np.full(n_b, -np.inf)  # when each building's budget in force was issued
        self.ceiling_w = np.full(n_b, np.nan)
        self.floor_w = np.full(n_b, np.nan)
        self.parent_t_s = -math.inf
        self.bess_setpoint_w = 0.0
        self.bess_revert_t_s = -math.inf  # when the battery reverts to idle if no setpoint comes

    def dimmer_parts(self) -> list[DimmerController]:
        """The flat controllers this runs (one per building; one for a site of one building)."""
        return [self.single] if self.single is not None else list(self.children)

    # -- the simulated link and its outages -------------------------------------------------------------------------

    def _child_up(self, t_s: float) -> np.ndarray:
        up = np.ones(len(self.parts), dtype=bool)
        names = [part.name for part in self.parts]
        for lost in self.p.child_lost:
            if lost.from_s <= t_s < lost.to_s:
                up[names.index(lost.building)] = False
        return up

    def _parent_up(self, t_s: float) -> bool:
        return not any(o.from_s <= t_s < o.to_s for o in self.p.parent_lost)

    def _take_reports(self, t_s: float) -> None:
        for up, r in self.up_link.receive(t_s):
            for name in REPORT_FIELDS:
                getattr(self.reports, name)[up] = getattr(r, name)[up]

    def _take_budgets(self, t_s: float) -> None:
        for up, b in self.down_link.receive(t_s):
            self.budget_t_s = np.where(up, b.t_s, self.budget_t_s)
            self.ceiling_w = np.where(up, b.ceiling_w, self.ceiling_w)
            self.floor_w = np.where(up, b.floor_w, self.floor_w)

    # -- one period ------------------------------------------------------------------------------------------------

    def step(self, obs: Observation) -> Actions:
        if self.single is not None:
            return self.single.step(obs)
        t = obs.t_s
        p = self.p
        reasons: list[Reason] = []
        self._take_reports(t)
        parent_up = self._parent_up(t)
        if parent_up and t - self.parent_t_s >= p.parent_period_s - 1e-6:
            self.parent_t_s = t
            budgets = self.coordinator.step(
                t, obs.pcc_power_w, obs.pcc_age_s, obs.pcc_limit_w, obs.bess_soc_frac, obs.bess_power_w,
                obs.bess_online, self.reports, obs.grid_freq_hz,
            )  # fmt: skip
            self.bess_setpoint_w = budgets.bess_setpoint_w
            self.bess_revert_t_s = t + budgets.bess_hold_s
            self.down_link.send(t + p.link_latency_s, (self._child_up(t), budgets))
            self._explain(budgets, reasons)
        elif not parent_up and t >= self.bess_revert_t_s:
            self.bess_setpoint_w = 0.0  # a battery whose controller is silent reverts to idle, on its timeout
        self._take_budgets(t)
        leased = (t - self.budget_t_s) <= p.lease_s
        safe = self.coordinator.safe_ceiling_w(obs.pcc_limit_w)
        lapsed = lapsed_ceiling_w(self.ceiling_w, safe, t - self.budget_t_s - p.lease_s, self.fall_w_per_s)
        ceiling = np.where(leased, self.ceiling_w, lapsed)
        ceiling = np.where(np.isfinite(ceiling), ceiling, safe)
        floor = np.where(leased, self.floor_w, np.nan)
        if not leased.all():
            n = int(np.count_nonzero(~leased))
            reasons.append(Reason("safety", f"{n} building(s) past their budget's lease: a safe budget"))
        actions = []
        for i, (part, ctrl) in enumerate(zip(self.parts, self.children, strict=True)):
            sub = building_observation(part, obs, float(ceiling[i]), float(floor[i]))
            actions.append(ctrl.step(sub))
        merged = merge_actions(self.site, self.parts, actions, self.bess_setpoint_w, reasons)
        report = building_reports(self.shape, self.children, obs, merged)
        self.up_link.send(t + p.link_latency_s, (self._child_up(t), report))
        return merged

    def _explain(self, b: Budgets, reasons: list[Reason]) -> None:
        c = self.coordinator
        if c.last_cut_w > 0:
            reasons.append(Reason("grid", "buildings over the campus's room: ceilings lowered", value_w=c.last_cut_w))
        if c.last_fill_w > 0:
            what = "campus falling faster than the ramp: building floors"
            reasons.append(Reason("trough", what, value_w=c.last_fill_w))
        if c.ffr is not None and c.ffr.order_w:
            reasons.append(c.ffr.reason())


def building_params(site: SiteModel, building: DimmerParams) -> DimmerParams:
    """A building controller's parameters under a coordinator: the campus keeps the interconnect's margin (the slack
    in each budget is the building's), and floors come down no faster than the campus may, its ramp spread over
    every job GPU (a building has no ramp of its own, so its default would release them at once). The fast frequency
    response is the coordinator's, on the campus's rating: a building answering too would count it once more each."""
    job_gpus = float(np.sum(site.rack_active_gpus[site.rack_job >= 0])) or 1.0
    spread = site.ramp_limit_w_per_min / 60.0 * building.ramp_margin_frac * site.rectifier_eff / job_gpus
    release = building.floor_release_w_per_s or (spread if math.isfinite(spread) else None)
    update = {"pcc_margin_frac": 1.0, "floor_release_w_per_s": release, "ffr_droop_pct": 0.0}
    return building.model_copy(update=update)


def make_coordinator(
    site: SiteModel, parts: list[BuildingPart], params: CampusParams, building: DimmerParams
) -> CampusCoordinator:
    """The campus coordinator over `parts`, with the campus-wide settings of the building parameters (the fast
    frequency response's among them: on the interconnect's rating, or where none is set the buildings' most)."""
    settings = CoordinatorSettings(
        period_s=params.parent_period_s,
        pcc_margin_frac=building.pcc_margin_frac,
        ramp_margin_frac=building.ramp_margin_frac,
        forecast_tau_s=building.forecast_tau_s,
        bess_level_s=building.bess_level_s,
        bess_soc_target_frac=building.bess_soc_target_frac,
        bess_soc_recovery_s=building.bess_soc_recovery_s,
        bess_reserve_frac=building.bess_reserve_frac,
        fill_deadband_frac=building.fill_deadband_frac,
        goodput_worth_j_per_gpu_s=building.goodput_worth_j_per_gpu_s,
        stale_s=building.stale_s,
        lease_s=params.lease_s,
        pcc_check_frac=building.pcc_check_frac,
        pcc_learn_tau_s=building.pcc_learn_tau_s,
        pcc_stuck_s=building.pcc_stuck_s,
        behind_meter_generation_w=building.behind_meter_generation_w,
        slack_frac=params.budget_slack_frac,
    )
    max_w = np.array([part.max_w for part in parts])
    ramp = site.ramp_limit_w_per_min
    ffr = FastFrequencyResponse.for_site(site, building, max_w)
    return CampusCoordinator(max_w, site.pcc_limit_w, ramp, site.ramp_window_s, site.bess, settings, ffr)


def campus_params(params: Mapping[str, Any], source: str = "controller") -> tuple[CampusParams, DimmerParams]:
    """`dimmer-campus`'s params validated: its own, and the building controllers' (InputError naming the key)."""
    try:
        p = CampusParams.model_validate(dict(params))
    except ValidationError as exc:
        raise from_validation_error(source, exc, ("params",)) from None
    try:
        building = DimmerParams.model_validate(p.building)
    except ValidationError as exc:
        raise from_validation_error(source, exc, ("params", "building")) from None
    return p, building


@register("dimmer-campus")
def _make_campus(site: SiteModel, params: Mapping[str, Any]) -> CampusHierarchy:
    p, building = campus_params(params)
    return CampusHierarchy(site, p, building)
