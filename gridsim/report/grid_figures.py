"""The figures of the grid connection: import at the PCC against its limits, its spectrum, the grid frequency, and
the one-page overview. Each draws one file and returns its caption (the overview has a fixed one).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from scipy.signal import welch

from gridsim.engine import SimResult
from gridsim.plant.grid import effective_band_hz
from gridsim.report.canvas import ONE_PANEL_IN, _legend, _legend_below, _mark_events, _new_figure, _save, _shade
from gridsim.report.series import _shown_jobs, _time_unit, ramp_envelope_w, trailing_mean
from gridsim.report.text import _hz, _mw, verdict


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
