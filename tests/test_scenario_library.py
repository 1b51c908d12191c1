"""The scenario library: every file says what it asks, validates, is documented, and the library covers the situations
it promises. Files that replay measured data (../shared/data) skip, saying why, when that folder is absent.
The one-minute run of every file is tests/test_compare.py::test_library_scenario_runs_for_a_minute."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gridsim.engine import run
from gridsim.metrics import summarize
from gridsim.plant.trace import load_nvsmi_trace
from gridsim.scenario import FrequencyReplayEvent, load_scenario

from .conftest import REPO, SCENARIOS, needs_shared_data, skip_without_shared_data

LIBRARY = sorted(SCENARIOS.glob("*.toml"))
DOCS = REPO / "docs" / "scenarios.md"
FREQUENCY_CSV = "gridfreq_gb_neso_1s_2019-08-09_event.csv"
TRACE_CSV = "gpu_titanx_2gpu_ddp_gpt_train_nvsmi100ms_noburn_2025-12-10.csv"


def _raw(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        return tomllib.load(f)


@pytest.mark.parametrize("path", LIBRARY, ids=[p.stem for p in LIBRARY])
def test_scenario_says_what_it_asks_and_validates(path: Path) -> None:
    raw = _raw(path)
    assert raw["name"] == path.stem, "the file is named after the scenario"
    assert len(" ".join(str(raw.get("description", "")).split())) >= 100, "a description of the situation"
    skip_without_shared_data(path)
    loaded = load_scenario(path)
    site = loaded.site()
    assert site.n_jobs >= 1 and site.n_racks >= 1
    assert loaded.scenario.description.strip()


@pytest.mark.parametrize("path", LIBRARY, ids=[p.stem for p in LIBRARY])
def test_scenario_has_a_section_in_the_docs(path: Path) -> None:
    docs = DOCS.read_text()
    section = docs.split(f"### `{path.stem}`", 1)
    assert len(section) == 2, f"docs/scenarios.md has no section for {path.stem}"
    body = section[1].split("\n### ", 1)[0]
    for heading in ("**Question**", "**Site**", "**Workload**", "**Storage**", "**Events**", "**`none`**"):
        assert heading in body, f"{path.stem}: {heading} missing"


def test_new_scenarios_report_none_and_dimmer_in_the_docs() -> None:
    docs = DOCS.read_text()
    for name in ("checkpoint-sync-async", "gb-frequency-event", "trace-hall", "prometheus-campus"):
        body = docs.split(f"### `{name}`", 1)[1].split("\n### ", 1)[0]
        assert "**`dimmer`**" in body, name


def test_library_covers_the_situations() -> None:
    raws = {p.stem: _raw(p) for p in LIBRARY}
    modes = {(job.get("checkpoint") or {}).get("mode", "async") for raw in raws.values() for job in raw.get("jobs", [])}
    assert {"sync", "async"} <= modes
    # one file holds both, so the two are compared on the same grid, at the same time
    both = raws["checkpoint-sync-async"]["jobs"]
    assert sorted(j["checkpoint"]["mode"] for j in both) == ["async", "sync"]
    assert any(needs_shared_data({"events": r.get("events", [])}) for r in raws.values())
    assert any(needs_shared_data({"jobs": r.get("jobs", [])}) for r in raws.values())


def test_campus_scenario_is_toward_a_million_gpus() -> None:
    loaded = load_scenario(SCENARIOS / "prometheus-campus.toml")
    site = loaded.site()
    assert site.n_gpus == 1_013_760 and site.n_racks == 14_080
    buildings = [n for n in site.domain_name if n.count("/") == 0 and n.startswith("b")]
    assert len(buildings) == 44
    assert site.n_racks // len(buildings) * site.gpus_per_rack == 23_040  # about 20k GPUs a building
    assert site.n_jobs >= 4
    assert loaded.scenario.duration_s <= 600  # a full run stays well under 30 s


def test_frequency_replay_resolves_to_the_shared_record(shared_data: Path) -> None:
    loaded = load_scenario(SCENARIOS / "gb-frequency-event.toml")
    replays = [ev for ev in loaded.scenario.events if isinstance(ev, FrequencyReplayEvent)]
    assert len(replays) == 1
    assert loaded.resolve(replays[0].path).resolve() == (shared_data / FREQUENCY_CSV).resolve()


def test_frequency_replay_reaches_the_recorded_nadir(shared_data: Path) -> None:
    """Replayed from 0 s, the GB record's nadir (48.787 Hz, 120 s after its 50.045 Hz start) is the run's, to the
    sample: the record is replayed as measured, not as a deviation from its first sample (45 mHz low)."""
    record = np.loadtxt(shared_data / FREQUENCY_CSV, delimiter=",", skiprows=1)
    loaded = load_scenario(
        SCENARIOS / "gb-frequency-event.toml", ["duration_s=125", "events[0].at_s=0", "jobs[1].start_s=100"]
    )
    res = run(loaded, controller="none")
    summary = summarize(res)
    # the campus's own load adds only millihertz in a 20 GW system (0.47 mHz at most: docs/scenarios.md)
    assert summary["max_freq_dev_hz"] == pytest.approx(50.0 - float(record[:, 1].min()), abs=1e-3)
    assert float(res.tick["freq_hz"].min()) == pytest.approx(float(record[:, 1].min()), abs=1e-3)
    nadir_s = float(res.t_s[np.argmin(res.tick["freq_hz"])])
    assert nadir_s == pytest.approx(float(record[np.argmin(record[:, 1]), 0]), abs=1.0)


def test_trace_job_replays_the_measured_profile(shared_data: Path) -> None:
    """The hall draws the idle lead-in of the trace, then its training power scaled 1,400 / 250."""
    loaded = load_scenario(SCENARIOS / "trace-hall.toml", ["duration_s=40"])
    job = loaded.scenario.jobs[0]
    assert loaded.resolve(str(job.trace_path)).resolve() == (shared_data / TRACE_CSV).resolve()
    res = run(loaded, controller="none")
    site = res.site
    demand = res.tick["demand_w"]
    idle_w = float(site.rack_power_w(np.full(site.n_racks, site.gpu.idle_w)).sum())
    assert demand[50] == pytest.approx(idle_w, rel=0.02)  # 5 s in: the trace's idle lead-in
    # its training peak within the 40 s played: the largest mean of the two traced GPUs, scaled from 250 W
    t_s, power_w = load_nvsmi_trace(shared_data / TRACE_CSV, 2, "test", "trace")
    pairs = power_w[t_s <= 40.0].mean(axis=1)
    per_gpu_w = min(float(pairs.max()) / 250.0 * site.gpu.rated_w, site.gpu.rated_w)
    running = ~site.rack_is_spare
    peak_w = float(site.rack_power_w(np.where(running, per_gpu_w, site.gpu.idle_w)).sum())
    assert demand.max() <= peak_w * (1 + 1e-9)
    assert demand.max() >= 0.97 * peak_w
