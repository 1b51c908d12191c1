"""GpuBank: caps, floors, ramp limits and actuation paths, checked against closed forms and the presets."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from dimmer.gpus import throughput_frac
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import SiteSpec
from gridsim.plant.gpu import GpuActuationSpec, GpuBank

NAN = math.nan


def _site(gpu: str = "h100", racks: int = 4) -> SiteModel:
    return build_site(
        SiteSpec.model_validate(
            {
                "gpu": gpu,
                "gpus_per_rack": 8,
                "active_gpus_per_rack": 8,
                "pcc": {"limit_mw": 10},
                "levels": [{"level": "row", "count": 1, "rating_mw": 10}, {"level": "rack", "count": racks}],
            }
        )
    )


def _bank(path: str = "inband", tau_s: float = 0.0, oob_delay_s: float = 40.0, racks: int = 4) -> GpuBank:
    return GpuBank(_site(racks=racks), GpuActuationSpec(path=path, tau_s=tau_s, oob_delay_s=oob_delay_s))


def test_starts_at_rated_cap_and_zero_floor() -> None:
    bank = _bank()
    np.testing.assert_array_equal(bank.cap_w, 700.0)
    np.testing.assert_array_equal(bank.floor_w, 0.0)


def test_clamps_to_h100_range_and_floor_below_cap() -> None:
    bank = _bank()
    bank.command(0.0, np.array([100.0, 300.0, 900.0, NAN]), np.array([-5.0, 800.0, 300.0, NAN]))
    # caps: H100 settable 200-700 W; NaN keeps the rated start
    np.testing.assert_array_equal(bank.cap_w, [200.0, 300.0, 700.0, 700.0])
    # floors: [0, 0.9 * 700 = 630], then at most the cap (rack 1: 630 -> 300)
    np.testing.assert_array_equal(bank.floor_w, [0.0, 300.0, 300.0, 0.0])


def test_nan_means_no_change_inband_and_oob() -> None:
    for path in ("inband", "oob"):
        bank = _bank(path=path, oob_delay_s=1.0)
        bank.command(0.0, np.array([400.0, 500.0, 600.0, 650.0]), np.array([100.0, 200.0, 300.0, 350.0]))
        bank.command(0.5, np.array([NAN, 250.0, NAN, NAN]), np.array([NAN, NAN, 50.0, NAN]))
        bank.step(2.0, 0.1, np.full(4, 700.0), np.ones(4, dtype=bool))
        np.testing.assert_array_equal(bank.cap_w, [400.0, 250.0, 600.0, 650.0], err_msg=path)
        # rack 1 keeps its floor 200 (still below its new cap 250); rack 2 takes the new floor 50
        np.testing.assert_array_equal(bank.floor_w, [100.0, 200.0, 50.0, 350.0], err_msg=path)


def test_new_cap_below_old_floor_pulls_floor_down() -> None:
    bank = _bank()
    bank.command(0.0, np.full(4, 700.0), np.full(4, 500.0))
    bank.command(1.0, np.full(4, 300.0), np.full(4, NAN))
    np.testing.assert_array_equal(bank.floor_w, 300.0)


@pytest.mark.parametrize(("start_w", "target_w"), [(700.0, 300.0), (300.0, 700.0)])
def test_inband_lag_is_first_order_with_tau(start_w: float, target_w: float) -> None:
    tau_s, dt_s = 0.3, 0.01
    bank = _bank(tau_s=tau_s)
    bank.command(0.0, np.full(4, start_w), np.zeros(4))
    for k in range(3000):  # settle
        bank.step(k * dt_s, dt_s, np.full(4, 700.0), np.ones(4, dtype=bool))
    np.testing.assert_array_equal(bank.cap_w, start_w)
    t0 = 30.0
    bank.command(t0, np.full(4, target_w), np.zeros(4))
    n = round(tau_s / dt_s)
    for k in range(n):
        bank.step(t0 + k * dt_s, dt_s, np.full(4, 700.0), np.ones(4, dtype=bool))
    expected = target_w + (start_w - target_w) * math.exp(-1.0)  # 1 - exp(-t/tau) of the way at t = tau
    np.testing.assert_allclose(bank.cap_w, expected, rtol=1e-12)
    # the draw follows the cap in force, not the command
    demand = 700.0
    np.testing.assert_allclose(bank.draw_w, min(demand, expected), rtol=1e-12)


def test_inband_floor_lags_with_the_same_tau() -> None:
    bank = _bank(tau_s=0.5)
    bank.command(0.0, np.full(4, 700.0), np.full(4, 400.0))
    for k in range(5):
        bank.step(k * 0.1, 0.1, np.zeros(4), np.ones(4, dtype=bool))
    np.testing.assert_allclose(bank.floor_w, 400.0 * (1.0 - math.exp(-1.0)), rtol=1e-12)
    np.testing.assert_allclose(bank.draw_w, bank.floor_w)  # zero demand: the floor holds the draw up


def test_inband_step_is_exact_for_any_dt() -> None:
    """Two steps of dt equal one step of 2 dt (the exponential step has no discretisation error)."""
    a, b = _bank(tau_s=0.3), _bank(tau_s=0.3)
    for bank in (a, b):
        bank.command(0.0, np.full(4, 250.0), np.zeros(4))
    d, on = np.full(4, 700.0), np.ones(4, dtype=bool)
    a.step(0.0, 0.2, d, on)
    b.step(0.0, 0.1, d, on)
    b.step(0.1, 0.1, d, on)
    np.testing.assert_allclose(a.cap_w, b.cap_w, rtol=1e-13)


def test_oob_delay_is_exact() -> None:
    dt_s = 0.1
    bank = _bank(path="oob", oob_delay_s=40.0)
    on, demand = np.ones(4, dtype=bool), np.full(4, 700.0)
    applied_at = None
    for k in range(700):
        t = k * dt_s  # accumulated as k * dt, the way an engine counts time
        if k == 100:  # t = 10 s
            bank.command(t, np.full(4, 300.0), np.full(4, 100.0))
        if k == 150:  # a second command in flight at the same time, due at 55 s
            bank.command(t, np.full(4, 450.0), np.full(4, NAN))
        bank.step(t, dt_s, demand, on)
        if applied_at is None and bank.cap_w[0] == 300.0:
            applied_at = t + dt_s
        if abs(t + dt_s - 49.9) < 1e-9:
            np.testing.assert_array_equal(bank.cap_w, 700.0)  # nothing before 50 s
            np.testing.assert_array_equal(bank.floor_w, 0.0)
        if abs(t + dt_s - 54.9) < 1e-9:
            np.testing.assert_array_equal(bank.cap_w, 300.0)
    assert applied_at == pytest.approx(50.0, abs=1e-9)
    np.testing.assert_array_equal(bank.cap_w, 450.0)
    np.testing.assert_array_equal(bank.floor_w, 100.0)  # NaN in the second command kept the first floor


def test_draw_is_clip_of_demand_without_ramp_limits() -> None:
    bank = _bank(racks=6)
    rng = np.random.default_rng(1)
    cap = np.array([300.0, 400.0, 500.0, 600.0, 700.0, 250.0])
    floor = np.array([0.0, 200.0, 450.0, 100.0, 630.0, 250.0])
    bank.command(0.0, cap, floor)
    on = np.ones(6, dtype=bool)
    for k in range(200):
        demand = rng.uniform(0.0, 800.0, 6)
        draw = bank.step(k * 0.1, 0.1, demand, on)
        np.testing.assert_array_equal(draw, np.minimum(np.maximum(demand, floor), cap))


def test_ramp_limits_cap_and_floor_all_hold() -> None:
    """With caps and floors settled, the draw never exceeds the cap, never falls below the floor and never
    moves faster than the ramp limits, on a random demand that swings much faster than the limits allow."""
    dt_s, up, down = 0.1, 800.0, 300.0  # W/s
    bank = _bank(racks=5)
    cap = np.array([700.0, 600.0, 500.0, 400.0, 650.0])
    floor = np.array([0.0, 300.0, 250.0, 400.0, 100.0])
    bank.command(0.0, cap, floor, ramp_up_w_per_s=up, ramp_down_w_per_s=down)
    rng = np.random.default_rng(2)
    on = np.ones(5, dtype=bool)
    last = bank.step(0.0, dt_s, np.full(5, 350.0), on).copy()
    hit_up = hit_down = 0
    for k in range(1, 400):
        draw = bank.step(k * dt_s, dt_s, rng.uniform(0.0, 800.0, 5), on).copy()
        delta = draw - last
        assert np.all(draw <= cap)
        assert np.all(draw >= floor)
        assert np.all(delta <= up * dt_s + 1e-9)
        assert np.all(delta >= -down * dt_s - 1e-9)
        hit_up += int(np.sum(np.isclose(delta, up * dt_s)))
        hit_down += int(np.sum(np.isclose(delta, -down * dt_s)))
        last = draw
    assert hit_up > 0 and hit_down > 0  # the limits were actually binding


def test_falling_cap_wins_over_ramp_down_limit() -> None:
    bank = _bank()
    on = np.ones(4, dtype=bool)
    bank.command(0.0, np.full(4, 700.0), np.zeros(4), ramp_up_w_per_s=100.0, ramp_down_w_per_s=100.0)
    bank.step(0.0, 0.1, np.full(4, 700.0), on)
    bank.command(0.1, np.full(4, 200.0), np.zeros(4), ramp_up_w_per_s=100.0, ramp_down_w_per_s=100.0)
    draw = bank.step(0.1, 0.1, np.full(4, 700.0), on)
    np.testing.assert_array_equal(draw, 200.0)  # the cap is the hard limit


def test_not_energized_draws_zero_and_ramps_back_from_zero() -> None:
    dt_s, up = 0.1, 1000.0
    bank = _bank()
    bank.command(0.0, np.full(4, 700.0), np.full(4, 200.0), ramp_up_w_per_s=up)
    demand = np.full(4, 600.0)
    on = np.ones(4, dtype=bool)
    bank.step(0.0, dt_s, demand, on)
    off = np.array([True, False, True, False])
    draw = bank.step(0.1, dt_s, demand, off)
    np.testing.assert_array_equal(draw, [600.0, 0.0, 600.0, 0.0])
    for k in range(2, 8):
        draw = bank.step(k * dt_s, dt_s, demand, on)
        n_up = k - 1  # steps since re-energizing
        expected = min(600.0, up * dt_s * n_up)
        np.testing.assert_allclose(draw[[1, 3]], expected)
        np.testing.assert_array_equal(draw[[0, 2]], 600.0)


def test_rack_speed_follows_the_throughput_curve() -> None:
    bank = _bank()
    peak = np.array([700.0, 700.0, 500.0, 0.0])
    bank.command(0.0, np.array([0.77 * 700.0, 700.0, 250.0, 300.0]), np.zeros(4))
    speed = bank.rack_speed_frac(peak)
    # Perseus A100 point 0.77 -> 0.923 (MODELS.md); uncapped -> 1; cap at half the peak -> the curve at 0.5
    assert speed[0] == pytest.approx(0.923, abs=0.01)
    assert speed[1] == 1.0
    assert speed[2] == pytest.approx(float(throughput_frac(0.5)))
    assert speed[3] == 1.0  # no demand: nothing to slow down


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValidationError):
        GpuActuationSpec(tau_s=-1.0)
    with pytest.raises(ValidationError):
        GpuActuationSpec.model_validate({"path": "bmc"})
    with pytest.raises(ValidationError):
        GpuActuationSpec.model_validate({"tau": 0.3})  # unit missing from the key
    with pytest.raises(ValueError, match="ramp"):
        _bank().command(0.0, np.full(4, 500.0), np.zeros(4), ramp_up_w_per_s=-1.0)


def test_defaults_are_the_published_figures() -> None:
    spec = GpuActuationSpec()
    assert 0.1 <= spec.tau_s <= 0.5  # MODELS.md in-band assumption
    assert spec.oob_delay_s == 40.0  # POLCA out-of-band


def test_a_ramp_limit_that_holds_draw_below_demand_slows_the_gpus() -> None:
    bank = _bank()
    on = np.ones(4, dtype=bool)
    bank.step(0.0, 0.1, np.full(4, 300.0), on)
    bank.command(0.0, np.full(4, 700.0), np.zeros(4), ramp_up_w_per_s=100.0)
    demand = np.full(4, 600.0)
    bank.step(0.1, 0.1, demand, on)
    held = bank.power_limit_w(demand)
    np.testing.assert_allclose(held, 310.0)  # rose only 100 W/s * 0.1 s
    np.testing.assert_allclose(bank.rack_speed_frac(demand, held), throughput_frac(310.0 / 600.0))
    for i in range(2, 60):
        bank.step(i * 0.1, 0.1, demand, on)
    np.testing.assert_allclose(bank.power_limit_w(demand), 700.0)  # caught up: only the cap holds it now
    np.testing.assert_allclose(bank.rack_speed_frac(demand, bank.power_limit_w(demand)), 1.0)
