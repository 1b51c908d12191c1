"""Properties of the breaker thermal model, the frequency model and the band metric on random inputs."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dimmer.site import build_site
from dimmer.siteconfig import LevelSpec, PccSpec, SiteSpec
from gridsim.plant.breakers import BreakerBank, BreakerSpec
from gridsim.plant.grid import FrequencyModel, FrequencySpec, band_rms_w, state_matrices
from tests.budget import examples

SITE = build_site(
    SiteSpec(
        pcc=PccSpec(limit_mw=1),
        levels=[LevelSpec(level="row", count=2, rating_kw=300), LevelSpec(level="rack", count=3)],
    )
)


@settings(max_examples=examples(40), deadline=None)
@given(
    ratios=st.lists(
        st.lists(st.floats(0.0, 12.0), min_size=SITE.n_domains, max_size=SITE.n_domains),
        min_size=1,
        max_size=30,
    ),
    dt_s=st.sampled_from([0.1, 1.0, 10.0]),
    theta0=st.floats(0.0, 1.3),  # below every preset's k²
    reclose_s=st.floats(1.0, 100.0),
)
def test_thermal_state_bounded(ratios: list[list[float]], dt_s: float, theta0: float, reclose_s: float) -> None:
    bank = BreakerBank(SITE, BreakerSpec(reclose_s=reclose_s))
    bank.theta[:] = theta0
    r = np.asarray(ratios)
    bound = max(float(np.max(r**2)), theta0)
    for i, row in enumerate(r):
        new = bank.step(i * dt_s, dt_s, row * bank.rating_w)
        assert np.all(bank.theta >= 0.0)
        assert np.all(bank.theta <= bound * (1 + 1e-12))
        # nothing trips below its pickup and instantaneous ratio unless it started hot enough
        assert not np.any(new & (row < bank.pickup_k) & (theta0 < bank.pickup_k**2))
        # a breaker open for this tick's whole start has nothing on it
        assert np.all(bank.theta[bank.tripped & ~new] <= bank.pickup_k[bank.tripped & ~new] ** 2 * (1 + 1e-12))
    assert bank.trips == len(bank.trip_log)
    assert bank.trips >= int(np.sum(bank.tripped))


def _stable_spec(h: float, r: float, d: float, tg: float, tt: float) -> FrequencySpec:
    probe = FrequencySpec.model_construct(
        nominal_hz=50.0,
        system_base_mw=10_000.0,
        inertia_h_s=h,
        droop_r_pu=r,
        damping_d_pu=d,
        governor_tg_s=tg,
        turbine_tt_s=tt,
    )
    a, _ = state_matrices(probe)
    assume(float(np.max(np.linalg.eigvals(a).real)) < -0.1)  # settles within the run
    return FrequencySpec(inertia_h_s=h, droop_r_pu=r, damping_d_pu=d, governor_tg_s=tg, turbine_tt_s=tt)


@settings(max_examples=examples(40), deadline=None)
@given(
    h=st.floats(2.0, 9.0),
    r=st.floats(0.04, 0.1),
    d=st.floats(0.8, 2.0),
    tg=st.floats(0.1, 0.3),
    tt=st.floats(0.3, 0.7),
    step_mw=st.floats(1.0, 2000.0),
    up=st.booleans(),
)
def test_frequency_follows_the_load_step(
    h: float, r: float, d: float, tg: float, tt: float, step_mw: float, up: bool
) -> None:
    spec = _stable_spec(h, r, d, tg, tt)
    sign = 1.0 if up else -1.0
    m = FrequencyModel(spec, load0_w=500e6, dt_s=0.1)
    dev = np.empty(1500)
    for i in range(dev.size):
        m.step(500e6 + sign * step_mw * 1e6)
        dev[i] = m.dev_hz  # not f − nominal: that would round a 1e-5 Hz deviation against 50 Hz
    # more load: frequency falls first, its largest excursion is a fall, and it settles below nominal
    assert sign * dev[0] < 0
    assert sign * dev[np.argmax(np.abs(dev))] < 0
    ss = -sign * step_mw * 1e6 / (spec.system_base_mw * 1e6) / (d + 1.0 / r) * spec.nominal_hz
    assert sign * dev[-1] < 0
    assert abs(dev[-1] - ss) < 0.02 * abs(ss)
    # and the response is linear in the step
    m2 = FrequencyModel(spec, load0_w=500e6, dt_s=0.1)
    dev2 = np.empty(50)
    for i in range(dev2.size):
        m2.step(500e6 + 2 * sign * step_mw * 1e6)
        dev2[i] = m2.dev_hz
    assert np.allclose(dev2, 2 * dev[:50], rtol=1e-9, atol=1e-15)


@settings(max_examples=examples(30), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    scale=st.floats(-1e3, 1e3).filter(lambda x: abs(x) > 1e-3),
    offset=st.floats(-1e8, 1e8),
    lo_hz=st.sampled_from([0.05, 0.1, 0.5]),
    hi_hz=st.sampled_from([0.8, 2.5, 20.0]),
)
def test_band_rms_nonnegative_and_linear(seed: int, scale: float, offset: float, lo_hz: float, hi_hz: float) -> None:
    rng = np.random.default_rng(seed)
    dt = 0.1
    x = rng.normal(0.0, 1e5, size=1500).cumsum() * 0.01 + rng.normal(0.0, 1e5, size=1500)
    base = band_rms_w(x, dt, lo_hz, hi_hz)
    assert base >= 0.0
    scaled = band_rms_w(scale * x + offset, dt, lo_hz, hi_hz)  # the offset (DC) is out of band
    assert scaled >= 0.0
    assert np.isclose(scaled, abs(scale) * base, rtol=1e-6, atol=1e-9 * abs(offset) + 1e-9)
