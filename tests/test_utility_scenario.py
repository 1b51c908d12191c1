"""Utility events in a scenario (gridsim.utility): replayed into the interconnect limit by the daemon's own schedule,
every key checked at the door, and the same event through the daemon's OpenADR door planned on identically."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.control import make_controller
from dimmer.daemon.openadr_signals import answer
from dimmer.daemon.utility_config import UtilitySpec
from dimmer.errors import InputError
from dimmer.observation import Actions, Observation
from dimmer.utility_events import Interval, UtilityEvent
from gridsim.describe import describe
from gridsim.engine import run
from gridsim.metrics import summarize
from gridsim.scenario import LoadedScenario, validate_scenario
from tests.test_engine_events import BASE, _loaded, _sim

EVENING = {
    "kind": "utility_event",
    "at_s": 20,
    "event_id": "evening",
    "ramp_up_s": 10,
    "recovery_s": 5,
    "intervals": [{"duration_s": 10, "limit_mw": 2.0}, {"duration_s": 10, "limit_mw": 1.5}],
}


def test_a_utility_event_moves_the_limit_on_the_utilitys_schedule(tmp_path: Path) -> None:
    res, rec = _sim(_loaded(tmp_path, events=[EVENING]))
    t, lim = res.t_s, res.tick["pcc_limit_w"]

    def at(s: float) -> float:
        return float(lim[np.searchsorted(t, s)])

    assert np.all(lim[t < 10] == 3e6)  # the site's 3 MW until the ramp-up begins
    assert at(15.0) == pytest.approx(2.5e6)  # halfway down the ramp-up: 3 -> 2 MW over 10 s
    assert at(20.0) == pytest.approx(2e6) and at(29.9) == pytest.approx(2e6)  # in force from the utility's start
    assert at(30.0) == pytest.approx(1.5e6) and at(39.9) == pytest.approx(1.5e6)  # the second interval steps
    assert at(42.5) == pytest.approx(2.25e6)  # halfway back over the 5 s recovery
    assert np.all(lim[t >= 45] == 3e6)
    assert np.all(lim <= 3e6)
    # what the controller saw is what was recorded
    for obs in rec.seen:
        assert obs.pcc_limit_w == pytest.approx(at(obs.t_s)), obs.t_s


def test_events_overlap_lowest_wins_and_a_curtailment_beneath(tmp_path: Path) -> None:
    emergency = {"kind": "utility_event", "at_s": 25, "intervals": [{"duration_s": 3, "target_mw": 1.0}]}
    curtail = {"kind": "curtail", "at_s": 0, "limit_mw": 2.8, "over_s": 0}
    res = run(_loaded(tmp_path, events=[EVENING, emergency, curtail]))
    t, lim = res.t_s, res.tick["pcc_limit_w"]
    assert lim[np.searchsorted(t, 26.0)] == pytest.approx(1e6)  # the target under the evening's 2 MW
    assert lim[np.searchsorted(t, 29.0)] == pytest.approx(2e6)
    assert lim[np.searchsorted(t, 15.0)] == pytest.approx(2.4e6)  # ramping from the curtailed 2.8 MW
    assert lim[np.searchsorted(t, 50.0)] == pytest.approx(2.8e6)
    # the metrics read the same series: the uncontrolled 1.62 MW is over it for the target's 3 s, the evening's 10 s
    # at 1.5 MW and the first 0.4 s of its recovery (1.5 -> 3 MW over 5 s)
    assert float(np.max(res.tick["grid_w"])) == pytest.approx(1.62e6, rel=0.01)
    assert summarize(res)["pcc_overlimit_s"] == pytest.approx(13.5, abs=0.11)


@pytest.mark.parametrize(
    ("intervals", "expected"),
    [
        ([{"duration_s": 10, "ramp_mw_per_min": 2.0}], "not replayed by gridsim yet"),
        ([{"duration_s": 10, "limit_mw": 2.0, "target_mw": 1.0}], "exactly one of limit_mw or target_mw"),
        ([{"duration_s": 10}], "exactly one of limit_mw or target_mw"),
        ([{"duration_s": 10, "limit_mw": 2.0}, {"duration_s": 10, "target_mw": 1.0}], "the same key"),
        ([{"duration_s": 0, "limit_mw": 2.0}], "greater than 0"),
        ([{"duration_s": 10, "limit_mw": -1}], "greater than 0"),
        ([], "at least 1 item"),
    ],
)
def test_bad_utility_events_are_one_line_errors(intervals: list[dict[str, Any]], expected: str) -> None:
    raw = {**BASE, "events": [{"kind": "utility_event", "at_s": 5, "intervals": intervals}]}
    with pytest.raises(InputError) as info:
        validate_scenario(raw, "s.toml")
    msg = str(info.value)
    assert msg.startswith("s.toml: events[0]") and "\n" not in msg and expected in msg, msg


def test_describe_names_the_utility_event(tmp_path: Path) -> None:
    text = describe(LoadedScenario(validate_scenario({**BASE, "events": [EVENING]}, "t"), "t", tmp_path))
    assert "utility_event" in text and "evening: interconnect limit 2 MW for 10 s then 1.5 MW for 10 s" in text


def test_the_daemon_and_gridsim_plan_on_the_same_event() -> None:
    """One utility event, through the daemon's OpenADR door (on the UTC axis) and a scenario's (on run seconds):
    the same UtilityEvent, shifted by the run's start."""
    t0 = datetime(2026, 7, 1, 18, 0, tzinfo=UTC)
    intervals = [
        {"dtstart": t0, "duration": timedelta(seconds=10), "signal_payload": 2000.0},
        {"dtstart": t0 + timedelta(seconds=10), "duration": timedelta(seconds=10), "signal_payload": 1500.0},
    ]
    openadr = {
        "event_descriptor": {"event_id": "evening", "modification_number": 0, "event_status": "far"},
        "active_period": {
            "dtstart": t0,
            "duration": timedelta(seconds=20),
            "ramp_up": timedelta(seconds=10),
            "recovery": timedelta(seconds=5),
        },
        "event_signals": [
            {"signal_name": "LOAD_CONTROL", "signal_type": "x-loadControlSetpoint", "intervals": intervals}
        ],
    }
    ans = answer(openadr, UtilitySpec(vtn_url="http://vtn", ven_name="campus"), 3e6)
    assert ans.opt == "optIn"
    daemon_event = ans.events[0]
    scenario = validate_scenario({**BASE, "events": [EVENING]}, "t")
    sim_event = scenario.events[0].event(0)  # type: ignore[union-attr]
    shift = t0.timestamp() - EVENING["at_s"]  # type: ignore[operator]
    shifted = UtilityEvent(
        sim_event.event_id,
        sim_event.kind,
        tuple(Interval(iv.start_s + shift, iv.duration_s, iv.value) for iv in sim_event.intervals),
        sim_event.ramp_up_s,
        sim_event.recovery_s,
    )
    assert shifted == daemon_event


