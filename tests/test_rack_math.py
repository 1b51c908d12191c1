"""RackMath gives the site's rack arithmetic to the last bit: the controller's decisions must not move with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dimmer.control.rack_math import RackMath
from gridsim.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
SITES = ("swing-8k.toml", "sites/two-buildings.toml", "sites/staggered-starts.toml", "sites/bare-racks.toml")


@pytest.mark.parametrize("name", SITES)
def test_rack_math_is_the_sites_to_the_bit(name: str) -> None:
    site = load_scenario(SCENARIOS / name, []).site()
    rm = RackMath(site)
    rng = np.random.default_rng(7)
    assert np.array_equal(rm.rack_max_w, site.rack_max_w())
    for _ in range(20):
        x = rng.random(site.n_racks) * 10.0 ** rng.integers(-2, 6)
        x[rng.random(site.n_racks) < 0.05] = np.nan
        x[rng.random(site.n_racks) < 0.02] = np.inf
        for mine, theirs in (
            (rm.rack_power_w, site.rack_power_w),
            (rm.gpu_draw_for_rack_w, site.gpu_draw_for_rack_w),
            (rm.domain_load_w, site.domain_load_w),
        ):
            with np.errstate(invalid="ignore"):  # (inf - inf in the sums, in both)
                assert np.array_equal(mine(x), theirs(x), equal_nan=True)
        finite = np.nan_to_num(x, nan=1.0, posinf=2.0)
        assert np.array_equal(rm.domain_load_w(finite), site.domain_load_w(finite))
        assert np.array_equal(rm.domain_load_w(finite > 1.0), site.domain_load_w(finite > 1.0))


def test_domain_sums_of_a_tree_that_does_not_tile() -> None:
    """Domains that are no tiling of equal spans (a hand-made site) are gathered as the site does."""
    from dataclasses import replace

    site = load_scenario(SCENARIOS / "sites/two-buildings.toml", []).site()
    start = site.domain_rack_start.copy()
    stop = site.domain_rack_stop.copy()
    stop[-1] = start[-1]  # an empty domain at the end
    odd = replace(site, domain_rack_start=start, domain_rack_stop=stop)
    x = np.random.default_rng(1).random(site.n_racks)
    assert np.array_equal(RackMath(odd).domain_load_w(x), odd.domain_load_w(x))
