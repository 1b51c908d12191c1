"""Fast frequency response under arbitrary frequencies and observations: the order never exceeds the share of the
site it may move and opposes the deviation, the battery's part never exceeds the order nor leaves its power and SoC
window, and the caps stay in the GPU's range (dimmer/control/ffr.py)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dimmer.control import make_controller
from dimmer.control.dimmer import DimmerController
from dimmer.control.ffr import FastFrequencyResponse, droop_response_w
from dimmer.site import SiteModel
from tests.properties.test_dimmer_properties import _obs, scenario

freqs = st.one_of(st.just(math.nan), st.floats(45.0, 55.0))
droops = st.floats(0.0, 20.0)
deadbands = st.floats(0.0, 0.5)
fracs = st.floats(0.0, 1.0)


@given(st.lists(freqs, min_size=1, max_size=20), droops, deadbands, fracs, st.floats(1e5, 2e9))
def test_droop_is_bounded_opposes_the_deviation_and_falls_with_frequency(
    f: list[float], droop: float, db: float, frac: float, p_ref: float
) -> None:
    fa = np.array(f)
    out = droop_response_w(fa, 50.0, db, droop, p_ref, frac)
    assert np.all(np.isfinite(out))
    assert np.all(np.abs(out) <= frac * p_ref * (1 + 1e-12))
    dev = fa - 50.0
    known = np.isfinite(dev)
    assert np.all(out[known] * dev[known] <= 0)  # less import below nominal, more above
    assert np.all(out[known & (np.abs(dev) <= db)] == 0)  # nothing inside the deadband
    assert np.all(out[~known] == 0)
    order = np.argsort(fa[known])
    assert np.all(np.diff(out[known][order]) <= 1e-9 * p_ref)  # non-increasing in frequency


@given(
    st.lists(st.tuples(freqs, st.floats(-2e6, 2e6), st.floats(0.0, 2e6), st.floats(0.0, 2e6)), min_size=1,
             max_size=30),
    droops, deadbands, fracs, st.floats(0.0, 1e6),
)  # fmt: skip
def test_the_split_keeps_the_battery_in_its_room_and_the_order_whole(
    steps: list[tuple[float, float, float, float]], droop: float, db: float, frac: float, release: float
) -> None:
    ffr = FastFrequencyResponse(db, droop, frac, 5e6, 50.0)
    for f, plan, discharge, charge in steps:
        plan = min(max(plan, -charge), discharge)  # a plan within the battery's room
        order = ffr.order(f, release)
        assert abs(order) <= frac * 5e6 * (1 + 1e-12)
        new, cut = ffr.split(order, plan, discharge, charge)
        assert -charge - 1e-6 <= new <= discharge + 1e-6  # within power, SoC window and the ceiling
        assert (new - plan) * order >= 0 and abs(new - plan) <= abs(order) + 1e-6  # the battery's part: the order's
        assert cut >= 0
        if order > 0:  # a reduction: the battery's part and what the caps give make at least the order
            assert (new - plan) + ffr.caps_w >= order - 1e-6
        else:  # an increase: the battery's part and what is left make the order; no cut
            assert cut == 0 and math.isclose((new - plan) + ffr.unmet_w, order, abs_tol=1e-6)


@given(scenario(), st.data(), st.sampled_from([0.5, 2.0, 5.0]), fracs)
def test_the_controller_answers_within_every_bound(
    case: tuple[SiteModel, list[dict[str, Any]]], data: st.DataObject, droop: float, frac: float
) -> None:
    site, steps = case
    ctrl = make_controller("dimmer", site, {"ffr_droop_pct": droop, "ffr_max_frac": frac, "ffr_deadband_hz": 0.02})
    assert isinstance(ctrl, DimmerController) and ctrl.ffr is not None
    gpu, b = site.gpu, site.bess
    t = 0.0
    for s in steps:
        t += s["dt"]
        f = data.draw(freqs)
        act = ctrl.step(replace(_obs(site, t, s), grid_freq_hz=f))
        cap, floor = act.rack_cap_w, act.rack_floor_w
        assert np.all(cap >= gpu.min_cap_w) and np.all(cap <= gpu.rated_w)
        assert np.all(floor >= 0) and np.all(floor <= cap + 1e-9)
        assert abs(ctrl.ffr.order_w) <= frac * site.pcc_limit_w * (1 + 1e-12)
        assert abs(ctrl.ffr.bess_w) <= abs(ctrl.ffr.order_w) + 1e-6
        sp = act.bess_setpoint_w
        assert math.isfinite(sp) and abs(sp) <= b.power_w + 1e-6
        soc = s["soc"]
        if b.energy_j <= 0 or not math.isfinite(soc):
            assert sp == 0.0  # no battery, or one not read: it is given nothing to do
        elif soc <= b.soc_min_frac:
            assert sp <= 0.0  # at the bottom of its window: no discharge
        elif soc >= b.soc_max_frac:
            assert sp >= 0.0  # at the top: no charge
