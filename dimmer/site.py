"""SiteModel: the power tree as arrays.

Racks are numbered in tree order, so every domain (campus, building, hall, row, rack) covers one contiguous
range of racks `[domain_rack_start, domain_rack_stop)`. That gives every domain's load from one cumulative
sum; the sparse incidence matrix (domains x racks) is kept for callers that want the linear-algebra form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from dimmer.errors import InputError
from dimmer.gpus import GPU_PRESETS, GpuSpec
from dimmer.siteconfig import LEVEL_ORDER, BbuSpec, JobPlacementSpec, SiteSpec, TraySpec
from dimmer.throughput import THROUGHPUT_PRESETS, ThroughputCurve, curve_from_points, load_profile_curve

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

LEVEL_PREFIX = {"building": "b", "hall": "h", "row": "r", "rack": "k"}


@dataclass(frozen=True)
class BessRatings:
    power_w: float
    energy_j: float
    round_trip_eff: float
    soc_min_frac: float
    soc_max_frac: float
    soc_init_frac: float
    response_tau_s: float


@dataclass(frozen=True)
class RackStorageRatings:
    tray_energy_j: FloatArray  # (n_racks,)
    tray_power_w: FloatArray
    bbu_power_w: FloatArray
    bbu_energy_j: FloatArray
    bbu_recharge_w: FloatArray
    bbu_round_trip_eff: float
    bbu_soc_min_frac: float
    bbu_soc_max_frac: float
    tray_refill_s: float = 2.0  # the trays' refill time constant (TraySpec.refill_s)

    def tray_refill_w(self) -> FloatArray:
        """The most each rack's supply carries above its load while its tray refills: half the tray's energy over
        its refill time, within the tray's power."""
        return np.minimum(self.tray_power_w, self.tray_energy_j / (2.0 * self.tray_refill_s))


@dataclass(frozen=True)
class SiteModel:
    gpu: GpuSpec
    gpus_per_rack: int
    rectifier_eff: float
    # racks (n_racks,)
    rack_active_gpus: IntArray  # GPUs that run the job (64 of 72 on an NVL72; the rest are hot spares)
    rack_is_spare: BoolArray  # a whole spare rack held by a job, idle until a swap
    rack_job: IntArray  # job index, -1 for racks with no job
    # domains (n_domains,), ordered by level then by rack range
    domain_name: tuple[str, ...]
    domain_level: IntArray  # index into LEVEL_ORDER
    domain_parent: IntArray  # -1 for the campus
    domain_rating_w: FloatArray
    domain_rack_start: IntArray
    domain_rack_stop: IntArray
    incidence: sp.csr_array  # (n_domains, n_racks), 1 where the rack is under the domain
    # jobs (n_jobs,)
    job_name: tuple[str, ...]
    job_priority: IntArray
    job_gpus: IntArray
    # the utility interconnect (PCC)
    pcc_limit_w: float
    ramp_limit_w_per_min: float
    ramp_window_s: float
    # storage
    rack_storage: RackStorageRatings
    bess: BessRatings
    # each job's throughput under a cap; () or a job's entry `gpu.throughput`: the GPU preset's curve
    job_throughput: tuple[ThroughputCurve, ...] = ()
    # how a cap reaches the GPUs: "inband" (NVML, the driver: within a period) or "oob" (through a BMC: tens of
    # seconds). The controller learns the delay from the writes that land; this is what it knows before any has.
    cap_path: Literal["inband", "oob"] = "inband"

    @property
    def n_racks(self) -> int:
        return int(self.rack_job.shape[0])

    @property
    def n_domains(self) -> int:
        return int(self.domain_rating_w.shape[0])

    @property
    def n_jobs(self) -> int:
        return len(self.job_name)

    @property
    def n_gpus(self) -> int:
        return self.n_racks * self.gpus_per_rack

    def domain_load_w(self, rack_w: FloatArray) -> FloatArray:
        """Load of every domain from rack loads `(n_racks,)` or a series `(n_steps, n_racks)`."""
        csum = np.cumsum(rack_w, axis=-1)
        zero = np.zeros((*csum.shape[:-1], 1))
        csum = np.concatenate([zero, csum], axis=-1)
        out: FloatArray = csum[..., self.domain_rack_stop] - csum[..., self.domain_rack_start]
        return out

    def rack_power_w(self, gpu_draw_w: FloatArray) -> FloatArray:
        """AC power of each rack when its active GPUs each draw `gpu_draw_w` (broadcasts over leading axes)."""
        idle_gpus = self.gpus_per_rack - self.rack_active_gpus
        dc = (
            self.rack_active_gpus * gpu_draw_w
            + idle_gpus * self.gpu.idle_w
            + self.gpus_per_rack * self.gpu.host_overhead_w
        )
        out: FloatArray = dc / self.rectifier_eff
        return out

    def gpu_draw_for_rack_w(self, rack_w: FloatArray) -> FloatArray:
        """Inverse of rack_power_w: the per-GPU draw that makes each rack draw `rack_w`."""
        idle_gpus = self.gpus_per_rack - self.rack_active_gpus
        fixed = idle_gpus * self.gpu.idle_w + self.gpus_per_rack * self.gpu.host_overhead_w
        out: FloatArray = (rack_w * self.rectifier_eff - fixed) / np.maximum(self.rack_active_gpus, 1)
        return out

    def rack_max_w(self) -> FloatArray:
        return self.rack_power_w(np.full(self.n_racks, self.gpu.rated_w))

    def job_curve(self, job: int) -> ThroughputCurve:
        """The throughput curve job `job` plans and runs with."""
        return self.job_throughput[job] if self.job_throughput else self.gpu.throughput

    @cached_property
    def _own_curve_racks(self) -> tuple[tuple[ThroughputCurve, IntArray], ...]:
        """(curve, racks) for every job whose curve is not the GPU preset's."""
        return tuple(
            (c, np.flatnonzero(self.rack_job == j))
            for j, c in enumerate(self.job_throughput)
            if c is not self.gpu.throughput
        )

    def rack_throughput_frac(self, power_frac: FloatArray) -> FloatArray:
        """Relative throughput of each rack (the last axis) held at `power_frac`, by its job's curve."""
        out = self.gpu.throughput(power_frac)
        for curve, racks in self._own_curve_racks:
            out[..., racks] = curve(power_frac[..., racks])
        return out

    def domain_index(self, name: str) -> int:
        try:
            return self.domain_name.index(name)
        except ValueError:
            raise KeyError(name) from None


