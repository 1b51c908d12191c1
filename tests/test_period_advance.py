"""The plant a control period at a time (gridsim/period.py) gives what the tick path gives, to the bit.

Each run here is made twice, once taking whole periods where it can and once tick by tick, and every series, every
period record, the accounting, the storage totals, the trips and the event log must be equal (assert_array_equal: NaN
where NaN, every other value the same float). Each scenario is chosen for a reason to fall back to the tick path
(events and actuations inside a period, faults, breaker trips, ramp limits, random failures, checkpoints) or for
what the period path must carry through a period (caps settling, out-of-band caps falling due, trays clipping, BBUs
recharging, background noise, traces, frequency replays, curtailment ramps), and each test also checks that the
period path was taken and that the fallback it is about happened, so that none passes by never taking the path under
test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.control import make_controller
from gridsim.engine import SimResult, Simulation
from gridsim.period import PeriodBlock
from gridsim.scenario import LoadedScenario, load_scenario, validate_scenario
from tests.budget import examples
from tests.conftest import skip_without_shared_data

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


def _run(loaded: LoadedScenario, controller: str, period_advance: bool) -> tuple[SimResult, PeriodBlock]:
    site = loaded.site()
    sc = loaded.scenario
    ctrl = make_controller(controller, site, sc.controllers.get(controller, {}), source=loaded.source)
    sim = Simulation(loaded, site, ctrl, sc.seed, period_advance=period_advance)
    res = sim.run()
    assert sim.period_block is not None
    return res, sim.period_block


def assert_same_run(a: SimResult, b: SimResult) -> None:
    for key in b.tick:
        np.testing.assert_array_equal(a.tick[key], b.tick[key], err_msg=key)
    for key in b.period:
        np.testing.assert_array_equal(a.period[key], b.period[key], err_msg=key)
    np.testing.assert_array_equal(a.period_t_s, b.period_t_s)
    for key in b.accounting:
        np.testing.assert_array_equal(a.accounting[key], b.accounting[key], err_msg=key)
    np.testing.assert_array_equal(list(a.storage.values()), list(b.storage.values()))
    assert list(a.storage) == list(b.storage)
    assert a.trips == b.trips
    assert a.events_log == b.events_log


def both_ways(loaded: LoadedScenario, controller: str) -> tuple[PeriodBlock, SimResult]:
    by_period, block = _run(loaded, controller, True)
    by_tick, none_taken = _run(loaded, controller, False)
    assert none_taken.taken == 0
    assert_same_run(by_period, by_tick)
    return block, by_tick


def _load(name: str, *overrides: str) -> LoadedScenario:
    skip_without_shared_data(SCENARIOS / name)  # (a clone with no ../shared: the measured trace is not there)
    return load_scenario(SCENARIOS / name, list(overrides))


CASES: list[tuple[str, list[str], str, str | None]] = [
    # (scenario, overrides, controller, a refusal the run must see); every run must take some periods whole
    ("swing-8k.toml", ["duration_s=60"], "none", None),  # trays clip in about half its periods
    ("swing-8k.toml", ["duration_s=60", "engine.actuation_latency_s=1.0"], "dimmer", None),  # lands on a period
    ("swing-8k.toml", ["duration_s=60", "events=[{kind='stop', at_s=30.25}]"], "none", "event or actuation inside"),
    ("swing-8k.toml", ["duration_s=40", "gpu.path=oob", "gpu.oob_delay_s=2.5"], "hard-stop", None),
    ("job-start-32k.toml", ["duration_s=40"], "none", None),
    ("job-start-32k.toml", ["duration_s=40"], "dimmer", None),  # caps settling in every period
    ("sites/staggered-starts.toml", ["duration_s=120"], "none", "a job changes state inside"),
    # drained at 150 s, the BBUs recharge: periods with BBUs that move
    ("faults/bbu-empty.toml", ["duration_s=200"], "none", "storage fault begins or ends inside"),
    ("faults/backup-transfer.toml", ["duration_s=200"], "none", "on backup power"),
    ("faults/commands-delayed.toml", ["duration_s=200"], "none", None),
    ("interruption-storm.toml", ["duration_s=300"], "none", "a job changes state inside"),
    ("checkpoint-sync-async.toml", ["duration_s=200", "jobs[0].checkpoint.interval_s=50"], "none", None),
    ("trace-hall.toml", ["duration_s=60"], "none", None),
    ("sites/h100-noisy.toml", ["duration_s=60"], "dimmer", None),
    ("gb-frequency-event.toml", ["duration_s=120"], "none", None),
    ("curtailment.toml", ["duration_s=120"], "dimmer", None),
    ("faults/cap-writes-lost-row.toml", ["duration_s=200"], "dimmer", None),
    ("sites/derate-crash.toml", ["duration_s=200"], "dimmer", None),
    # issue 15: a job on its own throughput curve under settling caps, and rows on the I²t curve loaded past its
    # pickup (~1.2 x: the heated drive in every period, no trip within the run)
    ("job-start-32k.toml", ["duration_s=40", "jobs[0].throughput_curve='a40-bloom-176b'"], "dimmer", None),
    ("swing-8k.toml", ["duration_s=60", "breakers.row='iec60947_2_i2t'", "site.levels[1].rating_kw=730"], "none", None),
    # racks out of lockstep well past the measured default: the tick means of a block of ticks at once
    (
        "swing-8k.toml",
        ["duration_s=60", "jobs[0].rack_phase_skew_s=0.15", "jobs[0].rack_amplitude_spread_frac=0.3"],
        "dimmer",
        None,
    ),
]


@pytest.mark.parametrize(("name", "overrides", "controller", "refusal"), CASES)
def test_a_period_at_a_time_is_the_tick_path_to_the_bit(
    name: str, overrides: list[str], controller: str, refusal: str | None
) -> None:
    block, _ = both_ways(_load(name, *overrides), controller)
    assert block.taken > 0, block.refused
    if refusal is not None:
        assert block.refused.get(refusal, 0) > 0, block.refused


@pytest.mark.parametrize(
    ("overrides", "controller", "refusal"),
    [
        (["engine.actuation_latency_s=0.35"], "dimmer", "event or actuation inside"),  # every actuation lands inside
        ([], "smoothing", "gpu ramp limit"),  # its ramp limit holds over the whole run
    ],
)
def test_runs_that_refuse_every_period_are_the_tick_path(overrides: list[str], controller: str, refusal: str) -> None:
    block, _ = both_ways(_load("swing-8k.toml", "duration_s=30", *overrides), controller)
    assert block.refused.get(refusal, 0) > 0


def test_a_breaker_that_trips_inside_a_period_sends_it_back_to_the_tick_path() -> None:
    # rows of eight ~110 kW racks on 300 kW breakers: UL 489 trips in about 30 s, and recloses 20 s later
    overrides = ["duration_s=150", "site.levels[1].rating_kw=300", "breakers.reclose_s=20", "site.pcc.limit_mw=40"]
    loaded = _load("swing-8k.toml", *overrides)
    block, res = both_ways(loaded, "none")
    assert res.trips
    assert block.refused.get("a breaker trips inside", 0) > 0
    assert block.refused.get("breaker open", 0) > 0
    assert block.taken > 0


def test_an_i2t_breaker_that_trips_inside_a_period_sends_it_back_to_the_tick_path() -> None:
    # the same rows on the I²t curve: ~2.9 x their rating trips after ~68 s (576 / x²), recloses 20 s later
    overrides = ["duration_s=150", "site.levels[1].rating_kw=300", "breakers.reclose_s=20", "site.pcc.limit_mw=40",
                 "breakers.row='iec60947_2_i2t'"]  # fmt: skip
    block, res = both_ways(_load("swing-8k.toml", *overrides), "none")
    assert res.trips
    assert block.refused.get("a breaker trips inside", 0) > 0
    assert block.taken > 0


def _swing_site(
    racks: int, iteration_s: float, background: str, events: list[dict[str, Any]], tray: bool
) -> dict[str, Any]:
    return {
        "name": "random",
        "seed": 3,
        "duration_s": 40,
        "site": {
            "gpu": "gb300",
            "pcc": {"limit_mw": 0.2 * racks, "ramp_mw_per_min": 1.0},
            "levels": [{"level": "row", "count": 2, "rating_kw": 70 * racks}, {"level": "rack", "count": racks}],
            "storage": {"bess": {"power_mw": 0.05 * racks, "energy_mwh": 0.02 * racks}},
            **({} if tray else {"storage": {"tray": {"j_per_gpu": 0.0}}}),
        },
        "jobs": [
            {"name": "a", "priority": 1, "racks": [0, racks], "iteration_s": iteration_s, "swing_frac": 0.5},
            {"name": "b", "priority": 0, "racks": [racks, 2 * racks - 1], "iteration_s": 0.7, "start_s": 3.35},
        ],
        "background": {"kind": background},
        "events": events,
    }


@settings(max_examples=examples(12), deadline=None)
@given(
    racks=st.integers(2, 5),
    iteration_s=st.floats(0.25, 3.0),
    background=st.sampled_from(["idle", "inference"]),
    at_s=st.lists(st.floats(1.0, 38.0), max_size=3),
    controller=st.sampled_from(["none", "dimmer"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_small_sites_a_period_at_a_time_are_the_tick_path(
    racks: int, iteration_s: float, background: str, at_s: list[float], controller: str, seed: int
) -> None:
    kinds = ["crash", "stop", "start"]
    events = [{"kind": kinds[i % 3], "at_s": round(t, 2), "jobs": ["a"]} for i, t in enumerate(sorted(at_s))]
    raw = _swing_site(racks, iteration_s, background, events, tray=True)
    raw["seed"] = seed
    loaded = LoadedScenario(validate_scenario(raw, "test"), "test", SCENARIOS)
    block, _ = both_ways(loaded, controller)
    assert block.taken > 0
