"""Capacitor trays, rack BBUs and the campus battery, checked against closed forms."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import SiteSpec
from gridsim.plant.storage import CampusBess, CapacitorTrays, RackBbus

# the ORv3 33 kW shelf (90 s at 33 kW, 3 kW recharge): the closed forms below are written for it
SHELF_33KW = {"bbu": {"kw_per_rack": 33.0, "kwh_per_rack": 0.825, "recharge_kw_per_rack": 3.0}}


def _site(racks: int = 2, storage: dict[str, Any] | None = None) -> SiteModel:
    """GB300 NVL72 racks with the default storage (sized from the rack: tray 65 J/GPU, 30.2 kW; BBU 144 kW,
    3.45 kWh) unless given."""
    return build_site(
        SiteSpec.model_validate(
            {
                "pcc": {"limit_mw": 50},
                "levels": [{"level": "row", "count": 1, "rating_mw": 50}, {"level": "rack", "count": racks}],
                "storage": storage or {},
            }
        )
    )


def _ripple_rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x - x.mean()) ** 2)))


# ---- capacitor trays ---------------------------------------------------------------------------------------


def test_tray_starts_half_full_with_the_gb300_rating() -> None:
    trays = CapacitorTrays(_site())
    np.testing.assert_array_equal(trays.energy_max_j, 65.0 * 72)  # NVIDIA GB300: ~65 J per GPU
    np.testing.assert_array_equal(trays.energy_j, 0.5 * 65.0 * 72)


def test_tray_smooths_a_2hz_square_wave_and_keeps_the_mean() -> None:
    """+-5 kW at 2 Hz on a 100 kW rack: the upstream ripple falls close to what an ideal first-order low-pass
    (tau 0.2 s) gives, the tray never saturates, and the mean is unchanged (to the energy the tray moved)."""
    site = _site(racks=1)
    tau_s, dt_s, amp_w, half_s = 0.2, 0.01, 5e3, 0.25
    trays = CapacitorTrays(site, smoothing_tau_s=tau_s)
    t = np.arange(0.0, 20.0, dt_s)
    load = 100e3 + amp_w * np.where((np.floor(t / half_s + 1e-9) % 2) == 0, 1.0, -1.0)
    up = np.empty_like(load)
    e_at_5s = 0.0
    for k, x in enumerate(load):
        if k == 500:
            e_at_5s = float(trays.energy_j[0])
        up[k] = trays.step(dt_s, np.array([x]))[0]
        assert 0.0 < trays.energy_j[0] < trays.energy_max_j[0]  # never on a rail
    w = t >= 5.0  # after the start-up transient; a whole number of periods (30)
    factor = _ripple_rms(load[w]) / _ripple_rms(up[w])
    # closed form: steady-state RMS of a square wave of amplitude A through a first-order low-pass
    q = math.exp(-half_s / tau_s)
    b = amp_w * (1 + (1 - q) / (1 + q))
    ms = amp_w**2 - 2 * amp_w * b * tau_s * (1 - q) / half_s + b**2 * tau_s * (1 - q * q) / (2 * half_s)
    ideal_factor = amp_w / math.sqrt(ms)  # 2.98
    assert factor > 2.5  # measured 2.71
    assert factor == pytest.approx(ideal_factor, rel=0.15)  # the slow pull to half charge costs ~10 %
    # mean: upstream energy = load energy - what the tray gave up, exactly; and that is small
    delta_e = float(trays.energy_j[0]) - e_at_5s
    assert np.sum(up[w]) * dt_s == pytest.approx(np.sum(load[w]) * dt_s + delta_e, rel=1e-12)
    assert abs(up[w].mean() - load[w].mean()) < 1e-3 * load[w].mean()


def test_tray_respects_power_and_energy_limits_and_is_lossless() -> None:
    site = _site(racks=3)
    trays = CapacitorTrays(site)
    rng = np.random.default_rng(3)
    dt_s = 0.05
    e0 = float(trays.energy_j.sum())
    for _ in range(400):
        rack = rng.uniform(0.0, 150e3, 3)  # swings far beyond the 30 kW tray
        up = trays.step(dt_s, rack)
        p = rack - up
        assert np.all(np.abs(p) <= trays.power_max_w * (1 + 1e-12))
        assert np.all(trays.energy_j >= 0.0) and np.all(trays.energy_j <= trays.energy_max_j)
        assert np.all(up >= 0.0)  # never back-feeds
        stored = float(trays.energy_j.sum()) - e0
        assert stored == pytest.approx(trays.energy_in_j - trays.energy_out_j, abs=1e-9 * 3 * 4680)
    assert trays.energy_in_j > 0 and trays.energy_out_j > 0


def test_tray_pulls_back_to_half_charge() -> None:
    site = _site(racks=1)
    trays = CapacitorTrays(site, smoothing_tau_s=0.2, recenter_tau_s=2.0)
    trays.step(0.1, np.array([100e3]))
    for _ in range(3):  # a load step down charges the tray
        trays.step(0.1, np.array([80e3]))
    assert trays.energy_j[0] > 0.6 * trays.energy_max_j[0]
    for _ in range(300):
        trays.step(0.1, np.array([80e3]))
    assert trays.energy_j[0] == pytest.approx(0.5 * trays.energy_max_j[0], rel=1e-3)


def test_zero_size_tray_passes_the_load_through() -> None:
    trays = CapacitorTrays(_site(storage={"tray": {"j_per_gpu": 0.0}}))
    for x in (100e3, 20e3, 130e3):
        np.testing.assert_array_equal(trays.step(0.1, np.array([x, x / 2])), [x, x / 2])


def test_tray_holds_charge_under_a_tripped_breaker() -> None:
    trays = CapacitorTrays(_site())
    trays.step(0.1, np.array([100e3, 100e3]))
    e = trays.energy_j.copy()
    up = trays.step(0.1, np.array([0.0, 100e3]), np.array([False, True]))
    assert up[0] == 0.0 and trays.energy_j[0] == e[0]


# ---- rack BBUs ---------------------------------------------------------------------------------------------

ETA_BBU = 0.92
BBU_J = 33e3 * 90  # OCP ORv3 high-power shelf: 33 kW for 90 s


def test_bbu_holds_rack_at_threshold_until_the_energy_runs_out() -> None:
    bbus = RackBbus(_site(racks=1, storage=SHELF_33KW))
    assert bbus.soc_frac[0] == 1.0
    dt_s, rack, thr = 0.1, 40e3, 30e3
    on = np.ones(1, dtype=bool)
    # closed form: 10 kW delivered drains the store at 10 kW / sqrt(eta) until soc 0.5
    t_empty = 0.5 * BBU_J * math.sqrt(ETA_BBU) / (rack - thr)  # 142.4 s
    t_released = math.nan  # end of the step in which the BBU ran out
    for k in range(1600):
        up = bbus.step(dt_s, np.array([rack]), np.array([thr]), np.array([3e3]), on)[0]
        if math.isnan(t_released) and up > thr:
            t_released = (k + 1) * dt_s
        if (k + 1) * dt_s < t_empty:
            assert up == thr
    assert t_empty <= t_released < t_empty + dt_s
    assert up == rack
    assert bbus.soc_frac[0] == pytest.approx(0.5, abs=1e-12)
    assert bbus.energy_out_j == pytest.approx(0.5 * BBU_J * math.sqrt(ETA_BBU), rel=1e-9)


def test_bbu_recharge_never_pushes_a_rack_above_its_threshold() -> None:
    bbus = RackBbus(_site(racks=3))
    on = np.ones(3, dtype=bool)
    thr = np.full(3, 30e3)
    for _ in range(300):  # drain to soc_min
        bbus.step(1.0, np.full(3, 60e3), thr, np.full(3, 3e3), on)
    np.testing.assert_allclose(bbus.soc_frac, 0.5)
    up = bbus.step(1.0, np.array([29e3, 20e3, 30e3]), thr, np.full(3, 3e3), on)
    # recharge = min(recharge 3 kW, threshold - rack): 1 kW, 3 kW, 0
    np.testing.assert_allclose(up, [30e3, 23e3, 30e3])
    rng = np.random.default_rng(4)
    for _ in range(300):
        rack = rng.uniform(0.0, 50e3, 3)
        up = bbus.step(1.0, rack, thr, np.full(3, 3e3), on)
        assert np.all(up[rack < thr] <= thr[rack < thr])
        assert np.all(up[rack >= thr] >= thr[rack >= thr])  # shaving stops at the threshold
        assert np.all(up[rack >= thr] <= rack[rack >= thr])


def test_bbu_backup_only_recharges_at_the_recharge_rate_and_round_trips() -> None:
    bbus = RackBbus(_site(racks=1, storage=SHELF_33KW))
    on = np.ones(1, dtype=bool)
    for _ in range(200):  # shave to soc_min
        bbus.step(1.0, np.array([50e3]), np.array([20e3]), np.array([3e3]), on)
    assert bbus.soc_frac[0] == pytest.approx(0.5)
    dt_s, rack = 1.0, 20e3
    inf = np.array([np.inf])
    # backup only: recharges at recharge_w whenever below soc_max (the uncoordinated recharge, MICRO 2020)
    t_full = 0.5 * BBU_J / (3e3 * math.sqrt(ETA_BBU))  # 516 s
    t_done = math.nan  # end of the step in which the BBU filled up (its recharge no longer at the rate)
    for k in range(700):
        up = bbus.step(dt_s, np.array([rack]), inf, np.array([3e3]), on)[0]
        if (k + 1) * dt_s < t_full:
            assert up == rack + 3e3
        elif math.isnan(t_done) and up < rack + 3e3:
            t_done = (k + 1) * dt_s
    assert t_full <= t_done < t_full + dt_s
    assert up == rack  # full: nothing more
    assert bbus.soc_frac[0] == pytest.approx(1.0, abs=1e-12)
    # full cycle soc_max -> soc_min -> soc_max: out = in * eta; loss = in - out
    assert bbus.energy_out_j == pytest.approx(bbus.energy_in_j * ETA_BBU, rel=1e-9)
    assert bbus.loss_j == pytest.approx(bbus.energy_in_j * (1 - ETA_BBU), rel=1e-6)


def test_bbu_not_energized_neither_charges_nor_discharges() -> None:
    bbus = RackBbus(_site(racks=2))
    on = np.ones(2, dtype=bool)
    for _ in range(10):
        bbus.step(1.0, np.full(2, 50e3), np.full(2, 20e3), np.full(2, 3e3), on)
    soc = bbus.soc_frac.copy()
    e_in, e_out = bbus.energy_in_j, bbus.energy_out_j
    off = np.zeros(2, dtype=bool)
    for thr in (20e3, np.inf):
        up = bbus.step(1.0, np.zeros(2), np.full(2, thr), np.full(2, 3e3), off)
        np.testing.assert_array_equal(up, 0.0)
    np.testing.assert_array_equal(bbus.soc_frac, soc)
    assert (bbus.energy_in_j, bbus.energy_out_j) == (e_in, e_out)


# ---- campus BESS -------------------------------------------------------------------------------------------


def _bess_site(**bess: float) -> SiteModel:
    return _site(storage={"bess": {"power_mw": 10.0, "energy_mwh": 10.0, **bess}})


def test_bess_round_trip_gives_back_eta_of_what_it_took() -> None:
    bess = CampusBess(_bess_site(soc_init_frac=0.1, round_trip_eff=0.88, response_tau_s=0.0))
    while bess.soc_frac < 0.9 - 1e-12:
        assert bess.step(10.0, -10e6) <= 0.0
    assert bess.soc_frac == pytest.approx(0.9, abs=1e-12)
    e_in = bess.energy_in_j
    assert e_in == pytest.approx(0.8 * 10 * 3.6e9 / math.sqrt(0.88), rel=1e-9)
    while bess.soc_frac > 0.1 + 1e-12:
        assert bess.step(10.0, 10e6) >= 0.0
    assert bess.energy_out_j == pytest.approx(e_in * 0.88, rel=1e-9)
    assert bess.loss_j == pytest.approx(e_in * 0.12, rel=1e-6)
    assert bess.equivalent_cycles() == pytest.approx(1.0, rel=1e-9)


def test_bess_first_order_response_with_its_time_constant() -> None:
    bess = CampusBess(_bess_site(response_tau_s=0.25))
    dt_s, sp = 0.01, 5e6
    for _ in range(25):
        p = bess.step(dt_s, sp)
    assert p == pytest.approx(sp * (1 - math.exp(-1.0)), rel=1e-12)
    for _ in range(75):  # 3 tau more: 1 - exp(-4)
        p = bess.step(dt_s, sp)
    assert p == pytest.approx(sp * (1 - math.exp(-4.0)), rel=1e-12)


def test_bess_power_and_soc_windows() -> None:
    bess = CampusBess(_bess_site(response_tau_s=0.0, soc_init_frac=0.5))
    assert bess.step(1.0, 50e6) == 10e6  # clipped to the rating
    assert bess.step(1.0, -50e6) == -10e6
    for _ in range(2000):  # 10 MW for 2000 s > the 4 MWh above soc_min
        p = bess.step(2.0, 10e6)
        assert 0.1 - 1e-12 <= bess.soc_frac <= 0.9 + 1e-12
    assert p == 0.0 and bess.soc_frac == pytest.approx(0.1, abs=1e-12)
    for _ in range(3000):
        p = bess.step(2.0, -10e6)
        assert 0.1 - 1e-12 <= bess.soc_frac <= 0.9 + 1e-12
    assert p == 0.0 and bess.soc_frac == pytest.approx(0.9, abs=1e-12)


def test_bess_offline_delivers_nothing_and_restarts_from_zero() -> None:
    bess = CampusBess(_bess_site(response_tau_s=0.25))
    for _ in range(200):
        bess.step(0.01, 8e6)
    soc = bess.soc_frac
    bess.online = False
    assert bess.step(0.01, 8e6) == 0.0 and bess.power_w == 0.0
    assert bess.soc_frac == soc
    bess.online = True
    assert bess.step(0.01, 8e6) == pytest.approx(8e6 * (1 - math.exp(-0.01 / 0.25)), rel=1e-12)


def test_zero_size_bess_always_delivers_zero() -> None:
    bess = CampusBess(_site())  # default storage: no campus battery
    for sp in (5e6, -5e6, 0.0, math.nan):
        assert bess.step(0.1, sp) == 0.0
    assert bess.soc_frac == 0.5 and bess.equivalent_cycles() == 0.0 and bess.loss_j == 0.0


# -- default sizes from the rack preset (issue #11) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "full_kw", "shelf_kw"),
    [("gb300", 72 * 1.840, 144.0), ("gb200", 72 * 1.667, 132.0), ("h100", 72 * 1.018, 84.0)],
)
def test_default_bbu_carries_its_rack_at_full_draw_for_its_hold_up(gpu: str, full_kw: float, shelf_kw: float) -> None:
    """ORv3 HPR: whole 12 kW modules that carry the rack at full draw (every GPU at rated and the host), storing
    90 s of it after discharge losses, so a full shelf rides through exactly its rated hold-up."""
    site = build_site(
        SiteSpec.model_validate({"gpu": gpu, "pcc": {"limit_mw": 50}, "levels": [{"level": "rack", "count": 1}]})
    )
    rs = site.rack_storage
    assert rs.bbu_power_w[0] == pytest.approx(shelf_kw * 1e3)
    assert rs.bbu_power_w[0] >= full_kw * 1e3 and rs.bbu_power_w[0] % 12e3 == pytest.approx(0.0, abs=1e-6)
    ride_s = rs.bbu_energy_j[0] * math.sqrt(rs.bbu_round_trip_eff) / (full_kw * 1e3)
    assert ride_s == pytest.approx(90.0)
    assert rs.bbu_recharge_w[0] == pytest.approx(shelf_kw * 1e3 * 3 / 33)
    assert rs.tray_power_w[0] == pytest.approx(0.3 * 72 * site.gpu.rated_w)


def test_configured_bbu_ratings_win_over_the_sizing() -> None:
    rs = _site(racks=1, storage=SHELF_33KW).rack_storage
    assert (rs.bbu_power_w[0], rs.bbu_energy_j[0], rs.bbu_recharge_w[0]) == pytest.approx((33e3, 0.825 * 3.6e6, 3e3))


def test_the_shelf_never_recharges_faster_than_its_rating() -> None:
    """A controller asking for the shelf's full power as recharge gets its rated 3 kW (the charger's limit)."""
    bbus = RackBbus(_site(racks=1, storage=SHELF_33KW))
    on = np.ones(1, dtype=bool)
    for _ in range(100):  # shave to soc_min
        bbus.step(1.0, np.array([50e3]), np.array([20e3]), np.array([0.0]), on)
    bbus.step(1.0, np.array([10e3]), np.array([np.inf]), np.array([33e3]), on)
    assert bbus.recharge_w[0] == pytest.approx(3e3)
