"""Fast frequency response (dimmer/control/ffr.py): the droop law, its release at the ramp, the battery-first split,
and the controller's answer in the period that sees the deviation (docs/controller.md, "Fast frequency response")."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from dimmer.control import make_controller
from dimmer.control.dimmer import DimmerController
from dimmer.control.ffr import HOLD_W, FastFrequencyResponse, droop_response_w, nominal_for, released_w
from dimmer.errors import InputError
from dimmer.observation import Actions
from gridsim.engine import run
from gridsim.metrics import summarize
from gridsim.scenario import load_scenario

from .conftest import SCENARIOS
from .test_dimmer_controller import _obs, _site

P_REF = 1650e6  # the 1M-GPU campus's interconnect rating


def _droop(f: Any, db: float = 0.017, pct: float = 2.0, frac: float = 0.1, nominal: float = 60.0) -> Any:
    return droop_response_w(f, nominal, db, pct, P_REF, frac)


# -- the droop law ---------------------------------------------------------------------------------------------------


def test_droop_is_zero_inside_the_deadband_and_measured_from_its_edge() -> None:
    assert _droop(60.0) == 0.0
    assert _droop(60.0 - 0.0169) == 0.0 and _droop(60.0 + 0.0169) == 0.0
    # 0.1 Hz beyond the deadband at 60 Hz on a 2 % droop: (0.1 / 60) / 0.02 of the rating (no step at the edge)
    assert float(_droop(60.0 - 0.117)) == pytest.approx(0.1 / 60 / 0.02 * P_REF)
    assert float(_droop(60.0 - 0.017 - 1e-4)) == pytest.approx(1e-4 / 60 / 0.02 * P_REF, rel=1e-6)


def test_droop_sign_less_import_under_frequency_more_over() -> None:
    assert float(_droop(59.9)) > 0  # under-frequency: reduce import
    assert float(_droop(60.1)) < 0  # over-frequency: increase import
    assert float(_droop(60.1)) == pytest.approx(-float(_droop(59.9)))


def test_droop_is_bounded_by_the_share_of_the_site_it_may_move() -> None:
    assert float(_droop(59.0)) == pytest.approx(0.1 * P_REF)
    assert float(_droop(61.0)) == pytest.approx(-0.1 * P_REF)
    assert float(_droop(59.0, frac=0.0)) == 0.0


def test_zero_droop_is_off_and_an_unknown_frequency_asks_nothing() -> None:
    assert float(_droop(59.0, pct=0.0)) == 0.0
    assert float(_droop(math.nan)) == 0.0


def test_droop_is_vectorised_over_readings() -> None:
    f = np.array([60.0, 59.95, 59.883, 60.05, 57.0])
    out = _droop(f)
    assert out.shape == (5,)
    assert out.tolist() == [float(_droop(x)) for x in f]


def test_a_nominal_is_taken_from_the_first_reading() -> None:
    assert nominal_for(49.2) == 50.0 and nominal_for(50.4) == 50.0
    assert nominal_for(59.1) == 60.0 and nominal_for(60.6) == 60.0


# -- the order: taken on at once, given back at the ramp ------------------------------------------------------------


def test_the_order_is_taken_on_at_once_and_given_back_at_the_release_rate() -> None:
    assert released_w(0.0, 50.0, 1.0) == 50.0  # at once
    assert released_w(50.0, 80.0, 1.0) == 80.0  # more of the same: at once
    assert released_w(50.0, 10.0, 1.0) == 49.0  # less: one release step
    assert released_w(10.5, 10.0, 1.0) == 10.0  # never past the target
    assert released_w(-50.0, 0.0, 1.0) == -49.0  # over-frequency likewise
    # the other side of nominal waits until the order in force is given back
    assert released_w(5.0, -50.0, 10.0) == 0.0
    assert released_w(0.0, -50.0, 10.0) == -50.0


def test_the_frequency_response_releases_as_the_frequency_recovers() -> None:
    ffr = FastFrequencyResponse(0.017, 2.0, 0.1, P_REF, 60.0)
    first = ffr.order(59.917, release_w=1e6)  # 0.066 Hz beyond the deadband
    assert first == pytest.approx(0.066 / 60 / 0.02 * P_REF)
    orders = [ffr.order(60.0, release_w=1e6) for _ in range(5)]
    assert orders == pytest.approx([first - 1e6 * (k + 1) for k in range(5)])
    assert ffr.order(math.nan, release_w=math.inf) == 0.0  # no reading: given back (here at once)


# -- the split: the battery first -----------------------------------------------------------------------------------


def test_the_battery_answers_first_and_the_caps_take_the_rest() -> None:
    ffr = FastFrequencyResponse(0.017, 2.0, 0.1, P_REF, 60.0)
    assert ffr.split(60e6, 40e6, 150e6, 150e6) == (100e6, 0.0)
    assert ffr.split(60e6, 120e6, 150e6, 150e6) == (150e6, 30e6)
    # the caps' share is cut once: the next period asks only what it adds, and holds what they give
    assert ffr.split(60e6, 120e6, 150e6, 150e6) == (150e6, HOLD_W)
    assert ffr.split(80e6, 120e6, 150e6, 150e6) == (150e6, 20e6)
    assert ffr.split(20e6, 120e6, 150e6, 150e6) == (140e6, 0.0)  # the battery covers it: the caps come back
    assert ffr.split(60e6, 0.0, 0.0, 150e6) == (0.0, 60e6)  # at the bottom of its window: all to the caps
    ffr = FastFrequencyResponse(0.017, 2.0, 0.1, P_REF, 60.0)
    # over-frequency: the battery charges within its room (the interconnect's ceiling included); the rest is left
    assert ffr.split(-60e6, 0.0, 150e6, 150e6) == (-60e6, 0.0) and ffr.unmet_w == 0.0
    assert ffr.split(-60e6, 0.0, 150e6, 20e6) == (-20e6, 0.0) and ffr.unmet_w == -40e6
    # a plan already past a bound is left where it is (the order does not move it back)
    assert ffr.split(10e6, 160e6, 150e6, 150e6) == (160e6, 10e6)
    assert ffr.split(0.0, 5e6, 150e6, 150e6) == (5e6, 0.0)


def test_no_response_is_built_at_zero_droop() -> None:
    site = _site(bess_mw=1.0)
    ctrl = make_controller("dimmer", site, {"ffr_deadband_hz": 0.0, "ffr_max_frac": 1.0})
    assert isinstance(ctrl, DimmerController) and ctrl.ffr is None
    on = make_controller("dimmer", site, {"ffr_droop_pct": 2.0})
    assert isinstance(on, DimmerController) and on.ffr is not None
    assert on.ffr.p_ref_w == site.pcc_limit_w  # the droop's base: the site's rating at the interconnect


@pytest.mark.parametrize(
    ("key", "value"),
    [("ffr_droop_pct", -1.0), ("ffr_droop_pct", "two"), ("ffr_deadband_hz", -0.01), ("ffr_max_frac", 1.5),
     ("ffr_nominal_hz", 0.0)],
)  # fmt: skip
def test_a_bad_frequency_response_key_is_one_line_naming_it(key: str, value: Any) -> None:
    with pytest.raises(InputError) as exc:
        make_controller("dimmer", _site(), {key: value})
    msg = str(exc.value)
    assert f"params.{key}" in msg and "\n" not in msg


def test_the_hierarchy_takes_the_response_and_checks_its_keys() -> None:
    """dimmer-campus answers at its coordinator (tests/test_ffr_campus.py); a bad value is still refused."""
    make_controller("dimmer-campus", _site(), {"building": {"ffr_droop_pct": 2.0}})
    with pytest.raises(InputError, match=r"params\.building\.ffr_droop_pct"):
        make_controller("dimmer-campus", _site(), {"building": {"ffr_droop_pct": -2.0}})


# -- the controller: in the period that sees the deviation ----------------------------------------------------------


def _steps(params: dict[str, Any], freqs: list[float], bess_mw: float) -> list[Actions]:
    """A site at a steady 900 W a GPU, stepped once a second through `freqs` (50 Hz nominal); the GPUs report the
    caps sent (in band)."""
    site = _site(bess_mw=bess_mw, ramp_mw_per_min=6.0)
    ctrl = make_controller("dimmer", site, params)
    out: list[Actions] = []
    for k, f in enumerate(freqs):
        sent = out[-1].rack_cap_w.copy() if out else np.full(site.n_racks, site.gpu.rated_w)
        out.append(ctrl.step(replace(_obs(site, float(k + 1), 900.0, rack_cap_w=sent), grid_freq_hz=f)))
    return out


FREQS = [50.0] * 20 + [49.7] * 5 + [50.0] * 20  # 0.3 Hz low for 5 s: 0.264 Hz beyond a 0.036 Hz deadband


def test_zero_droop_acts_exactly_as_without_the_keys() -> None:
    base = _steps({}, FREQS, 1.0)
    off = _steps({"ffr_droop_pct": 0.0, "ffr_deadband_hz": 0.0, "ffr_max_frac": 1.0}, FREQS, 1.0)
    for a, b in zip(base, off, strict=True):
        assert a.bess_setpoint_w == b.bess_setpoint_w
        assert np.array_equal(a.rack_cap_w, b.rack_cap_w) and np.array_equal(a.rack_floor_w, b.rack_floor_w)


def test_the_battery_answers_in_the_period_that_sees_the_deviation() -> None:
    base = _steps({}, FREQS, 1.0)
    on = _steps({"ffr_droop_pct": 2.0, "ffr_max_frac": 0.2}, FREQS, 1.0)
    order_w = 0.264 / 50 / 0.02 * 5e6  # 1.32 MW asked on the 5 MW rating: bounded to 20 %, 1 MW
    assert order_w > 1e6
    for k in range(20):
        assert on[k].bess_setpoint_w == base[k].bess_setpoint_w  # nothing before the event
    # the first period that reads 49.7 Hz: the battery's whole power (its plan was idle), caps where they were
    assert on[20].bess_setpoint_w - base[20].bess_setpoint_w == pytest.approx(1e6)
    assert np.array_equal(on[20].rack_cap_w, base[20].rack_cap_w)
    # recovered: given back at no more than the plan's ramp step a period (0.7 x 6 MW/min = 70 kW/s)
    after = [a.bess_setpoint_w - b.bess_setpoint_w for a, b in zip(on[25:], base[25:], strict=True)]
    assert after[0] == pytest.approx(1e6 - 70e3, rel=1e-6)
    assert all(x - y <= 70e3 + 1e-6 for x, y in itertools.pairwise(after))


def test_without_a_battery_the_caps_answer_lowest_priority_first() -> None:
    on = _steps({"ffr_droop_pct": 2.0, "ffr_max_frac": 0.015}, FREQS, 0.0)
    base = _steps({}, FREQS, 0.0)
    site = _site()
    eval_rack = int(np.flatnonzero(site.rack_job == site.job_name.index("eval"))[0])
    pre_rack = int(np.flatnonzero(site.rack_job == site.job_name.index("pretrain"))[0])
    k = 20  # the first period at 49.7 Hz
    assert on[k].rack_cap_w[eval_rack] < base[k].rack_cap_w[eval_rack]  # the lowest priority is cut
    assert on[k].rack_cap_w[pre_rack] == base[k].rack_cap_w[pre_rack]  # the highest is not
    # the order (75 kW: 1.5 % of the 5 MW rating), from the eval job's 900 W draw, and held there (not cut again)
    drawn_w = np.minimum(900.0, on[k].rack_cap_w)
    cut_w = float(site.rack_power_w(np.full(site.n_racks, 900.0)).sum() - site.rack_power_w(drawn_w).sum())
    assert cut_w == pytest.approx(75e3, rel=1e-3)
    for a in on[k + 1 : 25]:  # (each period's hold cuts a milliwatt: 1e-5 W a GPU)
        assert a.rack_cap_w == pytest.approx(on[k].rack_cap_w, abs=1e-3)
    # the order given back (75 kW at 70 kW a period: two periods), the caps rise again at the controller's pace
    assert on[-1].rack_cap_w[eval_rack] > on[k].rack_cap_w[eval_rack]


def test_over_frequency_charges_the_battery() -> None:
    freqs = [50.0] * 20 + [50.3] * 3
    base = _steps({}, freqs, 1.0)
    on = _steps({"ffr_droop_pct": 2.0, "ffr_max_frac": 0.2}, freqs, 1.0)
    # the battery charges at its whole power (1 MW, its plan was already taking 80 kW); no floor is raised for it
    assert base[20].bess_setpoint_w < 0
    assert on[20].bess_setpoint_w == pytest.approx(-1e6)
    assert np.array_equal(on[20].rack_floor_w, base[20].rack_floor_w)


# -- on the plant -----------------------------------------------------------------------------------------------------


def _freq_step(sets: list[str]) -> tuple[dict[str, Any], Any]:
    """fault-frequency-step to 240 s: 1,000 MW lost at 180 s in a 10 GW, 50 Hz area, under a 6 MW site with a
    2 MW battery; the frequency falls 0.37 Hz and settles 0.24 Hz low."""
    res = run(load_scenario(SCENARIOS / "faults" / "frequency-step.toml", ["duration_s=240", *sets]), "dimmer")
    return summarize(res), res


def test_a_small_site_answers_a_frequency_step_within_a_second_and_holds_every_limit() -> None:
    base_s, base = _freq_step([])
    on_s, on = _freq_step(["controllers.dimmer.ffr_droop_pct=2"])
    ask_w = 0.1 * 6e6  # 0.3 Hz beyond the deadband asks 1.8 MW on 2 %: bounded to 10 % of the 6 MW rating
    dt = on.tick_s
    lower = base.tick["grid_w"] - on.tick["grid_w"]
    assert np.all(np.abs(lower[: round(180 / dt)]) < 1.0)  # nothing before the event
    # the first period that reads the fall is at 181 s: the battery has the order 0.5 s later (its 0.08 s lag)
    assert lower[round(181.5 / dt)] == pytest.approx(ask_w, rel=0.02)
    assert np.mean(lower[round(182 / dt) :]) == pytest.approx(ask_w, rel=0.02)  # and holds it
    for s in (base_s, on_s):
        assert s["breaker_trips"] == 0 and s["pcc_overlimit_s"] == 0.0 and s["ramp_violation_s"] == 0.0
    assert on_s["goodput_loss_power_pct"] == base_s["goodput_loss_power_pct"]  # the battery gave it all


def test_without_a_battery_the_caps_give_the_response() -> None:
    sets = ["site.storage.bess.power_mw=0", "site.storage.bess.energy_mwh=0"]
    base_s, base = _freq_step(sets)
    on_s, on = _freq_step([*sets, "controllers.dimmer.ffr_droop_pct=2"])
    dt = on.tick_s
    lower = base.tick["grid_w"] - on.tick["grid_w"]
    # cut from the jobs' peaks, the caps lower a swinging job's mean by less than the 0.6 MW asked (docs)
    assert 0.3e6 < np.mean(lower[round(182 / dt) :]) <= 0.6e6
    assert on_s["breaker_trips"] == 0 and on_s["pcc_overlimit_s"] == 0.0 and on_s["ramp_violation_s"] == 0.0
    assert on_s["goodput_loss_power_pct"] > base_s["goodput_loss_power_pct"]


@pytest.mark.slow
def test_the_million_gpu_campus_through_a_1500_mw_generation_loss() -> None:
    """Issue 14, part 2: prometheus-ffr (the 1M-GPU campus, 1,500 MW lost at 300 s in its 100 GW area). Every limit
    holds, and the settled deviation moves by what the droop's closed form says it must: in per unit of the area,
    (1/R + D)·Δf + K·(Δf − db) = ΔP_loss with K = (1 / droop) · P_rating / P_area. That same closed form is why the
    issue's goal (largest deviation ≤ 0.8x `none`'s) is out of reach on this area: a 2 % droop on 1.65 GW is 3.9 % of
    a 100 GW area's response, and the nadir comes 1.2 s after the trip, before a 1 s period's answer (docs)."""
    loaded = load_scenario(SCENARIOS / "prometheus-ffr.toml")
    off = load_scenario(SCENARIOS / "prometheus-ffr.toml", ["controllers.dimmer.ffr_droop_pct=0"])
    none, on, zero = run(loaded, "none"), run(loaded, "dimmer"), run(off, "dimmer")
    s_none, s_on = summarize(none), summarize(on)
    assert s_on["breaker_trips"] == 0 and s_on["pcc_overlimit_s"] == 0.0 and s_on["ramp_violation_s"] == 0.0
    settled = on.t_s >= 330.0
    assert np.mean(on.tick["freq_hz"][settled]) > np.mean(none.tick["freq_hz"][settled]) + 2e-3
    # the response's own part (droop 2 against droop 0, both dimmer): the closed form's, within a fifth
    sc = loaded.scenario
    p = sc.controllers["dimmer"]
    f0, area_w = sc.grid.nominal_hz, sc.grid.system_base_mw * 1e6
    k = (100.0 / p["ffr_droop_pct"]) * sc.site.pcc.limit_mw * 1e6 / area_w
    gain = 1.0 / sc.grid.droop_r_pu + sc.grid.damping_d_pu
    dp = 1500e6 / area_w
    db = p["ffr_deadband_hz"] / f0
    without, with_ffr = dp / gain, (dp + k * db) / (gain + k)
    expected_hz = (without - with_ffr) * f0
    measured_hz = float(np.mean(on.tick["freq_hz"][settled]) - np.mean(zero.tick["freq_hz"][settled]))
    assert measured_hz == pytest.approx(expected_hz, rel=0.2), (measured_hz, expected_hz)  # 0.922 against 0.977 mHz
    ratio = s_on["max_freq_dev_hz"] / s_none["max_freq_dev_hz"]
    assert ratio < 0.95  # measured 0.927 (0.934 of it without the response: dimmer's shaping of the campus's swing)
