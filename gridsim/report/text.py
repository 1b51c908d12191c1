"""The words of the report: report.md, its verdict line, the summary table, and how numbers read in a sentence.

`verdict` is the one-line judgement (also used by compare.md and the overview's title); `verdict_line` adds where
and when the limits broke; `report_md` writes report.md around the figures `write_figures` drew.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gridsim.engine import SimResult
from gridsim.plant.grid import effective_band_hz
from gridsim.report.series import ramp_envelope_w, spells

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
    "max_grid_step_mw": ("MW", "largest change of grid import between two ticks"),
    "bbu_equivalent_cycles": ("cycles", "worst rack's BBU wear: depth-weighted rainflow cycles"),
    "bbu_cycles_per_day": ("cycles/day", "the same, scaled to a day (budget: bbu_cycle_budget_per_day)"),
    "bbu_throughput_cycles_per_day": ("cycles/day", "all BBUs' discharged energy over their usable capacity, a day"),
    "min_bbu_ride_through_s": ("s", "least time a rack's BBU could carry its rack's load"),
    "min_voltage_pu": ("pu", "lowest PCC voltage"),
    "voltage_violation_s": ("s", "time the PCC voltage was outside its band"),
    "load_lost_mw": ("MW", "largest load one UPS transfer took off the grid"),
    "ride_through_violations": ("transfers", "UPS transfers made inside the ride-through curve"),
    "max_breaker_heat_frac": ("× rating's", "hottest breaker thermal state (1: steady at its rating)"),
    "breaker_overload_s": ("s", "time some breaker ran hotter than its rating allows steadily"),
}


@dataclass(frozen=True)
class ReportFigure:
    """A figure written beside report.md: its file name, its heading and its one-line caption."""

    file: str
    title: str
    caption: str


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
    if summary.get("ride_through_violations", 0):  # the site dropped load the ride-through curve says it must keep
        n = summary["ride_through_violations"]
        problems.append(f"{n} UPS transfer{'s' if n != 1 else ''} to backup inside the ride-through curve "
                        f"(up to {summary['load_lost_mw']:.3g} MW)")  # fmt: skip
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
