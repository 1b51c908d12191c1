"""Fault injection in the simulator: each fault does what its event says, and only while it lasts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.errors import InputError
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel
from gridsim.engine import SimResult, Simulation
from gridsim.scenario import LoadedScenario, check_references, validate_scenario

BASE: dict[str, Any] = {
    "name": "faults",
    "duration_s": 40,
    "site": {
        "gpu": "gb300",
        "pcc": {"limit_mw": 3.0},
        "levels": [{"level": "row", "count": 2, "rating_kw": 1500}, {"level": "rack", "count": 10}],
        "storage": {"bess": {"power_mw": 1.0, "energy_mwh": 0.5}},
    },
    "jobs": [{"name": "a", "racks": [0, 20], "swing_frac": 0.0, "jitter_frac": 0.0}],
}


class Probe:
    """Records observations; from `at_s` on commands a cap, a BBU threshold and a battery setpoint."""

    name = "probe"

    def __init__(self, site: SiteModel, cap_w: float = 600.0, at_s: float = 5.0) -> None:
        self.site, self.cap_w, self.at_s = site, cap_w, at_s
        self.seen: list[Observation] = []

    def step(self, obs: Observation) -> Actions:
        self.seen.append(obs)
        act = Actions.hands_off(self.site)
        if obs.t_s >= self.at_s:
            n = self.site.n_racks
            act = Actions(
                **{
                    **act.__dict__,
                    "rack_cap_w": np.full(n, self.cap_w),
                    "bess_setpoint_w": 5e5,
                    "rack_bbu_threshold_w": np.full(n, 50e3),
                }
            )
        return act


def _run(tmp_path: Path, *events: dict[str, Any], **probe: Any) -> tuple[SimResult, Probe]:
    loaded = LoadedScenario(validate_scenario({**BASE, "events": list(events)}, "test"), "test", tmp_path)
    check_references(loaded)
    site = loaded.site()
    ctrl = Probe(site, **probe)
    return Simulation(loaded, site, ctrl, 0).run(), ctrl


def _at(res: SimResult, t: float) -> int:
    return int(np.searchsorted(res.t_s, t))


@pytest.mark.parametrize("mode", ["stale", "stuck", "nan", "spike", "drift"])
def test_pcc_meter_faults(tmp_path: Path, mode: str) -> None:
    ev = {"kind": "telemetry", "at_s": 10, "duration_s": 15, "target": "pcc", "mode": mode, "factor": 3.0}
    _, probe = _run(tmp_path, ev)
    seen = {o.t_s: o for o in probe.seen}
    true_before, during, after = seen[9.0], seen[20.0], seen[30.0]
    if mode == "stale":
        assert during.pcc_power_w == seen[10.0].pcc_power_w and during.pcc_age_s >= 10.0
    elif mode == "stuck":
        assert during.pcc_power_w == seen[10.0].pcc_power_w and during.pcc_age_s == true_before.pcc_age_s
    elif mode == "nan":
        assert math.isnan(during.pcc_power_w)
    elif mode == "spike":
        assert during.pcc_power_w > 2.5 * seen[30.0].pcc_power_w
    else:  # 3 per hour for 10 s: +0.8 %
        assert during.pcc_power_w != pytest.approx(seen[31.0].pcc_power_w, rel=1e-4)
    assert math.isfinite(after.pcc_power_w) and after.pcc_age_s == true_before.pcc_age_s  # over when it ends


def test_rack_readings_vanish_under_a_row(tmp_path: Path) -> None:
    _, probe = _run(tmp_path, {"kind": "telemetry", "at_s": 10, "target": "racks", "domain": "r1", "mode": "nan"})
    last = probe.seen[-1]
    assert np.all(np.isnan(last.rack_power_w[10:])) and np.all(np.isfinite(last.rack_power_w[:10]))


def test_meter_of_one_domain_goes_stale(tmp_path: Path) -> None:
    ev = {"kind": "telemetry", "at_s": 10, "target": "meter", "domain": "r0", "mode": "stale"}
    _, probe = _run(tmp_path, ev)
    d = probe.site.domain_index("r0")
    assert probe.seen[-1].domain_age_s[d] > 20 and probe.seen[-1].domain_age_s[d + 1] < 1


@pytest.mark.parametrize("mode", ["lost", "ignored", "agent_down"])
def test_cap_writes_that_do_not_arrive(tmp_path: Path, mode: str) -> None:
    res, probe = _run(tmp_path, {"kind": "actuation", "at_s": 0, "domain": "r1", "mode": mode})
    caps = res.period["rack_cap_w"][-1]
    racks = res.recorded_racks
    in_r1 = racks >= 10
    assert np.all(caps[~in_r1] == pytest.approx(600.0))  # row 0 obeys
    assert np.all(caps[in_r1] == probe.site.gpu.rated_w)  # row 1 never got (or took) the cap
    if mode == "agent_down":
        assert np.all(np.isnan(probe.seen[-1].rack_power_w[10:]))
        # a dark rack's age is its last reading's, and it grows for as long as the agent is down
        ages = np.array([o.rack_age_s[10] for o in probe.seen])
        assert np.all(np.diff(ages) > 0) and ages[-1] > 30.0
        assert probe.seen[-1].rack_age_s[0] < 2.0


def test_a_delayed_meter_reads_the_site_as_it_starts_never_an_empty_campus(tmp_path: Path) -> None:
    loaded = LoadedScenario(validate_scenario({**BASE, "telemetry": {"delay_s": 2.0}}, "test"), "test", tmp_path)
    site = loaded.site()
    probe = Probe(site, at_s=1e9)
    Simulation(loaded, site, probe, 0).run()
    first, settled = probe.seen[0], probe.seen[10]
    assert first.pcc_power_w == pytest.approx(settled.pcc_power_w, rel=0.05)  # the flat load as it starts, not 0 W
    assert np.all(first.rack_power_w > 0.9 * settled.rack_power_w)


def test_delayed_commands(tmp_path: Path) -> None:
    res, _ = _run(tmp_path, {"kind": "actuation", "at_s": 0, "mode": "delayed", "delay_s": 8.0})
    load = res.tick["load_w"]
    assert load[_at(res, 12.0)] == pytest.approx(load[_at(res, 4.0)])  # commanded at 5 s, not there yet
    assert load[_at(res, 16.0)] < 0.8 * load[_at(res, 4.0)]


def test_bess_trips_offline_and_comes_back(tmp_path: Path) -> None:
    res, probe = _run(tmp_path, {"kind": "storage", "at_s": 15, "duration_s": 10, "mode": "bess_offline"})
    bess = res.tick["bess_w"]
    assert bess[_at(res, 12.0)] > 4e5 and bess[_at(res, 20.0)] == 0.0 and bess[_at(res, 35.0)] > 4e5
    assert not {o.t_s: o for o in probe.seen}[20.0].bess_online


def test_failed_bbus_give_nothing_and_empty_ones_start_at_reserve(tmp_path: Path) -> None:
    res_ok, _ = _run(tmp_path)
    res_failed, _ = _run(tmp_path, {"kind": "storage", "at_s": 0, "mode": "bbu_failed"})
    res_empty, _ = _run(tmp_path, {"kind": "storage", "at_s": 1, "mode": "bbu_empty"})
    assert res_ok.storage["bbu_energy_out_j"] > 0  # the 50 kW threshold makes healthy BBUs discharge
    assert res_failed.storage["bbu_energy_out_j"] == 0.0
    assert res_empty.period["bbu_soc_min_frac"][2] == pytest.approx(0.5, abs=0.01)  # the reserve, then recharging
    assert res_empty.storage["bbu_fault_drained_j"] > 0


def test_trays_disabled(tmp_path: Path) -> None:
    res, _ = _run(tmp_path, {"kind": "storage", "at_s": 0, "mode": "trays_disabled"})
    assert res.storage["tray_energy_in_j"] == 0.0 and res.storage["tray_energy_out_j"] == 0.0


def test_backup_transfer_takes_the_site_off_the_grid_and_back(tmp_path: Path) -> None:
    res, _ = _run(tmp_path, {"kind": "backup_transfer", "at_s": 10, "duration_s": 10})
    grid = res.tick["grid_w"]
    assert grid[_at(res, 15.0)] == 0.0 and res.tick["campus_w"][_at(res, 15.0)] > 0.5e6  # racks on backup
    assert grid[_at(res, 25.0)] == pytest.approx(
        res.tick["campus_w"][_at(res, 25.0)] - res.tick["bess_w"][_at(res, 25.0)]
    )


def test_a_fault_on_a_domain_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"events\[0\]\.domain"):
        _run(tmp_path, {"kind": "storage", "at_s": 0, "mode": "bbu_failed", "domain": "r9"})
