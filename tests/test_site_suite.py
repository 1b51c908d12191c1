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
