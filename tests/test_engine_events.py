"""The engine's timed events, telemetry path and actuation latency, each against what it must do."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel
from gridsim.engine import SimResult, Simulation, run
from gridsim.plant.workload import JobState
from gridsim.scenario import LoadedScenario, validate_scenario

BASE: dict[str, Any] = {
    "name": "events",
    "duration_s": 60,
    "site": {
        "gpu": "gb300",
        "pcc": {"limit_mw": 3.0},
        "levels": [{"level": "row", "count": 2, "rating_kw": 1500}, {"level": "rack", "count": 10}],
    },
    "jobs": [{"name": "a", "racks": [0, 10], "swing_frac": 0.0, "jitter_frac": 0.0}],
}


def _loaded(tmp_path: Path, **changes: Any) -> LoadedScenario:
    raw = {**BASE, **changes}
    return LoadedScenario(validate_scenario(raw, "test"), "test", tmp_path)


class Recorder:
    """Records every observation; commands `cap_w` from `at_s` on (None: hands off)."""

    name = "recorder"

    def __init__(self, site: SiteModel, cap_w: float | None = None, at_s: float = 0.0) -> None:
        self.site = site
        self.cap_w = cap_w
        self.at_s = at_s
        self.seen: list[Observation] = []

    def step(self, obs: Observation) -> Actions:
        self.seen.append(obs)
        act = Actions.hands_off(self.site)
        if self.cap_w is not None and obs.t_s >= self.at_s:
            act = Actions(**{**act.__dict__, "rack_cap_w": np.full(self.site.n_racks, self.cap_w)})
        return act


def _sim(loaded: LoadedScenario, ctrl: Any = None) -> tuple[SimResult, Recorder]:
    site = loaded.site()
    rec = ctrl(site) if ctrl else Recorder(site)
    return Simulation(loaded, site, rec, 0).run(), rec


def test_curtailment_ramps_the_limit(tmp_path: Path) -> None:
    res = run(_loaded(tmp_path, events=[{"kind": "curtail", "at_s": 20, "limit_mw": 2.0, "over_s": 10}]))
    t, lim = res.t_s, res.tick["pcc_limit_w"]
    assert np.all(lim[t < 20] == 3e6)
    assert lim[np.searchsorted(t, 25.0)] == pytest.approx(2.5e6)
    assert np.all(lim[t >= 30] == pytest.approx(2e6))


def test_frequency_replay_is_the_measured_frequency(tmp_path: Path, shared_data: Path) -> None:
    path = shared_data / "gridfreq_gb_neso_1s_2019-08-09_event.csv"
    record = np.loadtxt(path, delimiter=",", skiprows=1)
    loaded = _loaded(tmp_path, duration_s=600, events=[{"kind": "frequency_replay", "at_s": 10, "path": str(path)}])
    res = run(loaded)
    f, t = res.tick["freq_hz"], res.t_s
    # GB 9 Aug 2019, replayed as measured: the campus is steady, so its own modelled deviation is ~0 and the run's
    # frequency at every sample of the record is the record (it was 45 mHz low: f - f(first sample))
    at_samples = np.searchsorted(t, 10.0 + record[:, 0] - 1e-6)
    assert np.max(np.abs(f[at_samples] - record[:, 1])) < 1e-4
    assert f.min() == pytest.approx(48.787, abs=1e-4)
    assert t[np.argmin(f)] == pytest.approx(130.0, abs=1e-6)
    # the record ends at 369 s at 50.089 Hz; from there the frequency returns to nominal without a step (it fell
    # 44 mHz in one tick): each tick moves it by at most the first-order return's first step, 0.15 mHz
    after = t > 369.0
    assert np.max(np.abs(np.diff(f[after]))) < 0.2e-3
    assert f[np.searchsorted(t, 369.0)] == pytest.approx(50.089, abs=1e-4)
    # first order with settle_tau_s = 60 s (the default): 2 % of the 89 mHz left 231 s later
    assert f[-1] - 50.0 == pytest.approx(0.089 * math.exp(-(t[-1] - 369.0) / 60.0), abs=1e-4)


def test_frequency_step_settles_at_the_closed_form(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, duration_s=120, events=[{"kind": "frequency_step", "at_s": 5, "load_mw": 100}])
    res = run(loaded)
    grid = loaded.scenario.grid
    dp_pu = 100.0 / grid.system_base_mw
    expected = -dp_pu / (grid.damping_d_pu + 1 / grid.droop_r_pu) * grid.nominal_hz
    assert res.tick["freq_hz"][-1] - grid.nominal_hz == pytest.approx(expected, rel=0.02)


def test_crash_event_drops_the_job_to_idle(tmp_path: Path) -> None:
    res = run(_loaded(tmp_path, events=[{"kind": "crash", "at_s": 30, "jobs": ["a"]}]))
    state = res.period["job_state"][:, 0]
    assert state[29] == JobState.RUNNING and state[31] == JobState.DOWN
    load = res.tick["load_w"]
    assert load[np.searchsorted(res.t_s, 31.0)] < 0.6 * load[np.searchsorted(res.t_s, 29.0)]  # idle GPUs, hosts on


def test_a_stopped_job_is_ended_unless_the_scenario_starts_it_again(tmp_path: Path) -> None:
    """What the scheduler tells the controller (Observation.job_ended): a job stopped for good is ended from its stop
    ramp on; one stopped and started again later is pending (requeued), never ended; a crashed one is neither."""
    two = [{"name": "a", "racks": [0, 8], "swing_frac": 0.0}, {"name": "b", "racks": [10, 18], "swing_frac": 0.0}]
    events = [{"kind": "stop", "at_s": 10, "jobs": ["a"]}, {"kind": "stop", "at_s": 10, "jobs": ["b"]},
              {"kind": "start", "at_s": 40, "jobs": ["b"]}]  # fmt: skip
    _, rec = _sim(_loaded(tmp_path, jobs=two, events=events))
    ended = np.array([o.job_ended for o in rec.seen])
    running = np.array([o.job_running for o in rec.seen])
    t = np.array([o.t_s for o in rec.seen])
    assert not ended[t < 10].any() and ended[(t > 10), 0].all()
    assert not ended[:, 1].any() and not running[(t > 10) & (t < 40), 1].any() and running[t > 42, 1].all()
    _, rec = _sim(_loaded(tmp_path, events=[{"kind": "crash", "at_s": 10, "jobs": ["a"]}]))
    assert not np.array([o.job_ended for o in rec.seen]).any()


def test_derated_row_trips(tmp_path: Path) -> None:
    res = run(_loaded(tmp_path, events=[{"kind": "derate", "at_s": 10, "domain": "r0", "factor": 0.3}]))
    assert [d for _, d in res.trips] == ["r0"]
    assert res.trips[0][0] >= 10.0


def test_telemetry_window_and_delay(tmp_path: Path) -> None:
    # The job starts at 20 s; with a 2 s delay and a 1 s window, the controller sees the start 2-3 s late.
    loaded = _loaded(
        tmp_path,
        duration_s=40,
        jobs=[{"name": "a", "racks": [0, 10], "start_s": 20.0, "ramp_s": 0.0, "swing_frac": 0.0}],
        telemetry={"window_s": 1.0, "delay_s": 2.0},
    )
    _, rec = _sim(loaded)
    seen = {o.t_s: o.pcc_power_w for o in rec.seen}
    idle = seen[10.0]
    # At t the controller sees the mean of the ticks in [t - 3 s, t - 2 s): before the start at 21 s, all of it at 23 s.
    assert seen[21.0] == pytest.approx(idle, rel=1e-9)
    full = seen[24.0]
    assert full > 1.5 * idle
    assert seen[23.0] == pytest.approx(full, rel=0.01)  # the trays have settled
    assert idle < seen[22.0] < full
    assert all(o.rack_age_s.min() >= 2.0 for o in rec.seen)


def test_telemetry_dropouts_are_nan_and_age(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, telemetry={"dropout_prob": 1.0})
    _, rec = _sim(loaded)
    last = rec.seen[-1]
    assert np.all(np.isnan(last.rack_power_w))
    assert last.rack_age_s.min() == pytest.approx(last.t_s)
    assert np.isfinite(last.pcc_power_w)  # the PCC meter is a separate device


def test_actuation_latency_delays_caps(tmp_path: Path) -> None:
    loaded = _loaded(tmp_path, duration_s=20, engine={"actuation_latency_s": 3.0})
    res, _ = _sim(loaded, lambda site: Recorder(site, cap_w=400.0, at_s=5.0))
    load, t = res.tick["load_w"], res.t_s
    assert load[np.searchsorted(t, 7.9)] == pytest.approx(load[np.searchsorted(t, 4.0)], rel=1e-9)
    assert load[np.searchsorted(t, 10.0)] < 0.7 * load[np.searchsorted(t, 4.0)]
