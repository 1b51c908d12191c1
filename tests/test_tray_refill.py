"""The capacitor trays' refill: what a rack's supply carries above its load while its tray recharges, which the plant
draws and the controller counts where it holds the import at the interconnect limit itself.

A tray that gave energy in a swing's rise takes it back in the plateau after it, so at a peak the supply carries
more than the rack's load: at most half the tray's energy over its refill time (`TraySpec.refill_s`). The controller
bounds the racks' load (their peak readings, their caps); without that refill in the bound, the import held at the
limit went over it at every peak.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.site import SiteModel
from gridsim.engine import run
from gridsim.plant.storage import CapacitorTrays
from gridsim.scenario import load_scenario
from tests.test_daemon_faults import SCENARIO


def _write(tmp_path: Path, at_s: float) -> Path:
    """The daemon fault tests' site (8 GB300 racks, one 448-GPU job swinging 35 % every 2 s under a 0.85 MW limit
    that binds, a 0.5 MW battery), 70 s long, its battery tripping at `at_s`."""
    text = SCENARIO.format(duration=70).replace(
        "duration_s = 70\n",
        f'duration_s = 70\nevents = [{{ kind = "storage", at_s = {at_s}, mode = "bess_offline" }}]\n',
        1,
    )
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


def _site(tmp_path: Path, at_s: float, overrides: list[str] | None = None) -> SiteModel:
    return load_scenario(_write(tmp_path, at_s), overrides or []).site()


with tempfile.TemporaryDirectory() as _d:
    GB300_SITE = _site(Path(_d), 30.0)


def test_a_trays_refill_is_half_its_energy_over_its_refill_time_within_its_power(tmp_path: Path) -> None:
    rs = _site(tmp_path, 30.0).rack_storage
    # GB300 NVL72: 65 J x 72 GPUs = 4,680 J, refilled over 2 s: 1,170 W (its 30.2 kW power does not bind)
    np.testing.assert_allclose(rs.tray_refill_w(), 4680.0 / 2.0 / 2.0)
    slow = _site(tmp_path, 30.0, ["site.storage.tray.refill_s=0.01", "site.storage.tray.kw_per_rack=100"]).rack_storage
    np.testing.assert_allclose(slow.tray_refill_w(), 100e3)  # (a fast refill is held to the tray's power)


@settings(max_examples=40, deadline=None)
@given(
    swing_w=st.floats(1e3, 60e3),
    period_ticks=st.integers(2, 40),
    duty=st.floats(0.1, 0.9),
    refill_s=st.floats(0.2, 10.0),
)
def test_the_supply_never_carries_more_than_the_highest_load_plus_the_refill(
    swing_w: float, period_ticks: int, duty: float, refill_s: float
) -> None:
    """Whatever the swing, a rack's supply stays under the highest load it has drawn plus its tray's refill: the
    bound the controller counts at the interconnect."""
    site = replace(GB300_SITE, rack_storage=replace(GB300_SITE.rack_storage, tray_refill_s=refill_s))
    trays = CapacitorTrays(site)  # (recentering on the site's refill time)
    t = np.arange(400)
    high = (t % period_ticks) < duty * period_ticks
    load = np.where(high, 100e3, 100e3 - swing_w)[:, None] * np.ones(site.n_racks)
    upstream = trays.step_ticks(0.1, load)
    highest = np.maximum.accumulate(load, axis=0)
    assert np.all(upstream <= highest + site.rack_storage.tray_refill_w() * (1 + 1e-9) + 1e-6)


def test_a_battery_lost_under_a_job_capped_at_its_peaks_takes_the_import_over_only_in_the_trip(tmp_path: Path) -> None:
    """The battery gives ~58 kW when it trips; the controller sees it a period later and cuts. The import goes over
    the limit only in the swing's first peak after the trip, by less than the battery gave, and never after: the
    trays' refill is counted in the bound held at the limit (without it: 3 kW over the limit at every peak, for
    good, 0.7 s of each 2 s iteration)."""
    for at_s in (30.0, 30.6, 31.2):
        res = run(load_scenario(_write(tmp_path, at_s)), "dimmer")
        t, grid_w, limit_w = res.t_s, res.tick["grid_w"], res.tick["pcc_limit_w"]
        lost_w = float(res.tick["bess_w"][t < at_s][-1])
        assert lost_w > 10e3  # (the battery was giving when it tripped)
        assert np.all(res.tick["bess_w"][t > at_s + 0.2] == 0.0)  # (and gave nothing after)
        over = (t >= 20.0) & (grid_w > limit_w * (1 + 1e-9))
        assert np.all(t[over] >= at_s) and np.all(t[over] < at_s + 2.0), t[over]
        assert np.all(grid_w[over] - limit_w[over] < lost_w)
        assert np.max(grid_w[t >= at_s + 2.0]) < 0.85e6  # (and with a margin: the refill sits inside it)
