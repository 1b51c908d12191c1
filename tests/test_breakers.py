"""Breaker thermal model: presets against the standards' published points, the bank against closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError
from scipy.integrate import solve_ivp

from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import LevelSpec, PccSpec, SiteSpec
from gridsim.plant.breakers import (
    BREAKER_PRESETS,
    BreakerBank,
    BreakerSpec,
    TripCurve,
    heating,
    trip_time_s,
)

UL = BREAKER_PRESETS["ul489"]
IEC = BREAKER_PRESETS["iec60947_2"]
I2T = BREAKER_PRESETS["iec60947_2_i2t"]


def _site() -> SiteModel:
    levels = [LevelSpec(level="row", count=2, rating_kw=300), LevelSpec(level="rack", count=3)]
    return build_site(SiteSpec(pcc=PccSpec(limit_mw=1), levels=levels))


def _loads(bank: BreakerBank, ratios: dict[int, float]) -> np.ndarray:
    load = np.zeros(bank.rating_w.shape[0])
    for i, r in ratios.items():
        load[i] = r * bank.rating_w[i]
    return load


def _ode_trip_s(curve: TripCurve, ratio: float, theta0: float = 0.0) -> float:
    """Trip time by integrating dθ/dt = (h − θ)/τ numerically until θ = k² (not from the closed form); h = r², or
    `heating`'s drive on an I²t curve."""
    drive = (
        float(heating(np.array(ratio**2), curve.pickup_k**2, curve.i2t_s / curve.tau_s)) if curve.i2t_s else ratio**2
    )

    def crossing(_t: float, y: np.ndarray) -> float:
        return float(y[0] - curve.pickup_k**2)

    crossing.terminal = True  # type: ignore[attr-defined]
    sol = solve_ivp(
        lambda _t, y: (drive - y) / curve.tau_s,
        (0.0, 7200.0),
        [theta0],
        events=crossing,
        rtol=1e-10,
        atol=1e-12,
    )
    return float(sol.t_events[0][0]) if sol.t_events[0].size else math.inf


# ---- presets against the closed form and the standards -----------------------------------------------------
@pytest.mark.parametrize("curve", [UL, IEC, I2T], ids=lambda c: c.name)
@pytest.mark.parametrize("ratio", [1.30, 1.35, 2.0])
def test_closed_form_matches_integrated_ode(curve: TripCurve, ratio: float) -> None:
    assert float(trip_time_s(curve, ratio)) == pytest.approx(_ode_trip_s(curve, ratio), rel=1e-6)
    hot = 1.0  # after carrying the rating for a long time
    assert float(trip_time_s(curve, ratio, hot)) == pytest.approx(_ode_trip_s(curve, ratio, hot), rel=1e-6)


def test_ul489_bounds() -> None:
    # UL 489: holds 100 % indefinitely, trips within 1 h at 135 % and within 2 min at 200 %
    assert math.isinf(float(trip_time_s(UL, 1.0)))
    assert math.isinf(float(trip_time_s(UL, 1.0, theta0=1.0)))
    t135, t200 = (float(x) for x in trip_time_s(UL, np.array([1.35, 2.0])))
    assert t135 < 3600.0 and t200 < 120.0
    # with margin, and the documented derivation (k 1.2, τ 180 s)
    assert t200 < 0.75 * 120.0
    assert t135 == pytest.approx(281.0, abs=0.5)
    assert t200 == pytest.approx(80.3, abs=0.1)


def test_iec60947_2_bounds_and_tr_point() -> None:
    # conventional non-trip current 1.05 In: no trip within 1 h, from cold or hot
    assert math.isinf(float(trip_time_s(IEC, 1.05)))
    assert math.isinf(float(trip_time_s(IEC, 1.05, theta0=1.05**2)))
    # conventional tripping current 1.30 In: trip within 1 h, from cold and right after carrying 1.05 In
    assert float(trip_time_s(IEC, 1.30)) < 3600.0
    assert float(trip_time_s(IEC, 1.30, theta0=1.05**2)) < 3600.0
    # Micrologic: tr = 16 s at 6 Ir
    assert float(trip_time_s(IEC, 6.0)) == pytest.approx(16.0, rel=1e-12)
    # electronic long time: I²t = const, t ≈ tr·36/x² at large multiples (below the instantaneous 10x)
    x = np.array([4.0, 5.0, 7.0, 9.0, 9.9])
    assert np.allclose(trip_time_s(IEC, x), 16.0 * 36.0 / x**2, rtol=0.03)
    # near pickup the model is slower than pure I²t: 2 Ir trips after ~172 s instead of 144 s (documented)
    assert float(trip_time_s(IEC, 2.0)) == pytest.approx(171.6, abs=0.5)


