"""A measured trace, at the level it was measured, mapped to the model's per-GPU demand (docs/models.md).

The model's power at a measured level is affine in the per-GPU demand `p` (W per active GPU):

    gpu:        U(p) = p
    node:       U(p) = G · (p + P_host) / η                                       G = trace_gpus_per_node
    rack / pdu: U(p) = R · (n_act · p + (n − n_act) · P_idle + n · P_host) / η    R = trace_racks

so a trace measured above the GPU already holds the host and the rectifier loss, and mapping it through U⁻¹ takes
them out once; the site model adds them back once (SiteModel.rack_power_w). Two maps (`trace_map`):

- `idle-peak` (default at gpu and node level): the trace's own idle and peak, its `trace_idle_pct` and
  `trace_peak_pct` percentiles (0 and 100: every sample lies between them, so none is clipped), go to the preset's
  idle and to its peak: `rated`, or, with the trace's rating declared (`trace_rated_w` per GPU, `trace_rating_kw`
  per node), the same fraction of the model's rating (U_full · x_peak / rating, through U⁻¹). Affine between.
- `absolute` (default at rack and pdu level): the trace is the power of the same kind of unit: `p = U⁻¹(x)`, with a
  utilisation trace (`pdu-util`) turned into watts by `trace_rating_kw` (default: the model unit's full draw U_full).

Either way p is then held to [idle, rated], and every sample so moved is counted (TraceStats.clipped).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field

from dimmer.errors import InputError
from dimmer.site import SiteModel
from dimmer.siteconfig import Strict
from gridsim.plant.trace import GapStats, filled, load_raw_trace
from gridsim.plant.trace_formats import LEVEL_OF_FORMAT

FloatArray = npt.NDArray[np.float64]
TraceCache = dict[tuple[Any, ...], Any]


class TraceFields(Strict):
    """A job's measured trace (kind = "trace"): the file, its format and level, the gap rule and the map."""

    trace_path: str | None = None
    trace_format: Literal["auto", "nvidia-smi", "dcgm-prometheus", "redfish", "pdu-util", "csv"] = "auto"
    # where it was measured; "auto": the format's (nvidia-smi, dcgm: gpu; redfish: node; pdu-util: pdu); csv must say
    trace_level: Literal["auto", "gpu", "node", "rack", "pdu"] = "auto"
    trace_map: Literal["auto", "idle-peak", "absolute"] = "auto"
    trace_gpus: int = Field(default=1, ge=1, le=1024)  # nvidia-smi: GPUs whose rows alternate
    trace_rated_w: float | None = Field(default=None, gt=0)  # the traced GPU's rating (gpu level)
    trace_rating_kw: float | None = Field(default=None, gt=0)  # the traced node's / rack's / PDU's rating
    trace_gpus_per_node: int = Field(default=8, ge=1, le=1024)  # node level: GPUs in the measured node
    trace_racks: float = Field(default=1.0, gt=0)  # rack / pdu level: racks the measured unit feeds
    trace_idle_pct: float = Field(default=0.0, ge=0, le=50)  # idle-peak anchors (percentiles of the trace)
    trace_peak_pct: float = Field(default=100.0, ge=50, le=100)
    trace_fill: Literal["linear", "hold"] = "linear"
    trace_max_gap_s: float | None = Field(default=None, gt=0)  # default: 10 median sample steps
    trace_time_scale: float = Field(default=1.0, gt=0)  # 2 plays the trace twice as slow


@dataclass(frozen=True)
class TraceStats:
    path: str
    format: str
    level: str
    map: str
    samples: int
    channels: int
    step_s: float
    span_s: float
    gaps: GapStats
    anchors: tuple[float, float]  # the trace's values (W, or utilisation) that went to ...
    targets_w: tuple[float, float]  # ... these per-GPU demands (idle-peak); (nan, nan) for absolute
    clipped_low: int  # samples held up to idle
    clipped_high: int  # samples held down to rated
    demand_w: tuple[float, float]  # per-GPU demand, min and max, as replayed

    @property
    def clipped_frac(self) -> float:
        return (self.clipped_low + self.clipped_high) / max(self.samples, 1)


def _unit(level: str, site: SiteModel, spec: TraceFields) -> tuple[float, float, float]:
    """(a, b, U_full) with U(p) = a·p + b at the trace's level, for the site's GPU (W)."""
    g, eta = site.gpu, site.rectifier_eff
    if level == "gpu":
        return 1.0, 0.0, g.rated_w
    if level == "node":
        n = float(spec.trace_gpus_per_node)
        return n / eta, n * g.host_overhead_w / eta, n * (g.rated_w + g.host_overhead_w) / eta
    n, act, r = float(site.gpus_per_rack), float(np.max(site.rack_active_gpus)), spec.trace_racks
    b = r * ((n - act) * g.idle_w + n * g.host_overhead_w) / eta
    return r * act / eta, b, r * n * (g.rated_w + g.host_overhead_w) / eta


