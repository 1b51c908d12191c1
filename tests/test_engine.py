from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gridsim.cli import main
from gridsim.engine import run
from gridsim.metrics import SUMMARY_KEYS, summarize
from gridsim.scenario import load_scenario

from .conftest import SCENARIOS

TIMING = {"controller_step_ms_p50", "controller_step_ms_p99", "sim_speed_x_realtime"}

SMALL = """
name = "small"
seed = 4
duration_s = 120
[site.pcc]
limit_mw = 3.0
ramp_mw_per_min = 100
[[site.levels]]
level = "row"
count = 2
rating_kw = 1500
[[site.levels]]
level = "rack"
count = 10
[site.storage.bess]
power_mw = 1.0
energy_mwh = 0.5
[[jobs]]
name = "a"
gpus = 640
priority = 1
[[jobs]]
name = "b"
gpus = 512
"""


@pytest.fixture
def small(tmp_path: Path) -> Path:
    p = tmp_path / "small.toml"
    p.write_text(SMALL)
    return p


def test_summary_has_every_contract_key(small: Path) -> None:
    res = run(load_scenario(small))
    summary = summarize(res)
    assert tuple(summary) == SUMMARY_KEYS
    assert summary["gpus"] == 20 * 72 and summary["racks"] == 20
    json.dumps(summary, allow_nan=False)


def test_uncontrolled_plant_draws_its_demand_and_grid_is_campus_minus_battery(small: Path) -> None:
    res = run(load_scenario(small), controller="none")
    tick = res.tick
    # No caps, no floors, no ramp limits: the racks draw exactly their demand.
    np.testing.assert_allclose(tick["load_w"], tick["demand_w"], rtol=1e-12)
    np.testing.assert_allclose(tick["grid_w"], tick["campus_w"] - tick["bess_w"], rtol=1e-12)
    assert np.all(tick["bess_w"] == 0.0)  # `none` leaves the battery idle


def test_rack_storage_energy_balance(small: Path) -> None:
    res = run(load_scenario(small))
    dt, st = res.tick_s, res.storage
    load_j = res.tick["load_w"].sum() * dt
    campus_j = res.tick["campus_w"].sum() * dt
    net_storage_j = (st["tray_energy_in_j"] - st["tray_energy_out_j"]) + (
        st["bbu_energy_in_j"] - st["bbu_energy_out_j"]
    )
    assert campus_j == pytest.approx(load_j + net_storage_j, rel=1e-9)


def test_same_seed_same_summary_and_other_seed_differs(small: Path) -> None:
    loaded = load_scenario(small)
    a = {k: v for k, v in summarize(run(loaded, seed=7)).items() if k not in TIMING}
    b = {k: v for k, v in summarize(run(loaded, seed=7)).items() if k not in TIMING}
    c = {k: v for k, v in summarize(run(loaded, seed=8)).items() if k not in TIMING}
    assert a == b
    assert a["band_rms_mw"] != c["band_rms_mw"]


def test_overloaded_row_trips_and_drops_its_racks(tmp_path: Path) -> None:
    # Rows rated far below their racks' draw: the row breakers must trip (instantaneous or thermal).
    p = tmp_path / "trip.toml"
    p.write_text(SMALL.replace("rating_kw = 1500", "rating_kw = 400"))
    res = run(load_scenario(p), controller="none")
    assert res.trips, "an overloaded row must trip"
    assert {d for _, d in res.trips} <= {"r0", "r1"}
    # after the trip the campus draws (almost) nothing from the tripped rows
    assert res.tick["campus_w"][-1] < 0.5 * res.tick["campus_w"][:50].max()
    summary = summarize(res)
    assert summary["breaker_trips"] == len(res.trips)
    assert summary["goodput_loss_power_pct"] > 0


def test_gridsim_run_writes_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    scenario = SCENARIOS / "swing-8k.toml"
    assert main(["run", str(scenario), "--out", str(out), "--quiet", "--set", "duration_s=60"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert {"jobs.csv", "overview.png", "report.md", "summary.json", "timeseries.csv"} <= set(names)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["duration_s"] == pytest.approx(60)
    png = (out / "overview.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "| `breaker_trips` |" in (out / "report.md").read_text()
    assert capsys.readouterr().err == ""


def test_racks_report_the_highest_sample_of_each_window(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """telemetry.peak_sample_s: each rack also reports its window's highest sample, one every peak_sample_s: sampled
    every tick, never under the window mean and above it where the job swings within the window; sampled more
    sparsely, never above that (and it may miss the peak: the controller takes one under the mean for none);
    0: no peak is reported at all."""
    from gridsim.engine import Simulation

    seen: list[tuple[np.ndarray, np.ndarray | None]] = []
    observe = Simulation.observe

    def recording(self: Simulation, t_s: float, k: int, freq_hz: float):  # type: ignore[no-untyped-def]
        obs = observe(self, t_s, k, freq_hz)
        seen.append((obs.rack_load_w, obs.rack_load_peak_w))
        return obs

    monkeypatch.setattr(Simulation, "observe", recording)
    peaks = {}
    for sample_s in (0.1, 0.5, 0.0):
        seen.clear()
        run(load_scenario(small, [f"telemetry.peak_sample_s={sample_s}"]), controller="none")
        peaks[sample_s] = [p for _, p in seen]
    load = np.array([m for m, _ in seen])
    assert all(p is None for p in peaks[0.0])
    every, sparse = np.array(peaks[0.1]), np.array(peaks[0.5])
    assert np.all(every >= load * (1 - 1e-12))
    assert np.mean(every > 1.05 * load) > 0.2  # the swing's peaks, which a 1 s mean hides
    assert np.all(sparse <= every) and np.any(sparse < every)
