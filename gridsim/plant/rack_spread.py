"""Per-rack phase skew and amplitude spread of a synchronous job's iteration swing.

A collective (all-reduce) synchronises every rank of a job once an iteration, so the racks of one job do not drift
apart: each rack keeps a fixed phase offset, drawn once, within `rack_phase_skew_s` of every other rack of its job
(offsets uniform on [-skew/2, +skew/2]). Chips of one SKU draw different power for the same work, so each rack's
swing (peak - trough) is scaled by a fixed gain 1 + spread * z, z a standard normal clipped to +-3 and centred on
the job's racks, so that the job's mean gain is 1 and its aggregate swing is the one the job spec asks for.
Separate jobs drift apart through their own per-iteration period jitter (`jitter_frac`), as before.

A skew of milliseconds is below the tick (0.1 s), so a rack's level in a tick is its *tick mean*: the fraction of
the tick's phase interval [phase - step, phase] (shifted by the rack's offset) it spends in compute, weighted
between trough and peak. The compute time of a rack up to phase x is F(x) = k * on + min(x - k * L, on),
k = floor(x / L): the current iteration's period L and compute length `on`, continued periodically either side,
which is exact while |offset| + step stays within the neighbouring phases (the job spec keeps the skew below half an
iteration). Where the step is zero (a stalled job) the level is the point sample at the shifted phase.

Everything here is elementwise over arrays that broadcast, so one function serves a tick `(k,)` in
`Workload.rack_demand_w` and a block of ticks `(T, k)` in `workload_period.advance_ticks`, to the bit: the two paths
must give the same numbers. docs/models.md gives the measured defaults and their sources.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from dimmer.site import SiteModel

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_Z_CLIP = 3.0  # the gain's normal draw is clipped here, so a gain is bounded (docs/models.md)


class RackSpreadFields(Protocol):
    """What a job spec carries for this model (JobSpec has these keys)."""

    @property
    def kind(self) -> str: ...
    @property
    def rack_phase_skew_s(self) -> float: ...
    @property
    def rack_amplitude_spread_frac(self) -> float: ...


@dataclass(frozen=True)
class RackSpread:
    """The running racks of jobs whose racks are not in lockstep, as a table: `(k,)` per rack."""

    rack: IntArray  # rack index on the site
    job: IntArray  # its job
    offset_s: FloatArray  # fixed phase lag behind the job's phase (seconds of progress; negative: ahead)
    gain: FloatArray  # multiplier on the job's swing (peak - trough); the job's racks average 1

    @classmethod
    def build(cls, site: SiteModel, jobs: Sequence[RackSpreadFields], rng: np.random.Generator) -> RackSpread | None:
        """The table for `site`, drawn once from `rng`; None where every job's racks run in lockstep.

        One uniform and one normal are drawn for every rack of the site, whether used or not, so a rack's
        offset and gain depend on the seed and its own job's keys only, not on the other jobs."""
        skew = np.asarray([j.rack_phase_skew_s if j.kind == "synthetic" else 0.0 for j in jobs], dtype=np.float64)
        spread = np.asarray(
            [j.rack_amplitude_spread_frac if j.kind == "synthetic" else 0.0 for j in jobs], dtype=np.float64
        )
        on = (skew > 0) | (spread > 0)
        if not on.any():
            return None
        u = rng.random(site.n_racks)
        z = np.clip(rng.standard_normal(site.n_racks), -_Z_CLIP, _Z_CLIP)
        rj = site.rack_job
        running = (rj >= 0) & ~site.rack_is_spare
        rack = np.flatnonzero(running & on[np.where(rj >= 0, rj, 0)])
        job = rj[rack].astype(np.int64)
        z = z[rack]
        # centre each job's draws: the job's racks' gains average exactly 1 (up to rounding)
        count = np.bincount(job, minlength=len(jobs)).astype(np.float64)
        z_mean = np.bincount(job, weights=z, minlength=len(jobs)) / np.maximum(count, 1.0)
        gain = 1.0 + spread[job] * (z - z_mean[job])
        offset = (u[rack] - 0.5) * skew[job]
        return cls(rack=rack, job=job, offset_s=offset, gain=gain)


def compute_fraction(
    phase_s: FloatArray, step_s: FloatArray, iter_len_s: FloatArray, on_len_s: FloatArray, offset_s: FloatArray
) -> FloatArray:
    """Share of the last tick's phase interval [phase - step, phase] - offset spent in compute, in [0, 1].

    `phase_s` is the job's phase at the tick's end (after any wrap), `step_s` the progress the tick added;
    all arguments broadcast. A zero step gives the point sample at phase - offset."""
    hi = phase_s - offset_s
    lo = hi - step_s
    k_hi = np.floor(hi / iter_len_s)
    k_lo = np.floor(lo / iter_len_s)
    r_hi = hi - k_hi * iter_len_s
    f_hi = k_hi * on_len_s + np.minimum(r_hi, on_len_s)
    f_lo = k_lo * on_len_s + np.minimum(lo - k_lo * iter_len_s, on_len_s)
    moved = step_s > 0.0
    frac = np.where(moved, (f_hi - f_lo) / np.where(moved, step_s, 1.0), r_hi < on_len_s)
    return np.minimum(np.maximum(frac, 0.0), 1.0)


