from __future__ import annotations

import numpy as np
import pytest

from dimmer.errors import InputError
from dimmer.site import build_site
from dimmer.siteconfig import JobPlacementSpec, LevelSpec, PccSpec, SiteSpec


def _spec(**kw: object) -> SiteSpec:
    levels = [
        LevelSpec(level="building", count=2, rating_mw=10),
        LevelSpec(level="row", count=3, rating_kw=900),
        LevelSpec(level="rack", count=4),
    ]
    return SiteSpec(pcc=PccSpec(limit_mw=20), levels=levels, **kw)  # type: ignore[arg-type]


def test_tree_shape_names_and_ranges() -> None:
    site = build_site(_spec())
    assert site.n_racks == 24
    assert site.n_domains == 1 + 2 + 6 + 24
    assert site.domain_name[:4] == ("campus", "b0", "b1", "b0/r0")
    assert site.domain_name[-1] == "b1/r2/k3"
    row = site.domain_index("b1/r1")
    assert (site.domain_rack_start[row], site.domain_rack_stop[row]) == (16, 20)
    assert site.domain_parent[row] == site.domain_index("b1")
    assert site.domain_rating_w[row] == 900e3
    assert site.domain_rating_w[0] == 20e6  # the campus breaker is the interconnect


def test_domain_load_matches_incidence_product() -> None:
    site = build_site(_spec())
    rng = np.random.default_rng(0)
    x = rng.random(site.n_racks) * 1e5
    np.testing.assert_allclose(site.domain_load_w(x), site.incidence @ x)
    series = rng.random((5, site.n_racks))
    np.testing.assert_allclose(site.domain_load_w(series), (site.incidence @ series.T).T)


def test_rack_power_inverse() -> None:
    site = build_site(_spec())
    draw = np.linspace(200, 1400, site.n_racks)
    np.testing.assert_allclose(site.gpu_draw_for_rack_w(site.rack_power_w(draw)), draw)


def test_job_by_gpu_count_takes_running_and_spare_racks() -> None:
    # 32,768 GPUs at 64 per rack = 512 running racks + ceil(2 %) = 11 spares = 523 racks (MODELS.md).
    levels = [LevelSpec(level="row", count=60, rating_mw=1.5), LevelSpec(level="rack", count=10)]
    spec = SiteSpec(pcc=PccSpec(limit_mw=100), levels=levels)
    site = build_site(spec, [JobPlacementSpec(name="big", gpus=32768)])
    assert int((site.rack_job == 0).sum()) == 523
    assert int(site.rack_is_spare.sum()) == 11
    assert int(site.rack_active_gpus[(site.rack_job == 0) & ~site.rack_is_spare].sum()) == 32768


def test_partial_last_rack_and_building_placement() -> None:
    site = build_site(_spec(), [JobPlacementSpec(name="a", gpus=100), JobPlacementSpec(name="b", building="b1")])
    run_a = (site.rack_job == 0) & ~site.rack_is_spare
    assert int(site.rack_active_gpus[run_a].sum()) == 100
    assert set(np.flatnonzero(site.rack_job == 1)) == set(range(12, 24))


def test_job_that_does_not_fit_names_the_key() -> None:
    with pytest.raises(InputError, match=r"jobs\[1\]\.gpus: .*only"):
        build_site(_spec(), [JobPlacementSpec(name="a", gpus=64), JobPlacementSpec(name="b", gpus=64 * 40)])


def test_override_of_unknown_domain_is_refused() -> None:
    spec = _spec(overrides=[{"domain": "b9/r0", "rating_kw": 500}])
    with pytest.raises(InputError, match=r"site\.overrides\[0\]\.domain"):
        build_site(spec)


def test_override_applies() -> None:
    site = build_site(_spec(overrides=[{"domain": "b0/r2", "rating_kw": 500}]))
    assert site.domain_rating_w[site.domain_index("b0/r2")] == 500e3
