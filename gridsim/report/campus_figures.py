"""The figures of the campus behind the meter: the most stressed breakers, the jobs' caps and speed, storage, and
goodput over time. Each draws one file and returns its caption.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from gridsim.engine import SimResult
from gridsim.plant.workload import JobState
from gridsim.report.canvas import ONE_PANEL_IN, TWO_PANEL_IN, _legend, _legend_below, _mark_events, _new_figure, _save
from gridsim.report.series import _period_s, _shown_jobs, _time_unit, goodput_series, stressed_domains, trailing_mean
from gridsim.report.text import _power_label, _s

RMS_WINDOW_S = 60.0  # domains.png: the thick line is the load's RMS over this window (breakers heat with I²)


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
