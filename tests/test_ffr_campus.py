"""Fast frequency response in the hierarchy (`dimmer-campus`): the coordinator answers on the campus's rating, the
battery first, the buildings' room next; the buildings' own controllers do not answer (docs/controller.md, "Fast
frequency response" and "The hierarchy")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.control import make_controller
from dimmer.control.campus import CampusHierarchy
from dimmer.control.ffr import droop_response_w
from dimmer.daemon.config import validate_config
from dimmer.daemon.coordinator_daemon import CoordinatorDaemon
from dimmer.errors import InputError
from dimmer.sim_hierarchy import building_config, coordinator_config
from gridsim.engine import SimResult, run
from gridsim.metrics import summarize
from gridsim.scenario import load_scenario

from .test_campus_hierarchy import _campus, _obs, _two_buildings
from .test_dimmer_controller import _site
from .test_hierarchy_daemons import _flat

ON = "controllers.dimmer-campus.building.ffr_droop_pct=2"
RATING_W = 6e6  # fault-frequency-step's interconnect limit: the droop's base
NOMINAL_HZ, DEADBAND_HZ, MAX_FRAC = 50.0, 0.036, 0.1  # its 50 Hz area; the keys' defaults


def _freq_step(tmp_path: Path, load_mw: float, sets: list[str]) -> tuple[dict[str, Any], SimResult]:
    """fault-frequency-step on two buildings (test_campus_hierarchy._two_buildings: a 6 MW campus, a 2 MW battery),
    `load_mw` of generation lost at 180 s in its 10 GW, 50 Hz area, run to 240 s under dimmer-campus."""
    event = f'events=[{{kind = "frequency_step", at_s = 180, load_mw = {load_mw}}}]'
    loaded = load_scenario(_two_buildings("frequency-step", tmp_path), ["duration_s=240", event, *sets])
    res = run(loaded, "dimmer-campus")
    return summarize(res), res


def _at(res: SimResult, t_s: float) -> int:
    return round(t_s / res.tick_s)


def _limits(s: dict[str, Any]) -> tuple[int, float, float]:
    return s["breaker_trips"], s["pcc_overlimit_s"], s["ramp_violation_s"]


@pytest.mark.parametrize("load_mw", [300.0, 1000.0], ids=["in-proportion", "at-its-bound"])
def test_campus_ffr_answers_a_frequency_step_from_the_battery_within_two_seconds(tmp_path: Path, load_mw: float
                                                                                  ) -> None:  # fmt: skip
    """300 MW lost: the order is the droop's closed form of the frequency the coordinator reads (0.44 MW at the
    nadir, 0.21 MW settled); 1,000 MW lost: it is bounded at ffr_max_frac of the 6 MW rating (0.6 MW)."""
    base_s, base = _freq_step(tmp_path, load_mw, [])
    on_s, on = _freq_step(tmp_path, load_mw, [ON])
    lower = base.tick["grid_w"] - on.tick["grid_w"]
    closed = droop_response_w(on.tick["freq_hz"], NOMINAL_HZ, DEADBAND_HZ, 2.0, RATING_W, MAX_FRAC)
    assert np.all(np.abs(lower[: _at(on, 180.0)]) < 1.0)  # nothing before the event
    # the coordinator's period at 181 s reads the fall; 0.5 s later the battery has the order it read (within 5 %:
    # the battery's lag and the tick the reading was taken on)
    assert lower[_at(on, 181.5)] == pytest.approx(closed[_at(on, 181.0)], rel=0.05)
    # settled (the order taken on at the nadir is given back at the ramp step, 11.7 kW a period): the closed form's
    settled = slice(_at(on, 220.0), None)
    assert float(np.mean(lower[settled])) == pytest.approx(float(np.mean(closed[settled])), rel=0.01)
    # all of it from the battery: the caps are where they were, the goodput as without the response
    from_battery = on.tick["bess_w"] - base.tick["bess_w"]
    assert np.allclose(from_battery[_at(on, 182.0) :], lower[_at(on, 182.0) :], atol=1e3)
    assert on_s["goodput_loss_power_pct"] == base_s["goodput_loss_power_pct"]
    # every limit holds, the ramp as without the response
    assert _limits(base_s) == _limits(on_s) == (0, 0.0, 0.0)


def test_campus_ffr_without_a_battery_lowers_the_buildings_budgets(tmp_path: Path) -> None:
    """No battery: the 0.6 MW order is a cut of the buildings' room, a budget a link's latency away, held from where
    it began; cut from the jobs' peaks, it lowers the swinging jobs' mean import by less (0.22 MW measured)."""
    sets = ["site.storage.bess.power_mw=0", "site.storage.bess.energy_mwh=0"]
    base_s, base = _freq_step(tmp_path, 1000.0, sets)
    on_s, on = _freq_step(tmp_path, 1000.0, [*sets, ON])
    lower = base.tick["grid_w"] - on.tick["grid_w"]
    assert np.all(np.abs(lower[: _at(on, 180.0)]) < 1.0)
    assert 0.1e6 < float(np.mean(lower[_at(on, 182.0) :])) <= 0.6e6
    assert _limits(on_s) == (0, 0.0, 0.0)
    assert on_s["goodput_loss_power_pct"] > base_s["goodput_loss_power_pct"]


def test_campus_ffr_off_is_bit_identical_to_without_the_keys(tmp_path: Path) -> None:
    """ffr_droop_pct = 0 (with the other keys moved) runs exactly as a run without them, which is main's code path
    (the same digest as before the coordinator answered, checked when this was written)."""
    _, absent = _freq_step(tmp_path, 1000.0, [])
    keys = ["ffr_droop_pct=0", "ffr_deadband_hz=0", "ffr_max_frac=1"]
    _, off = _freq_step(tmp_path, 1000.0, [f"controllers.dimmer-campus.building.{k}" for k in keys])
    for name in absent.tick:
        assert np.array_equal(absent.tick[name], off.tick[name], equal_nan=True), name
    for name in absent.period:
        assert np.array_equal(absent.period[name], off.period[name], equal_nan=True), name


def _hierarchy(params: dict[str, Any]) -> CampusHierarchy:
    ctrl = make_controller("dimmer-campus", _campus(), params)
    assert isinstance(ctrl, CampusHierarchy)
    return ctrl


def test_campus_ffr_is_the_coordinators_and_no_buildings() -> None:
    ctrl = _hierarchy({"building": {"ffr_droop_pct": 2.0, "ffr_max_frac": 0.1}})
    assert ctrl.coordinator.ffr is not None
    assert ctrl.coordinator.ffr.p_ref_w == ctrl.site.pcc_limit_w  # on the campus's rating
    assert all(c.ffr is None and c.p.ffr_droop_pct == 0.0 for c in ctrl.children)
    assert _hierarchy({}).coordinator.ffr is None
    # a site of one building: its flat controller is the campus's, and answers itself
    single = make_controller("dimmer-campus", _site(bess_mw=1.0), {"building": {"ffr_droop_pct": 2.0}})
    assert isinstance(single, CampusHierarchy) and single.single is not None and single.single.ffr is not None


def test_campus_ffr_orders_the_battery_in_the_coordinators_period_that_reads_the_fall() -> None:
    """On hand-built readings: 0.264 Hz beyond the deadband asks 0.66 MW of the 3 MW campus, bounded to 0.3 MW; the
    battery's setpoint moves by it in the period that reads 59.7 Hz, and no building's caps move for it."""
    params: dict[str, Any] = {"link_latency_s": 0.0, "building": {"ffr_max_frac": 0.1}}
    on = _hierarchy(params | {"building": {"ffr_droop_pct": 2.0, "ffr_max_frac": 0.1}})
    base = _hierarchy(params)
    site = on.site
    for t in range(1, 25):
        f = 60.0 if t < 20 else 59.7
        a = on.step(_obs(site, float(t), 700.0, grid_freq_hz=f))
        b = base.step(_obs(site, float(t), 700.0, grid_freq_hz=f))
        if t < 20:
            assert a.bess_setpoint_w == b.bess_setpoint_w
        else:
            assert a.bess_setpoint_w - b.bess_setpoint_w == pytest.approx(0.3e6)
            assert any("fast frequency response" in r.reason for r in a.reasons)
        assert np.array_equal(a.rack_cap_w, b.rack_cap_w)


@pytest.mark.parametrize(("key", "value"), [("ffr_droop_pct", -1.0), ("ffr_deadband_hz", -0.01), ("ffr_max_frac", 1.5)])
def test_campus_ffr_bad_keys_are_one_line_naming_them(key: str, value: Any) -> None:
    with pytest.raises(InputError) as exc:
        make_controller("dimmer-campus", _campus(), {"building": {key: value}})
    msg = str(exc.value)
    assert f"params.building.{key}" in msg and "\n" not in msg


# -- as daemons: the coordinator answers, its building daemons do not -------------------------------------------------


def test_campus_ffr_as_daemons_is_the_coordinators_and_no_building_daemons(tmp_path: Path) -> None:
    """The coordinator daemon builds the response from the building parameters, on the campus's rating, and reads
    the frequency from the site device as the flat daemon does (ObservationBuilder); a building daemon given the same
    parameters runs with its response off."""
    _, flat = _flat(tmp_path)
    on = {"ffr_droop_pct": 2.0, "ffr_deadband_hz": 0.017}
    campus = flat | {"controller": {"name": "dimmer-campus", "params": {"building": on}}}
    cfg = validate_config(coordinator_config(campus, {"b0": 5030, "b1": 5031}), "campus.json", tmp_path)
    coord = CoordinatorDaemon(cfg, metrics_address=None)
    try:
        ffr = coord.coordinator.ffr
        assert ffr is not None and ffr.droop_pct == 2.0 and ffr.deadband_hz == 0.017
        assert ffr.p_ref_w == cfg.site.pcc_limit_w
    finally:
        coord.audit.close()
    b1 = validate_config(building_config(flat, "b1", 8, 16, dict(on), 0.45, tmp_path / "b1"), "b1.json", tmp_path)
    assert b1.controller_params["ffr_droop_pct"] == 0.0
    assert b1.controller_params["ffr_deadband_hz"] == 0.017  # (the rest as given: only the droop is switched off)
