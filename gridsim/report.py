"""Figures and the written report of one run. matplotlib lives here (and in compare.png's drawing) and nowhere else.

`write_figures` draws the figures a facilities engineer reads at a glance, one question each, every one with a
title, units and the limits drawn in; `report_md` writes report.md around them: the scenario and its question, a
verdict line (limits held or not, and where), the summary.json metrics with units, then the figures with a caption
each. Everything is drawn from the `SimResult` alone.

    grid.png        grid import against the interconnect limit and the ramp envelope
    spectrum.png    power spectrum of grid import and of raw demand, the critical band shaded
    domains.png     the most stressed breakers: load against rating, thermal state
    jobs.png        per-job GPU power caps and floors, and job speed
    storage.png     campus battery and rack BBU state of charge with their windows; battery power
    frequency.png   grid frequency deviation from nominal
    goodput.png     useful work over time, per job and for the campus
    overview.png    the four main panels on one page
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from scipy.signal import welch

from gridsim.engine import SimResult
from gridsim.plant.grid import effective_band_hz
from gridsim.plant.workload import JobState

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

DPI = 110
WIDTH_IN = 10.0  # 1,100 px at DPI
ONE_PANEL_IN = 4.6  # height of a one-panel figure: ~500 px
TWO_PANEL_IN = 6.4  # height of a two-panel figure: ~700 px
TOP_DOMAINS = 6  # domains shown in domains.png
MAX_JOBS_SHOWN = 8  # jobs drawn in jobs.png and goodput.png (the highest priority first)
MAX_EVENT_LABELS = 12
RMS_WINDOW_S = 60.0  # domains.png: the thick line is the load's RMS over this window (breakers heat with I²)

# summary.json keys: (unit, what it is), in contract order; docs/models.md ("Metrics") holds the definitions
METRIC_INFO: dict[str, tuple[str, str]] = {
    "scenario": ("", "scenario name"),
    "controller": ("", "controller that ran"),
    "seed": ("", "random seed"),
    "duration_s": ("s", "simulated time"),
    "gpus": ("GPUs", "installed GPUs, spares included"),
    "racks": ("racks", "installed racks"),
    "breaker_trips": ("trips", "breaker trips, any domain"),
    "pcc_overlimit_s": ("s", "time grid import was above the interconnect limit in force"),
    "ramp_violation_s": ("s", "time the windowed ramp of grid import exceeded the ramp limit"),
    "max_ramp_mw_per_min": ("MW/min", "largest windowed ramp of grid import"),
    "band_hz": ("Hz", "critical band measured (edges held at or below Nyquist)"),
    "band_rms_mw": ("MW", "RMS of grid import within the critical band"),
    "demand_band_rms_mw": ("MW", "the same for raw demand (no control, no storage)"),
    "peak_grid_mw": ("MW", "highest grid import"),
    "grid_energy_mwh": ("MWh", "energy imported from the grid"),
    "demand_energy_mwh": ("MWh", "energy the raw demand would have taken"),
    "energy_overhead_pct": ("% of demand energy", "energy that did no work: power floors and storage losses"),
    "goodput_pct": ("% of allocated GPU-time", "useful GPU-time"),
    "goodput_loss_power_pct": ("% of allocated GPU-time", "lost to power management: caps, suspensions, trips"),
    "min_bess_soc_frac": ("fraction", "lowest campus battery state of charge (– : no battery)"),
    "min_bbu_soc_frac": ("fraction", "lowest state of charge of any rack BBU"),
    "bess_equivalent_cycles": ("cycles", "battery energy discharged / its usable capacity"),
    "max_freq_dev_hz": ("Hz", "largest deviation of grid frequency from nominal"),
    "max_rocof_hz_per_s": ("Hz/s", "largest rate of change of frequency (0.5 s window)"),
    "controller_step_ms_p50": ("ms", "controller step wall time, median"),
    "controller_step_ms_p99": ("ms", "controller step wall time, 99th percentile"),
    "sim_speed_x_realtime": ("× real time", "simulated seconds per wall second"),
}


@dataclass(frozen=True)
class ReportFigure:
    """A figure written beside report.md: its file name, its heading and its one-line caption."""

    file: str
    title: str
    caption: str


# -- helpers ---------------------------------------------------------------------------------------------------


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

    The ramp metric is |m(t) − m(t − W)| / W; it holds while m(t) stays within m(t − W) ± L·W (L the ramp limit per
    second, W the window). Returns (m, low, high), each (n_ticks,); NaN where not defined (before 2W, or no limit).
    """
    grid = res.tick["grid_w"]
    n = max(1, round(res.site.ramp_window_s / res.tick_s))
    mean = trailing_mean(grid, n)
    low = np.full(grid.shape, np.nan)
    high = np.full(grid.shape, np.nan)
    limit = res.site.ramp_limit_w_per_min
    if math.isfinite(limit) and grid.size >= 2 * n:
        allowed_w = limit / 60.0 * n * res.tick_s
        prev = mean[n - 1 : -n]  # m(t − W) for every t from 2W on
        low[2 * n - 1 :] = prev - allowed_w
        high[2 * n - 1 :] = prev + allowed_w
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


