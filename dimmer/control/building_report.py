"""What a building tells its parent each period (`BuildingReports`), from its controller's state and its readings.

One code path for both places a report is made: the simulator's `dimmer-campus`, where one object steps every
building (arrays over all of them, summed per building), and a building daemon, which reports its own building alone
(the same arrays over its racks, one row) through its `dimmer-building-v1` registers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dimmer.control.allocation import priority_groups
from dimmer.control.coordinator import BuildingReports
from dimmer.control.dimmer import DimmerController
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def n_priority_groups(site: SiteModel) -> int:
    return max(len(priority_groups(site.job_priority)), 1)


@dataclass(frozen=True)
class ReportShape:
    """What the reports of a set of buildings are summed over: each rack's building and priority group, the
    domain each building's meter is in the observation, and the racks' constants."""

    site: SiteModel
    rack_building: IntArray  # (n_racks,)
    meter_domain: IntArray  # (n_buildings,) the domain of the observation each building's meter reads
    rack_group: IntArray
    n_groups: int
    running_rack: npt.NDArray[np.bool_]
    rack_max_w: FloatArray
    rack_min_w: FloatArray

    @property
    def n_buildings(self) -> int:
        return int(self.meter_domain.size)

    @staticmethod
    def of(site: SiteModel, rack_building: IntArray, meter_domain: Sequence[int]) -> ReportShape:
        groups = priority_groups(site.job_priority)
        job_group = np.zeros(max(site.n_jobs, 1), dtype=np.int64)
        for g, jobs in enumerate(groups):
            job_group[jobs] = g
        return ReportShape(
            site=site,
            rack_building=np.asarray(rack_building, dtype=np.int64),
            meter_domain=np.asarray(meter_domain, dtype=np.int64),
            rack_group=job_group[np.where(site.rack_job >= 0, site.rack_job, 0)],
            n_groups=max(len(groups), 1),
            running_rack=(site.rack_job >= 0) & ~site.rack_is_spare,
            rack_max_w=site.rack_max_w(),
            rack_min_w=site.rack_power_w(np.full(site.n_racks, site.gpu.min_cap_w)),
        )


def building_reports(
    shape: ReportShape, children: Sequence[DimmerController], obs: Observation, act: Actions
) -> BuildingReports:
    """Every building's report this period (`children[i]` is building i's controller, `obs` and `act` span all
    their racks side by side; each building's sums from its own racks)."""
    site, gpu = shape.site, shape.site.gpu
    n_b, n_g = shape.n_buildings, shape.n_groups
    job_on = (
        obs.job_running[np.where(site.rack_job >= 0, site.rack_job, 0)]
        if site.n_jobs
        else np.zeros(site.n_racks, dtype=bool)
    )
    running = shape.running_rack & job_on
    stopped = shape.running_rack & ~job_on
    bound = np.concatenate([c.rack_bound_w for c in children])
    back = np.concatenate([c.rack_back_w() for c in children])
    capped = act.rack_cap_w < gpu.rated_w - 1e-6
    # a capped rack would draw up to its rated power: what it would draw above its cap no reading shows
    demand = np.where(capped, shape.rack_max_w, bound)
    floor = np.minimum(shape.rack_min_w, bound)
    returns = np.maximum(back - bound, 0.0)
    key = shape.rack_building * n_g + shape.rack_group
    size = n_b * n_g
    # (the building's overhead and its BBUs' recharge: its bound less its racks')
    extra = np.array([c.bound_w - float(c.rack_bound_w.sum()) for c in children])
    draw = site.gpu_draw_for_rack_w(np.where(np.isfinite(obs.rack_load_w), obs.rack_load_w, 0.0))
    per_gpu = site.rack_active_gpus / site.rectifier_eff
    # (floors lift a running, uncapped job's racks, and any stopped job's: a crashed job's idle GPUs)
    fillable = shape.running_rack & ~(running & capped)
    fill = np.where(fillable, per_gpu * np.maximum(act.rack_cap_w - draw, 0.0), 0.0)
    dom = shape.meter_domain
    meter_ok = obs.domain_age_s[dom] <= children[0].p.stale_s
    by_building = shape.rack_building

    def per_group(values: FloatArray) -> FloatArray:
        out: FloatArray = np.bincount(key, values, minlength=size).reshape(n_b, n_g).astype(float)
        return out

    def per_building(values: FloatArray) -> FloatArray:
        out: FloatArray = np.bincount(by_building, values, minlength=n_b).astype(float)
        return out

    return BuildingReports(
        t_s=np.full(n_b, obs.t_s),
        import_w=np.where(meter_ok, obs.domain_power_w[dom], np.nan),
        bound_w=np.array([c.bound_w for c in children]),
        prior_w=np.array([c.prior_w for c in children]),
        measured=np.array([c.all_measured for c in children]),
        return_w=np.array([c.return_w for c in children]),
        return_gpus=np.array([c.return_gpus for c in children]),
        base_w=per_building(np.where(running, 0.0, bound)) + extra,
        group_w=per_group(np.where(running, bound, 0.0)),
        floor_w=per_group(np.where(running, floor, 0.0)),
        demand_w=per_group(np.where(running, demand, 0.0)),
        back_w=per_building(np.where(stopped, returns, 0.0)),
        fill_w=per_building(fill),
    )