def _level_names(counts: list[int], prefixes: list[str]) -> list[list[str]]:
    names: list[list[str]] = []
    parent = [""]
    for count, prefix in zip(counts, prefixes, strict=True):
        level = [f"{p}/{prefix}{i}" if p else f"{prefix}{i}" for p in parent for i in range(count)]
        names.append(level)
        parent = level
    return names


BBU_MODULE_W = 12e3  # OCP ORv3 HPR BBU module
TRAY_SWING_FRAC = 0.3  # a tray covers this share of its GPUs' rated power: the iteration swing (30-40 %)
# the ORv3 33 kW shelf recharges at 3 kW: the recharge keeps that share of the shelf's power
BBU_RECHARGE_FRAC = 3.0 / 33.0


def size_bbu(bbu: BbuSpec, rack_full_w: float) -> tuple[float, float, float]:
    """(power W, energy J, recharge W) of one rack's BBU shelf: the configured value, or sized from the rack.

    `rack_full_w` is the rack's IT load at full draw (every GPU at rated, the host): the shelf carries it in whole
    12 kW modules and stores `hold_up_s` of it after discharge losses (sqrt of the round trip), so a full shelf
    rides through exactly its rated hold-up at full draw.
    """
    if bbu.kw_per_rack is not None:
        power_w = bbu.kw_per_rack * 1e3
    else:
        power_w = math.ceil(rack_full_w / BBU_MODULE_W - 1e-9) * BBU_MODULE_W
    if bbu.kwh_per_rack is not None:
        energy_j = bbu.kwh_per_rack * 3.6e6
    else:
        energy_j = min(power_w, rack_full_w) * bbu.hold_up_s / math.sqrt(bbu.round_trip_eff)
    if bbu.recharge_kw_per_rack is not None:
        recharge_w = bbu.recharge_kw_per_rack * 1e3
    else:
        recharge_w = BBU_RECHARGE_FRAC * power_w
    return power_w, energy_j, recharge_w


def size_tray_w(tray: TraySpec, gpu: GpuSpec, gpus_per_rack: int) -> float:
    """One rack's capacitor tray power (W): the configured value, or TRAY_SWING_FRAC of its GPUs at rated."""
    if tray.kw_per_rack is not None:
        return tray.kw_per_rack * 1e3
    return TRAY_SWING_FRAC * gpus_per_rack * gpu.rated_w