def test_the_controller_plans_on_a_lower_ramp_limit_in_the_observation(tmp_path: Path) -> None:
    """A ramp-limit event (the daemon's VEN lowers the Observation's ramp limit): dimmer shapes a job start to it,
    not to the site's 6 MW/min."""

    class LowerRamp(_Seen):
        def step(self, obs: Observation) -> Actions:
            return super().step(replace(obs, ramp_limit_w_per_min=0.5e6))

    site = {**BASE["site"], "pcc": {"limit_mw": 3.0, "ramp_mw_per_min": 6.0, "ramp_window_s": 60}}
    jobs = [{"name": "a", "racks": [0, 10], "start_s": 20.0, "ramp_s": 0.0, "swing_frac": 0.0}]
    storage = {"bess": {"power_mw": 1.0, "energy_mwh": 1.0}}
    loaded = _loaded(tmp_path, duration_s=300, site={**site, "storage": storage}, jobs=jobs)
    own, _ = _sim(loaded, lambda s: _Seen(make_controller("dimmer", s)))
    low, _ = _sim(loaded, lambda s: LowerRamp(make_controller("dimmer", s)))
    rate = {k: summarize(r)["max_ramp_mw_per_min"] for k, r in (("own", own), ("low", low))}
    assert rate["low"] <= 0.5, rate  # the utility's (measured 0.35 MW/min)
    assert rate["own"] > 0.55, rate  # the site's own rule lets the start climb faster (0.62: the battery's pace)


class _Seen:
    """A controller that records what it saw."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name, self.seen = inner, inner.name, []

    def step(self, obs: Observation) -> Actions:
        self.seen.append(obs)
        out: Actions = self.inner.step(obs)
        return out