def _spans(runs: list[tuple[int, int]], dt_s: float) -> str:
    """`from 308 s to 1,476 s`, `in 3 spells: 120–300 s, ...`, `in 12 spells between 120 s and 3,600 s`."""
    text = [f"{_s(a * dt_s)}–{_s((b + 1) * dt_s)}" for a, b in runs]
    if len(runs) == 1:
        return f"from {_s(runs[0][0] * dt_s)} to {_s((runs[0][1] + 1) * dt_s)}"
    if len(runs) <= 3:
        return f"in {len(runs)} spells: {', '.join(text)}"
    return f"in {len(runs)} spells between {_s(runs[0][0] * dt_s)} and {_s((runs[-1][1] + 1) * dt_s)}"


def _s(t_s: float) -> str:
    """A time for a sentence: `1,284 s`, `12.5 s`."""
    return f"{t_s:,.0f} s" if abs(t_s) >= 100 else f"{t_s:.1f} s"


def _mw(p_w: float) -> str:
    mw = p_w / 1e6
    return f"{mw:,.0f} MW" if abs(mw) >= 100 else f"{mw:.3g} MW"


def _hz(f_hz: float) -> str:
    """`1.26 Hz`, `8.76 mHz`."""
    return f"{f_hz:.3g} Hz" if abs(f_hz) >= 0.1 else f"{f_hz * 1e3:.3g} mHz"


def _power_label(rating_w: float) -> str:
    return f"{rating_w / 1e6:.3g} MW" if rating_w >= 1e7 else f"{rating_w / 1e3:,.0f} kW"


def _new_figure(height_in: float, rows: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig, list(axes)


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=DPI)


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


def _mark_events(ax: Axes, res: SimResult, scale: float, label: bool = True) -> None:
    """Events as thin dotted lines, named at the top when `label`; breaker trips as red triangles."""
    for i, (t, text) in enumerate(event_marks(res)):
        ax.axvline(t / scale, color="0.35", ls=":", lw=0.9, zorder=1)
        if label and i < MAX_EVENT_LABELS:
            ax.text(t / scale, 0.96, f"{text} ", transform=ax.get_xaxis_transform(), fontsize=7, color="0.3",
                    rotation=90, va="top", ha="right")  # fmt: skip
    if res.trips:
        tt = np.asarray([ts for ts, _ in res.trips]) / scale
        ax.plot(tt, np.full(tt.size, 1.0), "v", color="C3", ms=8, transform=ax.get_xaxis_transform(),
                clip_on=False, label="breaker trip", zorder=5)  # fmt: skip


def _shade(ax: Axes, t: FloatArray, mask: BoolArray, color: str, label: str) -> None:
    if mask.any():
        ax.fill_between(t, 0, 1, where=mask, transform=ax.get_xaxis_transform(), color=color, alpha=0.18,
                        lw=0, label=label, step="mid")  # fmt: skip


def _legend(ax: Axes, **kw: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, framealpha=0.9, **kw)


