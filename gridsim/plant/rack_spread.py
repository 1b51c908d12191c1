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

Most ticks find all of a job's racks on one side of an edge; those read their peak or trough from a table sorted by
job, and only the racks of a job at an edge take the formula. Each element is computed by the same arithmetic
whether one tick `(k,)` is asked (`Workload.rack_demand_w`) or a block `(T, k)` (`workload_period.advance_ticks`),
so the two paths give the same numbers, to the bit. docs/models.md gives the measured defaults and their sources.
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
    """The running racks of jobs whose racks are not in lockstep, as a table: `(k,)` per rack, `(n_jobs,)` per job."""

    rack: IntArray  # rack index on the site
    job: IntArray  # its job
    offset_s: FloatArray  # fixed phase lag behind the job's phase (seconds of progress; negative: ahead)
    gain: FloatArray  # multiplier on the job's swing (peak - trough); the job's racks average 1
    trough_w: FloatArray  # the rack's level in its trough (its job's)
    swing_w: FloatArray  # gain * (peak - trough): what a whole tick in compute adds
    peak_w: FloatArray  # the rack's level over a whole tick in compute: clip(trough + swing)
    jobs_on: IntArray  # (m,) the jobs with a spread: the only ones whose phase is read
    slot: IntArray  # (k,) the rack's job's place in jobs_on; the table is sorted by it
    count: IntArray  # (m,) racks of each job on, in the table
    start: IntArray  # (m,) where each job's racks begin in the table
    job_lead_s: FloatArray  # (m,) per job on, the most negative offset of its racks
    job_lag_s: FloatArray  # (m,) per job on, the largest offset

    @classmethod
    def build(
        cls,
        site: SiteModel,
        jobs: Sequence[RackSpreadFields],
        rng: np.random.Generator,
        peak_w: FloatArray,
        trough_w: FloatArray,
        idle_w: float,
        rated_w: float,
    ) -> RackSpread | None:
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
        n = len(jobs)
        u = rng.random(site.n_racks)
        z = np.clip(rng.standard_normal(site.n_racks), -_Z_CLIP, _Z_CLIP)
        rj = site.rack_job
        running = (rj >= 0) & ~site.rack_is_spare
        rack = np.flatnonzero(running & on[np.where(rj >= 0, rj, 0)])
        job = rj[rack].astype(np.int64)
        z = z[rack]
        # centre each job's draws: the job's racks' gains average exactly 1 (up to rounding)
        per_job = np.bincount(job, minlength=n).astype(np.float64)
        z_mean = np.bincount(job, weights=z, minlength=n) / np.maximum(per_job, 1.0)
        gain = 1.0 + spread[job] * (z - z_mean[job])
        offset = (u[rack] - 0.5) * skew[job]
        jobs_on = np.flatnonzero(on)
        slot = np.searchsorted(jobs_on, job)
        # sorted by job, so that a per-job value reaches the job's racks as one np.repeat, not a gather
        order = np.argsort(slot, kind="stable")
        rack, job, slot, offset, gain = rack[order], job[order], slot[order], offset[order], gain[order]
        count = np.bincount(slot, minlength=jobs_on.size).astype(np.int64)
        start = (np.cumsum(count) - count).astype(np.int64)
        lead, lag = np.zeros(jobs_on.size), np.zeros(jobs_on.size)
        np.minimum.at(lead, slot, offset)
        np.maximum.at(lag, slot, offset)
        trough = trough_w[job]
        swing = gain * (peak_w[job] - trough)
        peak = _level(trough, swing, np.ones(rack.size), idle_w, rated_w)
        return cls(rack, job, offset, gain, trough, swing, peak, jobs_on, slot, count, start, lead, lag)


def _level(trough_w: FloatArray, swing_w: FloatArray, frac: FloatArray, idle_w: float, rated_w: float) -> FloatArray:
    # clipped like every demand: a gain far above 1 on a job near rated meets the ceiling
    return np.minimum(np.maximum(trough_w + swing_w * frac, idle_w), rated_w)


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
    running: npt.NDArray[np.bool_],
    job_level_w: FloatArray,
    idle_w: float,
    rated_w: float,
) -> FloatArray:
    """Per-GPU level of each rack of `sp`: its tick mean while its job runs, the job's level while it does not.

    The job arrays are `(n_jobs,)` for one tick, or `(T, n_jobs)` for a block of T ticks (`running` is `(n_jobs,)`
    either way); the result is `(k,)` or `(T, k)`. Only racks whose job has a rack at an edge in a tick (the union
    of its racks' intervals crosses a phase boundary) go through `compute_fraction`; the rest of a job's racks are
    all in compute or all in the trough, read from the per-rack table. Each element is the same arithmetic however
    many ticks are asked at once, so a block gives what its ticks give one by one, to the bit."""
    shape = (*np.shape(phase_s)[:-1], sp.rack.size)
    jobs = sp.jobs_on  # (a trace job's period is infinite: never read here)
    phase = np.atleast_2d(phase_s)[:, jobs]
    step = np.atleast_2d(step_s)[:, jobs]
    length = np.atleast_2d(iter_len_s)[:, jobs]
    on = np.atleast_2d(on_len_s)[:, jobs]
    run = running[jobs]
    # per job and tick: where the earliest rack's interval starts and the latest's ends, in the job's iteration
    lo = phase - step - sp.job_lag_s
    hi = phase - sp.job_lead_s
    k_lo = np.floor(lo / length)
    k_hi = np.floor(hi / length)
    same = k_lo == k_hi
    in_compute = same & (hi - k_hi * length < on)
    in_trough = same & (lo - k_lo * length >= on)
    edge = ~(in_compute | in_trough) & run
    count = sp.count
    level = np.where(np.repeat(in_compute, count, axis=1), sp.peak_w, sp.trough_w)
    if not run.all():
        held = np.repeat(np.atleast_2d(job_level_w)[:, jobs], count, axis=1)
        level = np.where(np.repeat(run, count), level, held)
    tick, slot = np.nonzero(edge)  # (tick, job) pairs with a rack at an edge: their racks, one block each
    if tick.size:
        n_racks = count[slot]
        rows = np.repeat(tick, n_racks)
        cols = np.repeat(sp.start[slot] - (np.cumsum(n_racks) - n_racks), n_racks) + np.arange(rows.size)

        def each(x: FloatArray) -> FloatArray:  # a (tick, job) value to each of the job's racks
            return np.repeat(x[tick, slot], n_racks)

        frac = compute_fraction(each(phase), each(step), each(length), each(on), sp.offset_s[cols])
        level[rows, cols] = _level(sp.trough_w[cols], sp.swing_w[cols], frac, idle_w, rated_w)
    return level.reshape(shape)


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
