"""dimmer-campus: the campus split into buildings, the coordinator's budgets, and the link between the levels."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dimmer.control import make_controller
from dimmer.control.building_split import building_observation, building_parts, merge_actions
from dimmer.control.campus import CampusHierarchy
from dimmer.control.coordinator import allocate
from dimmer.errors import InputError
from dimmer.observation import Actions, Observation, Reason
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import JobPlacementSpec, LevelSpec, PccSpec, SiteSpec
from gridsim.engine import run
from gridsim.metrics import summarize
from gridsim.scenario import load_scenario
from tests.test_dimmer_controller import _obs as flat_obs

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def _campus(bess_mw: float = 2.0, pcc_mw: float = 3.0) -> SiteModel:
    """Two buildings of two rows of four GB300 racks (~126 kW each at full power); b0 rated tight, b1 roomy; a job
    spanning both buildings beside one in each."""
    spec = SiteSpec(
        pcc=PccSpec(limit_mw=pcc_mw, ramp_mw_per_min=2.0),
        spare_rack_frac=0.0,
        levels=[
            LevelSpec(level="building", count=2, rating_kw=1000),
            LevelSpec(level="row", count=2, rating_kw=500),
            LevelSpec(level="rack", count=4),
        ],
        overrides=[{"domain": "b0", "rating_kw": 800}],
        storage={"bess": {"power_mw": bess_mw, "energy_mwh": bess_mw / 2}},
    )
    jobs = [
        JobPlacementSpec(name="frontier", priority=10, racks=(2, 14)),
        JobPlacementSpec(name="eval", priority=1, racks=(0, 2)),
        JobPlacementSpec(name="rl", priority=5, racks=(14, 16)),
    ]
    return build_site(spec, jobs)


def _obs(site: SiteModel, t_s: float, gpu_w: float, **kw: Any) -> Observation:
    """The flat controller's tests' observation (every active GPU drawing `gpu_w`), on a campus with a battery."""
    defaults: dict[str, Any] = {"grid_freq_hz": 60.0, "bess_soc_frac": 0.6, "bess_online": True}
    return flat_obs(site, t_s, gpu_w, **(defaults | kw))


# -- the split ---------------------------------------------------------------------------------------------------


def test_each_building_is_a_site_under_a_feed_and_together_they_are_the_campus() -> None:
    site = _campus()
    parts = building_parts(site)
    assert [p.name for p in parts] == ["b0", "b1"]
    assert [(p.rack_start, p.rack_stop) for p in parts] == [(0, 8), (8, 16)]
    covered = np.concatenate([np.arange(site.n_racks)[p.racks] for p in parts])
    assert covered.tolist() == list(range(site.n_racks))
    for p in parts:
        sub = p.site
        assert sub.n_racks == 8 and sub.domain_name[0] == "feed" and sub.domain_name[1] == p.name
        # the building's breaker keeps its rating (b0's override included); the feed is budgeted, not rated
        assert sub.domain_rating_w[1] == site.domain_rating_w[p.domain]
        assert sub.domain_rating_w[0] == pytest.approx(p.max_w) == pytest.approx(site.rack_max_w()[p.racks].sum())
        assert sub.domain_parent[0] == -1 and sub.domain_parent[1] == 0
        assert np.all(sub.domain_parent[2:] >= 1)
        # every domain below the feed is the campus's own, over the same racks
        assert np.array_equal(sub.domain_rack_start[1:] + p.rack_start, site.domain_rack_start[p.domains])
        assert np.array_equal(sub.domain_rack_stop[1:] + p.rack_start, site.domain_rack_stop[p.domains])
        assert np.array_equal(sub.incidence.toarray()[1:], site.incidence.toarray()[p.domains][:, p.racks])
        # jobs keep their campus index; the ramp and the battery are the coordinator's
        assert sub.job_name == site.job_name and np.array_equal(sub.rack_job, site.rack_job[p.racks])
        assert math.isinf(sub.ramp_limit_w_per_min) and sub.bess.power_w == 0.0
    # every campus domain but the campus itself is in exactly one building
    inside = np.concatenate([p.domains for p in parts])
    assert sorted(inside.tolist()) == list(range(1, site.n_domains))


def test_a_site_without_buildings_is_one_building_under_the_interconnect() -> None:
    spec = SiteSpec(
        pcc=PccSpec(limit_mw=1.0),
        spare_rack_frac=0.0,
        levels=[LevelSpec(level="row", count=2, rating_kw=500), LevelSpec(level="rack", count=4)],
    )
    site = build_site(spec, [JobPlacementSpec(name="j", priority=1, racks=(0, 8))])
    (part,) = building_parts(site)
    assert part.domain == 0 and (part.rack_start, part.rack_stop) == (0, 8)
    assert part.site.domain_name == ("feed", "r0", "r1", "r0/k0", "r0/k1", "r0/k2", "r0/k3", "r1/k0", "r1/k1",
                                     "r1/k2", "r1/k3")  # fmt: skip


def test_a_building_sees_its_own_racks_its_meter_as_the_feed_and_its_budget_as_the_feed_limit() -> None:
    site = _campus()
    parts = building_parts(site)
    obs = _obs(site, 5.0, 900.0, rack_power_w=np.arange(16.0) * 1e4)
    sub = building_observation(parts[1], obs, ceiling_w=700e3, floor_w=400e3)
    assert np.array_equal(sub.rack_power_w, np.arange(8.0, 16.0) * 1e4)
    assert sub.pcc_power_w == obs.domain_power_w[parts[1].domain] == sub.domain_power_w[0] == sub.domain_power_w[1]
    assert sub.pcc_limit_w == 700e3 and sub.import_floor_w == 400e3
    assert not sub.bess_online and math.isinf(sub.ramp_limit_w_per_min)
    # no budget above what the racks can draw: the feed's limit is never over its most
    assert building_observation(parts[1], obs, math.inf, math.nan).pcc_limit_w == pytest.approx(parts[1].max_w)


def test_merged_actions_lay_the_buildings_side_by_side_and_name_campus_domains() -> None:
    site = _campus()
    parts = building_parts(site)
    acts = []
    for i, p in enumerate(parts):
        a = Actions.hands_off(p.site)
        acts.append(
            Actions(
                rack_cap_w=np.full(p.site.n_racks, 500.0 + i),
                rack_floor_w=np.full(p.site.n_racks, 100.0 * i),
                bess_setpoint_w=123.0,  # a building has no battery: the coordinator's setpoint is the campus's
                rack_bbu_threshold_w=a.rack_bbu_threshold_w,
                rack_bbu_recharge_w=a.rack_bbu_recharge_w,
                job_suspend=np.zeros(site.n_jobs, dtype=bool),
                reasons=(Reason("capping", "row over", domain=2), Reason("grid", "feed", domain=0)),
            )
        )
    out = merge_actions(site, parts, acts, bess_setpoint_w=-5e5, reasons=[])
    assert out.rack_cap_w.tolist() == [500.0] * 8 + [501.0] * 8
    assert out.rack_floor_w.tolist() == [0.0] * 8 + [100.0] * 8
    assert out.bess_setpoint_w == -5e5
    named = [site.domain_name[r.domain] for r in out.reasons]
    assert named == [site.domain_name[parts[0].domains[1]], "b0", site.domain_name[parts[1].domains[1]], "b1"]


# -- the coordinator's split of the room -------------------------------------------------------------------------


@st.composite
def _buildings(draw: st.DrawFn) -> tuple[np.ndarray, ...]:
    n_b, n_g = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    mw = st.floats(0, 10.0)
    floor = draw(arrays(np.float64, (n_b, n_g), elements=mw))
    bound = floor + draw(arrays(np.float64, (n_b, n_g), elements=mw))
    demand = bound + draw(arrays(np.float64, (n_b, n_g), elements=mw))
    base = draw(arrays(np.float64, (n_b,), elements=mw))
    return base, bound, floor, demand


@given(bld=_buildings(), room=st.floats(0, 300.0))
def test_the_room_goes_to_the_highest_priority_wants_and_cuts_come_from_the_lowest(
    bld: tuple[np.ndarray, ...], room: float
) -> None:
    base, bound, floor, demand = bld
    alloc = allocate(room, base, bound, floor, demand)
    least, now, most = (float(base.sum() + x.sum()) for x in (floor, bound, demand))
    # all of the room, between every group at its floor and every group at its demand
    assert base.sum() + alloc.sum() == pytest.approx(min(max(room, least), most), rel=1e-9, abs=1e-9)
    assert np.all(alloc >= floor - 1e-9) and np.all(alloc <= demand + 1e-9)
    # priority (groups lowest first): a group rises only once every higher group has all it wants; a group is cut
    # only once every lower group is at its floor; and a rise cuts no one, a cut raises no one
    tol = 1e-9 * max(1.0, most)
    if room >= now:
        assert np.all(alloc >= bound - tol)
        for g in range(bound.shape[1]):
            if float((alloc[:, g] - bound[:, g]).sum()) > tol:
                assert np.allclose(alloc[:, g + 1 :], demand[:, g + 1 :], atol=tol)
    else:
        assert np.all(alloc <= bound + tol)
        for g in range(bound.shape[1]):
            if float((bound[:, g] - alloc[:, g]).sum()) > tol:
                assert np.allclose(alloc[:, :g], floor[:, :g], atol=tol)


# -- the hierarchy on hand-built observations ---------------------------------------------------------------------


def _hierarchy(site: SiteModel, **params: Any) -> CampusHierarchy:
    ctrl = make_controller("dimmer-campus", site, params)
    assert isinstance(ctrl, CampusHierarchy)
    return ctrl


def test_a_building_holds_its_budget_for_the_lease_then_falls_to_a_safe_one() -> None:
    site = _campus()
    ctrl = _hierarchy(site, lease_s=5.0, link_latency_s=0.0, parent_lost=[{"from_s": 10.0, "to_s": 100.0}])
    for t in range(1, 10):
        ctrl.step(_obs(site, float(t), 900.0))
    assert np.all(ctrl.budget_t_s == 9.0)  # the last budget, issued at 9 s
    held = ctrl.ceiling_w.copy()
    safe = ctrl.coordinator.safe_ceiling_w(site.pcc_limit_w)
    for t in range(10, 15):
        act = ctrl.step(_obs(site, float(t), 900.0))
        assert act.bess_setpoint_w == 0.0  # a battery whose controller is silent reverts to idle
        assert np.array_equal(ctrl.ceiling_w, held)
        assert not any("lease" in r.reason for r in act.reasons)
    act = ctrl.step(_obs(site, 15.0, 900.0))  # 6 s after the last budget: past its 5 s lease
    assert any("past their budget's lease" in r.reason for r in act.reasons)
    seen = [c.p for c in ctrl.children]
    assert all(p.pcc_margin_frac == 1.0 for p in seen)
    # what the buildings plan against now is the safe share, within their own breakers
    for part, child in zip(ctrl.parts, ctrl.children, strict=True):
        sub = building_observation(part, _obs(site, 16.0, 900.0), float(safe[part.domain - 1]), math.nan)
        assert sub.pcc_limit_w <= site.pcc_limit_w * seen[0].pcc_margin_frac
        assert child.bound_w == child.bound_w  # reported, not NaN
    assert safe.sum() == pytest.approx(site.pcc_limit_w * 0.97)


def test_a_building_not_heard_from_is_planned_at_its_worst_case() -> None:
    site = _campus(pcc_mw=2.2)
    lost = _hierarchy(site, link_latency_s=0.0, child_lost=[{"building": "b1", "from_s": 0.0, "to_s": 1e9}])
    heard = _hierarchy(site, link_latency_s=0.0)
    for t in range(1, 12):
        lost.step(_obs(site, float(t), 700.0))
        heard.step(_obs(site, float(t), 700.0))
    assert math.isinf(lost.reports.t_s[1]) and lost.reports.t_s[0] == 10.0
    # b1 counts at every GPU at rated power: the coordinator has less room to give b0 than when it hears b1
    assert lost.coordinator.last_cut_w >= heard.coordinator.last_cut_w
    assert lost.ceiling_w[0] <= heard.ceiling_w[0] + 1e-6
    # and b1, hearing nothing, is on its safe budget
    assert math.isinf(lost.budget_t_s[1])


def test_a_building_meter_lost_leaves_the_pcc_check_and_the_budgets_finite() -> None:
    site = _campus()
    ctrl = _hierarchy(site, link_latency_s=0.0)
    b1 = site.domain_index("b1")
    for t in range(1, 30):
        obs = _obs(site, float(t), 900.0 + 50.0 * (t % 3))
        if t >= 12:  # b1's meter goes dark after the check has learned its fit
            dom = obs.domain_power_w.copy()
            dom[b1] = np.nan
            obs = _obs(site, float(t), 900.0 + 50.0 * (t % 3), domain_power_w=dom)
        act = ctrl.step(obs)
        assert math.isfinite(act.bess_setpoint_w)
        assert np.all(np.isfinite(ctrl.coordinator.pcc_check.fit()))
        assert np.all(np.isfinite(ctrl.coordinator.alloc_w))


def test_bad_hierarchy_parameters_name_the_key() -> None:
    site = _campus()
    with pytest.raises(InputError, match=r"params\.child_lost\[0\]\.building"):
        make_controller("dimmer-campus", site, {"child_lost": [{"building": "b9", "from_s": 0, "to_s": 1}]})
    with pytest.raises(InputError, match=r"params\.building\.soft_frac"):
        make_controller("dimmer-campus", site, {"building": {"soft_frac": 2.0}})
    with pytest.raises(InputError, match="lease_s"):
        make_controller("dimmer-campus", site, {"lease_s": 0})
    with pytest.raises(InputError, match="to_s"):
        make_controller("dimmer-campus", site, {"parent_lost": [{"from_s": 5, "to_s": 1}]})


# -- the hierarchy in the simulator ----------------------------------------------------------------------------------


def _held(s: dict[str, Any]) -> bool:
    return s["breaker_trips"] == 0 and s["pcc_overlimit_s"] == 0.0 and s["ramp_violation_s"] == 0.0


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"link_latency_s": 0.5, "parent_period_s": 2.0},  # a slow link and a slower parent
        {"child_lost": [{"building": "b0", "from_s": 120.0, "to_s": 240.0}]},
        {"parent_lost": [{"from_s": 120.0, "to_s": 240.0}], "lease_s": 10.0},
    ],
    ids=["flat-link", "slow-link", "child-lost", "parent-lost"],
)
def test_two_buildings_hold_every_limit_through_the_links_faults(params: dict[str, Any]) -> None:
    overrides = ["duration_s=360"] + [f"controllers.dimmer-campus.{k}={_toml(v)}" for k, v in params.items()]
    s = summarize(run(load_scenario(SCENARIOS / "sites" / "two-buildings.toml", overrides), "dimmer-campus"))
    assert _held(s), {k: s[k] for k in ("breaker_trips", "pcc_overlimit_s", "ramp_violation_s")}
    assert math.isfinite(s["goodput_loss_power_pct"]) and s["goodput_loss_power_pct"] < 30.0


FAULTS = SCENARIOS / "faults"


def _two_buildings(fault: str, tmp_path: Path) -> Path:
    """A fault of the catalogue on a campus of two buildings: its hall of six rows split into two buildings of
    three, each rated half the hall, and a fault on a row or on the hall moved to the first building."""
    text = (FAULTS / f"{fault}.toml").read_text()
    raw = tomllib.loads(text)
    hall = next(lv for lv in raw["site"]["levels"] if lv["level"] == "hall")
    rating_mw = hall["rating_mw"] if "rating_mw" in hall else hall["rating_kw"] / 1e3
    text, n = re.subn(
        r'level = "hall"\s*\ncount = 1\s*\nrating_(mw|kw) = [0-9.]+',
        f'level = "building"\ncount = 2\nrating_mw = {rating_mw / 2:.6f}',
        text,
    )
    text, m = re.subn(r'(level = "row"\s*\n)count = 6', r"\1count = 3", text)
    assert n == 1 and m == 1, "the catalogue's site changed: one hall of six rows expected"
    text = re.sub(r'domain = "h0(/r[01])?"', lambda k: f'domain = "b0{k.group(1) or ""}"', text)
    out = tmp_path / f"two-buildings-{fault}.toml"
    out.write_text(text)
    return out


@pytest.mark.parametrize(
    "fault", ["meter-spike", "meter-stuck", "all-jobs-crash", "commands-delayed", "agents-down-row"]
)
def test_the_fault_catalogue_on_two_buildings_holds_every_limit(fault: str, tmp_path: Path) -> None:
    """The coordinator checks the PCC meter against the buildings' meters (a spike or a stuck register broke the
    ramp for 99 s and 127 s before it did), keeps a pending return inside the room with the battery where it is
    (0.5 s over the limit at a restart before), and a building's controller meets its own faults as the flat one."""
    s = summarize(run(load_scenario(_two_buildings(fault, tmp_path)), "dimmer-campus"))
    assert _held(s), {k: s[k] for k in ("breaker_trips", "pcc_overlimit_s", "ramp_violation_s")}


def _toml(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join("{" + ", ".join(f"{k} = {_toml(x)}" for k, x in d.items()) + "}" for d in v) + "]"
    return f'"{v}"' if isinstance(v, str) else repr(v)


def test_same_seed_same_result() -> None:
    path = SCENARIOS / "sites" / "two-buildings.toml"
    a = run(load_scenario(path, ["duration_s=120"]), "dimmer-campus")
    b = run(load_scenario(path, ["duration_s=120"]), "dimmer-campus")
    assert np.array_equal(a.tick["grid_w"], b.tick["grid_w"])
    assert np.array_equal(a.period["job_cap_w"], b.period["job_cap_w"])
