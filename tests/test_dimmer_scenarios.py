"""The controller on the scenario library: every limit held, and the properties the comparison rests on."""

from __future__ import annotations

from pathlib import Path

import pytest

from gridsim.engine import run
from gridsim.metrics import summarize
from gridsim.scenario import load_scenario

from .conftest import SCENARIOS

LIBRARY = sorted(SCENARIOS.glob("*.toml"))


@pytest.mark.parametrize("path", LIBRARY, ids=[p.stem for p in LIBRARY])
def test_dimmer_holds_every_limit_on_the_first_ten_minutes(path: Path) -> None:
    s = summarize(run(load_scenario(path, ["duration_s=600"]), controller="dimmer"))
    assert s["breaker_trips"] == 0
    assert s["pcc_overlimit_s"] == 0.0
    assert s["ramp_violation_s"] == 0.0


def test_swing_reaches_the_grid_at_most_a_third() -> None:
    s = summarize(run(load_scenario(SCENARIOS / "swing-8k.toml", ["duration_s=600"]), controller="dimmer"))
    assert s["band_rms_mw"] <= s["demand_band_rms_mw"] / 3


def test_oversubscribed_row_costs_less_goodput_than_dynamo_and_hard_stop() -> None:
    loaded = load_scenario(SCENARIOS / "oversubscribed-row.toml", ["duration_s=900"])
    loss = {
        c: summarize(run(loaded, controller=c))["goodput_loss_power_pct"] for c in ("dimmer", "dynamo", "hard-stop")
    }
    assert loss["dimmer"] < loss["dynamo"] and loss["dimmer"] < loss["hard-stop"]


def test_dimmer_burns_less_energy_than_firmware_smoothing() -> None:
    loaded = load_scenario(SCENARIOS / "interruption-storm.toml", ["duration_s=600"])
    overhead = {c: summarize(run(loaded, controller=c))["energy_overhead_pct"] for c in ("dimmer", "smoothing")}
    assert overhead["dimmer"] < overhead["smoothing"]
