"""The series and spans the report reads from a `SimResult`: no drawing and no prose, so each is testable alone.

The time axis in a unit that suits the span, trailing means and the ramp envelope the utility's ramp metric implies,
runs of a condition (`episodes`, `spells`), the events to mark on a time axis, the jobs and breakers worth drawing,
and the useful work over time (`goodput_series`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from gridsim.engine import SimResult
from gridsim.plant.grid import window_means_w
from gridsim.plant.workload import JobState

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

TOP_DOMAINS = 6  # domains shown in domains.png
MAX_JOBS_SHOWN = 8  # jobs drawn in jobs.png and goodput.png (the highest priority first)


def time_axis(t_s: npt.NDArray[np.floating[Any]]) -> tuple[npt.NDArray[np.floating[Any]], str]:
    """Times in the unit that suits the span (s up to 3 min, min up to 3 h, then h), and the axis label."""
    scale, label = _time_unit(float(t_s[-1]) if t_s.size else 0.0)
    return t_s / scale, label


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s > 3 * 3600:
        return 3600.0, "time [h]"
    if span_s > 180:
        return 60.0, "time [min]"
    return 1.0, "time [s]"


def trailing_mean(x: FloatArray, n: int) -> FloatArray:
    """Mean of the last `n` samples at every sample; NaN until a whole window has passed."""
    csum = np.concatenate([[0.0], np.cumsum(x - (x[0] if x.size else 0.0))])
    out = np.full(x.shape, np.nan)
    if x.size >= n:
        out[n - 1 :] = (csum[n:] - csum[:-n]) / n + x[0]
    return out


def ramp_envelope_w(res: SimResult) -> tuple[FloatArray, FloatArray, FloatArray]:
    """The trailing window mean m(t) of grid import and the band the ramp limit allows it.

    The ramp metric is |m(t) − m(t − W)| / W (gridsim.plant.grid.ramp_w_per_min, demand as its reference, the
    windows reaching back before the run into `pre_run_w`); it holds while m(t) stays within m(t − W) ± L·W (L the
    ramp limit per second, W the window). Returns (m, low, high), each (n_ticks,), from the first tick; low and
    high NaN where there is no limit.
    """
    grid = res.tick["grid_w"]
    window_s = res.site.ramp_window_s
    n = max(1, round(window_s / res.tick_s))
    means = window_means_w(grid, res.tick_s, window_s, res.tick["demand_w"], windows_before=1)
    mean = means[n:]
    low = np.full(grid.shape, np.nan)
    high = np.full(grid.shape, np.nan)
    limit = res.site.ramp_limit_w_per_min
    if math.isfinite(limit) and grid.size:
        allowed_w = limit / 60.0 * n * res.tick_s
        prev = means[:-n]  # m(t − W)
        low[:] = prev - allowed_w
        high[:] = prev + allowed_w
    return mean, low, high


def episodes(mask: BoolArray) -> list[tuple[int, int]]:
    """Runs of True in `mask` as (first, last) indices, inclusive, in time order."""
    m = np.asarray(mask, dtype=bool)
    if not m.any():
        return []
    edges = np.diff(np.concatenate([[0], m.view(np.int8), [0]]))
    starts = np.flatnonzero(edges == 1)
    stops = np.flatnonzero(edges == -1) - 1
    return list(zip(starts.tolist(), stops.tolist(), strict=True))


def spells(mask: BoolArray, gap: int) -> list[tuple[int, int]]:
    """`episodes` of `mask` with those less than `gap` samples apart merged: the spells a person would name."""
    out: list[tuple[int, int]] = []
    for first, last in episodes(mask):
        if out and first - out[-1][1] <= gap:
            out[-1] = (out[-1][0], last)
        else:
            out.append((first, last))
    return out


# job states whose entry is marked on the time axes, and the word used
_JOB_MARKS = {
    JobState.STARTING: "start",
    JobState.DOWN: "down",
    JobState.RESTARTING: "restart",
    JobState.SUSPENDED: "suspended",
    JobState.STOPPING: "stop",
}
MAX_JOB_MARKS = 20  # more job transitions than this (an interruption storm) are left to goodput.png
_JOB_EVENT_KINDS = ("start", "stop", "crash")  # timed job events: shown through the job states they cause


def event_marks(res: SimResult) -> list[tuple[float, str]]:
    """What happened when: the scenario's timed events, with every job's start, stop, fall (down), restart or
    suspension read from its recorded state when there are few enough to label (else the timed job events)."""
    marks = {(round(t, 6), kind.replace("_", " ")) for t, kind in res.events_log if kind not in _JOB_EVENT_KINDS}
    state = res.period["job_state"]
    changed = np.zeros((0, 2), dtype=np.int64)
    if state.size and res.site.n_jobs:
        prev = np.vstack([state[:1], state[:-1]])
        changed = np.argwhere((state != prev) & np.isin(state, list(_JOB_MARKS)))
    if len(changed) <= MAX_JOB_MARKS:
        for p, j in changed.tolist():
            marks.add((float(res.period_t_s[p]), f"{res.site.job_name[j]} {_JOB_MARKS[JobState(state[p, j])]}"))
    else:
        marks |= {(round(t, 6), kind) for t, kind in res.events_log if kind in _JOB_EVENT_KINDS}
    merged: dict[float, list[str]] = {}
    for t, text in sorted(marks):
        merged.setdefault(t, []).append(text)
    return [(t, _join_marks(texts)) for t, texts in merged.items()]


def _join_marks(texts: list[str]) -> str:
    """`a down`, `b down` -> `a, b down`."""
    words = {t.rsplit(" ", 1)[-1] for t in texts}
    if len(texts) > 1 and len(words) == 1 and all(" " in t for t in texts):
        return ", ".join(t.rsplit(" ", 1)[0] for t in texts) + " " + words.pop()
    return "; ".join(texts)


def _shown_jobs(res: SimResult) -> list[int]:
    """Jobs drawn per job: all of them, or the MAX_JOBS_SHOWN of highest priority (ties by GPUs)."""
    site = res.site
    order = sorted(range(site.n_jobs), key=lambda j: (-int(site.job_priority[j]), -int(site.job_gpus[j]), j))
    return sorted(order[:MAX_JOBS_SHOWN])


def stressed_domains(res: SimResult) -> tuple[list[int], FloatArray]:
    """Columns of the recorded domains with the highest peak load over their rating in force, most stressed first."""
    load = res.period["domain_w"]
    rating = res.period["domain_limit_w"]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(rating > 0, load / rating, np.nan)
    if ratio.size == 0:
        return [], ratio
    peak = np.nan_to_num(np.nanmax(ratio, axis=0), nan=-1.0)
    tripped = {res.site.domain_name.index(d) for _, d in res.trips}
    rec = res.recorded_domains.tolist()
    # a tripped breaker is the most stressed of all, whatever its peak load looked like
    key = [(-(rec[c] in tripped), -peak[c], c) for c in range(len(rec))]
    cols = [c for *_, c in sorted(key)][:TOP_DOMAINS]
    return cols, ratio


def _period_s(res: SimResult) -> FloatArray:
    """Length of every control period (the last may be short)."""
    t = res.period_t_s
    if t.size == 0:
        return np.zeros(0)
    return np.diff(np.append(t, res.duration_s))


def _rolled_back(state: npt.NDArray[np.floating[Any]], progress: FloatArray) -> FloatArray:
    """Work (progress-seconds) each job loses at each period: at the period it falls DOWN, everything it did since
    its last committed checkpoint (the start of the last CHECKPOINT that went on to RUNNING), its last fall, or the
    start of the run. Shape (n_periods, n_jobs)."""
    lost = np.zeros(progress.shape)
    n_p = state.shape[0]
    for j in range(state.shape[1]):  # once per job at report time, not per tick
        st = state[:, j]
        prev = np.concatenate([[np.nan], st[:-1]])
        downs = np.flatnonzero((st == JobState.DOWN) & (prev != JobState.DOWN))
        if downs.size == 0:
            continue
        ck_start = np.flatnonzero((st == JobState.CHECKPOINT) & (prev != JobState.CHECKPOINT))
        ck_end = np.flatnonzero((st != JobState.CHECKPOINT) & (prev == JobState.CHECKPOINT))
        starts = ck_start[: ck_end.size]
        committed = starts[st[ck_end] == JobState.RUNNING]  # snapshot periods of checkpoints that committed
        csum = np.concatenate([[0.0], np.cumsum(progress[:, j])])  # csum[p]: work done before period p
        saved_at = 0
        for d in downs.tolist():
            before = committed[committed < d]
            if before.size:
                saved_at = max(saved_at, int(before[-1]))
            lost[d, j] = csum[d + 1] - csum[saved_at]
            saved_at = min(d + 1, n_p)
    return lost


def goodput_series(res: SimResult) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Useful work over time from the per-period job series (summary-independent).

    A job works while it is RUNNING, or in CHECKPOINT with an asynchronous write (a job whose accounting shows
    synchronous-stall time stalls in CHECKPOINT), at its speed under the caps; it holds its GPUs in every state but
    WAITING, STOPPING and DONE. When it falls DOWN it loses the work since its last committed checkpoint.

    Returns `(rate (n_periods, n_jobs), campus_rate (n_periods,), cumulative (n_periods,))`: each job's useful rate
    (NaN while it holds no GPUs), the GPU-weighted rate of all jobs, and useful over allocated GPU-time since the
    start with the rolled-back work taken off when it is lost, which ends near `goodput_pct` (sampled once per
    control period, so transitions are placed to within a period).
    """
    state = res.period["job_state"]
    speed = res.period["job_speed_frac"]
    acc_ck = res.accounting.get("checkpoint")
    sync = acc_ck > 0 if acc_ck is not None and acc_ck.shape == (state.shape[1],) else np.zeros(state.shape[1], bool)
    working = (state == JobState.RUNNING) | ((state == JobState.CHECKPOINT) & ~sync[None, :])
    held = ~np.isin(state, (JobState.WAITING, JobState.STOPPING, JobState.DONE))
    rate = np.where(held, speed * working, np.nan)
    gpus = res.site.job_gpus.astype(np.float64)
    dt_p = _period_s(res)[:, None]
    progress = np.nan_to_num(rate) * dt_p
    useful = ((progress - _rolled_back(state, progress)) * gpus).sum(axis=1)
    allocated = (held * dt_p * gpus).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        campus = np.where(allocated > 0, (np.nan_to_num(rate) * held * dt_p * gpus).sum(axis=1) / allocated, np.nan)
        cum_alloc = np.cumsum(allocated)
        cumulative = np.where(cum_alloc > 0, np.cumsum(useful) / cum_alloc, np.nan)
    return rate, campus, cumulative
