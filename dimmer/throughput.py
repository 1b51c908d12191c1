"""Throughput under a power cap: one curve per GPU preset, and per job where the job carries its own.

A curve maps relative power (the power a GPU is held to / what it would draw uncapped) to relative throughput. It is
a table of points evaluated piecewise-linearly: 1.0 at or above relative power 1, the lowest segment's slope
extended below the lowest point, floored at 0. Three ways to get one:

- the shipped table (`dimmer.gpus.PERF_POWER_FRAC` / `PERF_THROUGHPUT_FRAC`, the default for every GPU preset);
- points given in a scenario (`[[jobs]] throughput_curve = [[p, t], ...]`), or a named measured preset
  (`throughput_curve = "a40-bloom-176b"`, `THROUGHPUT_PRESETS`);
- a measured per-clock profile file as Perseus / ML.ENERGY publish it (`stage,instruction,frequency,time,energy`):
  time and energy summed over stages and instructions per clock, power = energy / time, throughput ~ 1 / time,
  both relative to the highest clock; the saturating form `fit_saturating` is fitted to those points with
  scipy.optimize.curve_fit and sampled every 0.025 of relative power from the lowest measured power to 1.

The saturating form t(p) = 1 − a·(exp(b·(1 − p)) − 1), a, b > 0: t(1) = 1, strictly increasing, flattening toward
full power (slope a·b at p = 1) and falling ever faster below, as throughput does once the clock leaves the
memory-bound plateau. Fitted to the four Perseus stage profiles (GPT-3 175B and BLOOM 176B on A100 SXM and A40) it
misses the worst measured clock by 2.2-3.4 %, where a single power law misses by 6-15 % and a saturating
hyperbola p(1 + c)/(p + c) by 4-9 % (measured; docs/models.md).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from dimmer.errors import InputError
from dimmer.inputfile import read_input_text

FloatArray = npt.NDArray[np.float64]

# A Perseus stage profile is ~600 lines (38-60 clocks x stages x 2 instructions); 16 MiB is far above any real one.
MAX_PROFILE_BYTES = 16 * 1024 * 1024
PROFILE_COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
SAMPLE_STEP = 0.025


@dataclass(frozen=True)
class ThroughputCurve:
    """Relative throughput at relative power, as points; `source` says where the points come from."""

    name: str
    power_frac: tuple[float, ...]  # strictly increasing, last 1.0
    throughput_frac: tuple[float, ...]  # non-decreasing, in (0, 1], last 1.0
    source: str = ""

    def __post_init__(self) -> None:
        problem = curve_problem(list(zip(self.power_frac, self.throughput_frac, strict=False)))
        if problem or len(self.power_frac) != len(self.throughput_frac):
            raise ValueError(f"throughput curve {self.name!r}: {problem or 'as many powers as throughputs'}")

    def __call__(self, power_frac: npt.ArrayLike) -> FloatArray:
        """Relative throughput at `power_frac` (any shape)."""
        p = np.asarray(power_frac, dtype=np.float64)
        xs = np.asarray(self.power_frac)
        ys = np.asarray(self.throughput_frac)
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
        inside = np.interp(np.minimum(p, 1.0), xs, ys)
        below = ys[0] + slope * (p - xs[0])
        out: FloatArray = np.where(p < xs[0], np.maximum(below, 0.0), inside)
        return out

    @property
    def points(self) -> list[list[float]]:
        return [[p, t] for p, t in zip(self.power_frac, self.throughput_frac, strict=True)]


def curve_problem(points: Sequence[Sequence[float]]) -> str:
    """What is wrong with `points` as a throughput curve ('' when nothing): the expected form, for an error."""
    if len(points) < 2 or any(len(pt) != 2 for pt in points):
        return "at least two [relative power, relative throughput] pairs"
    ps = [float(pt[0]) for pt in points]
    ts = [float(pt[1]) for pt in points]
    if not all(math.isfinite(v) for v in ps + ts):
        return "finite numbers"
    if not all(0.0 < p <= 1.0 for p in ps) or not all(0.0 < t <= 1.0 for t in ts):
        return "relative power and throughput each in (0, 1]"
    if any(b <= a for a, b in itertools.pairwise(ps)):
        return "relative power strictly increasing"
    if any(b < a for a, b in itertools.pairwise(ts)):
        return "relative throughput non-decreasing (monotone)"
    if ps[-1] != 1.0 or ts[-1] != 1.0:
        return "the last point [1.0, 1.0] (full power runs at full speed)"
    return ""


def curve_from_points(name: str, points: Sequence[Sequence[float]], source: str) -> ThroughputCurve:
    return ThroughputCurve(name, tuple(float(p[0]) for p in points), tuple(float(p[1]) for p in points), source=source)


# ---- the saturating form and the profile fit -----------------------------------------------------------------
def saturating(p: npt.ArrayLike, a: float, b: float) -> FloatArray:
    """t(p) = 1 − a·(exp(b·(1 − p)) − 1)."""
    out: FloatArray = 1.0 - a * np.expm1(b * (1.0 - np.asarray(p, dtype=np.float64)))
    return out


def fit_saturating(power_frac: FloatArray, speed_frac: FloatArray) -> tuple[float, float]:
    """(a, b) of `saturating` by least squares (scipy.optimize.curve_fit), both kept positive."""
    from scipy.optimize import curve_fit  # a file-load path only: keeps scipy.optimize out of the controller's import

    p = np.minimum(np.asarray(power_frac, dtype=np.float64), 1.0)
    (a, b), _ = curve_fit(saturating, p, speed_frac, p0=(0.05, 4.0), bounds=((1e-9, 1e-6), (10.0, 50.0)))
    return float(a), float(b)


def curve_from_fit(name: str, a: float, b: float, lowest_power_frac: float, source: str) -> ThroughputCurve:
    """`saturating(a, b)` sampled every SAMPLE_STEP from `lowest_power_frac` to 1 (below: the lowest slope extended)."""
    lo = min(max(lowest_power_frac, SAMPLE_STEP), 1.0 - SAMPLE_STEP)
    n = max(math.ceil((1.0 - lo) / SAMPLE_STEP - 1e-9), 1)
    ps = np.linspace(lo, 1.0, n + 1)
    ts = np.clip(saturating(ps, a, b), 1e-6, 1.0)
    ts[-1] = 1.0
    return ThroughputCurve(name, tuple(ps.tolist()), tuple(np.maximum.accumulate(ts).tolist()), source=source)


def profile_points(text: str, source: str, key: str) -> tuple[FloatArray, FloatArray]:
    """(relative power, relative throughput) per clock of a Perseus stage profile, sorted by clock."""
    what = "Perseus stage profile (CSV: stage,instruction,frequency,time,energy)"
    reader = csv.DictReader(io.StringIO(text, newline=""))
    if reader.fieldnames is None or not set(PROFILE_COLUMNS) <= {c.strip() for c in reader.fieldnames}:
        raise InputError(source, key, f"a {what} with a header naming those columns")
    time_s: dict[float, float] = defaultdict(float)
    energy_j: dict[float, float] = defaultdict(float)
    for n, row in enumerate(reader, start=2):
        row = {k.strip(): v for k, v in row.items() if k is not None}
        try:
            clock, t, e = float(row["frequency"]), float(row["time"]), float(row["energy"])
        except (TypeError, ValueError):
            raise InputError(source, key, f"a {what}: numbers in frequency, time, energy (line {n})") from None
        if not (math.isfinite(clock) and t > 0 and e > 0 and math.isfinite(t) and math.isfinite(e)):
            raise InputError(source, key, f"a {what}: positive finite time and energy (line {n})")
        time_s[clock] += t
        energy_j[clock] += e
    if len(time_s) < 3:
        raise InputError(source, key, f"a {what} with at least 3 clocks")
    clocks = sorted(time_s)
    top = clocks[-1]
    power = np.array([energy_j[c] / time_s[c] for c in clocks]) / (energy_j[top] / time_s[top])
    speed = np.array([time_s[top] / time_s[c] for c in clocks])
    return power, speed


def load_profile_curve(path: Path, source: str, key: str) -> ThroughputCurve:
    """The saturating fit to a Perseus / ML.ENERGY per-clock profile file, sampled (InputError on a bad file)."""
    text = read_input_text(path, source, key, "Perseus stage profile CSV", MAX_PROFILE_BYTES)
    power, speed = profile_points(text, source, key)
    try:
        a, b = fit_saturating(power, speed)
    except (RuntimeError, ValueError):
        raise InputError(source, key, "a profile whose throughput rises with power (the fit failed)") from None
    return curve_from_fit(path.name, a, b, float(power.min()), source=f"fitted to {path.name}")


# ---- measured presets ------------------------------------------------------------------------------------------
# `saturating` fitted (fit_saturating) to the Perseus stage
# profiles, ml-energy/zeus @38cb3f90c30d9041d4b141cfe5c922dba55baa45 : sosp24_data/emulation/stage_profile/<name>.csv
# (Perseus, SOSP 2024; Apache-2.0); the A100 GPT-3 one is ../shared/data's file, which tests refit.
_ZEUS = "Perseus (SOSP 2024) stage profile, ml-energy/zeus @38cb3f90 sosp24_data/emulation/stage_profile/"
_MEASURED: dict[str, tuple[float, float, float, str]] = {
    # name: (a, b, lowest measured relative power, file); max error over the measured clocks in the comment
    "a100-gpt3-175b": (0.0372, 4.5950, 0.497, "gpt3-175b+a100_sxm_bf16.csv"),  # 38 clocks, 2.3 %
    "a100-bloom-176b": (0.0215, 5.4513, 0.487, "bloom+a100_sxm_bf16.csv"),  # 38 clocks, 2.7 %
    "a40-gpt3-175b": (0.0505, 4.1438, 0.607, "gpt3-175b+a40_bf16.csv"),  # 60 clocks, 2.6 %
    "a40-bloom-176b": (0.0678, 3.8049, 0.599, "bloom+a40_bf16.csv"),  # 60 clocks, 3.4 %
}
THROUGHPUT_PRESETS: dict[str, ThroughputCurve] = {
    name: curve_from_fit(name, a, b, lo, source=_ZEUS + f) for name, (a, b, lo, f) in _MEASURED.items()
}