def map_trace(
    x: FloatArray, level: str, how: str, site: SiteModel, spec: TraceFields, rating: float | None
) -> tuple[FloatArray, tuple[float, float], tuple[float, float]]:
    """Per-GPU demand (W, unclipped) from the trace `x` at `level`; the anchors and targets used."""
    idle, rated = site.gpu.idle_w, site.gpu.rated_w
    a, b, full = _unit(level, site, spec)
    if how == "absolute":
        return (x - b) / a, (float("nan"), float("nan")), (float("nan"), float("nan"))
    lo, hi = (float(v) for v in np.percentile(x, [spec.trace_idle_pct, spec.trace_peak_pct]))
    if not hi > lo:
        raise ValueError("the trace's idle and peak percentiles are equal: a flat trace has no swing to map")
    p_hi = rated if rating is None else min(rated, max(idle, ((full * hi / rating) - b) / a))
    return idle + (x - lo) * (p_hi - idle) / (hi - lo), (lo, hi), (idle, p_hi)


def trace_levels(
    spec: TraceFields, site: SiteModel, source: str, key: str, cache: TraceCache
) -> tuple[FloatArray, float, TraceStats]:
    """The job's per-GPU demand on a uniform grid (W), that grid's step (trace seconds), and what was done."""
    path = str(spec.trace_path)
    ck = (path, spec.trace_format, spec.trace_gpus)
    if ck not in cache:
        cache[ck] = load_raw_trace(Path(path), spec.trace_format, source, key, spec.trace_gpus)
    raw, fmt = cache[ck]
    base = key.rsplit(".", 1)[0]
    level = spec.trace_level if spec.trace_level != "auto" else LEVEL_OF_FORMAT[fmt]
    if level is None:
        raise InputError(source, f"{base}.trace_level", "gpu, node, rack or pdu for a csv trace (where measured)")
    if raw.unit == "frac" and level in ("gpu", "node"):
        raise InputError(source, f"{base}.trace_level", "rack or pdu for a utilisation trace (pdu-util)")
    if level != "gpu" and spec.trace_rated_w is not None:
        raise InputError(source, f"{base}.trace_rated_w", f"trace_rating_kw for a {level}-level trace (not a GPU's W)")
    how = spec.trace_map if spec.trace_map != "auto" else ("idle-peak" if level in ("gpu", "node") else "absolute")
    power, gaps = filled(raw, source, key, spec.trace_max_gap_s, spec.trace_fill)
    # a unit's power: the mean over the trace's channels (GPUs of a log, nodes of a report)
    x = np.mean(power, axis=1)
    _, _, full = _unit(level, site, spec)
    rating = spec.trace_rated_w if level == "gpu" else None
    if level != "gpu" and spec.trace_rating_kw is not None:
        rating = spec.trace_rating_kw * 1e3
    if raw.unit == "frac":
        x = x * (rating if rating is not None else full)  # utilisation of the rating -> W
        rating = rating if rating is not None else full
    try:
        p, anchors, targets = map_trace(x, level, how, site, spec, rating)
    except ValueError as exc:
        raise InputError(source, key, f"{path}: {exc}") from None
    idle, rated = site.gpu.idle_w, site.gpu.rated_w
    t_s = raw.t_s
    step_s = float(np.median(np.diff(t_s)))
    grid = np.arange(int(t_s[-1] / step_s) + 1) * step_s
    level_w = np.clip(np.interp(grid, t_s, p), idle, rated)
    tol = 1e-9 * rated
    stats = TraceStats(
        path=path,
        format=fmt,
        level=level,
        map=how,
        samples=int(t_s.size),
        channels=int(power.shape[1]),
        step_s=step_s,
        span_s=float(t_s[-1]),
        gaps=gaps,
        anchors=anchors,
        targets_w=targets,
        clipped_low=int(np.sum(p < idle - tol)),
        clipped_high=int(np.sum(p > rated + tol)),
        demand_w=(float(level_w.min()), float(level_w.max())),
    )
    return level_w, step_s, stats


def stats_text(stats: TraceStats) -> str:
    """One line for `gridsim describe`."""
    g = stats.gaps
    anchor = (
        f"idle {stats.anchors[0]:.4g} → {stats.targets_w[0]:.0f} W, peak {stats.anchors[1]:.4g} → "
        f"{stats.targets_w[1]:.0f} W per GPU"
        if stats.map == "idle-peak"
        else "host and rectifier loss taken out once"
    )
    return (
        f"{stats.format} at {stats.level} level, {stats.samples:,} samples × {stats.channels} every "
        f"{stats.step_s:g} s over {stats.span_s / 3600:.3g} h; {g.failed_reads} failed reads filled ({g.rule}), "
        f"{g.gaps} gaps (longest {g.longest_gap_s:g} s, limit {g.max_gap_s:g} s); {stats.map}: {anchor}; "
        f"clipped {stats.clipped_low} low, {stats.clipped_high} high ({stats.clipped_frac:.1%}); "
        f"demand {stats.demand_w[0]:.0f}–{stats.demand_w[1]:.0f} W per GPU"
    )