def _legend_below(fig: Figure, axes: Sequence[Axes], ncol: int = 3) -> None:
    """One legend for the whole figure, below the axes, so that it never hides the data."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=ncol, fontsize=8,
                   frameon=False)  # fmt: skip


def _shown_jobs(res: SimResult) -> list[int]:
    """Jobs drawn per job: all of them, or the MAX_JOBS_SHOWN of highest priority (ties by GPUs)."""
    site = res.site
    order = sorted(range(site.n_jobs), key=lambda j: (-int(site.job_priority[j]), -int(site.job_gpus[j]), j))
    return sorted(order[:MAX_JOBS_SHOWN])


# -- the figures -----------------------------------------------------------------------------------------------


def grid_png(res: SimResult, path: Path) -> str:
    """Grid import against the interconnect limit, with the band the ramp limit allows its window mean."""
    site, s = res.site, res.summary
    scale, tlabel = _time_unit(res.duration_s)
    t = res.t_s / scale
    grid = res.tick["grid_w"]
    limit = res.tick["pcc_limit_w"]
    window_s = site.ramp_window_s
    mean, low, high = ramp_envelope_w(res)
    n = max(1, round(window_s / res.tick_s))
    ramp_limit = site.ramp_limit_w_per_min
    has_ramp = math.isfinite(ramp_limit)

    fig, (ax,) = _new_figure(ONE_PANEL_IN)
    over = grid > limit * (1 + 1e-6)
    outside = np.zeros(grid.shape, dtype=bool)
    if has_ramp:
        finite = np.isfinite(low)
        outside[finite] = (mean[finite] < low[finite] - 1e-6 * ramp_limit) | (
            mean[finite] > high[finite] + 1e-6 * ramp_limit
        )
        for edge in (low, high):
            ax.plot(t, edge / 1e6, color="C2", lw=0.7, alpha=0.8)
        ax.fill_between(t, low / 1e6, high / 1e6, color="C2", alpha=0.18, lw=0,
                        label=f"allowed for the {window_s:g} s mean: previous mean ± {ramp_limit / 1e6:g} MW/min "
                        f"× {window_s / 60:g} min")  # fmt: skip
    _shade(ax, t, outside, "C1", "ramp limit exceeded")
    _shade(ax, t, over, "C3", "over the interconnect limit")
    demand_mean = trailing_mean(res.tick["demand_w"], n)
    ax.plot(t, demand_mean / 1e6, color="0.45", lw=1.1, ls=":",
            label=f"raw demand, {window_s:g} s mean (no control, no storage)")  # fmt: skip
    ax.plot(t, grid / 1e6, color="C0", lw=0.4, alpha=0.5, label=f"grid import, every {res.tick_s:g} s")
    ax.plot(t, mean / 1e6, color="navy", lw=1.5, label=f"grid import, {window_s:g} s mean")
    base = site.pcc_limit_w
    ax.axhline(base / 1e6, color="C3", ls="--", lw=1.2, label=f"interconnect limit {_mw(base)}")
    if np.any(limit < base * (1 - 1e-9)):
        ax.plot(t, limit / 1e6, color="C3", lw=1.8, label="limit in force (curtailed)")
    _mark_events(ax, res, scale)

    lo_data = min(float(np.percentile(grid, 0.5)), float(limit.min()))
    hi_data = max(float(grid.max()), base)
    if np.isfinite(demand_mean).any():
        lo_data = min(lo_data, float(np.nanmin(demand_mean)))
        hi_data = max(hi_data, float(np.nanmax(demand_mean)))
    if np.isfinite(low).any():
        lo_data = min(lo_data, float(np.nanmin(low)))
        hi_data = max(hi_data, float(np.nanmax(high)))
    pad = 0.08 * max(hi_data - lo_data, 0.02 * hi_data, 1.0)
    ax.set_ylim(max(0.0, lo_data - 1.5 * pad) / 1e6, (hi_data + 2.5 * pad) / 1e6)
    ax.set_ylabel("power at the PCC [MW]")
    ax.set_xlabel(tlabel)
    held = "limits held" if not (s.get("pcc_overlimit_s", 0) or s.get("ramp_violation_s", 0)) else "limits NOT held"
    ramp_txt = f"{s.get('ramp_violation_s', 0):.0f} s over the ramp limit" if has_ramp else "no ramp limit"
    ax.set_title(f"Grid import at the PCC — {held}: {s.get('pcc_overlimit_s', 0):.0f} s over the interconnect "
                 f"limit, {ramp_txt} (largest ramp {s.get('max_ramp_mw_per_min', 0):.3g} MW/min)",
                 fontsize=10)  # fmt: skip
    _legend_below(fig, [ax], ncol=3)
    _save(fig, path)
    if has_ramp:
        band = (f"green: where the {window_s:g} s mean may go, the previous {window_s:g} s mean ± "
                f"{ramp_limit / 1e6:g} MW/min × {window_s / 60:g} min (orange: left it, a ramp violation)")  # fmt: skip
    else:
        band = "no ramp limit on this site"
    return (
        f"Grid import (thin: every {res.tick_s:g} s; thick: {window_s:g} s mean) against the interconnect limit "
        f"(red; shaded where exceeded); {band}; dotted: raw demand's mean."
    )


def spectrum_png(res: SimResult, path: Path) -> str:
    """Welch power spectral density of grid import and of raw demand, log-log, the critical band shaded."""
    s = res.summary
    fs = 1.0 / res.tick_s
    lo, hi = effective_band_hz(res.tick_s, *res.band_hz)
    n = res.t_s.size
    # segments long enough to resolve the band's lower edge 4 times over (at least 4 / lo seconds), a power of 2
    nperseg = min(n, 2 ** math.ceil(math.log2(max(8.0, 4.0 / (lo * res.tick_s)))))
    fig, (ax,) = _new_figure(ONE_PANEL_IN)
    cfg_lo, cfg_hi = res.band_hz
    seen = "" if (lo, hi) == (cfg_lo, cfg_hi) else f" ({cfg_lo:g}–{cfg_hi:g} Hz set; Nyquist at {hi:g} Hz)"
    ax.axvspan(lo, hi, color="C3", alpha=0.08, label=f"critical band {lo:g}–{hi:g} Hz{seen}")
    peak = 0.0
    lines = (
        ("demand_w", "raw demand (no control, no storage)", "0.5", s.get("demand_band_rms_mw")),
        ("grid_w", "grid import at the PCC", "C0", s.get("band_rms_mw")),
    )
    curves = []
    for key, label, color, rms in lines:
        f, pxx = welch(res.tick[key], fs=fs, nperseg=max(nperseg, 2), detrend="constant")
        pxx = pxx / 1e12  # W²/Hz -> MW²/Hz
        peak = max(peak, float(pxx[1:].max()) if pxx.size > 1 else 0.0)
        curves.append((f, pxx, label, color, rms))
    floor = peak * 1e-9 if peak > 0 else 1e-12
    for f, pxx, label, color, rms in curves:
        rms_txt = f" — band RMS {rms:.3g} MW" if isinstance(rms, float) else ""
        ax.loglog(f[1:], np.maximum(pxx[1:], floor), color=color, lw=1.1, label=label + rms_txt)
    ax.set_xlim(fs / max(nperseg, 2), fs / 2)
    ax.set_ylim(bottom=floor, top=max(peak * 5, floor * 10))
    ax.set_xlabel("frequency [Hz]")
    ax.set_ylabel("power spectral density [MW²/Hz]")
    ax.set_title(f"Spectrum of grid import against raw demand (Welch, {nperseg * res.tick_s:g} s segments); "
                 f"the utility watches the shaded band", fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    _legend(ax, loc="lower left")
    _save(fig, path)
    return (
        f"Welch power spectral density of grid import and raw demand ({nperseg * res.tick_s:g} s segments); each "
        f"band RMS is about the square root of the area under its curve within the shaded {lo:g}–{hi:g} Hz band."
    )


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


def domains_png(res: SimResult, path: Path) -> str:
    """The most stressed breakers: load as % of the rating in force, and thermal state (1 = trips)."""
    site = res.site
    scale, tlabel = _time_unit(res.duration_s)
    tp = res.period_t_s / scale
    cols, ratio = stressed_domains(res)
    fig, (ax, ax2) = _new_figure(TWO_PANEL_IN, rows=2)
    rec = res.recorded_domains
    period_s = float(np.median(_period_s(res))) if res.period_t_s.size else 1.0
    rms_n = max(1, round(RMS_WINDOW_S / period_s))
    for i, c in enumerate(cols):
        d = int(rec[c])
        rating = float(res.period["domain_limit_w"][-1, c]) if res.period_t_s.size else site.domain_rating_w[d]
        label = f"{site.domain_name[d]} (rated {_power_label(float(site.domain_rating_w[d]))}"
        label += ")" if math.isclose(rating, float(site.domain_rating_w[d])) else f", {_power_label(rating)} now)"
        color = f"C{i % 10}"
        ax.plot(tp, ratio[:, c] * 100, color=color, lw=0.5, alpha=0.35)
        rms = np.sqrt(np.maximum(trailing_mean(ratio[:, c] ** 2, rms_n), 0.0))
        ax.plot(tp, rms * 100, color=color, lw=1.6, label=label)
        ax2.plot(tp, res.period["domain_thermal_frac"][:, c], color=color, lw=1.4)
    ax.axhline(100.0, color="C3", ls="--", lw=1.2, label="rating in force")
    ax2.axhline(1.0, color="C3", ls="--", lw=1.2, label="trip point")
    for a in (ax, ax2):
        _mark_events(a, res, scale, label=a is ax)
    ax.set_ylabel("load [% of rating in force]")
    ax2.set_ylabel("thermal state [1 = trips]")
    ax2.set_xlabel(tlabel)
    top = float(np.nanmax(ratio[:, cols])) * 100 if cols else 100.0
    ax.set_ylim(0, max(110.0, top * 1.08))
    therm_top = float(np.nanmax(res.period["domain_thermal_frac"][:, cols])) if cols else 1.0
    ax2.set_ylim(0, max(1.1, therm_top * 1.08))
    trips = ", ".join(f"{d} at {_s(t)}" for t, d in res.trips[:4]) + (" …" if len(res.trips) > 4 else "")
    ax.set_title(f"The {len(cols)} most stressed breakers (of {rec.size} recorded; thick: {RMS_WINDOW_S:g} s RMS) — "
                 + (f"trips: {trips}" if res.trips else "no trips"), fontsize=10)  # fmt: skip
    ax2.set_title("breaker thermal state θ/k²: heats with (load / rating)², trips at 1", fontsize=9)
    _legend_below(fig, [ax, ax2], ncol=4)
    _save(fig, path)
    return (
        f"The {len(cols)} recorded breakers with the highest peak load over rating (tripped first): load in % of "
        f"the rating in force (thin {period_s:g} s means, thick {RMS_WINDOW_S:g} s RMS) and thermal state, which "
        f"trips at 1."
    )


def jobs_png(res: SimResult, path: Path) -> str:
    """Per-job GPU power cap and floor (W per GPU), and job speed under the caps."""
    site = res.site
    scale, tlabel = _time_unit(res.duration_s)
    tp = res.period_t_s / scale
    fig, (ax, ax2) = _new_figure(TWO_PANEL_IN, rows=2)
    shown = _shown_jobs(res)
    state = res.period["job_state"]
    training = (state == JobState.RUNNING) | (state == JobState.CHECKPOINT)
    for i, j in enumerate(shown):
        color = f"C{i % 10}"
        name = site.job_name[j]
        ax.plot(tp, res.period["job_cap_w"][:, j], color=color, lw=1.3,
                label=f"{name} (priority {site.job_priority[j]}) cap")  # fmt: skip
        floor = res.period["job_floor_w"][:, j]
        if np.any(floor > 0):
            ax.plot(tp, floor, color=color, lw=1.0, ls="--", label=f"{name} floor")
        speed = np.where(training[:, j], res.period["job_speed_frac"][:, j] * 100, np.nan)
        ax2.plot(tp, speed, color=color, lw=1.2, label=name)
    gpu = site.gpu
    ax.axhline(gpu.rated_w, color="0.4", ls=":", lw=1.0, label=f"rated {gpu.rated_w:g} W")
    ax.axhline(gpu.min_cap_w, color="0.4", ls="-.", lw=0.8, label=f"lowest cap {gpu.min_cap_w:g} W")
    ax.set_ylim(0, gpu.rated_w * 1.12)
    ax.set_ylabel(f"per-GPU power [W] ({gpu.name})")
    more = f" (the {len(shown)} of highest priority of {site.n_jobs})" if len(shown) < site.n_jobs else ""
    ax.set_title(f"GPU power caps (solid) and floors (dashed) per job{more}", fontsize=10)
    ax2.set_ylabel("job speed [% of uncapped]")
    ax2.set_xlabel(tlabel)
    low = float(np.nanmin(np.where(training, res.period["job_speed_frac"], np.nan))) if training.any() else 1.0
    ax2.set_ylim(min(95.0, low * 100 - 5), 101.5)
    ax2.set_title("speed of each job under its caps while it trains (gaps: waiting, down, suspended, stopped)",
                  fontsize=9)  # fmt: skip
    if not shown:
        ax.text(0.5, 0.5, "no jobs", transform=ax.transAxes, ha="center", fontsize=12, color="0.4")
    for a in (ax, ax2):
        _mark_events(a, res, scale, label=a is ax)
    _legend_below(fig, [ax], ncol=4)
    _save(fig, path)
    return (
        "Per-GPU cap (solid) and floor (dashed) the controller set for each job, and each job's speed under its cap "
        "while it trains (a synchronous job runs at its slowest rack's pace)."
    )


def storage_png(res: SimResult, path: Path) -> str:
    """Campus battery and rack BBU state of charge with their windows, and the battery's power."""
    site = res.site
    scale, tlabel = _time_unit(res.duration_s)
    t = res.t_s / scale
    tp = res.period_t_s / scale
    bess, bbu = site.bess, site.rack_storage
    has_bess = bess.energy_j > 0 and bess.power_w > 0
    fig, (ax, ax2) = _new_figure(TWO_PANEL_IN, rows=2)
    if has_bess:
        ax.plot(t, res.tick["bess_soc_frac"] * 100, color="C1", lw=1.4,
                label=f"campus battery ({bess.power_w / 1e6:g} MW / {bess.energy_j / 3.6e9:g} MWh)")  # fmt: skip
        ax.axhspan(bess.soc_min_frac * 100, bess.soc_max_frac * 100, color="C1", alpha=0.07)
        for v in (bess.soc_min_frac, bess.soc_max_frac):
            ax.axhline(v * 100, color="C1", ls=":", lw=1.0)
        ax.text(0.005, bess.soc_min_frac * 100, f" battery window {bess.soc_min_frac:.0%}–{bess.soc_max_frac:.0%}",
                transform=ax.get_yaxis_transform(), color="C1", fontsize=7, va="bottom")  # fmt: skip
    ax.plot(tp, res.period["bbu_soc_min_frac"] * 100, color="C4", lw=1.2, label="rack BBUs, lowest")
    ax.plot(tp, res.period["bbu_soc_mean_frac"] * 100, color="C4", lw=1.0, ls="--", label="rack BBUs, mean")
    ax.axhline(bbu.bbu_soc_min_frac * 100, color="C4", ls=":", lw=1.0)
    ax.text(0.005, bbu.bbu_soc_min_frac * 100, f" BBU reserve below {bbu.bbu_soc_min_frac:.0%} (ride-through)",
            transform=ax.get_yaxis_transform(), color="C4", fontsize=7, va="top")  # fmt: skip
    ax.set_ylim(-2, 102)
    ax.set_ylabel("state of charge [%]")
    ax.set_title("Storage state of charge against its windows", fontsize=10)
    _legend(ax, loc="lower right")
    if has_bess:
        p = res.tick["bess_w"] / 1e6
        ax2.plot(t, p, color="C1", lw=0.6)
        if np.any(p > 0):
            ax2.fill_between(t, 0, p, where=p > 0, color="C1", alpha=0.35, lw=0, label="discharging (to the campus)")
        if np.any(p < 0):
            ax2.fill_between(t, 0, p, where=p < 0, color="C0", alpha=0.35, lw=0, label="charging (from the grid)")
        for v in (bess.power_w, -bess.power_w):
            ax2.axhline(v / 1e6, color="0.4", ls=":", lw=1.0)
        ax2.axhline(0.0, color="0.5", lw=0.6)
        rating_mw = bess.power_w / 1e6
        ax2.set_ylim(-1.15 * rating_mw, 1.15 * rating_mw)
        ax2.set_title(f"campus battery power (dotted: its rating ±{rating_mw:g} MW)", fontsize=9)
        _legend(ax2, loc="lower right")
    else:
        ax2.text(0.5, 0.5, "no campus battery on this site", transform=ax2.transAxes, ha="center", color="0.4")
        ax2.set_title("campus battery power", fontsize=9)
    ax2.set_ylabel("battery power [MW]")
    ax2.set_xlabel(tlabel)
    for a in (ax, ax2):
        _mark_events(a, res, scale, label=False)
    _save(fig, path)
    return (
        "Campus battery and rack BBU state of charge against their windows (dotted), and the battery's power "
        "(positive: discharging into the campus)."
    )