def rack_levels(
    sp: RackSpread,
    phase_s: FloatArray,
    step_s: FloatArray,
    iter_len_s: FloatArray,
    on_len_s: FloatArray,
    peak_w: FloatArray,
    trough_w: FloatArray,
    idle_w: float,
    rated_w: float,
) -> FloatArray:
    """Per-GPU level of each rack of `sp` while its job runs: trough + gain * (peak - trough) * compute fraction.

    The job arrays are `(n_jobs,)` for one tick or `(T, n_jobs)` for a block; the result is `(k,)` or `(T, k)`.
    Clipped to [idle, rated] like every demand (a gain far above 1 on a job near rated meets the ceiling)."""
    j = sp.job
    frac = compute_fraction(phase_s[..., j], step_s[..., j], iter_len_s[..., j], on_len_s[..., j], sp.offset_s)
    trough = trough_w[j]
    level = trough + sp.gain * (peak_w[j] - trough) * frac
    return np.minimum(np.maximum(level, idle_w), rated_w)


@dataclass(frozen=True)
class PairSpread:
    """Two GPUs of one synchronous job, measured side by side (`measure_pair`)."""

    swing_ratio: float  # std of GPU 1's training power over GPU 0's: the ratio of their swing amplitudes
    compute_ratio: float  # GPU 1's over GPU 0's mean power in the compute phase (both above their joint median)
    trough_ratio: float  # the same in the trough (both at or below it)
    xcorr_peak_lag: int  # the lag, in samples, at which the two series correlate best (0: within a sample)
    edge_lag_s: float  # median of GPU 1's transition time less GPU 0's, matched edge by edge
    edge_lag_ci_s: tuple[float, float]  # its 95 % bootstrap interval
    edges: int  # transitions matched

    @property
    def gpu_spread_frac(self) -> float:
        """Std of a per-GPU swing multiplier from the two: |ln ratio| / sqrt(2), a two-sample std."""
        return abs(float(np.log(self.swing_ratio))) / float(np.sqrt(2.0))


def measure_pair(t_s: FloatArray, power_w: FloatArray, training: npt.NDArray[np.bool_]) -> PairSpread:
    """How far two GPUs of one data-parallel job are apart, from a power log `(n, 2)` at times `t_s`.

    `training` marks the samples in iterations (not idle, not evaluation). A transition is a GPU's crossing of its
    own mid level (mean of its 5th and 95th percentiles in training), linearly interpolated between samples; each
    of GPU 0's is matched to GPU 1's nearest in the same direction within half a second. At 100 ms sampling a lag
    is a bound, not a value: the estimate is the median over hundreds of edges, with its interval."""
    p = power_w[:, :2]
    x = np.where(training[:, None], p - p[training].mean(axis=0), 0.0)
    n = x.shape[0]
    norm = float(np.sqrt(np.sum(x[:, 0] ** 2) * np.sum(x[:, 1] ** 2)))
    lags = range(-3, 4)
    corr = [float(np.sum(x[max(0, -k) : n - max(0, k), 0] * x[max(0, k) : n - max(0, -k), 1])) / norm for k in lags]
    total = p.sum(axis=1)
    high = training & (total > np.median(total[training]))
    low = training & ~high

    def edges(col: int) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
        y = p[:, col]
        lo, hi = np.percentile(y[training], [5, 95])
        mid = 0.5 * (lo + hi)
        above = y > mid
        i = np.flatnonzero((above[1:] != above[:-1]) & training[1:] & training[:-1])
        frac = (mid - y[i]) / (y[i + 1] - y[i])
        return t_s[i] + frac * (t_s[i + 1] - t_s[i]), above[i + 1]

    t0, up0 = edges(0)
    t1, up1 = edges(1)
    lag: list[float] = []
    for t, up in zip(t0.tolist(), up0.tolist(), strict=True):  # once per edge of a measured log, not per tick
        same = t1[up1 == up]
        if same.size:
            d = float(same[np.argmin(np.abs(same - t))] - t)
            if abs(d) < 0.5:
                lag.append(d)
    lag_a = np.asarray(lag)
    boot = np.random.default_rng(0).choice(lag_a, size=(2000, lag_a.size))
    ci = np.percentile(np.median(boot, axis=1), [2.5, 97.5])
    return PairSpread(
        swing_ratio=float(p[training, 1].std() / p[training, 0].std()),
        compute_ratio=float(p[high, 1].mean() / p[high, 0].mean()),
        trough_ratio=float(p[low, 1].mean() / p[low, 0].mean()),
        xcorr_peak_lag=int(list(lags)[int(np.argmax(corr))]),
        edge_lag_s=float(np.median(lag_a)),
        edge_lag_ci_s=(float(ci[0]), float(ci[1])),
        edges=int(lag_a.size),
    )
