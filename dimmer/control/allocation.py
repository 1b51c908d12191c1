"""Budget allocation over the power tree: per-domain cuts and headroom become one cap change per job.

A synchronous job runs at the pace of its slowest rack, so a cap on part of a job costs the whole job; capping all
its racks evenly saves the same power for less loss. Every job therefore gets one per-GPU cap, and a domain's
required cut is met by the lowest-priority jobs under it first: to cut X W in domain d with a uniform per-GPU cut x on
job j, x = X * eta / n_dj, where n_dj is the number of job j's running GPUs under d and eta the rectifier efficiency.
Loops run over priority groups (a handful), each step vectorised over domains.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from dimmer.site import SiteModel
from dimmer.throughput import ThroughputCurve

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def job_gpus_per_domain(site: SiteModel, among: npt.NDArray[np.bool_] | None = None) -> FloatArray:
    """(n_domains, n_jobs): running GPUs of each job under each domain (spare racks excluded), counting only the
    racks in `among` where it is given."""
    running = (site.rack_job >= 0) & ~site.rack_is_spare
    racks = np.flatnonzero(running if among is None else running & among)
    member = sp.csr_array(
        (site.rack_active_gpus[racks].astype(np.float64), (racks, site.rack_job[racks])),
        shape=(site.n_racks, max(site.n_jobs, 1)),
    )
    out = (site.incidence @ member).toarray()[:, : site.n_jobs]
    return np.asarray(out, dtype=np.float64)


def priority_groups(priority: IntArray) -> list[IntArray]:
    """Job indices grouped by priority, lowest priority first."""
    return [np.flatnonzero(priority == p) for p in np.unique(priority)]


# Where on a job's curve its cost of a cut is read: the top fifth of relative power, where caps mostly sit.
COST_POWER_FRAC = 0.8


def cap_cost(curve: ThroughputCurve) -> float:
    """Relative throughput lost per unit of relative power over the curve's top fifth: (1 − t(0.8)) / 0.2."""
    return float(1.0 - curve(COST_POWER_FRAC)) / (1.0 - COST_POWER_FRAC)


def plan_groups(site: SiteModel) -> list[IntArray]:
    """priority_groups, each split by the jobs' own throughput curves: within one priority, the jobs that lose the
    least throughput per watt saved (cap_cost) give first and get back last. Jobs sharing one curve (every job that
    carries none shares the GPU preset's) stay one group, so a site without job curves plans as by priority alone."""
    out: list[IntArray] = []
    for g in priority_groups(site.job_priority):
        cost = np.array([cap_cost(site.job_curve(int(j))) for j in g])
        out.extend(g[cost == c] for c in np.unique(cost))
    return out


def shed(
    cut_w: FloatArray, gpus: FloatArray, room_w_per_gpu: FloatArray, groups: list[IntArray], eta: float
) -> tuple[FloatArray, FloatArray]:
    """Per-GPU cap reductions that meet each domain's `cut_w`, lowest priority group first.

    `gpus` (n_domains, n_jobs) from job_gpus_per_domain; `room_w_per_gpu` (n_jobs,) how far each job's cap may still
    fall. Within a group every job takes the same per-GPU cut (bounded by its own room): the group's cut is set by
    its most demanding domain. Returns (per-GPU reduction per job, the cut left unmet per domain).
    """
    reduction = np.zeros(gpus.shape[1])
    if not np.any(cut_w > 0):
        return reduction, np.zeros(cut_w.shape)  # (no domain asks for a cut: none to make, none unmet)
    remaining = np.maximum(np.nan_to_num(cut_w), 0.0)
    for group in groups:
        if not remaining.any():
            break
        g = group[room_w_per_gpu[group] > 0]
        if g.size == 0:
            continue
        n_group = gpus[:, g].sum(axis=1)
        need = np.where((n_group > 0) & (remaining > 0), remaining * eta / np.maximum(n_group, 1e-12), 0.0)
        x = float(need.max())
        if x <= 0:
            continue
        take = np.minimum(x, room_w_per_gpu[g])
        reduction[g] += take
        remaining = np.maximum(remaining - gpus[:, g] @ take / eta, 0.0)
    return reduction, remaining


def grant(
    headroom_w: FloatArray, gpus: FloatArray, want_w_per_gpu: FloatArray, groups: list[IntArray], eta: float
) -> FloatArray:
    """Per-GPU cap increases within each domain's headroom, highest priority group first.

    A job may rise by at most the smallest headroom of the domains it runs in, shared by the GPUs it has there.
    """
    increase = np.zeros(gpus.shape[1])
    if not np.any(want_w_per_gpu > 0):
        return increase  # (no job asks: nothing to share out)
    room = np.maximum(np.nan_to_num(headroom_w), 0.0)
    for group in reversed(groups):
        g = group[want_w_per_gpu[group] > 0]
        if g.size == 0:
            continue
        n_group = gpus[:, g].sum(axis=1)
        inside = n_group > 0
        if not inside.any():
            continue
        allow = float(np.min(room[inside] * eta / n_group[inside]))
        give = np.minimum(want_w_per_gpu[g], max(allow, 0.0))
        increase[g] = give
        room = np.maximum(room - gpus[:, g] @ give / eta, 0.0)
    return increase
