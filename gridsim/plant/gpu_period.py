"""The GPUs' caps and floors, and the jobs' speed they allow, over a block of ticks at once.

`GpuBank.step` first actuates (the in-band lag moves caps and floors toward their targets, an out-of-band command
falls due), then clips the demand. Over a block the actuation is stepped tick by tick with the bank's own `_actuate`
(so caps and floors are the tick path's to the bit), each tick's caps and floors kept as a row; the engine's job speed
after each tick (TickLoop.update_job_speed: a job runs at its slowest running rack's throughput under its cap) is then
computed for every row at once, the same elementwise operations on the same numbers.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.site import SiteModel
from gridsim.plant.gpu import GpuBank

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def snapshot(gpus: GpuBank) -> tuple[Any, ...]:
    return (
        gpus.cap_w.copy(),
        gpus.floor_w.copy(),
        gpus._remaining_frac,
        gpus._settling,
        gpus.version,
        deque(gpus._pending),
        gpus._decay_dt_s,
        gpus._decay,
    )


def restore(gpus: GpuBank, snap: tuple[Any, ...]) -> None:
    cap, floor, gpus._remaining_frac, gpus._settling, gpus.version, gpus._pending, gpus._decay_dt_s, gpus._decay = snap
    np.copyto(gpus.cap_w, cap)
    np.copyto(gpus.floor_w, floor)


def static(gpus: GpuBank, t_end_s: float) -> bool:
    """Nothing to actuate through `t_end_s`: no lag settling, no out-of-band command due (caps and floors stand)."""
    if gpus._settling:
        return False
    return not (gpus._pending and gpus._pending[0][0] <= t_end_s * (1.0 + 1e-9) + 1e-6)


def actuate_ticks(gpus: GpuBank, k0: int, n_ticks: int, dt: float) -> tuple[FloatArray, FloatArray]:
    """Each tick's caps and floors in force (n_ticks, n_racks), actuated as `step` actuates ticks k0 .. k0 + n - 1
    (tick k starts at k * dt)."""
    n = gpus.cap_w.shape[0]
    cap = np.empty((n_ticks, n))
    floor = np.empty((n_ticks, n))
    for i in range(n_ticks):
        gpus._actuate((k0 + i) * dt + dt, dt)
        cap[i] = gpus.cap_w
        floor[i] = gpus.floor_w
    return cap, floor


def speeds_after(
    cap: FloatArray,
    floor: FloatArray,
    peak_w: FloatArray,
    job_racks: npt.NDArray[np.int64],
    job_starts: npt.NDArray[np.int64],
    site: SiteModel,
) -> tuple[FloatArray, BoolArray, BoolArray]:
    """(job speed, floors all zero, a cap binds) after each tick whose caps and floors are the rows of `cap`,
    `floor`: TickLoop.update_job_speed (no ramp limit) row by row."""
    n_ticks = cap.shape[0]
    floors_zero = np.max(floor, axis=1, initial=0.0) <= 0.0
    binds = np.logical_or.reduce(cap < peak_w, axis=1) & bool(job_racks.size)
    speed = np.ones((n_ticks, job_starts.size))
    if binds.any():
        frac = np.ones_like(cap)
        np.divide(np.minimum(cap, peak_w), peak_w, out=frac, where=peak_w > 0.0)  # GpuBank.rack_speed_frac
        rack_speed = site.rack_throughput_frac(frac)
        job = np.minimum.reduceat(rack_speed[:, job_racks], job_starts, axis=1)
        speed[binds] = job[binds]
    return speed, floors_zero, binds
