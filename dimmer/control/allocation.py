"""Budget allocation over the power tree: per-domain cuts and headroom become one cap change per job.

A synchronous job runs at the pace of its slowest rack, so a cap on part of a job costs the whole job; capping all
its racks evenly saves the same power for less loss. Every job therefore gets one per-GPU cap, and a domain's
required cut is met by the lowest-priority jobs under it first: to cut X W in domain d with a uniform per-GPU cut x on
job j, x = X * eta / n_dj, where n_dj is the number of job j's running GPUs under d and eta the rectifier efficiency.
Loops run over priority groups (a handful), each step vectorised over domains.

`JobGpus` holds the (n_domains, n_jobs) matrix with what these loops read of each priority group worked out once
(the group's GPUs by domain, the domains it has GPUs under); `shed` and `grant` given one touch only those domains
where a group is one job, and give what they give for the bare matrix to the last bit (tests/test_step_fast_paths.py).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from dimmer.control.rack_math import RackMath, nan_to_num
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


class _Group:
    """What the allocation reads of one set of jobs: their GPUs by domain summed (`n_group`), the domains where
    that is above zero (`inside`, ascending) with its values there, and each job's GPUs there."""

    def __init__(self, matrix: FloatArray, g: IntArray) -> None:
        cols = matrix[:, g]  # (as the bare path gathers them: the same array, so the same sums and products)
        self.cols = cols
        self.n_group: FloatArray = cols.sum(axis=1)
        self.inside = np.flatnonzero(self.n_group > 0)
        self.n_inside: FloatArray = self.n_group[self.inside]
        # one job: its GPUs where it has any (a product of one term is the matrix product's, to the bit)
        self.col_inside: FloatArray | None = cols[self.inside, 0].copy() if g.size == 1 else None


class JobGpus:
    """`job_gpus_per_domain`'s matrix (`matrix`, never written) with each priority group's reads kept by the jobs
    in it. A group of one job is read only where it has GPUs: every other domain's cut or headroom is left as the
    bare matrix's product (zero there) leaves it."""

    def __init__(self, matrix: FloatArray) -> None:
        self.matrix = matrix
        self.shape = matrix.shape
        self._groups: dict[bytes, _Group] = {}

    def group(self, g: IntArray) -> _Group:
        key = g.tobytes()
        found = self._groups.get(key)
        if found is None:
            found = self._groups[key] = _Group(self.matrix, g)
        return found


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
    cut_w: FloatArray, gpus: FloatArray | JobGpus, room_w_per_gpu: FloatArray, groups: list[IntArray], eta: float
) -> tuple[FloatArray, FloatArray]:
    """Per-GPU cap reductions that meet each domain's `cut_w`, lowest priority group first.

    `gpus` (n_domains, n_jobs) from job_gpus_per_domain (or a JobGpus of it); `room_w_per_gpu` (n_jobs,) how far
    each job's cap may still fall. Within a group every job takes the same per-GPU cut (bounded by its own room):
    the group's cut is set by its most demanding domain. Returns (per-GPU reduction per job, the cut left unmet per
    domain).
    """
    reduction = np.zeros(gpus.shape[1])
    if not np.any(cut_w > 0):
        return reduction, np.zeros(cut_w.shape)  # (no domain asks for a cut: none to make, none unmet)
    remaining = np.maximum(nan_to_num(cut_w), 0.0)
    for group in groups:
        if not remaining.any():
            break
        g = group[room_w_per_gpu[group] > 0]
        if g.size == 0:
            continue
        if isinstance(gpus, JobGpus):
            remaining = _shed_group(remaining, gpus.group(g), g, room_w_per_gpu, reduction, eta)
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


def _shed_group(
    remaining: FloatArray, grp: _Group, g: IntArray, room_w_per_gpu: FloatArray, reduction: FloatArray, eta: float
) -> FloatArray:
    """One group's pass of `shed` (reduction in place; the cut left returned), read where the group has GPUs.

    Elsewhere the bare pass's need is 0 and its product 0: `remaining` there is what an earlier `maximum(.., 0)`
    left, which another leaves as it is (no -0.0 survives one)."""
    inside = grp.inside
    if inside.size == 0:
        return remaining  # (the bare pass: no need anywhere, x = 0)
    rem_in = remaining[inside]
    need = np.where(rem_in > 0, rem_in * eta / np.maximum(grp.n_inside, 1e-12), 0.0)
    x = float(need.max())
    if x <= 0:
        return remaining
    take = np.minimum(x, room_w_per_gpu[g])
    reduction[g] += take
    if grp.col_inside is None or not math.isfinite(float(take[0])):
        return np.maximum(remaining - grp.cols @ take / eta, 0.0)
    remaining[inside] = np.maximum(rem_in - grp.col_inside * take[0] / eta, 0.0)  # (shed's own array)
    return remaining


