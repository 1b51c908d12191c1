"""The baseline controllers (hard-stop, dynamo, smoothing, peak-shave) against hand-built observations, closed
forms and the simulator."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.control import controller_names, make_controller
from dimmer.control.baselines import Dynamo, HardStop, PeakShave, Smoothing, derived_ramp_w_per_s, waterfill_cut
from dimmer.errors import InputError
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import JobPlacementSpec, SiteSpec
from gridsim.engine import SimResult, run
from gridsim.plant.workload import JobState
from gridsim.scenario import LoadedScenario, validate_scenario
from tests.budget import examples

BASELINES = ("hard-stop", "dynamo", "smoothing", "peak-shave")

# ---------------------------------------------------------------------------------------------------- helpers


def make_site(
    levels: list[dict[str, Any]],
    jobs: list[dict[str, Any]],
    pcc_mw: float = 10.0,
    ramp_mw_per_min: float = math.inf,
    bess: dict[str, Any] | None = None,
) -> SiteModel:
    spec = SiteSpec.model_validate(
        {
            "gpu": "gb300",
            "spare_rack_frac": 0.0,
            "pcc": {"limit_mw": pcc_mw, "ramp_mw_per_min": ramp_mw_per_min},
            "levels": levels,
            "storage": {"bess": bess or {}},
        }
    )
    return build_site(spec, [JobPlacementSpec.model_validate(j) for j in jobs])


def make_obs(
    site: SiteModel,
    t_s: float,
    rack_w: Any,
    *,
    domain_w: Any = None,
    domain_limit_w: Any = None,
    domain_age_s: float = 0.0,
    job_running: Any = None,
    pcc_power_w: float | None = None,
    pcc_limit_w: float | None = None,
    bess_soc_frac: float = 0.5,
    bess_power_w: float = 0.0,
    bess_online: bool = True,
) -> Observation:
    """An Observation of `site` at `t_s`; domain meters default to the sum of the rack readings."""
    rack = np.broadcast_to(np.asarray(rack_w, dtype=np.float64), (site.n_racks,)).copy()
    dom = site.domain_load_w(np.nan_to_num(rack)) if domain_w is None else np.asarray(domain_w, dtype=np.float64)
    n, nd = site.n_racks, site.n_domains
    return Observation(
        t_s=t_s,
        rack_power_w=rack,
        rack_load_w=rack.copy(),
        rack_age_s=np.zeros(n),
        rack_cap_w=np.full(n, site.gpu.rated_w),
        rack_floor_w=np.zeros(n),
        rack_bbu_soc_frac=np.ones(n),
        rack_energized=np.ones(n, dtype=bool),
        domain_power_w=dom,
        domain_age_s=np.full(nd, domain_age_s),
        domain_limit_w=site.domain_rating_w.copy() if domain_limit_w is None else np.asarray(domain_limit_w, float),
        domain_thermal_frac=np.zeros(nd),
        pcc_power_w=float(dom[0]) - bess_power_w if pcc_power_w is None else pcc_power_w,
        pcc_age_s=0.0,
        pcc_limit_w=site.pcc_limit_w if pcc_limit_w is None else pcc_limit_w,
        ramp_limit_w_per_min=site.ramp_limit_w_per_min,
        grid_freq_hz=50.0,
        bess_soc_frac=bess_soc_frac,
        bess_power_w=bess_power_w,
        bess_online=bess_online,
        job_running=np.ones(site.n_jobs, dtype=bool) if job_running is None else np.asarray(job_running, bool),
    )


def loaded(raw: dict[str, Any], tmp_path: Path) -> LoadedScenario:
    return LoadedScenario(validate_scenario(raw, "test"), "test", tmp_path)


def rack_w_at(site: SiteModel, cap_w: Any) -> Any:
    """AC power of each rack when its active GPUs draw `cap_w` each."""
    return site.rack_power_w(np.broadcast_to(np.asarray(cap_w, dtype=np.float64), (site.n_racks,)))


def recorded(res: SimResult, name: str) -> int:
    names = [res.site.domain_name[d] for d in res.recorded_domains]
    return names.index(name)


def one_second_means(x: Any, tick_s: float) -> Any:
    k = round(1.0 / tick_s)
    return np.asarray(x)[: len(x) // k * k].reshape(-1, k).mean(axis=1)


ROWS_OF_4 = [{"level": "row", "count": 2, "rating_kw": 1000}, {"level": "rack", "count": 4}]


def test_every_baseline_is_registered() -> None:
    assert set(BASELINES) | {"none"} <= set(controller_names())


# ---------------------------------------------------------------------------------------------------- waterfill


def test_waterfill_cuts_the_highest_down_to_a_common_level() -> None:
    p = np.array([60.0, 70.0, 80.0, 125.0, 10.0, 20.0])
    f = np.array([50.0, 50.0, 50.0, 50.0, 0.0, 0.0])
    seg = np.array([0, 0, 0, 0, 1, 1])
    # segment 0: 125 -> 80 gives 45, then both to 70 gives 20 more: a need of 55 leaves both at 75
    # segment 1: more than its floors allow -> everything down to the floors
    x = waterfill_cut(p, f, seg, np.array([55.0, 100.0]))
    np.testing.assert_allclose(x, [0.0, 0.0, 5.0, 50.0, 10.0, 20.0])
    # nothing to cut for a need <= 0
    np.testing.assert_array_equal(waterfill_cut(p, f, seg, np.array([0.0, -1.0])), np.zeros(6))


@settings(max_examples=examples(50), deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 100), st.floats(0, 1), st.integers(0, 2)), min_size=1, max_size=12),
    st.lists(st.floats(-10, 400), min_size=3, max_size=3),
)
def test_waterfill_meets_the_need_within_floors_at_one_level(
    items: list[tuple[float, float, int]], need: list[float]
) -> None:
    p = np.array([i[0] for i in items])
    f = p * np.array([i[1] for i in items])
    seg = np.array([i[2] for i in items], dtype=np.int64)
    need_arr = np.array(need)
    x = waterfill_cut(p, f, seg, need_arr)
    assert np.all(x >= 0) and np.all(x <= p - f + 1e-9)
    for s in range(3):
        m = seg == s
        room = float((p[m] - f[m]).sum())
        assert x[m].sum() == pytest.approx(min(max(need[s], 0.0), room), abs=1e-7 * max(1.0, room))
        left = p[m] - x[m]
        free = (x[m] > 1e-9) & (left > f[m] + 1e-9)  # cut, not at its floor: all at one level, uncut ones below it
        if free.any():
            level = left[free].max()
            assert np.ptp(left[free]) < 1e-6
            assert np.all(left[left > f[m] + 1e-9] <= level + 1e-6)


# ---------------------------------------------------------------------------------------------------- hard-stop


def _hard_stop_site() -> SiteModel:
    # r0 = racks 0-3, r1 = racks 4-7; "a" (priority 3) and "b" (1) sit under r0, "c" (0) only under r1
    jobs = [
        {"name": "a", "racks": (0, 2), "priority": 3},
        {"name": "b", "racks": (2, 6), "priority": 1},
        {"name": "c", "racks": (6, 8), "priority": 0},
    ]
    return make_site([{"level": "row", "count": 2, "rating_kw": 400}, {"level": "rack", "count": 4}], jobs)


BUSY_W = np.array([105e3] * 4 + [60e3] * 4)  # r0 420 kW > 400 kW, r1 240 kW; every rack within its own rating


def test_hard_stop_suspends_the_lowest_priority_job_under_the_overloaded_row_one_per_period() -> None:
    site = _hard_stop_site()
    ctrl = make_controller("hard-stop", site)
    assert isinstance(ctrl, HardStop)
    rack_w = BUSY_W
    act = ctrl.step(make_obs(site, 1.0, rack_w))
    np.testing.assert_array_equal(act.job_suspend, [False, True, False])  # c is lower but not under r0
    assert [(r.domain, r.job) for r in act.reasons] == [(site.domain_index("r0"), 1)]
    np.testing.assert_array_equal(act.rack_cap_w, site.gpu.rated_w)  # caps stay at rated
    # the next reading still shows the overload (b's relief is in it and was not enough): one more job
    act = ctrl.step(make_obs(site, 2.0, rack_w, job_running=[True, False, True]))
    np.testing.assert_array_equal(act.job_suspend, [True, True, False])
    # with nothing left to suspend under r0, an overload only explains itself
    act = ctrl.step(make_obs(site, 3.0, rack_w, job_running=[False, False, True]))
    np.testing.assert_array_equal(act.job_suspend, [True, True, False])
    assert "no running job" in act.reasons[0].reason


def test_hard_stop_waits_for_a_suspension_to_show_in_delayed_readings() -> None:
    site = _hard_stop_site()
    ctrl = make_controller("hard-stop", site)
    rack_w = BUSY_W
    ctrl.step(make_obs(site, 1.0, rack_w, domain_age_s=2.0))
    # readings 2 s old cannot show b's suspension yet; its expected relief (its racks down to idle) covers r0
    act = ctrl.step(make_obs(site, 2.0, rack_w, domain_age_s=2.0, job_running=[True, False, True]))
    np.testing.assert_array_equal(act.job_suspend, [False, True, False])
    # once a reading taken after the suspension still shows the overload, the next job goes
    act = ctrl.step(make_obs(site, 4.0, rack_w, domain_age_s=2.0, job_running=[True, False, True]))
    np.testing.assert_array_equal(act.job_suspend, [True, True, False])


def test_hard_stop_resumes_after_the_hold_only_when_the_return_fits() -> None:
    site = _hard_stop_site()
    ctrl = make_controller("hard-stop", site, {"hold_s": 30.0})
    busy = BUSY_W
    ctrl.step(make_obs(site, 1.0, busy))  # b suspended; its racks 2-5 read 105/105/60/60 kW while running
    idle_w = float(rack_w_at(site, site.gpu.idle_w)[0])
    quiet = busy.copy()
    quiet[2:6] = idle_w
    quiet[0:2] = 75e3  # r0 = 150 kW + 2 idle racks = 240 kW < 0.85 x 400; b's return adds 2 x (105 kW - idle)
    running = [True, False, True]
    for t in range(2, 31):
        act = ctrl.step(make_obs(site, float(t), quiet, job_running=running))
        assert act.job_suspend[1], f"resumed at {t} s, before the 30 s hold since the last high reading at 1 s"
    act = ctrl.step(make_obs(site, 31.0, quiet, job_running=running))
    assert not act.job_suspend[1]
    assert any(r.job == 1 and r.reason.startswith("resume") for r in act.reasons)

    # the same, but a's racks now draw more: b's return would take r0 over its limit, so b stays suspended
    ctrl = make_controller("hard-stop", site, {"hold_s": 30.0})
    ctrl.step(make_obs(site, 1.0, busy))
    heavy = quiet.copy()
    heavy[0:2] = 100e3  # r0 = 290 kW, still quiet; with b back 410 kW > 400 kW
    for t in range(2, 60):
        act = ctrl.step(make_obs(site, float(t), heavy, job_running=running))
    assert act.job_suspend[1]
    assert "would overload" in act.reasons[0].reason


def test_a_missing_meter_falls_back_to_the_sum_of_its_racks() -> None:
    site = _hard_stop_site()
    ctrl = make_controller("hard-stop", site)
    dom = site.domain_load_w(BUSY_W)
    dom[site.domain_index("r0")] = math.nan  # the row meter is lost; its racks still show 420 kW > 400 kW
    act = ctrl.step(make_obs(site, 1.0, BUSY_W, domain_w=dom))
    np.testing.assert_array_equal(act.job_suspend, [False, True, False])
    # a lost rack reading keeps the rack's last one
    rack = BUSY_W.copy()
    rack[2] = math.nan  # a rack of b, the group the row cut falls on
    ctrl = make_controller("dynamo", site)
    first = ctrl.step(make_obs(site, 1.0, BUSY_W)).rack_cap_w
    again = make_controller("dynamo", site)
    again.step(make_obs(site, 1.0, BUSY_W))
    assert isinstance(ctrl, Dynamo)
    meters = site.domain_load_w(BUSY_W)  # the meters still read; only rack 2's own reading is lost
    np.testing.assert_array_equal(
        ctrl.step(make_obs(site, 4.0, BUSY_W)).rack_cap_w,
        again.step(make_obs(site, 4.0, rack, domain_w=meters)).rack_cap_w,
    )
    assert first.min() < site.gpu.rated_w


def test_hard_stop_answers_to_the_pcc_limit(tmp_path: Path) -> None:
    site = _hard_stop_site()
    ctrl = make_controller("hard-stop", site)
    rack_w = np.full(site.n_racks, 90e3)  # rows at 360 kW, campus 720 kW
    act = ctrl.step(make_obs(site, 1.0, rack_w, pcc_limit_w=0.7e6))
    np.testing.assert_array_equal(act.job_suspend, [False, False, True])  # the campus' lowest priority job
    assert act.reasons[0].domain == 0


def test_hard_stop_in_the_simulator_suspends_then_resumes_after_the_hold(tmp_path: Path) -> None:
    raw = {
        "name": "hard-stop",
        "duration_s": 80,
        "site": {
            "gpu": "gb300",
            "spare_rack_frac": 0.0,
            "pcc": {"limit_mw": 3.0},
            "levels": [{"level": "row", "count": 2, "rating_kw": 900}, {"level": "rack", "count": 8}],
        },
        # r0 holds "hi" and half of "lo": ~1.04 x its rating at the compute peak
        "jobs": [{"name": "hi", "racks": [0, 4], "priority": 5}, {"name": "lo", "racks": [4, 12], "priority": 0}],
        "controllers": {"hard-stop": {"hold_s": 20}},
        "events": [{"kind": "stop", "at_s": 10, "jobs": ["hi"]}],
    }
    res = run(loaded(raw, tmp_path), controller="hard-stop")
    t, state = res.period_t_s, res.period["job_state"]
    suspended = t[state[:, 1] == JobState.SUSPENDED]
    assert suspended.size and suspended.min() <= 2.0  # the first reading showed the overload
    assert np.all(state[:, 0] != JobState.SUSPENDED)  # the higher priority job kept running
    # r0 went quiet when "hi" stopped at 10 s; the first reading below 0.85 x 900 kW came ~1 s after the suspension
    assert 20.0 <= suspended.max() <= 25.0
    assert state[-1, 1] == JobState.RUNNING
    assert res.trips == []
    r0 = res.period["domain_w"][:, recorded(res, "r0")]
    assert np.all(r0[t >= 2] <= 900e3)
    assert np.all(res.period["rack_cap_w"] == res.site.gpu.rated_w)


# ---------------------------------------------------------------------------------------------------- dynamo


def _dynamo_row_site() -> SiteModel:
    jobs = [{"name": "hi", "racks": (0, 4), "priority": 5}, {"name": "lo", "racks": (4, 8), "priority": 0}]
    return make_site([{"level": "row", "count": 1, "rating_kw": 740}, {"level": "rack", "count": 8}], jobs)


def _implied_rack_w(site: SiteModel, cap_w: Any) -> Any:
    return rack_w_at(site, cap_w)


def test_dynamo_caps_the_highest_rack_of_the_lowest_priority_group_first() -> None:
    site = _dynamo_row_site()
    ctrl = make_controller("dynamo", site)
    assert isinstance(ctrl, Dynamo)
    rack_w = np.array([100e3] * 4 + [60e3, 70e3, 80e3, 125e3])  # 735 kW > 0.99 x 740 kW
    act = ctrl.step(make_obs(site, 1.0, rack_w))
    # cut to 0.95 x 740 = 703 kW: 32 kW, all from the highest "lo" rack (125 -> 93 kW, still above the next, 80)
    planned = _implied_rack_w(site, act.rack_cap_w)
    np.testing.assert_array_equal(act.rack_cap_w[:7], site.gpu.rated_w)
    assert planned[7] == pytest.approx(125e3 - (735e3 - 0.95 * 740e3))
    assert any(r.domain == site.domain_index("r0") and "cut" in r.reason for r in act.reasons)


def test_dynamo_goes_to_the_next_priority_group_only_when_the_lowest_is_at_its_sla_floor() -> None:
    site = _dynamo_row_site()
    ctrl = make_controller("dynamo", site)
    limits = site.domain_rating_w.copy()
    limits[site.domain_index("r0")] = 600e3  # derated: cut 735 - 570 = 165 kW
    rack_w = np.array([100e3] * 4 + [60e3, 70e3, 80e3, 125e3])
    act = ctrl.step(make_obs(site, 1.0, rack_w, domain_limit_w=limits))
    floor_rack_w = float(rack_w_at(site, site.gpu.min_cap_w)[0])
    np.testing.assert_allclose(act.rack_cap_w[4:], site.gpu.min_cap_w)  # "lo" down to its SLA floor
    rest = 165e3 - float(np.sum(rack_w[4:] - floor_rack_w))
    np.testing.assert_allclose(_implied_rack_w(site, act.rack_cap_w)[:4], 100e3 - rest / 4)  # evenly: equal racks


def test_dynamo_runs_leaves_every_3_s_and_upper_levels_every_9_s_and_meets_the_contract() -> None:
    # a hall over two rows; only the hall is over its rating, so only contracts from it make the rows cut
    levels = [
        {"level": "hall", "count": 1, "rating_kw": 700},
        {"level": "row", "count": 2, "rating_kw": 1000},
        {"level": "rack", "count": 4},
    ]
    jobs = [{"name": "a", "racks": (0, 4), "priority": 1}, {"name": "b", "racks": (4, 8), "priority": 0}]
    site = make_site(levels, jobs)
    ctrl = make_controller("dynamo", site)
    assert isinstance(ctrl, Dynamo)
    rack_w = np.array([90e3, 90e3, 100e3, 110e3, 95e3, 95e3, 95e3, 95e3])  # hall 770 kW > 0.99 x 700 kW
    leaf_at, upper_at, cap_changed_at, contract_changed_at = [], [], [], []
    cap = np.full(site.n_racks, site.gpu.rated_w)
    contract = ctrl.contract_w
    for t in range(1, 20):
        leaf0, upper0 = ctrl.leaf_cycles, ctrl.upper_cycles
        act = ctrl.step(make_obs(site, float(t), rack_w))
        if ctrl.leaf_cycles > leaf0:
            leaf_at.append(t)
        if ctrl.upper_cycles > upper0:
            upper_at.append(t)
        if not np.array_equal(act.rack_cap_w, cap):
            cap_changed_at.append(t)
        if not np.array_equal(ctrl.contract_w, contract):
            contract_changed_at.append(t)
        if t == 1:
            # the hall's cut (770 - 665 kW) went to the lower priority row b's racks: its contract is its share,
            # and its leaf cut exactly that, so the hall plans to sit at its capping target
            hall, r0, r1 = (site.domain_index(n) for n in ("h0", "h0/r0", "h0/r1"))
            assert np.isinf(ctrl.contract_w[[hall, r0]]).all()
            assert ctrl.contract_w[r1] == pytest.approx(380e3 - (770e3 - 0.95 * 700e3))
            planned = _implied_rack_w(site, act.rack_cap_w)
            planned = np.where(act.rack_cap_w < site.gpu.rated_w, planned, rack_w)
            assert planned.sum() == pytest.approx(0.95 * 700e3)
            np.testing.assert_array_equal(act.rack_cap_w[:4], site.gpu.rated_w)
        cap, contract = act.rack_cap_w, ctrl.contract_w
    assert leaf_at == [1, 4, 7, 10, 13, 16, 19]
    assert upper_at == [1, 10, 19]
    # the same readings keep showing the overload, so every leaf cycle cuts again, and only leaf cycles do
    assert set(cap_changed_at) <= set(leaf_at) and 1 in cap_changed_at
    assert set(contract_changed_at) <= set(upper_at)


def test_dynamo_releases_caps_in_steps_highest_priority_first() -> None:
    site = _dynamo_row_site()
    ctrl = make_controller("dynamo", site)
    limits = site.domain_rating_w.copy()
    limits[site.domain_index("r0")] = 600e3
    busy = np.array([100e3] * 4 + [60e3, 70e3, 80e3, 125e3])
    ctrl.step(make_obs(site, 1.0, busy, domain_limit_w=limits))  # everything capped (see above)
    low = np.full(site.n_racks, 50e3)  # 400 kW < 0.9 x 600: release up to 0.95 x 600 - 400 = 170 kW
    before = ctrl.step(make_obs(site, 2.0, low, domain_limit_w=limits)).rack_cap_w  # between cycles: held
    assert np.all(before < site.gpu.rated_w)
    np.testing.assert_array_equal(ctrl.step(make_obs(site, 3.0, low, domain_limit_w=limits)).rack_cap_w, before)
    act = ctrl.step(make_obs(site, 4.0, low, domain_limit_w=limits))
    raised_w = rack_w_at(site, act.rack_cap_w) - rack_w_at(site, before)
    assert raised_w.sum() == pytest.approx(170e3)  # released by the headroom, counted as cap power
    # "hi" (capped a little) comes back to rated first; "lo" gets the rest, evenly from its common floor
    np.testing.assert_array_equal(act.rack_cap_w[:4], site.gpu.rated_w)
    assert np.ptp(act.rack_cap_w[4:]) < 1e-6 and site.gpu.min_cap_w < act.rack_cap_w[4] < site.gpu.rated_w
    # the next leaf cycle releases the rest
    for t in (7.0, 10.0, 13.0):
        act = ctrl.step(make_obs(site, t, low, domain_limit_w=limits))
    np.testing.assert_array_equal(act.rack_cap_w, site.gpu.rated_w)


def test_dynamo_in_the_simulator_holds_rows_under_the_capping_threshold(tmp_path: Path) -> None:
    raw = {
        "name": "dynamo",
        "duration_s": 120,
        "site": {
            "gpu": "gb300",
            "spare_rack_frac": 0.0,
            "pcc": {"limit_mw": 3.0},
            "levels": [{"level": "row", "count": 2, "rating_kw": 900}, {"level": "rack", "count": 8}],
        },
        # r0: 4 "hi" + 4 "lo" racks, r1: 8 "lo" racks; uncapped, both rows peak at ~1.04 x 900 kW
        "jobs": [{"name": "hi", "racks": [0, 4], "priority": 5}, {"name": "lo", "racks": [4, 16], "priority": 0}],
        "events": [{"kind": "stop", "at_s": 60, "jobs": ["hi"]}],
    }
    res = run(loaded(raw, tmp_path), controller="dynamo")
    t = res.period_t_s
    rows = res.period["domain_w"][:, [recorded(res, "r0"), recorded(res, "r1")]]
    assert rows[:2].max() > 1.0 * 900e3  # it was overloaded before the first cycles
    assert rows[t >= 10].max() <= 0.99 * 900e3
    assert res.trips == []
    caps = res.period["rack_cap_w"]  # every rack is recorded on this small site
    assert np.all(caps[:, :4] == res.site.gpu.rated_w)  # "hi" (the higher priority group) never capped
    assert caps[t == 30, 4:].max() < res.site.gpu.rated_w
    assert caps.min() >= res.site.gpu.min_cap_w
    # after "hi" stops, r0's "lo" racks are released in steps back to rated; r1 still needs its caps
    np.testing.assert_allclose(caps[-1, 4:8], res.site.gpu.rated_w, rtol=1e-12)  # (the plant's lag settles)
    assert caps[-1, 8:].max() < res.site.gpu.rated_w


# ---------------------------------------------------------------------------------------------------- smoothing


def test_smoothing_floor_on_running_jobs_only_and_released_at_the_ramp_down_rate() -> None:
    site = make_site(ROWS_OF_4, [{"name": "a", "racks": (0, 3)}, {"name": "b", "racks": (4, 6)}])
    ctrl = make_controller("smoothing", site, {"ramp_down_w_per_s": 100.0})
    assert isinstance(ctrl, Smoothing)
    floor_w = 0.8 * site.gpu.rated_w
    act = ctrl.step(make_obs(site, 1.0, 100e3))
    expected = np.zeros(site.n_racks)
    expected[[0, 1, 2, 4, 5]] = floor_w  # no floor on racks without a job
    np.testing.assert_array_equal(act.rack_floor_w, expected)
    np.testing.assert_array_equal(act.rack_cap_w, site.gpu.rated_w)
    assert act.bess_setpoint_w == 0.0
    assert act.gpu_ramp_down_w_per_s == 100.0 and act.gpu_ramp_up_w_per_s == math.inf  # no utility ramp limit
    # "a" crashes: its floor is let go at 100 W/s, "b" keeps its floor
    for k, t in enumerate((2.0, 3.0, 5.0), start=1):
        act = ctrl.step(make_obs(site, t, 100e3, job_running=[False, True]))
        released = floor_w - 100.0 * (t - 1.0)
        np.testing.assert_allclose(act.rack_floor_w[:3], released)
        np.testing.assert_allclose(act.rack_floor_w[4:6], floor_w)
        assert any(r.job == 0 and "released" in r.reason for r in act.reasons), k


def test_smoothing_default_ramp_spreads_the_utility_ramp_over_the_job_gpus() -> None:
    site = make_site(ROWS_OF_4, [{"name": "a", "gpus": 300}], ramp_mw_per_min=1.2)
    ctrl = make_controller("smoothing", site)
    act = ctrl.step(make_obs(site, 1.0, 100e3))
    # 1.2 MW/min = 20 kW/s over 300 GPUs behind 97 % rectifiers
    expected = 20e3 * site.rectifier_eff / 300
    assert derived_ramp_w_per_s(site) == pytest.approx(expected)
    assert act.gpu_ramp_up_w_per_s == pytest.approx(expected) and act.gpu_ramp_down_w_per_s == pytest.approx(expected)
    # the floor rises no faster than the ramp-up limit either: one period (1 s) of it at the first step
    assert act.rack_floor_w.max() == pytest.approx(expected)


def test_smoothing_in_the_simulator_bounds_the_grid_ramp_after_a_crash(tmp_path: Path) -> None:
    raw = {
        "name": "smoothing",
        "duration_s": 200,
        "site": {
            "gpu": "gb300",
            "spare_rack_frac": 0.0,
            "pcc": {"limit_mw": 3.0, "ramp_mw_per_min": 1.0},
            "levels": [{"level": "row", "count": 2, "rating_kw": 1500}, {"level": "rack", "count": 8}],
        },
        "jobs": [{"name": "a", "racks": [0, 16]}],
        "events": [{"kind": "crash", "at_s": 120, "jobs": ["a"]}],
    }
    ld = loaded(raw, tmp_path)
    limit_w_per_s = 1e6 / 60
    falls = {}
    for name in ("none", "smoothing"):  # `res` keeps the smoothing run
        res = run(ld, controller=name)
        grid = one_second_means(res.tick["grid_w"], res.tick_s)
        falls[name] = -np.diff(grid).min()
    # uncontrolled, ~1 MW leaves in a second; smoothed, the grid follows the 1 MW/min limit (trays and the
    # first-order floor actuation add a few %)
    assert falls["none"] > 30 * limit_w_per_s
    assert falls["smoothing"] <= 1.1 * limit_w_per_s
    # the floor holds the crashed job's GPUs up and is released by at most the ramp-down limit per period
    floor = res.period["job_floor_w"][:, 0]
    t = res.period_t_s
    assert floor[(t > 100) & (t < 120)].min() == pytest.approx(0.8 * res.site.gpu.rated_w)
    step = np.diff(floor[t >= 119])
    ramp = derived_ramp_w_per_s(res.site)
    assert step.min() >= -ramp * 1.0001 and step.min() < -0.5 * ramp  # periods of 1 s
    assert res.tick["floor_burn_w"][res.t_s > 121].max() > 0  # the floor burns power after the crash
    assert res.trips == []


# ---------------------------------------------------------------------------------------------------- peak-shave


def _openems_pid(inputs: list[float], target: float, lo: float, hi: float) -> list[float]:
    """OpenEMS PidFilter.applyPidFilter (0.3 / 0.3 / 0.1), written out from its source."""
    out, err_sum, last = [], 0.0, None
    for x in inputs:
        t = min(max(target, lo), hi)
        e = t - x
        if last is None:
            last = x
        o = 0.3 * e + min(max(0.3 * err_sum, lo), hi) - 0.1 * (x - last)
        last = x
        err_sum += e
        out.append(min(max(o, lo), hi))
    return out


def _bess_site() -> SiteModel:
    return make_site(ROWS_OF_4, [], pcc_mw=1.0, bess={"power_mw": 0.5, "energy_mwh": 1.0})


def test_peak_shave_discharges_above_the_peak_through_the_openems_pid() -> None:
    site = _bess_site()
    ctrl = make_controller("peak-shave", site)
    assert isinstance(ctrl, PeakShave)
    assert ctrl.settings_w(1e6) == (pytest.approx(0.95e6), pytest.approx(0.8e6))
    campus_w = 1.05e6  # 100 kW above the 0.95 MW peak setting
    battery = [0.0, 20e3, 55e3]  # what the battery delivers at each step
    got = []
    for t, b in enumerate(battery, start=1):
        act = ctrl.step(make_obs(site, float(t), campus_w / 8, bess_power_w=b))
        got.append(act.bess_setpoint_w)
        assert act.reasons[0].layer == "baseline" and "discharge" in act.reasons[0].reason
    np.testing.assert_allclose(got, _openems_pid(battery, 100e3, -0.5e6, 0.5e6))
    np.testing.assert_array_equal(act.rack_cap_w, site.gpu.rated_w)


def test_peak_shave_recharges_below_the_recharge_setting_within_the_soc_window() -> None:
    site = _bess_site()
    ctrl = make_controller("peak-shave", site)
    act = ctrl.step(make_obs(site, 1.0, 0.6e6 / 8))  # 200 kW below the 0.8 MW recharge setting
    assert act.bess_setpoint_w == pytest.approx(0.3 * -200e3)
    # at soc_max it may not charge, at soc_min it may not discharge
    full = make_controller("peak-shave", site)
    assert full.step(make_obs(site, 1.0, 0.6e6 / 8, bess_soc_frac=0.9)).bess_setpoint_w == 0.0
    empty = make_controller("peak-shave", site)
    assert empty.step(make_obs(site, 1.0, 1.2e6 / 8, bess_soc_frac=0.1)).bess_setpoint_w == 0.0
    offline = make_controller("peak-shave", site)
    assert offline.step(make_obs(site, 1.0, 1.2e6 / 8, bess_online=False)).bess_setpoint_w == 0.0
    # explicit settings in MW, and the default follows a curtailed PCC limit
    fixed = make_controller("peak-shave", site, {"peak_mw": 0.9, "recharge_mw": 0.5})
    assert isinstance(fixed, PeakShave) and fixed.settings_w(0.5e6) == (0.9e6, 0.5e6)
    assert isinstance(ctrl, PeakShave) and ctrl.settings_w(0.5e6) == (pytest.approx(0.475e6), pytest.approx(0.4e6))


def _peak_shave_raw(energy_mwh: float) -> dict[str, Any]:
    return {
        "name": "peak-shave",
        "duration_s": 160,
        "site": {
            "gpu": "gb300",
            "spare_rack_frac": 0.0,
            "pcc": {"limit_mw": 1.8},
            "levels": [{"level": "row", "count": 2, "rating_kw": 1500}, {"level": "rack", "count": 8}],
            "storage": {"bess": {"power_mw": 1.0, "energy_mwh": energy_mwh}},
        },
        "jobs": [{"name": "a", "racks": [0, 16], "swing_frac": 0.0, "jitter_frac": 0.0}],  # ~1.87 MW steady
        "events": [{"kind": "stop", "at_s": 100, "jobs": ["a"]}],
    }


def test_peak_shave_in_the_simulator_holds_the_peak_and_recharges(tmp_path: Path) -> None:
    res = run(loaded(_peak_shave_raw(0.5), tmp_path), controller="peak-shave")
    t, grid, bess, soc = res.t_s, res.tick["grid_w"], res.tick["bess_w"], res.tick["bess_soc_frac"]
    peak, recharge = 0.95 * 1.8e6, 0.8 * 1.8e6
    assert res.tick["campus_w"][t < 100].min() > peak + 0.1e6  # the load is above the peak setting
    assert grid[(t > 30) & (t < 100)].max() <= peak * 1.001  # held at the peak setting once the PID settled
    assert bess[(t > 30) & (t < 100)].min() > 0.1e6
    # the job stops: the load falls to ~0.7 MW, below the recharge setting, and the battery recharges up to it
    after = t > 130
    assert res.tick["campus_w"][after].max() < recharge
    assert bess[after].max() < -0.5e6
    assert grid[after].max() <= recharge * 1.001
    assert soc[-1] > soc[t < 100].min()


def test_peak_shave_in_the_simulator_stops_at_soc_min(tmp_path: Path) -> None:
    # 5 kWh from soc 0.5 down to soc_min 0.1 is 2 kWh: ~165 kW of shaving lasts under a minute
    res = run(loaded(_peak_shave_raw(0.005), tmp_path), controller="peak-shave")
    t, grid, soc = res.t_s, res.tick["grid_w"], res.tick["bess_soc_frac"]
    empty = t[soc <= 0.1 + 1e-9]
    assert empty.size and empty.min() < 100
    late = (t > empty.min() + 5) & (t < 100)
    np.testing.assert_allclose(res.tick["bess_w"][late], 0.0, atol=1e-6)
    assert grid[late].min() > 0.95 * 1.8e6 + 0.1e6  # no energy left: the peak goes to the grid


# ---------------------------------------------------------------------------------------------------- all


@pytest.mark.parametrize(
    ("name", "params", "key"),
    [
        ("hard-stop", {"stop_fraction": 1.0}, "params.stop_fraction"),
        ("hard-stop", {"hold_s": -1}, "params.hold_s"),
        ("hard-stop", {"stop_frac": 0.8, "release_frac": 0.9}, "params"),
        ("dynamo", {"capping_target_frac": "high"}, "params.capping_target_frac"),
        ("dynamo", {"capping_target_frac": 0.995}, "params"),
        ("dynamo", {"sla_floor_w": 100.0}, "params.sla_floor_w"),
        ("dynamo", {"leaf_period_s": 0}, "params.leaf_period_s"),
        ("dynamo", {"reading": "mean"}, "params.reading"),
        ("smoothing", {"floor_frac": 0.95}, "params.floor_frac"),
        ("smoothing", {"ramp_up_w_per_s": 0}, "params.ramp_up_w_per_s"),
        ("smoothing", {"floor_pct": 70}, "params.floor_pct"),
        ("peak-shave", {"peak_mw": 0.5}, "params.peak_mw"),
        ("peak-shave", {"peak_mw": 0.9, "recharge_mw": 0.9}, "params"),
        ("peak-shave", {"recharge_mw": 2.0}, "params.recharge_mw"),
        ("peak-shave", {"kp": -0.3}, "params.kp"),
    ],
)
def test_bad_parameters_give_a_one_line_input_error(name: str, params: dict[str, Any], key: str) -> None:
    site = _bess_site()
    with pytest.raises(InputError) as info:
        make_controller(name, site, params)
    err = info.value
    assert err.source == "controller" and err.key == key
    text = str(err)
    assert "\n" not in text and text.startswith(f"controller: {key}: ")


def _random_site() -> SiteModel:
    levels = [
        {"level": "hall", "count": 2, "rating_kw": 900},
        {"level": "row", "count": 2, "rating_kw": 500},
        {"level": "rack", "count": 3},
    ]
    jobs = [
        {"name": "a", "racks": (0, 5), "priority": 2},
        {"name": "b", "racks": (5, 9), "priority": 0},
        {"name": "c", "racks": (9, 11), "priority": 2},
    ]
    return make_site(levels, jobs, pcc_mw=1.5, ramp_mw_per_min=2.0, bess={"power_mw": 0.3, "energy_mwh": 0.2})


_SITE = _random_site()


def _same(a: Actions, b: Actions) -> bool:
    arrays = ("rack_cap_w", "rack_floor_w", "rack_bbu_threshold_w", "rack_bbu_recharge_w", "job_suspend")
    return (
        all(np.array_equal(getattr(a, k), getattr(b, k)) for k in arrays)
        and a.bess_setpoint_w == b.bess_setpoint_w
        and a.gpu_ramp_up_w_per_s == b.gpu_ramp_up_w_per_s
        and a.gpu_ramp_down_w_per_s == b.gpu_ramp_down_w_per_s
        and a.reasons == b.reasons
    )


@settings(max_examples=examples(25), deadline=None)
@given(
    name=st.sampled_from(BASELINES),
    steps=st.lists(
        st.tuples(
            st.lists(st.floats(0.0, 130e3) | st.just(math.nan), min_size=12, max_size=12),
            st.lists(st.booleans(), min_size=3, max_size=3),
            st.floats(0.1, 0.9),
            st.floats(-0.3e6, 0.3e6),
        ),
        min_size=1,
        max_size=25,
    ),
)
def test_actions_stay_in_range_and_the_same_input_gives_the_same_output(
    name: str, steps: list[tuple[list[float], list[bool], float, float]]
) -> None:
    site = _SITE
    one, two = make_controller(name, site), make_controller(name, site)
    gpu = site.gpu
    for k, (rack_w, running, soc, bess_w) in enumerate(steps, start=1):
        obs = make_obs(site, float(k), rack_w, job_running=running, bess_soc_frac=soc, bess_power_w=bess_w)
        a, b = one.step(obs), two.step(obs)
        assert _same(a, b)
        assert np.all(a.rack_cap_w >= gpu.min_cap_w) and np.all(a.rack_cap_w <= gpu.rated_w)
        assert np.all(a.rack_floor_w >= 0) and np.all(a.rack_floor_w <= gpu.floor_max_frac * gpu.rated_w)
        assert np.all(a.rack_floor_w <= a.rack_cap_w)
        assert abs(a.bess_setpoint_w) <= site.bess.power_w
        assert a.job_suspend.dtype == np.bool_ and a.job_suspend.shape == (site.n_jobs,)
        assert a.reasons and all(r.layer == "baseline" and r.reason for r in a.reasons)
        if name != "peak-shave":
            assert a.bess_setpoint_w == 0.0  # no storage coordination
        assert np.all(np.isinf(a.rack_bbu_threshold_w))  # BBUs stay backup only
