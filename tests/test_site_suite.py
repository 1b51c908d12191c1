"""The site suite (scenarios/sites/, issue #11): sites dimmer was not tuned on. Each file loads and runs; what each
controller achieves on them is bench/site_suite.py's business (figures, not pass/fail)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridsim.engine import run
from gridsim.metrics import summarize
from gridsim.scenario import load_scenario
from tests.conftest import skip_without_shared_data

SITES = sorted((Path(__file__).resolve().parents[1] / "scenarios" / "sites").glob("*.toml"))


def test_the_suite_is_there() -> None:
    assert len(SITES) >= 8


@pytest.mark.parametrize("path", SITES, ids=lambda p: p.stem)
def test_each_site_loads_and_runs(path: Path) -> None:
    skip_without_shared_data(path)
    loaded = load_scenario(path, ["duration_s=20"])
    first = loaded.scenario.description.strip().splitlines()[0] if loaded.scenario.description else ""
    assert first, f"{path.name}: a site states its question"
    s = summarize(run(loaded, controller="dimmer"))
    json.dumps(s, allow_nan=False)  # every metric a number or null
    assert s["duration_s"] == pytest.approx(20.0, abs=1.0)


def _suite_module():  # type: ignore[no-untyped-def]
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "site_suite.py"
    spec = importlib.util.spec_from_file_location("site_suite", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(**overrides: float) -> dict[str, float]:
    base = {
        "breaker_trips": 0,
        "pcc_overlimit_s": 0.0,
        "ramp_violation_s": 0.0,
        "goodput_loss_power_pct": 0.0,
        "energy_overhead_pct": 0.0,
        "bbu_cycles_per_day": 0.1,
        "min_bbu_ride_through_s": 100.0,
    }
    return {**base, **overrides}


@pytest.mark.parametrize(
    ("sized_s", "judged_s", "met"),
    [(100.0, 60.0, True), (100.0, 59.0, False), (6.45, 6.45, True), (6.45, 6.0, False)],
)
def test_the_ride_through_goal_is_sixty_seconds_or_what_the_bbus_hold_uncontrolled(
    sized_s: float, judged_s: float, met: bool
) -> None:
    suite = _suite_module()
    rows = {
        "none": _summary(min_bbu_ride_through_s=sized_s),
        "dimmer": _summary(min_bbu_ride_through_s=judged_s),
    }
    lines = suite.verdict(rows)
    ride = [line for line in lines if "ride-through" in line]
    assert len(ride) == 1
    assert ride[0].startswith("PASS" if met else "MISS"), ride[0]
    assert all(line.startswith("PASS") for line in lines if line not in ride)


def test_the_verdict_notes_the_heat_the_best_baseline_s_goodput_was_bought_with() -> None:
    """A baseline that trips nothing holds the limits the issue names; where it bought its goodput by running a
    breaker above its rating's steady heat, the verdict says so beside the goal (a note, not a miss)."""
    suite = _suite_module()
    hot = {"breaker_overload_s": 612.0, "max_breaker_heat_frac": 1.22}
    rows = {
        "smoothing": _summary(goodput_loss_power_pct=1.0, **hot),
        "dimmer": _summary(goodput_loss_power_pct=2.5, breaker_overload_s=0.0, max_breaker_heat_frac=0.91),
    }
    lines = suite.verdict(rows)
    notes = [line for line in lines if line.startswith("note")]
    assert len(notes) == 1 and "`smoothing`" in notes[0] and "612 s" in notes[0]
    assert any(line.startswith("MISS goodput") for line in lines)  # (the goal itself is unchanged)
    rows["dimmer"] |= hot
    assert not any(line.startswith("note") for line in suite.verdict(rows))


def test_the_suite_judges_any_folder_and_names_an_empty_or_unknown_one(tmp_path: Path) -> None:
    suite = _suite_module()
    library = Path(__file__).resolve().parents[1] / "scenarios"
    assert [p.stem for p in suite.site_paths(["swing-8k"], library)] == ["swing-8k"]
    with pytest.raises(SystemExit, match="no scenario"):
        suite.site_paths([], tmp_path)
    with pytest.raises(SystemExit, match="no site 'bare-racks'"):
        suite.site_paths(["bare-racks"], library)


def test_poor_rack_meters_cost_no_goodput_where_no_limit_is_near() -> None:
    """noisy-falls: racks 4 s late losing 5 % of readings on a site every domain of which holds its rating at full
    power, and the main job's crash and return under a 2 MW/min rule. A stale or late rack that could break no limit
    holds its job back no longer (11.96 % of GPU time lost over the full run before: the safe cap whenever two
    readings of one rack were lost in a row, and no cap rise while any rack was late), and the fall and the return
    hold the rule."""
    path = next(p for p in SITES if p.stem == "noisy-falls")
    s = summarize(run(load_scenario(path, ["duration_s=360"]), controller="dimmer"))
    assert s["breaker_trips"] == 0 and s["pcc_overlimit_s"] == 0.0 and s["ramp_violation_s"] == 0.0
    assert s["goodput_loss_power_pct"] < 0.1


