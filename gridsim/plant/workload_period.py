"""The workload advanced over a block of ticks at once, where no job changes state inside the block.

`Workload.advance` run T times with the same inputs does, while no job changes state: progress and iteration phase
grow by each tick's step (a cumulative sum along the tick axis, the same additions in the same order), an iteration
that ends draws its jittered length (in the tick it ends, before that tick's background draw), the background's AR(1)
noise moves once a tick, and each tick's levels are read from the phase (or a trace, from progress). This module does
exactly that for T ticks, array by array, and leaves the workload as T calls of `advance` would: the same numbers to
the bit, the same random draws in the same order (a draw of m x n normals is the m draws of n one after the other).

`advance_ticks` refuses (returns None, having changed nothing) where a tick of the block could change a job's state:
a timed transition or random failure due, a checkpoint due, a ramp under way, a suspension asked for or in force, a
rack not energized. The caller then runs the ticks one by one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from gridsim.plant.rack_spread import rack_levels
from gridsim.plant.workload import _EPS_S, JobState, Workload

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

_STATE = (
    "_progress_s",
    "_iter_phase_s",
    "_iter_len_s",
    "_on_len_s",
    "_level_w",
    "_bg_x_w",
    "_bg_level_w",
    "_suspend_req",
    "_last_step",
)


def snapshot(wl: Workload) -> tuple[Any, ...]:
    """What `advance_ticks` changes, to put back with `restore` when the block is not taken after all."""
    arrays = tuple(getattr(wl, name).copy() for name in _STATE)
    return arrays, wl.t_s, wl._rng.bit_generator.state, wl._bg_dt_s, wl._bg_a, wl._bg_b


def restore(wl: Workload, snap: tuple[Any, ...]) -> None:
    arrays, wl.t_s, wl._rng.bit_generator.state, wl._bg_dt_s, wl._bg_a, wl._bg_b = snap
    for name, a in zip(_STATE, arrays, strict=True):
        np.copyto(getattr(wl, name), a)


def advance_ticks(wl: Workload, dt: float, steps: FloatArray, job_suspend: BoolArray) -> FloatArray | None:
    """Advance `wl` by steps.shape[0] ticks of `dt` whose progress steps per job are `steps` (T, n_jobs), each row
    what `advance` computes from that tick's job speed (clip(speed, 0, 1) * running * dt).

    Returns the racks' per-GPU demand at the end of each tick (T, n_racks), what `rack_demand_w` reads after each
    `advance`; None, with nothing changed, where a job could change state inside the block.
    """
    if wl._dirty or wl._any_ramp or wl._any_susp or not wl._all_energized or wl._any_deenerg:
        return None
    if bool(np.logical_or.reduce(job_suspend)):
        return None
    n_ticks, n = steps.shape
    t = wl.t_s
    for _ in range(n_ticks):  # the workload's clock, added tick by tick as `advance` adds it
        t += dt
    if t + _EPS_S >= wl._next_event_s:  # a timed transition, scheduled start/stop or failure in the block
        return None
    prog = np.empty((n_ticks + 1, n))
    prog[0] = wl._progress_s
    prog[1:] = steps
    np.cumsum(prog, axis=0, out=prog)
    progress = prog[1:]
    # progress never falls, so a checkpoint that begins in the block is due by its last tick
    if bool(np.any((progress[-1] >= wl._ck_due_s) & (wl.job_state == JobState.RUNNING))):
        return None

    # iteration phase, tick by tick where an iteration ends (its draw), as cumulative sums between
    bg_on = wl._bg_on
    n_bg = wl._bg_rack.size
    normals: list[FloatArray] = []
    bg_drawn = 0
    phase = np.empty((n_ticks, n))
    on_len = np.empty((n_ticks, n))
    iter_len = np.empty((n_ticks, n))  # the period each tick's phase is read against (racks out of lockstep)
    seg = np.empty((n_ticks + 1, n))
    j = 0
    while j < n_ticks:
        m = n_ticks - j
        seg[0] = wl._iter_phase_s
        seg[1 : m + 1] = steps[j:]
        np.cumsum(seg[: m + 1], axis=0, out=seg[: m + 1])
        hit = seg[1 : m + 1] >= wl._iter_len_s
        rows = np.flatnonzero(np.logical_or.reduce(hit, axis=1))
        if rows.size == 0:
            phase[j:] = seg[1 : m + 1]
            on_len[j:] = wl._on_len_s
            iter_len[j:] = wl._iter_len_s
            break
        r = int(rows[0])
        w = j + r  # the tick in which an iteration ends
        phase[j:w] = seg[1 : r + 1]
        on_len[j:w] = wl._on_len_s
        iter_len[j:w] = wl._iter_len_s
        if bg_on and w > bg_drawn:  # the background's draws of the ticks before come first
            normals.append(wl._rng.standard_normal((w - bg_drawn, n_bg)))
            bg_drawn = w
        np.copyto(wl._iter_phase_s, seg[r + 1])
        wl._wrap(np.flatnonzero(hit[r]))
        phase[w] = wl._iter_phase_s
        on_len[w] = wl._on_len_s
        iter_len[w] = wl._iter_len_s
        j = w + 1
    np.copyto(wl._iter_phase_s, phase[-1])
    np.copyto(wl._progress_s, progress[-1])
    wl.t_s = t

    # the levels after each tick (_update_level with no ramp under way)
    swing = np.where(phase < on_len, wl._peak_w, wl._trough_w)
    if wl._has_trace:
        tj = wl._trace_jobs
        pos = (progress[:, tj] * wl._trace_inv_step + 1e-6).astype(np.int64) % wl._trace_len
        swing[:, tj] = wl._trace_table[pos + wl._trace_offset]
    level = np.empty((n_ticks, n + 1))
    level[:, :n] = np.where(wl._running, swing, wl._from_w)
    level[:, n] = wl._level_w[n]
    np.copyto(wl._job_level_w, level[-1, :n])
    demand: FloatArray = np.take(level, wl._rack_slot, axis=1)
    sp = wl._spread
    if sp is not None:  # racks out of lockstep: rack_demand_w's tick means, the same elementwise arithmetic
        demand[:, sp.rack] = rack_levels(
            sp, phase, steps, iter_len, on_len, wl._running, level[:, :n], wl.idle_w, wl.rated_w
        )
    wl._last_step = steps[-1].copy()

    if bg_on:
        if n_ticks > bg_drawn:
            normals.append(wl._rng.standard_normal((n_ticks - bg_drawn, n_bg)))
        if dt != wl._bg_dt_s:
            wl._bg_dt_s = dt
            wl._bg_a = math.exp(-dt / wl._bg_tau_s)
            wl._bg_b = wl._bg_sigma_w * math.sqrt(1.0 - wl._bg_a**2)
        kicks = wl._bg_b * np.concatenate(normals)
        x = wl._bg_x_w
        xs = np.empty((n_ticks, n_bg))
        a = wl._bg_a
        for i in range(n_ticks):  # the AR(1) recursion, as `_advance_background` steps it
            x *= a
            x += kicks[i]
            xs[i] = x
        np.add(xs, wl._bg_mean_w, out=xs)
        np.minimum(xs, wl.rated_w, out=xs)
        np.maximum(xs, wl.idle_w, out=xs)
        np.copyto(wl._bg_level_w, xs[-1])
        demand[:, wl._bg_rack] = xs
    np.copyto(wl._suspend_req, job_suspend)
    return demand