def frequency_png(res: SimResult, path: Path) -> str:
    """Deviation of the modelled grid frequency from nominal, in mHz."""
    s = res.summary
    scale, tlabel = _time_unit(res.duration_s)
    t = res.t_s / scale
    dev = (res.tick["freq_hz"] - res.nominal_hz) * 1e3
    fig, (ax,) = _new_figure(ONE_PANEL_IN)
    ax.axhline(0.0, color="0.3", lw=1.0, label=f"nominal {res.nominal_hz:g} Hz")
    ax.plot(t, dev, color="C2", lw=0.8, label="grid frequency − nominal")
    _mark_events(ax, res, scale)
    span = max(float(np.abs(dev).max()) if dev.size else 0.0, 1e-3)
    ax.set_ylim(-1.15 * span, 1.15 * span)
    ax.set_ylabel("frequency deviation [mHz]")
    ax.set_xlabel(tlabel)
    ax.set_title(f"Grid frequency: largest deviation {_hz(s.get('max_freq_dev_hz', 0.0))}, largest rate of change "
                 f"{_hz(s.get('max_rocof_hz_per_s', 0.0))}/s", fontsize=10)  # fmt: skip
    _legend(ax, loc="lower left")
    _save(fig, path)
    return (
        "Modelled grid frequency minus nominal: the area's response to the campus's import and other load steps, "
        "plus any replayed measured event."
    )


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


