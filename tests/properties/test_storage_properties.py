"""Invariants of the storage and GPU models on random small sites and random load / setpoint sequences.

Energy balance (every tick, every store), with s = sqrt(round-trip efficiency):
    stored_now - stored_0 == energy_in * s - energy_out / s       (trays: s = 1, lossless)
    loss == energy_in - energy_out - (stored_now - stored_0) >= 0
and the state of charge never leaves its window.

Grid-side draw (rack loads >= 0):
- tray: 0 <= upstream <= rack + tray power. A tray never supplies more than its own rack draws (no back-feed).
- BBU, energized rack: min(rack, max(threshold, 0)) <= upstream (shaving never goes below the threshold, nor
  below 0); upstream <= threshold where rack < threshold (recharge never pushes the rack above its threshold);
  upstream <= rack where rack >= threshold (no recharge while shaving); upstream <= rack + recharge_w.
- BBU, de-energized rack: upstream == 0 and its stored energy does not move.
GPUs: caps within [min_cap, rated], floors within [0, floor_max_frac * rated] and <= cap, draw <= cap, 0 off.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dimmer.gpus import GPU_PRESETS
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import SiteSpec
from gridsim.plant.gpu import GpuActuationSpec, GpuBank
from gridsim.plant.storage import CampusBess, CapacitorTrays, RackBbus
from tests.budget import examples

MAX_STEPS = 40
RACK_W = 200e3


@st.composite
def sites(draw: st.DrawFn) -> SiteModel:
    gpus_per_rack = draw(st.integers(1, 72))
    soc_lo = draw(st.floats(0.0, 0.8))
    soc_hi = draw(st.floats(soc_lo + 0.05, 1.0))
    bess_lo = draw(st.floats(0.0, 0.5))
    bess_hi = draw(st.floats(bess_lo + 0.05, 1.0))
    storage: dict[str, Any] = {
        "tray": {"j_per_gpu": draw(st.floats(0.0, 200.0)), "kw_per_rack": draw(st.floats(0.0, 60.0))},
        "bbu": {
            "kw_per_rack": draw(st.floats(0.0, 40.0)),
            "kwh_per_rack": draw(st.sampled_from([0.0, 0.01, 0.1, 0.825, 2.0])),
            "round_trip_eff": draw(st.floats(0.5, 1.0)),
            "soc_min_frac": soc_lo,
            "soc_max_frac": soc_hi,
            "recharge_kw_per_rack": draw(st.floats(0.0, 10.0)),
        },
        "bess": {
            "power_mw": draw(st.sampled_from([0.0, 0.5, 5.0, 20.0])),
            "energy_mwh": draw(st.sampled_from([0.0, 0.001, 0.5, 20.0])),
            "round_trip_eff": draw(st.floats(0.5, 1.0)),
            "soc_min_frac": bess_lo,
            "soc_max_frac": bess_hi,
            "soc_init_frac": draw(st.floats(bess_lo, bess_hi)),
            "response_tau_s": draw(st.sampled_from([0.0, 0.05, 0.25, 2.0])),
        },
    }
    spec = SiteSpec.model_validate(
        {
            "gpu": draw(st.sampled_from(sorted(GPU_PRESETS))),
            "gpus_per_rack": gpus_per_rack,
            "active_gpus_per_rack": draw(st.integers(1, gpus_per_rack)),
            "pcc": {"limit_mw": 100},
            "levels": [
                {"level": "row", "count": draw(st.integers(1, 2)), "rating_mw": 10},
                {"level": "rack", "count": draw(st.integers(1, 3))},
            ],
            "storage": storage,
        }
    )
    return build_site(spec)


@st.composite
def site_and_loads(draw: st.DrawFn) -> tuple[SiteModel, np.ndarray, float]:
    site = draw(sites())
    n_steps = draw(st.integers(1, MAX_STEPS))
    loads = draw(
        hnp.arrays(np.float64, (n_steps, site.n_racks), elements=st.floats(0.0, RACK_W, allow_subnormal=False))
    )
    dt_s = draw(st.sampled_from([0.01, 0.1, 1.0, 5.0]))
    return site, loads, dt_s


def _tol(*scales: float) -> float:
    return 1e-11 * max(1.0, *(abs(x) for x in scales))


@settings(max_examples=examples(50), deadline=None)
@given(site_and_loads())
def test_tray_energy_balance_window_and_no_back_feed(case: tuple[SiteModel, np.ndarray, float]) -> None:
    site, loads, dt_s = case
    trays = CapacitorTrays(site)
    e0 = float(trays.energy_j.sum())
    for rack in loads:
        up = trays.step(dt_s, rack)
        stored = float(trays.energy_j.sum()) - e0
        assert math.isclose(
            stored,
            trays.energy_in_j - trays.energy_out_j,
            abs_tol=_tol(e0, trays.energy_in_j, trays.energy_out_j),
        )
        assert np.all(trays.energy_j >= 0.0) and np.all(trays.energy_j <= trays.energy_max_j)
        assert np.all(up >= 0.0)
        assert np.all(up <= rack + trays.power_max_w * (1 + 1e-12) + 1e-9)
        assert np.all(np.abs(rack - up) <= trays.power_max_w * (1 + 1e-12) + 1e-9)


@settings(max_examples=examples(50), deadline=None)
@given(site_and_loads(), st.data())
def test_bbu_energy_balance_window_and_grid_side_draw(
    case: tuple[SiteModel, np.ndarray, float], data: st.DataObject
) -> None:
    site, loads, dt_s = case
    n = site.n_racks
    bbus = RackBbus(site)
    eta = site.rack_storage.bbu_round_trip_eff
    s = math.sqrt(eta)
    cap = site.rack_storage.bbu_energy_j
    lo, hi = site.rack_storage.bbu_soc_min_frac, site.rack_storage.bbu_soc_max_frac
    stored_0 = float(bbus.stored_j.sum())
    thresholds = st.one_of(st.just(math.inf), st.floats(-10e3, RACK_W))
    for rack in loads:
        thr = np.array(data.draw(st.lists(thresholds, min_size=n, max_size=n)))
        recharge = np.array(data.draw(st.lists(st.floats(0.0, 20e3), min_size=n, max_size=n)))
        on = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        before = bbus.stored_j.copy()
        up = bbus.step(dt_s, rack, thr, recharge, on)
        # energy
        delta = float(bbus.stored_j.sum()) - stored_0
        tol = _tol(stored_0, bbus.energy_in_j, bbus.energy_out_j)
        assert math.isclose(delta, bbus.energy_in_j * s - bbus.energy_out_j / s, abs_tol=tol)
        assert bbus.loss_j >= -tol
        assert np.all(bbus.stored_j >= lo * cap) and np.all(bbus.stored_j <= hi * cap)
        assert np.all(bbus.soc_frac >= lo) and np.all(bbus.soc_frac <= hi)
        # grid side
        eps = 1e-9 * RACK_W
        off = ~on
        assert np.all(up[off] == 0.0) and np.all(bbus.stored_j[off] == before[off])
        r, t, u, c = rack[on], thr[on], up[on], recharge[on]
        assert np.all(u >= np.minimum(r, np.maximum(t, 0.0)) - eps)
        assert np.all(u[r < t] <= t[r < t] + eps)
        assert np.all(u[r >= t] <= r[r >= t] + eps)
        assert np.all(u <= r + c + eps)


@settings(max_examples=examples(50), deadline=None)
@given(
    sites(),
    st.lists(
        st.tuples(st.floats(-30e6, 30e6), st.booleans(), st.sampled_from([0.01, 0.1, 1.0, 60.0, 600.0])),
        min_size=1,
        max_size=MAX_STEPS,
    ),
)
def test_bess_energy_balance_power_and_soc_window(site: SiteModel, steps: list[tuple[float, bool, float]]) -> None:
    bess = CampusBess(site)
    b = site.bess
    s = math.sqrt(b.round_trip_eff)
    stored_0 = bess.stored_j
    for setpoint_w, online, dt_s in steps:
        bess.online = online
        soc_before = bess.soc_frac
        p = bess.step(dt_s, setpoint_w)
        assert p == bess.power_w
        assert abs(p) <= b.power_w
        if not online:
            assert p == 0.0 and bess.soc_frac == soc_before
        tol = _tol(b.energy_j, bess.energy_in_j, bess.energy_out_j)
        assert math.isclose(bess.stored_j - stored_0, bess.energy_in_j * s - bess.energy_out_j / s, abs_tol=tol)
        assert bess.loss_j >= -tol
        if b.energy_j > 0:
            assert b.soc_min_frac <= bess.soc_frac <= b.soc_max_frac
        else:
            assert p == 0.0
        assert bess.equivalent_cycles() >= 0.0


@settings(max_examples=examples(50), deadline=None)
@given(sites(), st.sampled_from(["inband", "oob"]), st.data())
def test_gpu_caps_floors_and_draw_stay_in_range(site: SiteModel, path: str, data: st.DataObject) -> None:
    n = site.n_racks
    g = site.gpu
    bank = GpuBank(site, GpuActuationSpec(path=path, tau_s=0.3, oob_delay_s=1.0))
    watts = st.one_of(st.just(math.nan), st.floats(-500.0, 3000.0))
    ramps = st.one_of(st.just(math.inf), st.floats(0.0, 1e4))
    dt_s = 0.1
    for k in range(data.draw(st.integers(1, MAX_STEPS))):
        t = k * dt_s
        if data.draw(st.booleans()):
            bank.command(
                t,
                np.array(data.draw(st.lists(watts, min_size=n, max_size=n))),
                np.array(data.draw(st.lists(watts, min_size=n, max_size=n))),
                data.draw(ramps),
                data.draw(ramps),
            )
        demand = np.array(data.draw(st.lists(st.floats(0.0, 2000.0), min_size=n, max_size=n)))
        on = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        draw = bank.step(t, dt_s, demand, on)
        assert np.all(bank.cap_w >= g.min_cap_w) and np.all(bank.cap_w <= g.rated_w)
        assert np.all(bank.floor_w >= 0.0) and np.all(bank.floor_w <= g.floor_max_frac * g.rated_w)
        assert np.all(bank.floor_w <= bank.cap_w + 1e-9)
        assert np.all(draw <= bank.cap_w) and np.all(draw >= 0.0)
        assert np.all(draw[~on] == 0.0)
