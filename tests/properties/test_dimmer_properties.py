"""The dimmer controller under arbitrary observation sequences: it never raises, caps stay in the GPU's range,
floors stay under caps, a rack without a fresh reading never has its cap raised, and one without a reading for
stale_s is at the safe cap unless, at its maximum, it could take no domain past its rating. And the PCC meter
check never overrides a healthy meter, whatever the load, the battery, the unmetered overhead and the limit do."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dimmer.control import Controller, make_controller
from dimmer.control.plausibility import PccCheck
from dimmer.observation import Observation
from dimmer.site import SiteModel
from tests.properties.small_sites import small_campus, small_site

floats = st.one_of(st.just(math.nan), st.floats(min_value=-1e3, max_value=1e9))


@st.composite
def _steps(draw: st.DrawFn, site: SiteModel) -> list[dict[str, Any]]:
    steps = []
    for _ in range(draw(st.integers(1, 25))):
        n, d = site.n_racks, site.n_domains
        steps.append(
            {
                "gpu_w": np.array(draw(st.lists(floats, min_size=n, max_size=n))),
                "age_s": np.array(draw(st.lists(st.sampled_from([0.5, 1.0, 30.0, math.inf]), min_size=n, max_size=n))),
                "domain_nan": draw(st.booleans()),
                "pcc_nan": draw(st.booleans()),
                "thermal": draw(st.floats(0.0, 1.2)),
                "limit_scale": draw(st.floats(0.3, 1.2)),
                "soc": draw(st.one_of(st.just(math.nan), st.floats(0.0, 1.0))),
                "dt": draw(st.sampled_from([0.5, 1.0, 3.0])),
                "d": d,
            }
        )
    return steps


@st.composite
def scenario(draw: st.DrawFn) -> tuple[SiteModel, list[dict[str, Any]]]:
    site = small_site(
        draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(0, 3)), draw(st.sampled_from([0.0, 0.3]))
    )
    return site, draw(_steps(site))


def _obs(site: SiteModel, t: float, s: dict[str, Any]) -> Observation:
    rack = s["gpu_w"]
    dom = site.domain_load_w(np.nan_to_num(rack))
    return Observation(
        t_s=t,
        rack_power_w=rack,
        rack_load_w=rack,
        rack_age_s=s["age_s"],
        rack_cap_w=np.full(site.n_racks, site.gpu.rated_w),
        rack_floor_w=np.zeros(site.n_racks),
        rack_bbu_soc_frac=np.full(site.n_racks, s["soc"]),
        rack_energized=np.ones(site.n_racks, dtype=bool),
        domain_power_w=np.full(site.n_domains, np.nan) if s["domain_nan"] else dom,
        domain_age_s=np.ones(site.n_domains),
        domain_limit_w=site.domain_rating_w * s["limit_scale"],
        domain_thermal_frac=np.full(site.n_domains, s["thermal"]),
        pcc_power_w=math.nan if s["pcc_nan"] else float(dom[0]),
        pcc_age_s=1.0,
        pcc_limit_w=site.pcc_limit_w * s["limit_scale"],
        ramp_limit_w_per_min=site.ramp_limit_w_per_min,
        grid_freq_hz=50.0,
        bess_soc_frac=s["soc"],
        bess_power_w=0.0,
        bess_online=site.bess.energy_j > 0,
        job_running=np.ones(site.n_jobs, dtype=bool),
    )


@given(scenario())
def test_controller_invariants_under_arbitrary_observations(case: tuple[SiteModel, list[dict[str, Any]]]) -> None:
    site, steps = case
    _check_rack_rules(make_controller("dimmer", site), site, steps, pcc_counts=True)


def _check_rack_rules(ctrl: Controller, site: SiteModel, steps: list[dict[str, Any]], pcc_counts: bool) -> None:
    """Step `ctrl` through `steps` and check every rack's rules each period. `pcc_counts`: a missing PCC reading
    holds every cap too (the flat controller's; a building of dimmer-campus reads its own meter instead)."""
    gpu = site.gpu
    rack_max = site.rack_max_w()
    t = 0.0
    prev_cap = np.full(site.n_racks, gpu.rated_w)
    held = np.zeros(site.n_racks, dtype=bool)  # a fresh reading has arrived once: the controller holds a value
    t_first: float | None = None
    for s in steps:
        t += s["dt"]
        t_first = t if t_first is None else t_first
        # (a rack not yet heard from whose reading is reported recent is held, not stale, for 5 s from the first step)
        grace = ~held & (s["age_s"] <= 5.0) & (t - t_first <= 5.0)
        held |= np.isfinite(s["gpu_w"]) & (s["age_s"] <= 5.0)
        act = ctrl.step(_obs(site, t, s))
        cap, floor = act.rack_cap_w, act.rack_floor_w
        assert np.all(np.isfinite(cap)) and np.all(np.isfinite(floor))
        assert np.all(cap >= gpu.min_cap_w) and np.all(cap <= gpu.rated_w)
        assert np.all(floor >= 0) and np.all(floor <= cap + 1e-9)
        assert np.all(floor <= gpu.floor_max_frac * gpu.rated_w + 1e-9)
        assert math.isfinite(act.bess_setpoint_w) and abs(act.bess_setpoint_w) <= site.bess.power_w + 1e-6
        # no fresh reading this period: the cap is not raised; the latest that arrived older than stale_s (5 s), or
        # none ever (past the first 5 s, or reported older than that): at the safe cap (a reading lost this period
        # reports the age of the one before it)
        pcc_nan = s["pcc_nan"] and pcc_counts
        not_fresh = ~np.isfinite(s["gpu_w"]) | (s["age_s"] > 5.0) | pcc_nan
        assert np.all(cap[not_fresh] <= prev_cap[not_fresh] + 1e-9), "a cap was raised without a fresh reading"
        stale = (s["age_s"] > 5.0) | (~held & ~grace) | pcc_nan
        # a stale rack keeps a cap above the safe one only where, at its maximum, it could take no domain above it
        # past its rating: the controller's worst case (the other racks at their bounds, no lower than their readings
        # under their maxima; the campus with its overhead; soft levels at most the ratings) is no lower than this
        kept = stale & (cap > 0.6 * gpu.rated_w + 1e-9) & (gpu.min_cap_w <= 0.6 * gpu.rated_w)
        if kept.any():
            assert not pcc_nan, "a missing PCC reading sends every rack to the safe cap"
            reading = np.clip(np.nan_to_num(s["gpu_w"], nan=0.0), 0.0, rack_max)
            lowest_worst = site.domain_load_w(np.where(stale, rack_max, reading))
            limit = site.domain_rating_w * s["limit_scale"]
            under = (site.incidence @ kept.astype(np.float64)) > 0
            assert np.all(lowest_worst[under] <= limit[under] * (1 + 1e-9)), "a stale rack that matters kept its cap"
        prev_cap = cap


@st.composite
def campus_scenario(draw: st.DrawFn) -> tuple[SiteModel, list[dict[str, Any]]]:
    site = small_campus(draw(st.integers(2, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 4)),
                        draw(st.sampled_from([0.0, 0.3])))  # fmt: skip
    return site, draw(_steps(site))


@given(campus_scenario(), st.sampled_from([0.0, 0.3]), st.booleans())
def test_the_hierarchy_keeps_the_same_invariants_under_arbitrary_observations(
    case: tuple[SiteModel, list[dict[str, Any]]], latency_s: float, parent_lost: bool
) -> None:
    """dimmer-campus: every building's controller keeps the flat controller's rules on its own racks, whatever the
    coordinator's budgets say, and the campus battery stays within its power."""
    site, steps = case
    params: dict[str, Any] = {"link_latency_s": latency_s, "lease_s": 3.0}
    if parent_lost:
        params["parent_lost"] = [{"from_s": 2.0, "to_s": 1e9}]
    _check_rack_rules(make_controller("dimmer-campus", site, params), site, steps, pcc_counts=False)


@given(
    overhead_w=st.floats(-2e5, 1e6),
    steps=st.lists(
        st.tuples(
            st.floats(0.0, 5e6),  # rack sum: any load, any jump between periods
            st.floats(-2e6, 2e6),  # battery: anything within a 2 MW rating, any jump
            st.floats(0.5e6, 6e6),  # interconnect limit in force: curtailments come and go
            st.sampled_from([0.5, 1.0, 3.0]),
            st.booleans(),  # the meter goes missing now and then
        ),
        min_size=1,
        max_size=200,
    ),
)
def test_the_pcc_check_never_overrides_a_healthy_meter(
    overhead_w: float, steps: list[tuple[float, float, float, float, bool]]
) -> None:
    """A meter that reads the truth (the racks, a constant overhead no rack meter sees, less the battery) is always
    plausible: the check plans on its reading exactly, every period it is there. (A negative overhead is generation
    behind the meter, which the site declares: the import is never under the racks' sum by more.)"""
    check = PccCheck(6e6, tol_frac=0.02, learn_tau_s=1800.0, stuck_s=3.0, generation_w=max(-overhead_w, 0.0))
    seen = False
    for rack_w, bess_w, limit_w, dt_s, missing in steps:
        pcc_w = rack_w + overhead_w - bess_w
        v = check.update(math.nan if missing else pcc_w, not missing, rack_w, bess_w, 0.0, limit_w, dt_s)
        if missing:
            # the racks stand in, with the overhead learned once the meter has been seen
            assert v.status == "missing"
            assert v.used_w == pytest.approx(pcc_w if seen else rack_w - bess_w, abs=1.0)
        else:
            assert v.status == "ok" and v.used_w == pcc_w
            seen = True
