"""dimmer.gpus.throughput_frac against the measured Perseus / ML.ENERGY A100 stage profile of GPT-3 175B."""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from dimmer.errors import InputError
from dimmer.gpus import DEFAULT_CURVE, GPU_PRESETS, PERF_POWER_FRAC, PERF_THROUGHPUT_FRAC, throughput_frac
from dimmer.throughput import (
    THROUGHPUT_PRESETS,
    fit_saturating,
    load_profile_curve,
    profile_points,
    saturating,
)

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


# ---- the saturating fit and the profile loader (dimmer.throughput) ---------------------------------------------
def test_profile_loader_reads_the_shared_file_as_the_test_does() -> None:
    power, speed = _measured()
    p, s = profile_points(PROFILE.read_text(encoding="utf-8"), "t", "k")
    np.testing.assert_allclose(p, power, rtol=1e-12)
    np.testing.assert_allclose(s, speed, rtol=1e-12)


def test_saturating_fit_reproduces_the_shared_perseus_curve_within_2_5pct() -> None:
    """load_profile_curve (curve_fit of 1 − a(e^{b(1−p)} − 1), sampled every 0.025) against every measured clock:
    measured 2.26 % worst (at 0.50 of peak power: 0.663 vs 0.656), 0.9 % mean."""
    power, speed = _measured()
    curve = load_profile_curve(PROFILE, "t", "jobs[0].throughput_profile")
    rel = np.abs(curve(power) / speed - 1.0)
    assert rel.max() <= 0.025
    assert rel.mean() <= 0.012
    # and the shipped preset is that same fit, frozen
    np.testing.assert_allclose(THROUGHPUT_PRESETS["a100-gpt3-175b"](power), curve(power), atol=2e-3)


def test_saturating_form_beats_a_power_law_and_a_hyperbola_on_the_shared_profile() -> None:
    """Why this form (docs/models.md): one power law misses by > 6 % and p(1 + c)/(p + c) by > 8 % at best."""
    from scipy.optimize import curve_fit

    power, speed = _measured()
    p = np.minimum(power, 1.0)
    a, b = fit_saturating(power, speed)
    sat = np.abs(saturating(p, a, b) / speed - 1.0).max()
    (c,), _ = curve_fit(lambda x, c: x * (1 + c) / (x + c), p, speed, p0=(0.3,))
    hyp = np.abs(p * (1 + c) / (p + c) / speed - 1.0).max()
    assert sat < 0.025 < 0.06 < hyp


def test_presets_are_monotone_bounded_and_sourced() -> None:
    p = np.linspace(0.2, 1.5, 1301)
    for name, curve in THROUGHPUT_PRESETS.items():
        y = curve(p)
        assert np.all(np.diff(y) >= 0.0) and np.all((y > 0.0) & (y <= 1.0)), name
        assert curve(1.0) == 1.0 and "ml-energy/zeus @38cb3f90" in curve.source, name
    # the example: A40 BLOOM at its lowest clock runs far slower than the shipped A100 table says
    lowest = THROUGHPUT_PRESETS["a40-bloom-176b"].power_frac[0]
    assert float(throughput_frac(lowest)) == pytest.approx(0.821, abs=0.002)
    assert float(THROUGHPUT_PRESETS["a40-bloom-176b"](lowest)) == pytest.approx(0.756, abs=0.002)  # measured 0.732


def test_profile_loader_refuses_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "p.csv"
    for text, says in [
        ("a,b\n1,2\n", "header"),
        ("stage,instruction,frequency,time,energy\n0,f,1,x,2\n", "numbers"),
        ("stage,instruction,frequency,time,energy\n0,f,1,-1,2\n", "positive"),
        ("stage,instruction,frequency,time,energy\n0,f,1,1,2\n0,f,2,1,2\n", "3 clocks"),
    ]:
        bad.write_text(text)
        with pytest.raises(InputError, match=says) as exc:
            load_profile_curve(bad, "s.toml", "jobs[0].throughput_profile")
        assert "jobs[0].throughput_profile" in str(exc.value)
    with pytest.raises(InputError, match="existing"):
        load_profile_curve(tmp_path / "none.csv", "s.toml", "jobs[0].throughput_profile")


def test_default_curve_is_the_shipped_table_to_the_bit() -> None:
    p = np.linspace(-0.2, 1.4, 4001)
    xs, ys = np.asarray(PERF_POWER_FRAC), np.asarray(PERF_THROUGHPUT_FRAC)
    slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
    today = np.where(p < xs[0], np.maximum(ys[0] + slope * (p - xs[0]), 0.0), np.interp(np.minimum(p, 1.0), xs, ys))
    assert np.array_equal(throughput_frac(p), today)
    for gpu in GPU_PRESETS.values():
        assert gpu.throughput is DEFAULT_CURVE
