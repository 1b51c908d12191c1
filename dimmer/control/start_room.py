"""A stopped job comes back at caps the site can take: its ceiling is set while it draws nothing.

A job that is not running (not yet started, stalled in a checkpoint, crashed and recovering) draws its idle power
and may come back within a tick at whatever cap it holds: 16 GB200 racks are a 1.6 MW step in a second. Readings
show the step a period late and a cap acts a period after that, so the controller must meet it before it happens.
The rack BBUs can bridge it only as far as their wear allowance goes (a start bridged on a short run spends days of
the cycle budget); what they cannot afford is room the power tree must have. Where it has not, the stopped job's
own cap comes down: a cap on a job that draws nothing costs no goodput until it runs again, and then it starts
where the site can take it and goes back to its cap as fast as the headroom allows (the controller's part).
Running jobs are never cut for a job that is not running: whether to hold room for a return is the ReturnHold's
trade of energy against goodput.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from dimmer.control.allocation import JobGpus, shed
from dimmer.control.rack_math import RackMath
from dimmer.site import SiteModel

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.int64]


def start_ceiling_w(
    site: SiteModel,
    cap_w: FloatArray,
    job_running: BoolArray,
    down_rack: BoolArray,
    planned_rack_w: FloatArray,
    bridged_rack_w: FloatArray,
    room_w: FloatArray,
    gpus: FloatArray | JobGpus,
    groups: list[IntArray],
    eta: float,
    return_rack_w: FloatArray | None = None,
    rm: RackMath | None = None,
) -> FloatArray:
    """Per-GPU caps of every job, those of stopped jobs lowered so that their return fits the room.

    `cap_w` the caps decided this period (per job); `down_rack` the racks whose job is not running;
    `planned_rack_w` what the plan of each domain counts each rack at (its readings);
    `bridged_rack_w` what each down rack's BBU may carry of a return (0 where none); `room_w` (per domain) how far
    each domain's planned load may rise before its soft level; `gpus` and `groups` as for allocation.shed;
    `return_rack_w` the most each rack draws when its job comes back below its caps (inf: up to them); `rm` the
    site's RackMath, where the caller keeps one (the same sums, its constants worked out once).
    """
    gpu = site.gpu
    stopped = ~job_running
    if not stopped.any() or not down_rack.any():
        return cap_w
    if rm is None:
        at_cap_w = site.rack_power_w(np.where(site.rack_job >= 0, cap_w[np.maximum(site.rack_job, 0)], gpu.rated_w))
        if return_rack_w is not None:
            at_cap_w = np.fmin(at_cap_w, return_rack_w)
        surge_rack_w = np.where(down_rack, np.maximum(at_cap_w - planned_rack_w - bridged_rack_w, 0.0), 0.0)
        surge_w = site.domain_load_w(surge_rack_w)
    else:  # (the same figures, worked out for the down racks only: every other rack's surge is +0.0)
        at = np.flatnonzero(down_rack)
        job = site.rack_job[at]
        at_cap_at_w = rm.rack_power_at_w(np.where(job >= 0, cap_w[np.maximum(job, 0)], gpu.rated_w), at)
        if return_rack_w is not None:
            at_cap_at_w = np.fmin(at_cap_at_w, return_rack_w[at])
        surge_rack_w = np.zeros(site.n_racks)
        surge_rack_w[at] = np.maximum(at_cap_at_w - planned_rack_w[at] - bridged_rack_w[at], 0.0)
        surge_w = rm.domain_load_w(surge_rack_w, only_at=at)
    excess_w = np.maximum(surge_w - np.maximum(room_w, 0.0), 0.0)
    if not np.any(excess_w > 0):
        return cap_w
    room_per_gpu = np.where(stopped, np.maximum(cap_w - gpu.min_cap_w, 0.0), 0.0)
    # (only the stopped jobs' GPUs shed: a running job has no room here, so shed passes it by, and a JobGpus is
    # read as it is rather than masked)
    stopped_gpus = gpus if isinstance(gpus, JobGpus) else gpus * stopped[None, :]
    reduction, _ = shed(excess_w, stopped_gpus, room_per_gpu, groups, eta)
    out: FloatArray = cap_w - reduction
    return out
