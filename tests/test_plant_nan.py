"""A non-finite value from a controller never reaches the plant, and no metric is computed over non-finite data.

Issue 12 item 1: a NaN BBU threshold made `RackBbus.stored_j` NaN, the grid import NaN for 590 of 600 ticks, no
breaker tripped, and the summary read 0 trips, 0 s over the limit, peak null.
"""

from __future__ import annotations

import json
import math
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel
from gridsim import cli, engine
from gridsim.engine import Simulation, check_actions
from gridsim.errors import ActionsError, PlantError, ResultError
from gridsim.metrics import summarize
from gridsim.plant.storage import RackBbus
from gridsim.scenario import LoadedScenario, validate_scenario

BASE: dict[str, Any] = {
    "name": "poison",
    "duration_s": 60,
    "site": {
        "gpu": "gb300",
        "pcc": {"limit_mw": 0.8},  # below the demand (0.94 MW peak): a plant that sees the load goes over it
        "levels": [{"level": "row", "count": 2, "rating_kw": 1500}, {"level": "rack", "count": 4}],
    },
    "jobs": [{"name": "a", "racks": [0, 8], "swing_frac": 0.3, "jitter_frac": 0.0}],
}


def _loaded(tmp_path: Path) -> LoadedScenario:
    return LoadedScenario(validate_scenario(BASE, "test"), "test", tmp_path)


class Poisoned:
    """Hands off, then from `at_s` on returns Actions with `changes` applied."""

    name = "poisoned"

    def __init__(self, site: SiteModel, at_s: float = 5.0, **changes: Any) -> None:
        self.site, self.at_s, self.changes = site, at_s, changes
        self.steps = 0

    def step(self, obs: Observation) -> Actions:
        self.steps += 1
        act = Actions.hands_off(self.site)
        if obs.t_s < self.at_s:
            return act
        n = self.site.n_racks
        # a callable builds the field for n racks; anything else is the field
        return replace(act, **{k: v(n) if callable(v) else v for k, v in self.changes.items()})


def _at_rack(value: float, rack: int = 1) -> Any:
    def make(n: int) -> np.ndarray:
        a = np.full(n, 50e3)
        a[rack] = value
        return a

    return make


REFUSED = [
    ("rack_bbu_threshold_w", _at_rack(math.nan)),  # the reproduction
    ("rack_bbu_threshold_w", _at_rack(-math.inf)),
    ("rack_bbu_recharge_w", _at_rack(math.nan)),
    ("rack_bbu_recharge_w", _at_rack(-math.inf)),
    ("rack_cap_w", _at_rack(math.inf)),
    ("rack_cap_w", _at_rack(-math.inf)),
    ("rack_floor_w", _at_rack(math.inf)),
    ("rack_cap_w", lambda n: np.full(n - 1, 900.0)),  # one rack short: numpy would not have said so everywhere
    ("bess_setpoint_w", math.inf),
    ("bess_setpoint_w", -math.inf),
    ("gpu_ramp_up_w_per_s", math.nan),
    ("gpu_ramp_down_w_per_s", -1.0),
    ("job_suspend", lambda n: np.array([math.nan])),
]


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_a_refused_value_fails_the_run_naming_the_field_and_the_time(tmp_path: Path, field: str, value: Any) -> None:
    loaded = _loaded(tmp_path)
    site = loaded.site()
    ctrl = Poisoned(site, at_s=5.0, **{field: value})
    with pytest.raises(ActionsError) as info:
        Simulation(loaded, site, ctrl, 0).run()
    err = info.value
    assert err.field == field and err.controller == "poisoned"
    assert err.t_s == pytest.approx(5.0) and err.tick == 50  # the first period it was returned, not later
    msg = str(err)
    assert f"Actions.{field}" in msg and "t = 5 s" in msg and "\n" not in msg
    assert isinstance(err, ValueError) and isinstance(err, PlantError)
    if callable(value) and field.startswith("rack_") and "shape" not in err.expected:
        assert "rack 1 is" in msg and "1 of 8 racks" in msg


def test_the_contracted_non_finite_values_pass_and_mean_what_they_say(tmp_path: Path) -> None:
    """NaN cap/floor: no change; inf threshold: backup only; inf recharge: the shelf's rating; NaN setpoint: idle."""
    loaded = _loaded(tmp_path)
    site = loaded.site()
    ctrl = Poisoned(
        site,
        at_s=5.0,
        rack_cap_w=lambda n: np.full(n, np.nan),
        rack_floor_w=lambda n: np.full(n, np.nan),
        rack_bbu_threshold_w=lambda n: np.full(n, np.inf),
        rack_bbu_recharge_w=lambda n: np.full(n, np.inf),
        bess_setpoint_w=math.nan,
        gpu_ramp_up_w_per_s=math.inf,
    )
    sim = Simulation(loaded, site, ctrl, 0)
    res = sim.run()
    assert ctrl.steps == 59
    assert np.all(sim.gpus.cap_w == site.gpu.rated_w)  # NaN kept the hands-off cap in force
    assert np.all(res.tick["bess_w"] == 0.0)  # NaN setpoint: idle
    assert np.all(np.isfinite(res.tick["grid_w"]))
    s = summarize(res)
    assert s["pcc_overlimit_s"] > 0 and s["peak_grid_mw"] > 0.8  # the import is real data over a real limit