def goodput_png(res: SimResult, path: Path) -> str:
    """Useful work over time: each job's rate, the campus's, and the running goodput after rollbacks."""
    site, s = res.site, res.summary
    scale, tlabel = _time_unit(res.duration_s)
    tp = res.period_t_s / scale
    rate, campus, cumulative = goodput_series(res)
    fig, (ax,) = _new_figure(ONE_PANEL_IN)
    for i, j in enumerate(_shown_jobs(res)):
        ax.plot(tp, rate[:, j] * 100, color=f"C{i % 10}", lw=0.9, alpha=0.8, label=f"{site.job_name[j]}, now")
    ax.plot(tp, campus * 100, color="0.3", lw=0.9, ls="--", label="all jobs, now (GPU-weighted)")
    ax.plot(tp, cumulative * 100, color="k", lw=2.2, label="goodput since the start (rollbacks taken off)")
    _mark_events(ax, res, scale)
    ax.set_ylim(-3, 108)
    ax.set_ylabel("useful work [% of allocated GPU-time]")
    ax.set_xlabel(tlabel)
    final = s.get("goodput_pct")
    end = f": {final:.3g} % at the end, {s.get('goodput_loss_power_pct', 0):.2g} % lost to power management" if (
        isinstance(final, float)) else ""  # fmt: skip
    ax.set_title(f"Goodput — the share of allocated GPU-time doing useful training{end}", fontsize=10)
    if not site.n_jobs:
        ax.text(0.5, 0.5, "no jobs", transform=ax.transAxes, ha="center", fontsize=12, color="0.4")
    _legend_below(fig, [ax], ncol=4)
    _save(fig, path)
    return (
        "Each job's useful rate now (thin; 0 while starting, stalled, down or suspended) and useful over allocated "
        "GPU-time since the start (thick; steps down when a fall loses the work since the last checkpoint), which "
        "ends at `goodput_pct`."
    )


