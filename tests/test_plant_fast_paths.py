"""The plant's shortcuts (issue 13 part 4) give what the full computation gives, to the bit.

Each shortcut skips work whose result is known: a BBU step that moves nothing, a settling lag already at its target,
a breaker tick in which nothing trips, the rack-level domains' loads read as slices. Each is checked here against the
computation it stands in for.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import SiteSpec
from gridsim.engine import _domain_gather
from gridsim.plant.breakers import BreakerBank, BreakerSpec
from gridsim.plant.gpu import GpuActuationSpec, GpuBank
from gridsim.plant.storage import RackBbus


def _site(levels: list[dict[str, Any]]) -> SiteModel:
    return build_site(SiteSpec.model_validate({"pcc": {"limit_mw": 50}, "levels": levels}))


ROWS = [{"level": "row", "count": 3, "rating_mw": 1.5}, {"level": "rack", "count": 4}]
TREE = [
    {"level": "building", "count": 2, "rating_mw": 20},
    {"level": "hall", "count": 2, "rating_mw": 8},
    {"level": "row", "count": 2, "rating_mw": 1.5},
    {"level": "rack", "count": 3},
]


@pytest.mark.parametrize("levels", [ROWS, TREE, [{"level": "rack", "count": 1}]])
def test_the_engines_domain_loads_are_site_domain_load_w_to_the_bit(levels: list[dict[str, Any]]) -> None:
    site = _site(levels)
    rack_w = np.random.default_rng(0).uniform(0.0, 140e3, site.n_racks)
    start, stop, lo, r0 = _domain_gather(site)
    csum = np.zeros(site.n_racks + 1)
    np.cumsum(rack_w, out=csum[1:])
    out = np.empty(site.n_domains)
    out[:lo] = csum[stop] - csum[start]
    out[lo:] = csum[r0 + 1 : r0 + 1 + site.n_domains - lo] - csum[r0 : r0 + site.n_domains - lo]
    np.testing.assert_array_equal(out, site.domain_load_w(rack_w))
    assert lo < site.n_domains  # the rack level is read as slices


def _bbu_run(site: SiteModel, fast: bool, steps: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> Any:
    bbus = RackBbus(site)
    if not fast:
        bbus._all_idle = lambda *a: False  # type: ignore[method-assign]
    ups = [bbus.step(0.1, r, thr, rec, on).copy() for r, thr, rec, on in steps]
    return ups, bbus.stored_j, bbus.energy_in_j, bbus.energy_out_j, bbus.discharge_w, bbus.recharge_w, bbus.idle


def test_a_bbu_step_that_moves_nothing_is_skipped_with_the_same_result() -> None:
    site = _site(ROWS)
    n = site.n_racks
    rng = np.random.default_rng(1)
    inf = np.full(n, np.inf)
    rec = site.rack_storage.bbu_recharge_w.copy()
    on = np.ones(n, dtype=bool)
    off = on.copy()
    off[:4] = False
    shave = np.full(n, 60e3)
    steps = []
    for k in range(60):
        rack = rng.uniform(20e3, 140e3, n)
        rack[0] = -0.0 if k == 3 else rack[0]
        # backup only and full, then shaving (discharge), then backup only again while recharging, then full
        thr = shave if 10 <= k < 20 else inf
        steps.append((rack, thr, rec, off if 30 <= k < 35 else on))
    fast, slow = _bbu_run(site, True, steps), _bbu_run(site, False, steps)
    for a, b in zip(fast[0], slow[0], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(fast[1:6], slow[1:6], strict=True):
        np.testing.assert_array_equal(a, b)
    # a NaN load or recharge limit is never skipped: it reaches the state as before
    nan_rack = np.full(n, np.nan)
    bbus = RackBbus(site)
    bbus.step(0.1, nan_rack, inf, rec, on)
    assert not bbus.idle


def test_the_bbu_shortcut_is_taken_when_full_and_backup_only() -> None:
    site = _site(ROWS)
    n = site.n_racks
    bbus = RackBbus(site)
    up = bbus.step(0.1, np.full(n, 100e3), np.full(n, np.inf), site.rack_storage.bbu_recharge_w, np.ones(n, bool))
    assert bbus.idle
    np.testing.assert_array_equal(up, 100e3)
    bbus.stored_j[0] -= 1.0  # not full: a recharge to do
    bbus.step(0.1, np.full(n, 100e3), np.full(n, np.inf), site.rack_storage.bbu_recharge_w, np.ones(n, bool))
    assert not bbus.idle and bbus.recharge_w[0] > 0


def test_a_command_for_the_values_in_force_leaves_the_lag_idle_and_the_caps_as_they_are() -> None:
    site = _site(ROWS)
    n = site.n_racks
    bank = GpuBank(site, GpuActuationSpec(tau_s=0.3))
    bank.command(0.0, np.full(n, 900.0), np.zeros(n))
    v = bank.version
    for k in range(5):
        bank.step(k * 0.1, 0.1, np.full(n, 1000.0), np.ones(n, bool))
    assert bank.version > v  # settling moves the caps
    caps = bank.cap_w.copy()
    v = bank.version
    bank.command(0.5, caps.copy(), bank.floor_w.copy())  # what is in force: nothing to settle
    bank.step(0.5, 0.1, np.full(n, 1000.0), np.ones(n, bool))
    assert bank.version == v
    np.testing.assert_array_equal(bank.cap_w, caps)


def test_a_breaker_tick_with_no_trip_returns_a_shared_read_only_mask() -> None:
    site = _site(ROWS)
    bank = BreakerBank(site, BreakerSpec())
    load = np.full(site.n_domains, 1e3)
    a = bank.step(0.0, 0.1, load)
    b = bank.step(0.1, 0.1, load)
    assert a is b and not a.any() and not a.flags.writeable
    load[1] = 100 * bank.rating_w[1]  # instantaneous trip
    c = bank.step(0.2, 0.1, load)
    assert c[1] and c is not a and not a.any()
