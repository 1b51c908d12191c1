"""A building daemon: the flat daemon on one building of a campus, under a campus coordinator.

Its site is its building's (`building_split.BuildingPart`: the building's racks, its breaker and all below, and
above them a *feed*); its devices are its building's; what its controller plans on in place of an interconnect
limit is the budget its parent writes into its `dimmer-building-v1` registers (`BuildingServer`), within that
budget's lease, and its safe budget once the lease lapses. Each period it publishes there what its parent plans on
(`building_report.building_reports`, the same code the simulator's `dimmer-campus` reports with). The ramp rule and
the campus battery are the coordinator's: the building's controller sees neither.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from dimmer.control.building_report import ReportShape, building_reports, n_priority_groups
from dimmer.control.building_split import building_parts
from dimmer.control.coordinator import lapse_fall_w_per_s
from dimmer.control.dimmer import DimmerController, DimmerParams
from dimmer.daemon.agent_server import AllowList
from dimmer.daemon.building_server import BuildingServer
from dimmer.daemon.config import LoadedConfig, parse_address
from dimmer.observation import Actions, Observation

if TYPE_CHECKING:
    from collections.abc import Callable


def _default(key: str) -> float:
    return float(DimmerParams.model_fields[key].default)


def default_safe_share(loaded: LoadedConfig) -> float:
    """A building's share of the interconnect limit when it has no budget: its most over the campus's, within the
    campus's margin (`CampusCoordinator.safe_ceiling_w` with the default margin)."""
    assert loaded.part is not None
    total = sum(p.max_w for p in building_parts(loaded.campus_site))
    margin = float(_default("pcc_margin_frac"))
    return margin * loaded.part.max_w / max(total, 1.0)


class BuildingRole:
    def __init__(self, loaded: LoadedConfig, clock: Callable[[], float], speed: float) -> None:
        part, spec = loaded.part, loaded.config.building
        assert part is not None and spec is not None
        self.part = part
        self.campus_limit_w = loaded.campus_site.pcc_limit_w
        self.host, self.port = parse_address(spec.serve)
        share = spec.safe_share if spec.safe_share is not None else default_safe_share(loaded)
        campus = loaded.campus_site
        most = np.array([p.max_w for p in building_parts(campus)])
        index = [p.name for p in building_parts(campus)].index(part.name)
        margin = float(loaded.controller_params.get("ramp_margin_frac", _default("ramp_margin_frac")))
        fall = lapse_fall_w_per_s(most, campus.ramp_limit_w_per_min, margin)[index]
        site = loaded.site
        self.shape = ReportShape.of(site, np.zeros(site.n_racks, dtype=np.int64), [0])
        self.server = BuildingServer(
            part.name,
            part.max_w,
            share,
            n_priority_groups(site),
            unit=spec.unit,
            clock=clock,
            speed=speed,
            fall_w_per_s=float(fall),
            allow=AllowList.parse(spec.allow),
        )

    async def start(self) -> int:
        """Serve the registers; the port bound (the one configured, or the one the OS chose for port 0)."""
        self.port = await self.server.start(self.host, self.port)
        return self.port

    async def stop(self) -> None:
        await self.server.stop()

    def observe(self, obs: Observation, site_pcc_limit_w: float) -> Observation:
        """The building's observation with its budget in force as its feed's limit and least import; no ramp rule and
        no battery of its own (the campus's are its parent's)."""
        limit = float(np.fmin(self.campus_limit_w, site_pcc_limit_w))
        ceiling, floor = self.server.budget(limit)
        domain_limit = obs.domain_limit_w.copy()
        domain_limit[0] = self.part.max_w  # the feed is budgeted, not rated
        # the feed's import is the building breaker's meter (domain 1), unless a meter on the feed itself is fresher
        power, age = obs.domain_power_w.copy(), obs.domain_age_s.copy()
        if not age[0] <= age[1]:
            power[0], age[0] = power[1], age[1]
        return replace(
            obs,
            domain_power_w=power,
            domain_age_s=age,
            pcc_power_w=float(power[0]),
            pcc_age_s=float(age[0]),
            pcc_limit_w=min(ceiling, self.part.max_w) if math.isfinite(ceiling) else self.part.max_w,
            ramp_limit_w_per_min=math.inf,
            domain_limit_w=domain_limit,
            bess_soc_frac=math.nan,
            bess_power_w=0.0,
            bess_online=False,
            import_floor_w=floor,
        )

    def report(self, controller: object, obs: Observation, act: Actions) -> None:
        """Publish this period's report (nothing from a controller that is not the flat one: it has no bound)."""
        if isinstance(controller, DimmerController):
            soc = obs.rack_bbu_soc_frac
            rs = self.shape.site.rack_storage
            known = np.isfinite(soc) & (rs.bbu_energy_j > 0)
            mean = float(np.mean(soc[known])) if known.any() else math.nan
            above = np.maximum(soc[known] - rs.bbu_soc_min_frac, 0.0) * rs.bbu_energy_j[known]
            energy = float(np.sum(above)) if known.any() else math.nan
            self.server.publish(building_reports(self.shape, [controller], obs, act), mean, energy)
