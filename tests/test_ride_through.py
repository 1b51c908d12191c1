"""dimmer's voltage ride-through (dimmer/control/ride_through.py) on hand-made observations."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from dimmer.control.dimmer_params import DimmerParams
from dimmer.control.ride_through import RideThrough
from dimmer.observation import Actions
from tests.test_baselines import make_obs, make_site


def _site():  # type: ignore[no-untyped-def]
    levels = [{"level": "row", "count": 2, "rating_kw": 1500}, {"level": "rack", "count": 8}]
    jobs = [{"name": "a", "racks": [0, 16]}]
    return make_site(levels, jobs, pcc_mw=3.0, ramp_mw_per_min=1.0, bess={"power_mw": 1.0, "energy_mwh": 0.5})


def test_no_voltage_reading_leaves_the_actions_as_they_are() -> None:
    site = _site()
    rt = RideThrough(site, DimmerParams())
    act = Actions.hands_off(site)
    obs = make_obs(site, 1.0, 1e5)
    assert math.isnan(obs.pcc_voltage_pu)
    assert rt.apply(obs, act, 1.0) is act


def test_a_dip_holds_caps_and_floors_and_the_battery_supports_then_lets_go_within_return_s() -> None:
    site = _site()
    p = DimmerParams()
    rt = RideThrough(site, p)
    rated = site.gpu.rated_w
    base = make_obs(site, 1.0, 1e5)
    held_caps = np.full(site.n_racks, 0.8 * rated)
    obs = dataclasses.replace(base, pcc_voltage_pu=0.85, rack_cap_w=held_caps, rack_floor_w=np.full(site.n_racks, 50.0))
    plan = dataclasses.replace(Actions.hands_off(site), bess_setpoint_w=-2e5)  # the plan: caps up, charging
    out = rt.apply(obs, plan, 1.0)
    assert np.array_equal(out.rack_cap_w, held_caps)  # no cap rises into the dip
    assert np.all(out.rack_floor_w == 50.0)
    campus_w = base.pcc_power_w + base.bess_power_w
    assert out.bess_setpoint_w == pytest.approx(min(site.bess.power_w, campus_w))  # full support, no export
    # a lower cap the controller wants for its limits still passes
    lower = dataclasses.replace(plan, rack_cap_w=np.full(site.n_racks, 0.5 * rated))
    assert np.all(rt.apply(dataclasses.replace(obs, t_s=2.0), lower, 1.0).rack_cap_w == 0.5 * rated)
    # the source recovers: held for clear_s, then the support goes in about return_s periods, never as one step
    rec = dataclasses.replace(obs, pcc_voltage_pu=0.99)
    support = []
    for k in range(12):
        a = rt.apply(dataclasses.replace(rec, t_s=3.0 + k), plan, 1.0)
        support.append(a.bess_setpoint_w - plan.bess_setpoint_w)
    assert support[0] > 0
    steps = -np.diff(support)
    assert steps.max() <= max(support) / p.ride_through_return_s + 1e-6
    assert support[-1] == 0.0
    assert rt.apply(dataclasses.replace(rec, t_s=20.0), plan, 1.0).bess_setpoint_w == plan.bess_setpoint_w


def test_the_battery_keeps_the_ride_through_reserve() -> None:
    site = _site()
    rt = RideThrough(site, DimmerParams())
    floor = site.bess.soc_min_frac
    reserve_frac = rt.reserve_j() / site.bess.energy_j
    plan = dataclasses.replace(Actions.hands_off(site), bess_setpoint_w=3e5)
    low = dataclasses.replace(make_obs(site, 1.0, 1e5, bess_soc_frac=floor + 0.5 * reserve_frac), pcc_voltage_pu=1.0)
    assert rt.apply(low, plan, 1.0).bess_setpoint_w == 0.0
    ok = dataclasses.replace(low, bess_soc_frac=floor + 2 * reserve_frac)
    assert rt.apply(ok, plan, 1.0) is plan


def test_off_when_dip_pu_is_zero() -> None:
    assert RideThrough.for_site(_site(), DimmerParams(ride_through_dip_pu=0.0)) is None