def overview_png(res: SimResult, path: Path) -> None:
    """One page: grid vs limits, frequency, storage, and what the jobs got."""
    s = res.summary
    scale, tlabel = _time_unit(res.duration_s)
    t = res.t_s / scale
    tp = res.period_t_s / scale
    fig, axes = _new_figure(12.0, rows=4)

    ax = axes[0]
    n = max(1, round(res.site.ramp_window_s / res.tick_s))
    ax.plot(t, res.tick["demand_w"] / 1e6, color="0.75", lw=0.5, label="raw demand (no control, no storage)")
    ax.plot(t, res.tick["grid_w"] / 1e6, color="C0", lw=0.5, alpha=0.8, label="grid import at the PCC")
    ax.plot(t, trailing_mean(res.tick["grid_w"], n) / 1e6, color="navy", lw=1.4,
            label=f"grid import, {res.site.ramp_window_s:g} s mean")  # fmt: skip
    ax.plot(t, res.tick["pcc_limit_w"] / 1e6, color="C3", ls="--", lw=1.2, label="interconnect limit in force")
    _mark_events(ax, res, scale)
    ax.set_ylabel("power [MW]")
    held = verdict(s, res.trips) == "Limits held."
    ax.set_title(f"{res.scenario} — controller {res.controller}: " + ("limits held" if held else
                 f"limits NOT held: {s['breaker_trips']} trips, {s['pcc_overlimit_s']:.0f} s over the limit, "
                 f"{s['ramp_violation_s']:.0f} s over the ramp limit"), fontsize=10)  # fmt: skip
    _legend(ax, loc="lower left", ncol=3)

    ax = axes[1]
    ax.plot(t, (res.tick["freq_hz"] - res.nominal_hz) * 1e3, color="C2", lw=0.8)
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.set_ylabel("frequency − nominal [mHz]")
    ax.set_title(f"frequency of the surrounding system (nominal {res.nominal_hz:g} Hz)", fontsize=10)

    ax = axes[2]
    if res.site.bess.energy_j > 0:
        ax.plot(t, res.tick["bess_soc_frac"] * 100, color="C1", label="campus battery")
        ax.axhline(res.site.bess.soc_min_frac * 100, color="C1", ls=":", lw=1)
    ax.plot(tp, res.period["bbu_soc_min_frac"] * 100, color="C4", label="rack BBU (lowest)")
    ax.plot(tp, res.period["bbu_soc_mean_frac"] * 100, color="C4", ls="--", label="rack BBU (mean)")
    ax.set_ylabel("state of charge [%]")
    ax.set_ylim(-2, 102)
    ax.set_title("storage", fontsize=10)
    _legend(ax, loc="lower right")

    ax = axes[3]
    for i, j in enumerate(_shown_jobs(res)):
        name = res.site.job_name[j]
        ax.plot(tp, res.period["job_cap_w"][:, j], color=f"C{i % 10}", lw=1, label=f"{name} cap")
        ax.plot(tp, res.period["job_speed_frac"][:, j] * res.site.gpu.rated_w, color=f"C{i % 10}", lw=0.8,
                ls=":", label=f"{name} speed × rated")  # fmt: skip
    ax.axhline(res.site.gpu.rated_w, color="0.5", ls="--", lw=0.8)
    ax.set_ylim(0, res.site.gpu.rated_w * 1.1)
    ax.set_ylabel("per-GPU cap [W]")
    ax.set_xlabel(tlabel)
    ax.set_title("GPU power caps and job speed", fontsize=10)
    _legend(ax, loc="lower right", ncol=2)
    _save(fig, path)