def build_site(spec: SiteSpec, jobs: Sequence[JobPlacementSpec] | None = None, source: str = "site") -> SiteModel:
    """Arrays for the tree that `spec` describes, with `jobs` placed on its racks.

    Raises InputError (naming `source` and the key) for an override of a domain that does not exist or a job that
    does not fit.
    """
    gpu = GPU_PRESETS[spec.gpu]
    counts = [lv.count for lv in spec.levels]
    n_racks = math.prod(counts)
    names = _level_names(counts, [LEVEL_PREFIX[lv.level] for lv in spec.levels])

    rack_dc_max = spec.gpus_per_rack * (gpu.rated_w + gpu.host_overhead_w)
    default_rack_rating = rack_dc_max / spec.rectifier_eff

    domain_names = ["campus"]
    level_idx = [0]
    parent = [-1]
    rating = [spec.pcc.limit_mw * 1e6]
    start = [0]
    stop = [n_racks]
    prev_first = 0  # index of the first domain of the level above
    per_parent = 1
    for depth, lv in enumerate(spec.levels):
        n_level = len(names[depth])
        span = n_racks // n_level
        first = len(domain_names)
        idx = np.arange(n_level)
        domain_names += names[depth]
        level_idx += [LEVEL_ORDER.index(lv.level)] * n_level
        parent += (prev_first + idx // lv.count).tolist() if depth else [0] * n_level
        r = lv.rating_w()
        rating += [r if r is not None else default_rack_rating] * n_level
        start += (idx * span).tolist()
        stop += ((idx + 1) * span).tolist()
        prev_first = first
        per_parent *= lv.count

    rating_arr = np.asarray(rating, dtype=np.float64)
    index = {n: i for i, n in enumerate(domain_names)}
    for i, ov in enumerate(spec.overrides):
        if ov.domain not in index:
            raise InputError(source, f"site.overrides[{i}].domain", f"no domain named {ov.domain!r}")
        rating_arr[index[ov.domain]] = ov.rating_w()

    start_arr = np.asarray(start, dtype=np.int64)
    stop_arr = np.asarray(stop, dtype=np.int64)
    lengths = stop_arr - start_arr
    rows = np.repeat(np.arange(len(domain_names)), lengths)
    cols = np.concatenate([np.arange(a, b) for a, b in zip(start, stop, strict=True)])
    incidence = sp.csr_array(
        (np.ones(rows.shape[0]), (rows, cols)), shape=(len(domain_names), n_racks), dtype=np.float64
    )

    rack_job, rack_spare, rack_active, job_gpus = _place_jobs(spec, jobs or [], names, n_racks, source)

    st = spec.storage
    ones = np.ones(n_racks)
    bbu_power_w, bbu_energy_j, bbu_recharge_w = size_bbu(st.bbu, rack_dc_max)
    rack_storage = RackStorageRatings(
        tray_energy_j=ones * st.tray.j_per_gpu * spec.gpus_per_rack,
        tray_power_w=ones * size_tray_w(st.tray, gpu, spec.gpus_per_rack),
        bbu_power_w=ones * bbu_power_w,
        bbu_energy_j=ones * bbu_energy_j,
        bbu_recharge_w=ones * bbu_recharge_w,
        bbu_round_trip_eff=st.bbu.round_trip_eff,
        bbu_soc_min_frac=st.bbu.soc_min_frac,
        bbu_soc_max_frac=st.bbu.soc_max_frac,
        tray_refill_s=st.tray.refill_s,
    )
    bess = BessRatings(
        power_w=st.bess.power_mw * 1e6,
        energy_j=st.bess.energy_mwh * 3.6e9,
        round_trip_eff=st.bess.round_trip_eff,
        soc_min_frac=st.bess.soc_min_frac,
        soc_max_frac=st.bess.soc_max_frac,
        soc_init_frac=st.bess.soc_init_frac,
        response_tau_s=st.bess.response_tau_s,
    )
    jobs = jobs or []
    return SiteModel(
        gpu=gpu,
        gpus_per_rack=spec.gpus_per_rack,
        rectifier_eff=spec.rectifier_eff,
        rack_active_gpus=rack_active,
        rack_is_spare=rack_spare,
        rack_job=rack_job,
        domain_name=tuple(domain_names),
        domain_level=np.asarray(level_idx, dtype=np.int64),
        domain_parent=np.asarray(parent, dtype=np.int64),
        domain_rating_w=rating_arr,
        domain_rack_start=start_arr,
        domain_rack_stop=stop_arr,
        incidence=incidence,
        job_name=tuple(j.name for j in jobs),
        job_priority=np.asarray([j.priority for j in jobs], dtype=np.int64),
        job_gpus=job_gpus,
        pcc_limit_w=spec.pcc.limit_mw * 1e6,
        ramp_limit_w_per_min=spec.pcc.ramp_mw_per_min * 1e6,
        ramp_window_s=spec.pcc.ramp_window_s,
        rack_storage=rack_storage,
        bess=bess,
        job_throughput=tuple(_job_curve(j, gpu, source, f"jobs[{i}]") for i, j in enumerate(jobs)),
    )


def _job_curve(job: JobPlacementSpec, gpu: GpuSpec, source: str, key: str) -> ThroughputCurve:
    """A job's own throughput curve (points, preset or profile file), else the GPU preset's (the same object)."""
    if job.throughput_profile is not None:
        return load_profile_curve(Path(job.throughput_profile), source, f"{key}.throughput_profile")
    if isinstance(job.throughput_curve, str):
        return THROUGHPUT_PRESETS[job.throughput_curve]
    if job.throughput_curve is not None:
        return curve_from_points(f"{job.name} (scenario points)", job.throughput_curve, source=source)
    return gpu.throughput


def _place_jobs(
    spec: SiteSpec, jobs: Sequence[JobPlacementSpec], names: list[list[str]], n_racks: int, source: str
) -> tuple[IntArray, BoolArray, IntArray, IntArray]:
    active = spec.active_gpus_per_rack
    rack_job = np.full(n_racks, -1, dtype=np.int64)
    rack_spare = np.zeros(n_racks, dtype=bool)
    rack_active = np.full(n_racks, active, dtype=np.int64)
    job_gpus = np.zeros(len(jobs), dtype=np.int64)
    seen: set[str] = set()
    building_names = names[0] if spec.levels[0].level == "building" else []
    racks_per_building = n_racks // max(len(building_names), 1)
    for j, job in enumerate(jobs):
        key = f"jobs[{j}]"
        if job.name in seen:
            raise InputError(source, f"{key}.name", f"job names must be unique ({job.name!r} repeats)")
        seen.add(job.name)
        free = np.flatnonzero(rack_job < 0)
        if job.gpus is not None:
            n_run = math.ceil(job.gpus / active)
            n_spare = math.ceil(n_run * spec.spare_rack_frac)
            if n_run + n_spare > free.size:
                raise InputError(
                    source,
                    f"{key}.gpus",
                    f"{job.gpus} GPUs need {n_run + n_spare} racks ({n_run} running + {n_spare} spare at "
                    f"{active} active GPUs per rack) but only {free.size} racks are free",
                )
            chosen = free[: n_run + n_spare]
            gpus = job.gpus
        else:
            if job.racks is not None:
                lo, hi = job.racks
                if hi > n_racks:
                    raise InputError(source, f"{key}.racks", f"the site has racks 0..{n_racks - 1}")
                candidates = np.arange(lo, hi)
                where = f"{key}.racks"
            else:
                if job.building not in building_names:
                    raise InputError(
                        source,
                        f"{key}.building",
                        f"a building of the site ({', '.join(building_names) or 'none'})",
                    )
                b = building_names.index(str(job.building))
                candidates = np.arange(b * racks_per_building, (b + 1) * racks_per_building)
                where = f"{key}.building"
            chosen = candidates[rack_job[candidates] < 0]
            if chosen.size != candidates.size:
                raise InputError(source, where, "racks that no other job holds")
            n_spare = round(chosen.size * spec.spare_rack_frac / (1 + spec.spare_rack_frac))
            n_run = chosen.size - n_spare
            if n_run < 1:
                raise InputError(source, where, "at least one rack to run on")
            gpus = n_run * active
        rack_job[chosen] = j
        rack_spare[chosen[n_run:]] = True
        last_run = chosen[n_run - 1]
        rack_active[last_run] = gpus - (n_run - 1) * active
        job_gpus[j] = gpus
    return rack_job, rack_spare, rack_active, job_gpus