# Schneider Electric, "Trip Curve Values for Micrologic Trip Units, Basic, A, P and H Types", Instruction Bulletin
# S1A1576900 Rev01 (09/2009), Table 1, long-time delay setting tr = 16 s: (multiple of Ir, min s, max s).
MICROLOGIC_TR16 = (
    (1.35, 382.19, 611.92),
    (1.5, 277.1, 400.43),
    (2.0, 132.69, 174.92),
    (3.0, 53.78, 68.34),
    (5.0, 18.56, 23.25),
    (6.0, 12.8, 16.0),
    (7.2, 8.85, 11.04),
)


@pytest.mark.parametrize(("ratio", "lo_s", "hi_s"), MICROLOGIC_TR16, ids=lambda v: str(v))
def test_iec60947_2_inside_the_micrologic_published_band(ratio: float, lo_s: float, hi_s: float) -> None:
    """The electronic long-time preset follows the vendor's published table, not pure I²t: at every tabulated
    multiple the cold trip time lies inside Schneider's min-max band for tr = 16 s (to 0.5 % at its edges)."""
    t = float(trip_time_s(IEC, ratio))
    assert lo_s * 0.995 <= t <= hi_s * 1.005


def test_vendor_table_itself_is_not_pure_i2t_near_pickup() -> None:
    """Why the preset is matched to the vendor table and not to t = 36·tr/x²: Schneider's own band excludes pure
    I²t at 1.35 and 1.5 Ir (316 s and 256 s lie below the band's minimum) though it holds it from 2 Ir up."""
    i2t = {r: 36.0 * 16.0 / r**2 for r, _, _ in MICROLOGIC_TR16}
    below = [r for r, lo, _ in MICROLOGIC_TR16 if i2t[r] < lo]
    assert below == [1.35, 1.5]
    # the preset against pure I²t, measured: +75 % at 1.35, +48 % at 1.5, +19 % at 2, +6 % at 3, +2 % at 4, 0 at 6
    dev = {r: float(trip_time_s(IEC, r)) / (576.0 / r**2) - 1.0 for r in (1.35, 1.5, 2.0, 3.0, 4.0, 6.0)}
    assert dev[1.5] == pytest.approx(0.480, abs=0.002) and dev[2.0] == pytest.approx(0.192, abs=0.002)
    assert all(abs(dev[r]) <= 0.10 for r in (3.0, 4.0, 6.0))


@pytest.mark.parametrize("curve", [UL, IEC, I2T], ids=lambda c: c.name)
def test_instantaneous_and_degenerate_cases(curve: TripCurve) -> None:
    ii = curve.instantaneous_ratio
    t = trip_time_s(curve, np.array([ii, ii * 1.5, ii * 0.99, curve.pickup_k, 0.0]))
    assert t[0] == 0.0 and t[1] == 0.0
    assert 0.0 < t[2] < 10.0
    assert math.isinf(t[3]) and math.isinf(t[4])  # at the pickup itself θ only approaches k²
    assert float(trip_time_s(curve, 1.5, theta0=curve.pickup_k**2)) == 0.0
    # trip time falls monotonically with the load
    r = np.linspace(curve.pickup_k + 0.01, ii - 0.01, 200)
    assert np.all(np.diff(trip_time_s(curve, r)) < 0)


