"""A campus split into buildings, each a site of its own under a feed its parent budgets.

A building controller sees its building as a whole site: its racks, the building's breaker and everything under it,
and above them a *feed* (domain 0 of the building's site): the budget its parent grants, in the place where a flat
site has its interconnect. The feed is held as an interconnect is, on the most its racks may draw, so a budget set
in that currency holds the building's import under it; the building's own breaker stays a breaker below it, held on
its RMS against its rating as on the flat site. Every job keeps its campus index (a job spanning buildings is one
job in each), so caps, reports and budgets line up across the levels without a table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from dimmer.observation import Actions, Observation, Reason
from dimmer.site import BessRatings, RackStorageRatings, SiteModel
from dimmer.siteconfig import LEVEL_ORDER

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

BUILDING_LEVEL = LEVEL_ORDER.index("building")
NO_BESS = BessRatings(0.0, 0.0, 1.0, 0.0, 1.0, 0.5, 1.0)


@dataclass(frozen=True)
class BuildingPart:
    """One building of a campus: where its racks and domains sit in the campus arrays, and its own site."""

    name: str
    domain: int  # the building's index among the campus's domains
    rack_start: int
    rack_stop: int
    domains: IntArray  # campus indices of the building's own site's domains 1.. (the building and below)
    site: SiteModel  # domain 0: the feed its parent budgets; 1: the building's breaker
    max_w: float  # the most its racks can draw: every GPU at its rated power

    @property
    def racks(self) -> slice:
        return slice(self.rack_start, self.rack_stop)


def building_parts(site: SiteModel) -> list[BuildingPart]:
    """The campus's buildings, in rack order; a site with no building level is one building (the campus)."""
    idx = np.flatnonzero(site.domain_level == BUILDING_LEVEL)
    if idx.size == 0:
        return [_part(site, "campus", 0, 0, site.n_racks, np.arange(1, site.n_domains))]
    parts = []
    for d in idx.tolist():
        start, stop = int(site.domain_rack_start[d]), int(site.domain_rack_stop[d])
        inside = (
            (site.domain_rack_start >= start) & (site.domain_rack_stop <= stop) & (site.domain_level >= BUILDING_LEVEL)
        )
        parts.append(_part(site, site.domain_name[d], d, start, stop, np.flatnonzero(inside)))
    return parts


def _part(site: SiteModel, name: str, domain: int, start: int, stop: int, domains: IntArray) -> BuildingPart:
    racks = slice(start, stop)
    n = stop - start
    gpu_max = site.rack_max_w()[racks]
    max_w = float(gpu_max.sum())
    # the building's domains keep their campus order (by level, then racks); the feed goes first, over all of it
    parent_map = {int(g): i + 1 for i, g in enumerate(domains)}
    parent = [-1] + [parent_map.get(int(site.domain_parent[g]), 0) for g in domains]
    start_arr = np.concatenate(([0], site.domain_rack_start[domains] - start)).astype(np.int64)
    stop_arr = np.concatenate(([n], site.domain_rack_stop[domains] - start)).astype(np.int64)
    lengths = stop_arr - start_arr
    rows = np.repeat(np.arange(start_arr.size), lengths)
    cols = np.concatenate([np.arange(a, b) for a, b in zip(start_arr, stop_arr, strict=True)])
    incidence = sp.csr_array((np.ones(rows.size), (rows, cols)), shape=(start_arr.size, n), dtype=np.float64)
    rs = site.rack_storage
    storage = RackStorageRatings(
        tray_energy_j=rs.tray_energy_j[racks].copy(),
        tray_power_w=rs.tray_power_w[racks].copy(),
        bbu_power_w=rs.bbu_power_w[racks].copy(),
        bbu_energy_j=rs.bbu_energy_j[racks].copy(),
        bbu_recharge_w=rs.bbu_recharge_w[racks].copy(),
        bbu_round_trip_eff=rs.bbu_round_trip_eff,
        bbu_soc_min_frac=rs.bbu_soc_min_frac,
        bbu_soc_max_frac=rs.bbu_soc_max_frac,
        tray_refill_s=rs.tray_refill_s,
    )
    sub = replace(
        site,
        rack_active_gpus=site.rack_active_gpus[racks].copy(),
        rack_is_spare=site.rack_is_spare[racks].copy(),
        rack_job=site.rack_job[racks].copy(),
        domain_name=("feed", *(site.domain_name[g] for g in domains)),
        domain_level=np.concatenate(([0], site.domain_level[domains])).astype(np.int64),
        domain_parent=np.asarray(parent, dtype=np.int64),
        domain_rating_w=np.concatenate(([max_w], site.domain_rating_w[domains])),
        domain_rack_start=start_arr,
        domain_rack_stop=stop_arr,
        incidence=incidence,
        # the feed is budgeted, not rated: its limit arrives with each observation; the ramp and the campus battery
        # are the parent's
        pcc_limit_w=max_w,
        ramp_limit_w_per_min=math.inf,
        rack_storage=storage,
        bess=NO_BESS,
    )
    return BuildingPart(name, domain, start, stop, np.asarray(domains, dtype=np.int64), sub, max_w)