def test_lost_rack_readings_on_tight_rows_cost_little_more_than_the_rows_do() -> None:
    """lossy-tight: rows at their ratings (every rack could take its row past its soft level), rack meters 3 s late
    and losing 8 % of readings. A rack two readings overdue sends itself alone to the safe cap, back on its next
    reading: the losses cost 1.0 point of GPU time over the same meters losing nothing (3.2 points when the whole
    50-rack job went to the safe cap, climbing back at the slow rise for 12 s; 0.6 while a crashed job's racks were
    counted at their breakers at the level their BBUs' guard would hold, also where the guard was lifted)."""
    path = next(p for p in SITES if p.stem == "lossy-tight")
    lossy = summarize(run(load_scenario(path, ["duration_s=360"]), controller="dimmer"))
    clean = summarize(run(load_scenario(path, ["duration_s=360", "telemetry.dropout_prob=0"]), controller="dimmer"))
    for s in (lossy, clean):
        assert s["breaker_trips"] == 0 and s["pcc_overlimit_s"] == 0.0 and s["ramp_violation_s"] == 0.0
    assert lossy["goodput_loss_power_pct"] - clean["goodput_loss_power_pct"] < 1.25


def test_a_meter_spike_on_a_site_near_its_limit_cuts_no_job() -> None:
    """spike-tight: peaks 0.4 MW under a 19.6 MW limit, a 2 s swing read at 1 s, and the PCC meter reading twice the
    import for a minute. Read as the top of its tolerance band, which counts a period's movement of the racks' sum
    (up to ~1 MW on this swing), the spike cut the fine-tuning job to 283 W and its return broke the ramp rule (5.98 %
    of GPU time lost, 11.4 s over the ramp limit). Read at the estimate and the base tolerance, it cuts nothing."""
    path = next(p for p in SITES if p.stem == "spike-tight")
    s = summarize(run(load_scenario(path, ["duration_s=660"]), controller="dimmer"))
    assert s["breaker_trips"] == 0 and s["pcc_overlimit_s"] == 0.0 and s["ramp_violation_s"] == 0.0
    assert s["goodput_loss_power_pct"] < 0.5


def test_the_perturbed_sites_are_the_site_made_harder_as_the_bench_says() -> None:
    """bench/site_perturb.py's variants: the limit 3 % lower, the ramp limit 30 % lower and half the battery where the
    site has them (none where it does not), another seed; each loads as a scenario."""
    import importlib.util
    import tomllib

    path = Path(__file__).resolve().parents[1] / "bench" / "site_perturb.py"
    spec = importlib.util.spec_from_file_location("site_perturb", path)
    assert spec is not None and spec.loader is not None
    perturb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perturb)
    site = next(p for p in SITES if p.stem == "spike-tight")  # a ramp limit and a battery
    raw = tomllib.loads(site.read_text())
    assert perturb.variant_overrides(raw, "limit-3pct") == ([f"site.pcc.limit_mw={19.6 * 0.97!r}"], None)
    assert perturb.variant_overrides(raw, "ramp-30pct") == ([f"site.pcc.ramp_mw_per_min={1.5 * 0.7!r}"], None)
    assert perturb.variant_overrides(raw, "half-battery") == (
        ["site.storage.bess.power_mw=0.5", "site.storage.bess.energy_mwh=0.25"],
        None,
    )
    assert perturb.variant_overrides(raw, "seed") == ([], raw["seed"] + 1000)
    for variant in perturb.VARIANTS:
        overrides, seed = perturb.variant_overrides(raw, variant)
        loaded = load_scenario(site, [*overrides, "duration_s=5"])
        assert loaded.site().pcc_limit_w > 0 and (seed is None or seed > 0)
    no_battery = tomllib.loads(next(p for p in SITES if p.stem == "no-battery-start").read_text())
    assert perturb.variant_overrides(no_battery, "half-battery") is None  # no battery: no such variant


def test_a_slow_rl_swing_and_a_checkpoint_s_floors_burn_no_energy_the_rule_does_not_ask_for() -> None:
    """rl-ckpt-stop: a 15 s RL iteration (9 readings of rollouts, more than the campus level's least window of 6) beside
    a pretraining run's synchronous checkpoints, then the RL job's stop for good. The level had restarted on every
    change of the RL job's phase and followed the swing, and floors lifted for a stall came down at the slow rate for
    minutes, so the stop under them held a fall no rule asked to hold: 1.67 % energy overhead, the goal 1 %."""
    path = next(p for p in SITES if p.stem == "rl-ckpt-stop")
    s = summarize(run(load_scenario(path), controller="dimmer"))
    assert s["breaker_trips"] == 0 and s["pcc_overlimit_s"] == 0.0 and s["ramp_violation_s"] == 0.0
    assert s["energy_overhead_pct"] < 1.2 and s["goodput_loss_power_pct"] < 0.2
