"""dimmer.gpus.throughput_frac against the measured Perseus / ML.ENERGY A100 stage profile of GPT-3 175B."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from dimmer.gpus import throughput_frac

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PROFILE = DATA / "zeus_perseus_stage_profile_gpt3-175b_a100_sxm_bf16.csv"


def _measured() -> tuple[np.ndarray, np.ndarray]:
    """(relative power, relative throughput) per SM clock, both relative to the highest clock.

    Time and energy are summed over every stage and instruction at one clock: power = E / t,
    throughput ~ 1 / t.
    """
    if not PROFILE.is_file():
        pytest.skip(f"measured data {PROFILE} is absent (the checkout's parent holds shared/data)")
    time_s: dict[int, float] = defaultdict(float)
    energy_j: dict[int, float] = defaultdict(float)
    with PROFILE.open(newline="") as f:
        for row in csv.DictReader(f):
            clock = int(row["frequency"])
            time_s[clock] += float(row["time"])
            energy_j[clock] += float(row["energy"])
    clocks = sorted(time_s)
    top = clocks[-1]
    power = np.array([energy_j[c] / time_s[c] for c in clocks]) / (energy_j[top] / time_s[top])
    speed = np.array([time_s[top] / time_s[c] for c in clocks])
    return power, speed


def test_profile_covers_the_published_range() -> None:
    power, speed = _measured()
    assert power.size == 38  # 38 SM clocks, 855-1410 MHz
    assert power.min() == pytest.approx(0.50, abs=0.01)
    assert speed.min() == pytest.approx(0.66, abs=0.01)  # MODELS.md: 0.50 -> 0.661


def test_curve_is_within_2pct_of_every_measured_point() -> None:
    power, speed = _measured()
    rel_err = np.abs(throughput_frac(power) / speed - 1.0)
    assert rel_err.max() <= 0.02  # measured: 0.8 %


def test_no_single_power_law_fits_within_2pct() -> None:
    """perf = (P/P0)^alpha for every alpha in 0.01-2 misses some point by more than 2 % (the best, alpha 0.52,
    misses by 6.4 %), so the piecewise fit is needed."""
    power, speed = _measured()
    alphas = np.linspace(0.01, 2.0, 4000)
    worst = np.max(np.abs(power[None, :] ** alphas[:, None] / speed[None, :] - 1.0), axis=1)
    assert worst.min() > 0.02
    # the exponents MODELS.md quotes are each worse still
    for alpha in (0.3, 0.5):
        assert np.max(np.abs(power**alpha / speed - 1.0)) > 0.02


def test_curve_is_monotone_and_bounded() -> None:
    p = np.linspace(0.0, 1.5, 3001)
    y = throughput_frac(p)
    assert np.all(np.diff(y) >= 0.0)
    assert np.all((y >= 0.0) & (y <= 1.0))
    assert throughput_frac(1.0) == 1.0 and throughput_frac(1.3) == 1.0