def building_observation(part: BuildingPart, obs: Observation, ceiling_w: float, floor_w: float) -> Observation:
    """What the building's controller sees: its own racks and domains, its breaker's meter as the feed's, and the
    budget (`ceiling_w`, `floor_w`; NaN: none) as the feed's limit and the least import asked of it."""
    r, d, b = part.racks, part.domains, part.domain
    peak = obs.rack_load_peak_w[r] if obs.rack_load_peak_w is not None else None
    return Observation(
        t_s=obs.t_s,
        rack_power_w=obs.rack_power_w[r],
        rack_load_w=obs.rack_load_w[r],
        rack_age_s=obs.rack_age_s[r],
        rack_cap_w=obs.rack_cap_w[r],
        rack_floor_w=obs.rack_floor_w[r],
        rack_bbu_soc_frac=obs.rack_bbu_soc_frac[r],
        rack_energized=obs.rack_energized[r],
        domain_power_w=np.concatenate(([obs.domain_power_w[b]], obs.domain_power_w[d])),
        domain_age_s=np.concatenate(([obs.domain_age_s[b]], obs.domain_age_s[d])),
        domain_limit_w=np.concatenate(([part.max_w], obs.domain_limit_w[d])),
        domain_thermal_frac=np.concatenate(([math.nan], obs.domain_thermal_frac[d])),
        pcc_power_w=float(obs.domain_power_w[b]),
        pcc_age_s=float(obs.domain_age_s[b]),
        pcc_limit_w=min(ceiling_w, part.max_w) if math.isfinite(ceiling_w) else part.max_w,
        ramp_limit_w_per_min=math.inf,
        grid_freq_hz=obs.grid_freq_hz,
        bess_soc_frac=math.nan,
        bess_power_w=0.0,
        bess_online=False,
        job_running=obs.job_running,
        job_ended=obs.job_ended,
        rack_load_peak_w=peak,
        import_floor_w=floor_w,
    )


def merge_actions(
    site: SiteModel, parts: list[BuildingPart], actions: list[Actions], bess_setpoint_w: float, reasons: list[Reason]
) -> Actions:
    """The campus's actions from its buildings' (rack arrays side by side) and the coordinator's battery setpoint;
    a building's reasons name campus domains."""
    out = Actions.hands_off(site)
    planned = np.full(site.n_domains, np.nan)
    suspend = np.zeros(site.n_jobs, dtype=bool)
    for part, act in zip(parts, actions, strict=True):
        r = part.racks
        out.rack_cap_w[r] = act.rack_cap_w
        out.rack_floor_w[r] = act.rack_floor_w
        out.rack_bbu_threshold_w[r] = act.rack_bbu_threshold_w
        out.rack_bbu_recharge_w[r] = act.rack_bbu_recharge_w
        suspend |= act.job_suspend
        if act.planned_domain_w is not None:
            planned[part.domains] = act.planned_domain_w[1:]
        for why in act.reasons:
            dom = int(part.domains[why.domain - 1]) if why.domain >= 1 else (part.domain if why.domain == 0 else -1)
            reasons.append(replace(why, domain=dom))
    return replace(
        out, bess_setpoint_w=bess_setpoint_w, job_suspend=suspend, planned_domain_w=planned, reasons=tuple(reasons)
    )
