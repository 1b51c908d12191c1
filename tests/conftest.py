"""Shared test settings: hypothesis profiles, and where the measured data lives."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# ci: bounded so the whole suite fits CI's budget; dev: the default; long: for a soak run by hand.
settings.register_profile("ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SCENARIOS = REPO / "scenarios"

# the smallest scenario every loader test starts from: one job on two rows of four racks
MINIMAL_SCENARIO = """
name = "tiny"
duration_s = 10
[site.pcc]
limit_mw = 2.0
[[site.levels]]
level = "row"
count = 2
rating_kw = 600
[[site.levels]]
level = "rack"
count = 4
[[jobs]]
name = "j"
gpus = 256
"""


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"measured data folder {SHARED_DATA} is absent")
    return SHARED_DATA


def needs_shared_data(raw: Mapping[str, Any]) -> bool:
    """A scenario (its parsed TOML) that replays measured data (a frequency record, a power trace) from
    ../shared/data."""
    replays = any(ev.get("kind") == "frequency_replay" for ev in raw.get("events", []))
    traces = any(job.get("kind") == "trace" for job in raw.get("jobs", []))
    return replays or traces


def skip_without_shared_data(path: Path) -> None:
    """Skip, with the reason, a test of a scenario whose measured data is absent (a clone with no ../shared)."""
    with path.open("rb") as f:
        raw = tomllib.load(f)
    if needs_shared_data(raw) and not SHARED_DATA.is_dir():
        pytest.skip(f"{path.name} replays measured data from {SHARED_DATA}, which is absent")