def test_spec_validates_preset_names_and_keys() -> None:
    assert BreakerSpec().row == "ul489"
    with pytest.raises(ValidationError, match="breaker preset"):
        BreakerSpec(row="ul498")
    with pytest.raises(ValidationError):
        BreakerSpec(reclose_min=5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        BreakerSpec(reclose_s=0)


# ---- the bank ----------------------------------------------------------------------------------------------
def test_bank_takes_each_level_preset() -> None:
    site = _site()
    bank = BreakerBank(site, BreakerSpec(campus="ul489", row="iec60947_2", rack="ul489"))
    campus, row, rack = 0, site.domain_index("r0"), site.domain_index("r0/k0")
    assert bank.tau_s[campus] == UL.tau_s and bank.pickup_k[campus] == UL.pickup_k
    assert bank.tau_s[row] == IEC.tau_s and bank.instantaneous_ratio[row] == IEC.instantaneous_ratio
    assert bank.tau_s[rack] == UL.tau_s
    assert np.array_equal(bank.rating_w, site.domain_rating_w)


@pytest.mark.parametrize(
    ("name", "level", "ratio", "dt_s"),
    [
        ("r1/k2", "rack", 2.0, 0.1),
        ("r1", "row", 1.3, 0.5),
        ("r0/k0", "rack", 1.35, 1.0),
        ("campus", "campus", 1.3, 0.5),
    ],
)
def test_bank_trips_at_closed_form_time(name: str, level: str, ratio: float, dt_s: float) -> None:
    site = _site()
    spec = BreakerSpec()
    bank = BreakerBank(site, spec)
    d = site.domain_index(name)
    curve = spec.curve_for_level(level)
    expected = float(trip_time_s(curve, ratio))
    load = _loads(bank, {d: ratio})
    t = 0.0
    while True:
        new = bank.step(t, dt_s, load)
        if new.any():
            break
        t += dt_s
        assert t < 2 * expected
    assert np.flatnonzero(new).tolist() == [d]
    assert t <= expected <= t + dt_s + 1e-9  # tripped in the tick that holds the closed-form time
    assert bank.trip_log == [(pytest.approx(expected, rel=1e-9), d)]
    assert bank.trips == 1 and bank.tripped[d]


def test_exact_discretisation_is_independent_of_dt() -> None:
    site = _site()
    a, b = BreakerBank(site, BreakerSpec()), BreakerBank(site, BreakerSpec())
    load = 1.1 * site.domain_rating_w  # below every pickup: no trips
    for i in range(100):
        a.step(i * 1.0, 1.0, load)
    for i in range(1000):
        b.step(i * 0.1, 0.1, load)
    assert np.allclose(a.theta, b.theta, rtol=1e-10)
    expected = 1.21 * (1.0 - np.exp(-100.0 / a.tau_s))
    assert np.allclose(a.theta, expected, rtol=1e-10)
    assert np.allclose(a.thermal_frac(), expected / a.pickup_k**2)


def test_instantaneous_trip_in_the_first_tick() -> None:
    site = _site()
    bank = BreakerBank(site, BreakerSpec())
    d = site.domain_index("r0/k1")
    new = bank.step(42.0, 0.1, _loads(bank, {d: 10.5}))
    assert new[d] and new.sum() == 1
    assert bank.trip_log == [(42.0, d)]
    bank2 = BreakerBank(site, BreakerSpec())
    assert not bank2.step(0.0, 0.1, _loads(bank2, {d: 9.5})).any()  # thermal only below Ii


def test_reclose_and_cooling_while_open() -> None:
    site = _site()
    bank = BreakerBank(site, BreakerSpec(reclose_s=50.0))
    d = site.domain_index("r0/k0")
    load = _loads(bank, {d: 2.0})
    dt = 0.1
    t_trip = float(trip_time_s(UL, 2.0))
    n = 0
    while not bank.step(n * dt, dt, load).any():
        n += 1
    n += 1
    # open: the breaker carries nothing and cools from k²; it stays open until trip time + reclose_s
    while n * dt < t_trip + 50.0 - 1e-9:
        assert bank.tripped[d]
        bank.step(n * dt, dt, load)
        n += 1
    t_end = n * dt
    assert bank.theta[d] == pytest.approx(UL.pickup_k**2 * math.exp(-(t_end - t_trip) / UL.tau_s), rel=1e-9)
    bank.step(n * dt, dt, np.zeros_like(load))  # the first tick at/after the reclose time
    assert not bank.tripped[d]
    assert bank.rack_energized().all()
    assert bank.trips == 1


def test_thermal_memory_second_overload_trips_sooner() -> None:
    site = _site()
    bank = BreakerBank(site, BreakerSpec(reclose_s=30.0))
    d = site.domain_index("r0/k2")
    load = _loads(bank, {d: 2.0})
    dt = 0.1
    n = 0
    while bank.trips < 1:
        bank.step(n * dt, dt, load)
        n += 1
    while bank.tripped[d]:
        bank.step(n * dt, dt, load)
        n += 1
    theta_reclose = float(bank.theta[d])  # θ after the closing tick
    t_closed = n * dt
    while bank.trips < 2:
        bank.step(n * dt, dt, load)
        n += 1
    second = bank.trip_log[1][0] - t_closed
    first = float(trip_time_s(UL, 2.0))
    assert second < 0.8 * first
    assert second == pytest.approx(float(trip_time_s(UL, 2.0, theta0=theta_reclose)), abs=1e-6)


def test_rack_energized_and_dead_subtree() -> None:
    site = _site()
    bank = BreakerBank(site, BreakerSpec())
    row = site.domain_index("r0")
    child = site.domain_index("r0/k1")
    bank.step(0.0, 0.1, _loads(bank, {row: 11.0}))
    assert bank.tripped[row]
    assert bank.rack_energized().tolist() == [False, False, False, True, True, True]
    with pytest.raises(ValueError):
        bank.rack_energized()[0] = True  # read-only
    # a domain under the open row carries nothing, whatever load the caller passes
    for i in range(1, 2000):
        bank.step(i * 0.1, 0.1, _loads(bank, {child: 5.0}))
    assert not bank.tripped[child] and bank.theta[child] == 0.0
    # a rack breaker opening takes only its own rack out; the campus takes everything
    bank2 = BreakerBank(site, BreakerSpec())
    bank2.step(0.0, 0.1, _loads(bank2, {site.domain_index("r1/k0"): 20.0}))
    assert bank2.rack_energized().tolist() == [True, True, True, False, True, True]
    bank2.step(0.1, 0.1, _loads(bank2, {0: 20.0}))
    assert not bank2.rack_energized().any()


def test_derate_and_restore() -> None:
    site = _site()
    bank = BreakerBank(site, BreakerSpec())
    row = site.domain_index("r1")
    mask = np.zeros(site.n_domains, dtype=bool)
    mask[row] = True
    load = np.zeros(site.n_domains)
    load[row] = 0.8 * site.domain_rating_w[row]  # fine at the base rating ...
    bank.derate(mask, 0.5)  # ... but 1.6 x a halved rating
    assert bank.rating_w[row] == 0.5 * site.domain_rating_w[row]
    assert np.array_equal(bank.rating_w[~mask], site.domain_rating_w[~mask])
    t_exp = float(trip_time_s(BreakerSpec().curve_for_level("row"), 1.6))
    tt = bank.time_to_trip_s(load)
    assert tt[row] == pytest.approx(t_exp, rel=1e-12) and math.isinf(tt[0])
    for i in range(int(t_exp / 1.0) + 2):
        bank.step(float(i), 1.0, load)
    assert bank.tripped[row]
    assert bank.trip_log[0][0] == pytest.approx(t_exp, rel=1e-9)
    bank.restore()
    assert np.array_equal(bank.rating_w, site.domain_rating_w)
    with pytest.raises(ValueError):
        bank.derate(mask, 0.0)


# ---- the I²t preset (issue 15 item 5) ------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0, 4.0, 6.0])
@pytest.mark.parametrize("dt_s", [0.1, 1.0])
def test_i2t_preset_simulated_trip_is_i2t_within_10pct(ratio: float, dt_s: float) -> None:
    """The bank stepped tick by tick on a campus breaker set to `iec60947_2_i2t` trips at t = 36·tr / x² (closed form
    of I²t, tr = 16 s at 6 Ir): within 10 % is asked; measured: exact to 1e-9 (the crossing is solved in the tick).
    The default `iec60947_2` is +48 %, +19 %, +6.2 %, +2.4 %, 0 % at these multiples (matched to the vendor's table)."""
    site = _site()
    bank = BreakerBank(site, BreakerSpec(campus="iec60947_2_i2t"))
    load = _loads(bank, {0: ratio})
    i2t = 36.0 * 16.0 / ratio**2
    t = 0.0
    while not bank.step(t, dt_s, load).any():
        t += dt_s
        assert t < 2 * i2t
    t_trip = bank.trip_log[0][0]
    assert t_trip == pytest.approx(i2t, rel=0.10)
    assert t_trip == pytest.approx(i2t, rel=1e-9)
    assert float(trip_time_s(I2T, ratio)) == pytest.approx(i2t, rel=1e-12)


def test_i2t_preset_keeps_iec_points_and_thermal_memory() -> None:
    assert math.isinf(float(trip_time_s(I2T, 1.05))) and math.isinf(float(trip_time_s(I2T, 1.15)))
    assert math.isinf(float(trip_time_s(I2T, 1.05, theta0=1.05**2)))
    assert float(trip_time_s(I2T, 1.30)) == pytest.approx(576.0 / 1.69)  # 341 s: within IEC's 1 h
    # warm from carrying the rating it trips sooner (thermal memory, τ = 427.5 s): 39.8 s at 2 Ir instead of 144
    assert float(trip_time_s(I2T, 2.0, theta0=1.0)) == pytest.approx(39.84, abs=0.01)
    # below the pickup θ follows r² exactly as on the default curve: same state, same thermal_frac
    site = _site()
    a, b = BreakerBank(site, BreakerSpec(campus="iec60947_2_i2t")), BreakerBank(site, BreakerSpec())
    load = 1.1 * site.domain_rating_w
    for i in range(50):
        a.step(i * 1.0, 1.0, load)
        b.step(i * 1.0, 1.0, load)
    assert np.array_equal(a.theta, b.theta)
    assert np.array_equal(a.time_to_trip_s(2.0 * site.domain_rating_w)[:1], trip_time_s(I2T, 2.0, a.theta[0])[None])