def grant(
    headroom_w: FloatArray, gpus: FloatArray | JobGpus, want_w_per_gpu: FloatArray, groups: list[IntArray], eta: float
) -> FloatArray:
    """Per-GPU cap increases within each domain's headroom, highest priority group first.

    A job may rise by at most the smallest headroom of the domains it runs in, shared by the GPUs it has there.
    """
    increase = np.zeros(gpus.shape[1])
    if not np.any(want_w_per_gpu > 0):
        return increase  # (no job asks: nothing to share out)
    room = np.maximum(nan_to_num(headroom_w), 0.0)
    for group in reversed(groups):
        g = group[want_w_per_gpu[group] > 0]
        if g.size == 0:
            continue
        if isinstance(gpus, JobGpus):
            room = _grant_group(room, gpus.group(g), g, want_w_per_gpu, increase, eta)
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


def _grant_group(
    room: FloatArray, grp: _Group, g: IntArray, want_w_per_gpu: FloatArray, increase: FloatArray, eta: float
) -> FloatArray:
    """One group's pass of `grant` (increase in place; the room left returned), read where the group has GPUs
    (elsewhere the bare pass subtracts a product of 0 from a room at or above +0.0: it stays as it is)."""
    inside = grp.inside
    if inside.size == 0:
        return room
    room_in = room[inside]
    allow = float(np.min(room_in * eta / grp.n_inside))
    give = np.minimum(want_w_per_gpu[g], max(allow, 0.0))
    increase[g] = give
    if grp.col_inside is None or not math.isfinite(float(give[0])):
        out: FloatArray = np.maximum(room - grp.cols @ give / eta, 0.0)
        return out
    room[inside] = np.maximum(room_in - grp.col_inside * give[0] / eta, 0.0)  # (grant's own array)
    return room


def shed_past_the_draw(
    rm: RackMath,
    running_rack: npt.NDArray[np.bool_],
    job_rack: IntArray,
    groups: list[IntArray],
    cut: FloatArray,
    reduction: FloatArray,
    unmet: FloatArray,
    effective: FloatArray,
    room: FloatArray,
    hidden_frac: FloatArray,
    gpu_env_w: FloatArray,
) -> tuple[FloatArray, FloatArray]:
    """(per-GPU reduction per job, cut left unmet per domain), with what the uniform cut missed shed again.

    One cap per job sheds nothing on a rack drawing under the new cap, yet the allocation counts every GPU of the
    job as giving the whole cut. Where a job's racks read flat (no peak hidden: the readings are the draw), what
    each rack gives is known; a domain that asked for more than its racks give is cut again, on the GPUs that
    give (two passes). A swinging job's readings understate its peaks, so its racks are taken to give the cut
    as before. (The stateful machine at its long profile: one job whose row held a rack at 1,400 W beside one
    at 1,138 W took three periods of cuts past its window to reach its rating.)

    `rm` the site's RackMath; `running_rack` the racks of a job that are not spare, `job_rack` each rack's job (0
    for none); `cut`, `reduction`, `unmet` as shed gave them for caps cut from `effective` (per job) with `room`;
    `hidden_frac` per job the share of its peak its readings may hide; `gpu_env_w` each rack's per-GPU envelope."""
    site = rm.site
    eta = site.rectifier_eff
    flat_rack = running_rack & (hidden_frac[job_rack] <= 0.0)
    if not (flat_rack.any() and np.any(cut > 0)):
        return reduction, unmet
    gpus_rack = site.rack_active_gpus.astype(np.float64) * running_rack
    draw_w = np.minimum(gpu_env_w, effective[job_rack])
    for again in (True, True, False):  # two passes more, then what is still unmet
        new_cap = (effective - reduction)[job_rack]
        gives = np.where(flat_rack, np.maximum(draw_w - new_cap, 0.0), reduction[job_rack])
        given_w = rm.domain_load_w(gpus_rack * gives) / eta
        short_w = np.where(cut > 0, np.maximum(cut - given_w, 0.0), 0.0)
        unmet = np.where(short_w > 1e-6 * np.maximum(cut, 1.0), short_w, 0.0)  # (not float dust)
        if not (again and np.any(unmet > 0)):
            break
        gpus_giving = job_gpus_per_domain(site, among=np.where(flat_rack, draw_w > new_cap, True))
        more, _ = shed(unmet, gpus_giving, np.maximum(room - reduction, 0.0), groups, eta)
        reduction = reduction + more
    return reduction, unmet
