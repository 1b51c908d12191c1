"""The small sites the controller's property tests run on: rows of GB300 racks, jobs in contiguous rack ranges."""

from __future__ import annotations

import numpy as np

from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import JobPlacementSpec, LevelSpec, PccSpec, SiteSpec


def small_site(rows: int, racks: int, n_jobs: int, bess_mw: float) -> SiteModel:
    """Rows rated 110 kW a rack (a GB300 rack draws up to ~126 kW: every row is oversubscribed)."""
    spec = SiteSpec(
        pcc=PccSpec(limit_mw=0.12 * rows * racks, ramp_mw_per_min=1.0),
        spare_rack_frac=0.0,
        levels=[LevelSpec(level="row", count=rows, rating_kw=110 * racks), LevelSpec(level="rack", count=racks)],
        storage={"bess": {"power_mw": bess_mw, "energy_mwh": bess_mw}},
    )
    return build_site(spec, _jobs(rows * racks, n_jobs))


def _jobs(n_racks: int, n_jobs: int) -> list[JobPlacementSpec]:
    """`n_jobs` jobs over contiguous rack ranges of `n_racks` racks, priorities 0, 1, 2, 0, ..."""
    bounds = np.linspace(0, n_racks, n_jobs + 1).round().astype(int)
    return [
        JobPlacementSpec(name=f"j{i}", priority=i % 3, racks=(int(bounds[i]), int(bounds[i + 1])))
        for i in range(n_jobs)
        if bounds[i + 1] > bounds[i]
    ]


def small_campus(buildings: int, racks: int, n_jobs: int, bess_mw: float) -> SiteModel:
    """Buildings of two rows of `racks` racks, each row rated 110 kW a rack, each building 200 kW a rack (under what
    its racks may draw); jobs in contiguous rack ranges that may span buildings."""
    spec = SiteSpec(
        pcc=PccSpec(limit_mw=0.2 * buildings * 2 * racks, ramp_mw_per_min=1.0),
        spare_rack_frac=0.0,
        levels=[
            LevelSpec(level="building", count=buildings, rating_kw=200 * 2 * racks),
            LevelSpec(level="row", count=2, rating_kw=110 * racks),
            LevelSpec(level="rack", count=racks),
        ],
        storage={"bess": {"power_mw": bess_mw, "energy_mwh": bess_mw}},
    )
    return build_site(spec, _jobs(buildings * 2 * racks, n_jobs))
