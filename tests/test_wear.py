"""Storage wear: depth-weighted rainflow cycles (Xu et al. 2018), turning points kept per rack, the summary keys."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dimmer.control.rack_storage import BbuPolicy
from dimmer.wear import DAY_S, depth_for_weight
from gridsim.engine import run
from gridsim.metrics import SUMMARY_KEYS, summarize
from gridsim.scenario import load_scenario
from gridsim.wear import SocTurningPoints, depth_weight, equivalent_cycles
from tests.test_dimmer_controller import _site

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def test_the_depth_stress_curve_of_xu_et_al() -> None:
    assert depth_weight(1.0) == pytest.approx(1.0)
    assert depth_weight(0.0) == 0.0
    # a 1 % cycle weighs (k1 + k3) / (k1 0.01^k2 + k3) = 17,000 / 1.293e6 of a full one: more than its depth
    assert float(depth_weight(0.01)) == pytest.approx(17000.0 / (1.40e5 * 0.01**-0.501 - 1.23e5), rel=1e-12)
    assert 0.01 < float(depth_weight(0.01)) < 0.02
    d = np.linspace(0.001, 1.0, 200)
    assert np.all(np.diff(depth_weight(d)) > 0)  # deeper costs more


def test_cycles_of_known_swings() -> None:
    assert equivalent_cycles([0.0, 1.0, 0.0]) == pytest.approx(1.0)  # one full swing: two half cycles
    assert equivalent_cycles([0.5, 0.5, 0.5]) == 0.0
    # 100 swings of 1 % of a 0.5 window (depth 0.02 each)
    soc = 0.9 + 0.005 * np.tile([0.0, 1.0], 101)
    assert equivalent_cycles(soc, 0.5) == pytest.approx(100 * float(depth_weight(0.01)), rel=0.02)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=60), st.floats(-0.2, 0.2), st.floats(1.0, 3.0))
@example([1.0, 0.0, 2.225073858507e-311, 0.0, 1.0], 0.125, 1.0)  # a denormal turn lost a 0.3-deep cycle
def test_cycle_invariants(soc: list[float], shift: float, gain: float) -> None:
    """Non-negative; a constant offset changes nothing; a larger swing never costs less; same input, same result."""
    x = np.asarray(soc) * 0.3
    base = equivalent_cycles(x)
    assert base >= 0.0
    assert equivalent_cycles(x + shift) == pytest.approx(base, rel=1e-9, abs=1e-12)
    assert equivalent_cycles(x * gain) >= base - 1e-12
    assert equivalent_cycles(x) == base


def test_turning_points_keep_what_rainflow_needs() -> None:
    rng = np.random.default_rng(3)
    series = np.cumsum(rng.normal(0.0, 0.01, size=(400, 3)), axis=0) + 0.7
    tp = SocTurningPoints(series[0], hysteresis_frac=0.0)
    for row in series[1:]:
        tp.update(row)
    for k in range(3):
        assert equivalent_cycles(tp.series(k)) == pytest.approx(equivalent_cycles(series[:, k]), rel=1e-5)
    per_rack = tp.cycles_per_rack(1.0)
    assert per_rack.shape == (3,) and np.all(per_rack > 0)
    # one discharge that never turns is half a cycle of its depth
    once = SocTurningPoints(np.array([1.0, 1.0]))
    for soc in np.linspace(1.0, 0.6, 50):
        once.update(np.array([soc, 1.0]))
    np.testing.assert_allclose(once.cycles_per_rack(0.5), [0.5 * float(depth_weight(0.8)), 0.0])


def test_summary_counts_bbu_wear_ride_through_and_steps(tmp_path: Path) -> None:
    res = run(load_scenario(SCENARIOS / "swing-8k.toml", ["duration_s=120"]), controller="dimmer")
    s = summarize(res)
    assert tuple(s) == SUMMARY_KEYS
    json.dumps(s, allow_nan=False)  # every key is a number or null, never NaN
    grid = res.tick["grid_w"]
    assert s["max_grid_step_mw"] == pytest.approx(float(np.max(np.abs(np.diff(grid)))) / 1e6)
    assert s["bbu_cycles_per_day"] == pytest.approx(s["bbu_equivalent_cycles"] * 86400.0 / 120.0)
    usable = float(np.sum((res.site.rack_storage.bbu_soc_max_frac - res.site.rack_storage.bbu_soc_min_frac)
                          * res.site.rack_storage.bbu_energy_j))  # fmt: skip
    assert s["bbu_throughput_cycles_per_day"] == pytest.approx(
        res.storage["bbu_energy_out_j"] / usable * 86400.0 / 120.0
    )
    # the ride-through lies between a shelf at its floor carrying the rack at full draw and a full shelf
    # carrying 1 kW
    rs = res.site.rack_storage
    eff = math.sqrt(rs.bbu_round_trip_eff)
    lowest = rs.bbu_soc_min_frac * float(np.min(rs.bbu_energy_j)) * eff / float(np.max(res.site.rack_max_w()))
    assert lowest <= s["min_bbu_ride_through_s"] <= float(np.max(rs.bbu_energy_j)) * eff / 1e3
    assert np.isfinite(res.tick["bbu_soc_min_frac"]).all()
    assert np.all(res.tick["bbu_soc_min_frac"] <= res.tick["bbu_soc_mean_frac"] + 1e-12)


def test_a_site_without_bbus_reports_null_wear() -> None:
    loaded = load_scenario(
        SCENARIOS / "swing-8k.toml",
        ["duration_s=30", "site.storage.bbu.kw_per_rack=0", "site.storage.bbu.kwh_per_rack=0"],
    )
    s = summarize(run(loaded, controller="none"))
    assert s["bbu_equivalent_cycles"] is None and s["bbu_cycles_per_day"] is None
    assert s["bbu_throughput_cycles_per_day"] is None and s["min_bbu_ride_through_s"] is None
    assert math.isfinite(s["max_grid_step_mw"])


@given(st.floats(min_value=1e-9, max_value=1.0))
def test_the_depth_a_wear_allowance_buys_costs_that_allowance(weight: float) -> None:
    """depth_for_weight inverts the depth-stress curve: the cycle it names costs the allowance, and no more."""
    depth = float(depth_for_weight(weight))
    assert 0.0 < depth <= 1.0
    assert float(depth_weight(depth)) == pytest.approx(weight, rel=1e-9)
    assert float(depth_weight(min(depth * 1.001, 1.0))) >= float(depth_weight(depth))
    assert float(depth_for_weight(0.0)) == 0.0 and float(depth_for_weight(2.0)) == 1.0


@given(st.floats(min_value=60.0, max_value=86400.0), st.floats(min_value=0.1, max_value=5.0))
def test_a_discharge_sized_by_the_allowance_closes_within_it(elapsed_s: float, budget: float) -> None:
    """After `elapsed_s` with no cycles, a BBU that gives what affordable_w allows for one period, then recharges
    to where it was, has made a cycle that rainflow (gridsim's own count) weighs at most the allowance accrued."""
    site = _site()
    policy = BbuPolicy(site, budget, reserve_s=0.0, recharge_full_tau_s=600.0)
    full = np.full(site.n_racks, 1.0)
    policy.step(elapsed_s, full, np.zeros(site.n_racks), np.ones(site.n_racks), np.ones(site.n_racks, dtype=bool), 0.0)
    allowance = float(policy.allowance[0])
    assert allowance == pytest.approx(min(budget * elapsed_s / DAY_S, budget))
    give_w = policy.affordable_w(1.0)[0]
    assert give_w > 0
    fall = give_w * 1.0 / (policy.energy_j[0] * policy.discharge_eff)  # SoC the shelf loses giving it for 1 s
    window = policy.soc_max - policy.soc_min
    cost = equivalent_cycles([1.0, 1.0 - fall, 1.0], window)
    assert cost <= allowance * (1 + 1e-4)  # (rainflow counts charge at 1e-12 resolution)
    assert cost >= 0.99 * allowance or fall >= window * 0.999  # and the whole allowance is usable


@given(
    st.lists(st.floats(min_value=-3e-3, max_value=3e-3, allow_nan=False), min_size=2, max_size=200),
    st.floats(min_value=0.5, max_value=1.0),
)
@example([-1.5e-4, 1.5e-4] * 20, 1.0)  # reversals between 1e-4 and 2e-4: the controller's old threshold missed them
def test_the_budget_counts_every_cycle_the_wear_metric_counts(steps: list[float], start: float) -> None:
    """The controller's half-cycle count (what its allowance is charged) is never under gridsim's depth-weighted
    rainflow count of the same SoC series (what the summary reports): a budget that misses a cycle the metric
    counts is overspent without knowing it."""
    site = _site()
    policy = BbuPolicy(site, 1.0, reserve_s=0.0, recharge_full_tau_s=600.0)
    window = policy.soc_max - policy.soc_min
    soc = np.clip(start + np.cumsum([0.0, *steps]), policy.soc_min, policy.soc_max)
    turns = SocTurningPoints(np.full(1, soc[0]))
    charged = 0.0
    for x in soc:
        charged += float(policy.cycles.update(np.full(site.n_racks, x))[0])
        turns.update(np.full(1, x))
    # the run still open at the end is charged as the whole cycle its recharge will close
    charged += float(depth_weight(policy.cycles.open_depth()[0]))
    counted = float(turns.cycles_per_rack(window)[0])
    assert charged >= counted * (1 - 1e-6) - 1e-12


def test_a_relief_never_plans_more_than_the_allowance_buys_nor_relieves_a_guarded_rack() -> None:
    """A domain over its soft threshold asks every rack under it for relief: each shelf gives at most what its
    wear allowance left buys this period (affordable_w), and a rack whose job is stopped (a finite guard: it may
    come back within the period, far over its idle bound) keeps its guard and gives none."""
    site = _site()
    policy = BbuPolicy(site, 1.0, reserve_s=0.0, recharge_full_tau_s=600.0)
    n = site.n_racks
    full, bound = np.full(n, 1.0), np.full(n, 100e3)
    policy.step(60.0, full, bound, np.ones(n), np.ones(n, dtype=bool), 0.0)  # a minute's allowance banked
    afford = policy.affordable_w(1.0)
    assert np.all((afford > 0) & (afford < 0.5 * bound))  # it buys less than the half a relief asks of a rack
    guard = np.where(np.arange(n) < 2, 120e3, np.inf)  # racks 0-1: a stopped job's
    threshold, _, relief = policy.step(1.0, full, bound, np.full(n, 0.5), np.zeros(n, dtype=bool), 0.0, guard)
    assert np.all(relief[2:] > 0)
    # the cycle that relief opens, closed by its recharge, costs no more than the allowance (with this period's
    # refill): rainflow, gridsim's own count
    window = policy.soc_max - policy.soc_min
    for k in range(2, n):
        fall = relief[k] * 1.0 / (policy.energy_j[k] * policy.discharge_eff)
        assert equivalent_cycles([1.0, 1.0 - fall, 1.0], window) <= policy.allowance[k] * (1 + 1e-4)
    np.testing.assert_allclose(threshold[2:], bound[2:] - relief[2:])  # the shelf gives no more than planned
    assert np.all(relief[:2] == 0) and np.all(threshold[:2] == 120e3)