def test_check_actions_accepts_hands_off_and_costs_one_isfinite_per_array() -> None:
    from dimmer.site import build_site
    from dimmer.siteconfig import SiteSpec

    site = build_site(SiteSpec.model_validate(BASE["site"]), [])
    act = Actions.hands_off(site)
    assert check_actions(act, site.n_racks, site.n_jobs) is None
    bad = replace(act, rack_bbu_threshold_w=np.where(np.arange(site.n_racks) == 3, np.nan, np.inf))
    refused = check_actions(bad, site.n_racks, site.n_jobs)
    assert refused is not None and refused[0] == "rack_bbu_threshold_w" and "rack 3 is nan" in refused[1]


def test_unguarded_the_nan_poisons_the_plant_and_the_summary_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mechanism the guard stops, and the second guard behind it: with the check switched off the issue's run
    comes back (grid import NaN from the first poisoned tick on), and summarize raises instead of reporting 0 s."""
    bbus = RackBbus(_loaded(tmp_path).site())
    n = bbus.stored_j.size
    bbus.step(0.1, np.full(n, 100e3), np.full(n, np.nan), np.full(n, 1e3), np.ones(n, dtype=bool))
    assert np.isnan(bbus.stored_j).all()  # what RackBbus does with a NaN threshold (why the door is the engine)

    monkeypatch.setattr(engine, "check_actions", lambda *a: None)
    loaded = _loaded(tmp_path)
    site = loaded.site()
    res = Simulation(loaded, site, Poisoned(site, at_s=5.0, rack_bbu_threshold_w=_at_rack(math.nan)), 0).run()
    grid = res.tick["grid_w"]
    assert np.isnan(grid[51:]).all() and np.isfinite(grid[:50]).all()
    assert not res.trips  # the breakers saw NaN, which is never over a rating
    with pytest.raises(
        ResultError, match=r"series 'campus_w' is nan at 550 of 600 samples \(first at t = 5 s\)"
    ) as info:
        summarize(res)
    assert "\n" not in str(info.value) and not res.summary


def test_summarize_allows_the_contracted_non_finite_series(tmp_path: Path) -> None:
    """+inf limit where none is set, NaN BBU state of charge on a site without BBUs: not refused."""
    loaded = _loaded(tmp_path)
    site = loaded.site()
    res = Simulation(loaded, site, Poisoned(site, at_s=1e9), 0).run()
    res.tick["pcc_limit_w"][:] = np.inf
    res.tick["bbu_soc_min_frac"][:] = np.nan
    s = summarize(res)
    assert s["pcc_overlimit_s"] == 0.0
    res.tick["pcc_limit_w"][7] = np.nan
    with pytest.raises(ResultError, match="pcc_limit_w"):
        summarize(res)


def test_the_errors_cross_a_process_pool_whole() -> None:
    for err in (
        ActionsError("dimmer", "rack_cap_w", "a finite cap (rack 2 is inf)", 12.0, 120),
        ResultError("s", "none", "grid_w", "is nan at 3 of 10 samples (first at t = 1 s)"),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)


def _scenario_file(tmp_path: Path) -> Path:
    p = tmp_path / "nan.toml"
    p.write_text(
        'name = "nan"\nduration_s = 30\n[site]\ngpu = "gb300"\n[site.pcc]\nlimit_mw = 3.0\n'
        '[[site.levels]]\nlevel = "row"\ncount = 1\nrating_kw = 1500\n[[site.levels]]\nlevel = "rack"\ncount = 4\n'
        '[[jobs]]\nname = "a"\nracks = [0, 4]\n'
    )
    return p


@pytest.mark.parametrize("command", ["run", "compare"])
def test_cli_reports_one_line_exit_1_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    real = engine.make_controller

    def poisoned(name: str, site: SiteModel, params: Any, source: str = "") -> Any:
        ctrl = real(name, site, params, source=source)

        class Bad:
            def __init__(self) -> None:
                self.name = ctrl.name

            def step(self, obs: Observation) -> Actions:
                act = ctrl.step(obs)
                if obs.t_s >= 3.0:
                    thr = act.rack_bbu_threshold_w.copy()
                    thr[0] = np.nan
                    act = replace(act, rack_bbu_threshold_w=thr)
                return act

        return Bad()

    monkeypatch.setattr(engine, "make_controller", poisoned)
    out = tmp_path / "out"
    argv = [command, str(_scenario_file(tmp_path)), "--out", str(out), "--quiet"]
    if command == "compare":
        argv += ["--controllers", "none"]
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gridsim: controller 'none' returned Actions.rack_bbu_threshold_w at t = 3 s")
    assert "rack 0 is nan" in lines[0]
    assert not out.exists() or not any(out.iterdir())  # staged: nothing half-written
    assert not list(tmp_path.glob(".out*"))  # and no staging directory left beside it


def test_a_finished_run_still_writes_its_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The guards cost nothing to a good run: the same scenario through the CLI, unpoisoned."""
    out = tmp_path / "out"
    assert cli.main(["run", str(_scenario_file(tmp_path)), "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peak_grid_mw"] is not None and summary["breaker_trips"] == 0