FIGURES: tuple[tuple[str, str, Any], ...] = (
    ("grid.png", "Grid import against the interconnect and ramp limits", grid_png),
    ("spectrum.png", "Spectrum of grid import against raw demand", spectrum_png),
    ("domains.png", "The most stressed breakers", domains_png),
    ("jobs.png", "Caps, floors and job speed", jobs_png),
    ("storage.png", "Battery and BBU state of charge", storage_png),
    ("frequency.png", "Grid frequency", frequency_png),
    ("goodput.png", "Goodput over time", goodput_png),
)


def write_figures(res: SimResult, out_dir: Path) -> list[ReportFigure]:
    """Draw every figure of the report into `out_dir` (summary filled first); the overview comes last."""
    out: list[ReportFigure] = []
    for file, title, draw in FIGURES:
        caption = draw(res, Path(out_dir) / file)
        out.append(ReportFigure(file, title, caption))
    overview_png(res, Path(out_dir) / "overview.png")
    out.append(ReportFigure("overview.png", "Overview", "Grid import, frequency, storage and caps on one page."))
    return out


# -- the written report ----------------------------------------------------------------------------------------


def verdict(
    summary: dict[str, Any],
    trips: Sequence[tuple[float, str]],
    where_over: str = "",
    where_ramp: str = "",
) -> str:
    """One line: whether the limits held and, if not, which breakers tripped when and how long over a limit
    (with `where_over` / `where_ramp`, when and by how much, in brackets)."""
    problems = []
    if summary["breaker_trips"]:
        by_domain: dict[str, list[float]] = {}
        for ts, d in trips:
            by_domain.setdefault(d, []).append(ts)
        where = "; ".join(f"{d} at {', '.join(_s(ts) for ts in times[:3])}" + (" …" if len(times) > 3 else "")
                          for d, times in list(by_domain.items())[:4])  # fmt: skip
        if len(by_domain) > 4:
            where += f"; {len(by_domain) - 4} more breakers"
        n = summary["breaker_trips"]
        problems.append(f"{n} breaker trip{'s' if n != 1 else ''} ({where})")
    if summary["pcc_overlimit_s"] > 0:
        problems.append(f"{summary['pcc_overlimit_s']:,.1f} s over the interconnect limit"
                        + (f" ({where_over})" if where_over else ""))  # fmt: skip
    if summary["ramp_violation_s"] > 0:
        problems.append(f"{summary['ramp_violation_s']:,.1f} s over the utility ramp limit"
                        + (f" ({where_ramp})" if where_ramp else ""))  # fmt: skip
    return "Limits held." if not problems else "Limits NOT held: " + "; ".join(problems) + "."


def verdict_line(res: SimResult) -> str:
    """The verdict with where and when: trips by breaker and time, and the spells and size of each excess."""
    s, site, dt = res.summary, res.site, res.tick_s
    if verdict(s, res.trips) == "Limits held.":
        ramp = (f" against {site.ramp_limit_w_per_min / 1e6:g} MW/min" if math.isfinite(site.ramp_limit_w_per_min)
                else ", no ramp limit")  # fmt: skip
        return (f"Limits held: no breaker trips, grid import within the interconnect limit and the ramp limit "
                f"(peak {s['peak_grid_mw']:.4g} MW against {site.pcc_limit_w / 1e6:g} MW; largest ramp "
                f"{s['max_ramp_mw_per_min']:.3g} MW/min{ramp}).")  # fmt: skip
    grid, limit = res.tick["grid_w"], res.tick["pcc_limit_w"]
    gap = max(1, round(site.ramp_window_s / dt))  # excursions closer than a ramp window make one spell
    where_over = where_ramp = ""
    over = spells(grid > limit * (1 + 1e-6), gap)
    if over:
        where_over = f"{_spans(over, dt)}, by up to {_mw(float(np.max(grid - limit)))}"
    mean, low, high = ramp_envelope_w(res)
    finite = np.isfinite(low)
    if s["ramp_violation_s"] > 0 and finite.any():
        tol = 1e-6 * site.ramp_limit_w_per_min
        outside = np.zeros(grid.shape, dtype=bool)
        outside[finite] = (mean[finite] < low[finite] - tol) | (mean[finite] > high[finite] + tol)
        ramps = spells(outside, gap)
        if ramps:
            where_ramp = (f"{_spans(ramps, dt)}; largest ramp {s['max_ramp_mw_per_min']:.3g} MW/min against "
                          f"{site.ramp_limit_w_per_min / 1e6:g} MW/min")  # fmt: skip
    return verdict(s, res.trips, where_over, where_ramp)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if abs(v) < 1e-9:
            return "0" if v == 0 else "≈0"
        return f"{v:,.4g}" if abs(v) >= 1e-3 else f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, list | tuple):
        return "–".join(_fmt(x) for x in v)
    return str(v)


def summary_table(summary: dict[str, Any]) -> str:
    """The summary.json metrics as a markdown table: key, value, unit, meaning."""
    rows = []
    for key, value in summary.items():
        unit, meaning = METRIC_INFO.get(key, ("", ""))
        rows.append(f"| `{key}` | {_fmt(value)} | {unit} | {meaning} |")
    return "| metric | value | unit | meaning |\n|---|---:|---|---|\n" + "\n".join(rows) + "\n"


def report_md(
    res: SimResult,
    figure: str = "overview.png",
    figures: Sequence[ReportFigure] = (),
    description: str | None = None,
) -> str:
    """report.md: the scenario and its question, the verdict, the metrics with units, the figures with captions.

    `figures` are those `write_figures` drew; with none, the report shows `figure` alone (the overview).
    """
    s, site = res.summary, res.site
    ramp = (f"ramp limit {site.ramp_limit_w_per_min / 1e6:g} MW/min over {site.ramp_window_s:g} s"
            if math.isfinite(site.ramp_limit_w_per_min) else "no ramp limit")  # fmt: skip
    lo, hi = effective_band_hz(res.tick_s, *res.band_hz)
    parts = [f"# {res.scenario} — controller `{res.controller}`, seed {res.seed}\n"]
    if description and description.strip():
        text = " ".join(description.split())
        parts.append(f"> {text}\n")
    parts.append(f"**{verdict_line(res)}**\n")
    parts.append(
        f"{site.n_gpus:,} GPUs in {site.n_racks:,} racks ({site.gpu.name}), {site.n_domains:,} breakers, "
        f"{site.n_jobs} job{'s' if site.n_jobs != 1 else ''}; {res.duration_s:,.0f} s simulated at {res.tick_s:g} s "
        f"ticks; interconnect limit {site.pcc_limit_w / 1e6:g} MW; {ramp}; critical band {lo:g}–{hi:g} Hz.\n"
    )
    parts.append("## Summary\n\n" + summary_table(s))
    parts.append("## Figures\n")
    shown = list(figures) or [ReportFigure(figure, "Overview", "Grid import, frequency, storage and caps.")]
    for f in shown:
        parts.append(f"### {f.title}\n\n![{f.title}]({f.file})\n\n*{f.caption}*\n")
    return "\n".join(parts)
