"""`gridsim compare`: every controller on the same scenario and seed, side by side.

`compare` runs the controllers (all of them unless told otherwise) after checking every one of them can be built
for the scenario; `write_compare` writes, all or nothing,

    compare.json   a list of summary dicts, one per controller, exactly the summary.json contract
    compare.csv    one row per controller, the contract's keys as columns
    compare.png    one row per controller: grid import against the interconnect limit, with the key metrics
    compare_pareto.png  goodput lost against in-band oscillation, energy overhead as marker colour and size, one
                   labelled point per controller, those that broke a limit marked apart, the Pareto front drawn
    compare.md     a side-by-side table of the key metrics and the figures

matplotlib is imported inside `compare_png` only.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.control import controller_names, make_controller
from dimmer.errors import InputError
from dimmer.outpath import staging, writing
from gridsim.engine import SimResult, run
from gridsim.metrics import SUMMARY_KEYS, summarize
from gridsim.scenario import LoadedScenario

FloatArray = npt.NDArray[np.float64]

# controller name, its index in the run order, the number of controllers, the fraction of its run done
CompareProgress = Callable[[str, int, int, float], None]

FILES = ("compare.json", "compare.csv", "compare.png", "compare_pareto.png", "compare.md")

# The metrics compare.md puts side by side: summary key and the row label (with its unit).
KEY_METRICS: tuple[tuple[str, str], ...] = (
    ("breaker_trips", "breaker trips"),
    ("breaker_overload_s", "a breaker above its rating's heat [s]"),
    ("pcc_overlimit_s", "over the interconnect limit [s]"),
    ("ramp_violation_s", "over the ramp limit [s]"),
    ("max_ramp_mw_per_min", "largest ramp [MW/min]"),
    ("max_grid_step_mw", "largest grid step in one tick [MW]"),
    ("peak_grid_mw", "peak grid import [MW]"),
    ("band_rms_mw", "band RMS, grid import [MW]"),
    ("demand_band_rms_mw", "band RMS, demand [MW]"),
    ("goodput_pct", "goodput [%]"),
    ("goodput_loss_power_pct", "goodput lost to power management [%]"),
    ("energy_overhead_pct", "energy overhead [%]"),
    ("grid_energy_mwh", "grid energy [MWh]"),
    ("min_bess_soc_frac", "lowest campus battery SoC"),
    ("min_bbu_soc_frac", "lowest rack BBU SoC"),
    ("bess_equivalent_cycles", "battery equivalent cycles"),
    ("bbu_cycles_per_day", "BBU cycles a day, worst rack (depth-weighted)"),
    ("min_bbu_ride_through_s", "least BBU ride-through [s]"),
    ("max_freq_dev_hz", "largest frequency deviation [Hz]"),
    ("controller_step_ms_p99", "controller step, p99 [ms]"),
)


# -- checking the request ------------------------------------------------------------------------------------


def parse_controllers(text: str | None) -> list[str]:
    """`a,b` -> ["a", "b"], each a registered controller, each once.

    None -> every registered controller, the baseline `none` first (the reference the others are read against).
    """
    known = controller_names()
    if text is None:
        return sorted(known, key=lambda n: n != "none")
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise InputError("--controllers", repr(text), f"a comma-separated list of: {', '.join(known)}")
    seen: set[str] = set()
    for name in names:
        if name not in known:
            raise InputError("--controllers", repr(name), f"one of {', '.join(known)}")
        if name in seen:
            raise InputError("--controllers", repr(name), "each controller named once")
        seen.add(name)
    return names


def check_controllers(loaded: LoadedScenario, controllers: Sequence[str]) -> None:
    """Build every controller once for the scenario's site and parameters, so that a bad name or parameter
    fails before anything runs."""
    if not controllers:
        raise InputError(loaded.source, "controllers", "at least one controller to compare")
    site = loaded.site()
    for name in controllers:
        make_controller(name, site, loaded.scenario.controllers.get(name, {}), source=loaded.source)


# -- running -------------------------------------------------------------------------------------------------


def compare(
    loaded: LoadedScenario,
    controllers: Sequence[str],
    seed: int | None = None,
    progress: CompareProgress | None = None,
) -> list[SimResult]:
    """Run `controllers` in order on the same scenario and seed (default: the scenario's), summaries filled.

    Every controller is built first: a bad name or parameter raises InputError before any run.
    """
    if seed is not None and seed < 0:
        raise InputError("seed", str(seed), "a non-negative integer")
    check_controllers(loaded, controllers)
    results = []
    for i, name in enumerate(controllers):
        res = run(loaded, controller=name, seed=seed, progress=_labelled(progress, name, i, len(controllers)))
        summarize(res)
        results.append(res)
    return results


def _labelled(progress: CompareProgress | None, name: str, index: int, count: int) -> Callable[[float], None] | None:
    if progress is None:
        return None

    def report(frac: float) -> None:
        progress(name, index, count, frac)

    return report


# -- writing -------------------------------------------------------------------------------------------------


def summaries(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    return [res.summary if res.summary else summarize(res) for res in results]


def compare_csv(rows: Sequence[dict[str, Any]]) -> str:
    """One row per controller, SUMMARY_KEYS as columns; a list (band_hz) as JSON, null as an empty cell."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(SUMMARY_KEYS)
    for row in rows:
        writer.writerow([csv_cell(row[k]) for k in SUMMARY_KEYS])
    return buf.getvalue()


def csv_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, list | tuple | dict):
        return json.dumps(v)
    return repr(v) if isinstance(v, float) else str(v)


def compare_table(rows: Sequence[dict[str, Any]]) -> str:
    """A fixed-width table of the headline metrics, one line per controller (for the terminal)."""
    head = (
        f"{'controller':<12} {'trips':>5} {'over limit s':>12} {'over ramp s':>11} {'goodput lost %':>14} "
        f"{'overhead %':>10} {'band RMS MW':>11} {'demand MW':>9}"
    )
    lines = [head]
    for s in rows:
        lines.append(
            f"{s['controller']:<12} {s['breaker_trips']:>5d} {s['pcc_overlimit_s']:>12.1f} "
            f"{s['ramp_violation_s']:>11.1f} {s['goodput_loss_power_pct']:>14.2f} {s['energy_overhead_pct']:>10.2f} "
            f"{s['band_rms_mw']:>11.3f} {s['demand_band_rms_mw']:>9.3f}"
        )
    return "\n".join(lines)


def holds_limits(s: dict[str, Any]) -> bool:
    """No breaker trip, never over the interconnect limit, never over the ramp limit."""
    return not (s["breaker_trips"] or s["pcc_overlimit_s"] > 0 or s["ramp_violation_s"] > 0)


def pareto_front(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Controllers that hold the limits and that no other such controller beats on both goodput lost and band
    RMS (lower is better on both), in order of goodput lost."""
    held = [s for s in rows if holds_limits(s)]
    front = [
        s
        for s in held
        if not any(
            o["goodput_loss_power_pct"] <= s["goodput_loss_power_pct"]
            and o["band_rms_mw"] <= s["band_rms_mw"]
            and (o["goodput_loss_power_pct"] < s["goodput_loss_power_pct"] or o["band_rms_mw"] < s["band_rms_mw"])
            for o in held
        )
    ]
    return [s["controller"] for s in sorted(front, key=lambda s: (s["goodput_loss_power_pct"], s["band_rms_mw"]))]


def compare_pareto_png(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> None:
    """Goodput lost (x) against band RMS of grid import (y), one labelled point per controller; energy overhead
    as colour and size; a circle where every limit held, a cross where one was broken; the Pareto front of the
    controllers that held the limits as a step line; demand's band RMS (what no control would show) dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    x = np.asarray([s["goodput_loss_power_pct"] for s in rows], dtype=np.float64)
    y = np.asarray([s["band_rms_mw"] for s in rows], dtype=np.float64)
    e = np.asarray([s["energy_overhead_pct"] for s in rows], dtype=np.float64)
    held = np.asarray([holds_limits(s) for s in rows], dtype=bool)
    e_hi = max(float(e.max()), 1e-9)
    size = 70 + 430 * e / e_hi

    fig = Figure(figsize=(9, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    sc = None
    for mask, marker in ((held, "o"), (~held, "X")):
        if mask.any():
            sc = ax.scatter(x[mask], y[mask], s=size[mask], c=e[mask], cmap="viridis", vmin=0.0, vmax=e_hi,
                            marker=marker, edgecolors="C3" if marker == "X" else "black", linewidths=1.2,
                            zorder=3)  # fmt: skip
    if sc is not None:
        fig.colorbar(sc, ax=ax, label="energy overhead [%] (also marker size)")
    front = pareto_front(rows)
    if len(front) > 1:
        pts = sorted((s["goodput_loss_power_pct"], s["band_rms_mw"]) for s in rows if s["controller"] in front)
        fx, fy = zip(*pts, strict=True)
        ax.step(fx, fy, where="post", color="C2", lw=1.5, ls="-", zorder=2)
    base = next((s for s in rows if s["controller"] == "none"), rows[0])
    ax.axhline(base["demand_band_rms_mw"], color="0.5", ls="--", lw=1.0, zorder=1)
    span_x = float(x.max() - x.min()) or 1.0
    span_y = float(max(y.max(), base["demand_band_rms_mw"])) or 1.0
    anchors: list[list[int]] = []  # clusters of points that (nearly) coincide: their names are stacked
    for i, s in enumerate(rows):
        cluster = next(
            (c for c in anchors if abs(x[c[0]] - x[i]) < 0.04 * span_x and abs(y[c[0]] - y[i]) < 0.05 * span_y), None
        )
        if cluster is None:
            cluster = []
            anchors.append(cluster)
        cluster.append(i)
        a = cluster[0]
        ax.annotate(s["controller"], (x[a], y[a]), xytext=(11, 4 + 11 * (len(cluster) - 1)), textcoords="offset points",
                    fontsize=9, fontweight="bold" if s["controller"] in front else "normal",
                    color="black" if held[i] else "C3")  # fmt: skip
    ax.set_xlim(float(x.min()) - 0.08 * span_x, float(x.max()) + 0.25 * span_x)
    y_top = max(float(y.max()), float(base["demand_band_rms_mw"]))
    ax.set_ylim(0.0, 1.12 * y_top if y_top > 0 else 1.0)
    ax.set_xlabel("goodput lost to power management [%]  (goodput_loss_power_pct)")
    ax.set_ylabel("band RMS of grid import [MW]  (band_rms_mw)")
    ax.grid(alpha=0.3)
    legend = [
        Line2D([], [], marker="o", ls="", mfc="0.8", mec="black", ms=9, label="every limit held"),
        Line2D([], [], marker="X", ls="", mfc="0.8", mec="C3", ms=9, label="a limit broken (trip, limit or ramp)"),
        Line2D([], [], color="C2", lw=1.5, label="Pareto front of those that held (bold names)"),
        Line2D([], [], color="0.5", ls="--", lw=1.0, label="band RMS of demand (no control, no storage)"),
    ]
    ax.legend(handles=legend, loc="upper right", fontsize=8, framealpha=0.9)
    ax.set_title(title or "goodput lost against in-band oscillation; lower left is better", fontsize=11)
    fig.savefig(path, dpi=100)


def compare_md(results: Sequence[SimResult], figure: str, pareto: str | None = None) -> str:
    from gridsim.report import verdict

    rows = summaries(results)
    first = results[0]
    site = first.site
    names = [s["controller"] for s in rows]
    header = "| metric | " + " | ".join(f"`{n}`" for n in names) + " |\n"
    header += "|---|" + "---:|" * len(names) + "\n"
    body = "".join(f"| {label} | " + " | ".join(_md_cell(s[key]) for s in rows) + " |\n" for key, label in KEY_METRICS)
    verdicts = "".join(f"- `{s['controller']}`: {verdict(s, r.trips)}\n" for s, r in zip(rows, results, strict=True))
    return (
        f"# {first.scenario}: {len(rows)} controllers compared, seed {first.seed}\n\n"
        f"{first.duration_s:g} s simulated; {site.n_gpus:,} GPUs in {site.n_racks} racks; interconnect limit "
        f"{site.pcc_limit_w / 1e6:g} MW; ramp limit {site.ramp_limit_w_per_min / 1e6:g} MW/min over "
        f"{site.ramp_window_s:g} s; critical band {rows[0]['band_hz'][0]:g}–{rows[0]['band_hz'][1]:g} Hz.\n\n"
        f"{verdicts}\n{header}{body}\n"
        f"Every key of `summary.json` for every controller is in `compare.json` and `compare.csv`.\n\n"
        f"![grid import of every controller]({figure})\n"
        + (
            f"\n## Goodput against oscillation\n\n"
            f"What each controller pays (goodput lost to power management, across) for the oscillation it leaves in "
            f"the critical band (band RMS of grid import, up); colour and size are the energy overhead, a cross marks "
            f"a controller that broke a limit. Pareto front of the controllers that held the limits: "
            f"{', '.join(f'`{n}`' for n in pareto_front(rows)) or 'none held them'}.\n\n"
            f"![goodput lost against band RMS]({pareto})\n"
            if pareto
            else ""
        )
    )


def _md_cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _trailing_mean(x: FloatArray, n: int) -> FloatArray:
    """Mean of the last `n` samples at every sample; NaN until a whole window has passed."""
    csum = np.concatenate([[0.0], np.cumsum(x)])
    out = np.full(x.shape, np.nan)
    if x.size >= n:
        out[n - 1 :] = (csum[n:] - csum[:-n]) / n
    return out


def compare_png(results: Sequence[SimResult], path: Path) -> None:
    """One row per controller, shared axes: grid import and its windowed mean against the interconnect limit."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from gridsim.report import time_axis

    rows = summaries(results)
    first = results[0]
    site = first.site
    t, tlabel = time_axis(first.t_s)
    per_unit_s = float(first.t_s[-1] / t[-1]) if t.size and t[-1] > 0 else 1.0  # seconds per axis unit
    window = max(1, round(site.ramp_window_s / first.tick_s))
    base_mw = site.pcc_limit_w / 1e6

    lows, highs = [], [base_mw]
    for res in results:
        grid_mw = res.tick["grid_w"] / 1e6
        lows += [float(np.percentile(grid_mw, 1)), float(res.tick["pcc_limit_w"].min()) / 1e6]
        highs += [float(grid_mw.max())]
    span = max(highs) - min(lows)
    y_lo, y_hi = max(0.0, min(lows) - 0.15 * span), max(highs) + 0.12 * span

    n = len(results)
    fig = Figure(figsize=(13, 1.4 + 2.3 * n), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n, 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, res, s in zip(axes, results, rows, strict=True):
        limit_mw = res.tick["pcc_limit_w"] / 1e6
        t = res.t_s / per_unit_s
        ax.plot(t, _trailing_mean(res.tick["demand_w"], window) / 1e6, color="0.6", lw=1.0, ls=":",
                label=f"demand (no control, no storage), {site.ramp_window_s:g} s mean")  # fmt: skip
        ax.plot(t, res.tick["grid_w"] / 1e6, color="C0", lw=0.3, alpha=0.6, label="grid import at the PCC")
        ax.plot(t, _trailing_mean(res.tick["grid_w"], window) / 1e6, color="navy", lw=1.4,
                label=f"grid import, {site.ramp_window_s:g} s mean")  # fmt: skip
        ax.axhline(base_mw, color="C3", ls="--", lw=1.1, label=f"interconnect limit {base_mw:g} MW")
        if np.any(limit_mw < base_mw):
            ax.plot(t, limit_mw, color="C3", lw=1.6, label="limit in force (curtailed)")
        if res.trips:
            trip_t = np.asarray([ts for ts, _ in res.trips]) / per_unit_s
            ax.plot(trip_t, np.full(trip_t.size, 0.93), "v", color="C3", ms=7, transform=ax.get_xaxis_transform(),
                    label="breaker trip", clip_on=False)  # fmt: skip
        held = not (s["breaker_trips"] or s["pcc_overlimit_s"] > 0 or s["ramp_violation_s"] > 0)
        ax.set_title(f"{s['controller']}: " + ("limits held" if held else "limits NOT held"), loc="left",
                     fontsize=10, fontweight="bold", color="C2" if held else "C3")  # fmt: skip
        ax.set_title(
            f"{s['breaker_trips']} trips · {s['pcc_overlimit_s']:.0f} s over limit · "
            f"{s['ramp_violation_s']:.0f} s over ramp · goodput lost {s['goodput_loss_power_pct']:.2f} % · "
            f"energy overhead {s['energy_overhead_pct']:.2f} % · band RMS {s['band_rms_mw']:.2f} MW "
            f"(demand {s['demand_band_rms_mw']:.2f} MW)",
            loc="right",
            fontsize=9,
        )
        ax.set_ylabel("power [MW]")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(y_lo, y_hi)
    axes[-1].set_xlabel(tlabel)
    handles: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncol=min(len(handles), 3),
               fontsize=9, frameon=False)  # fmt: skip
    fig.suptitle(
        f"{first.scenario}, seed {first.seed}: grid import of each controller against the interconnect limit "
        f"(ramp limit {site.ramp_limit_w_per_min / 1e6:g} MW/min over {site.ramp_window_s:g} s)",
        fontsize=12,
    )
    fig.savefig(path, dpi=100)


def write_compare(results: Sequence[SimResult], out_dir: Path) -> list[Path]:
    """Write the four files into `out_dir`, all or nothing: they are staged beside it and moved in at the end."""
    if not results:
        raise ValueError("no results to write")
    out_dir = Path(out_dir)
    rows = summaries(results)
    with writing(out_dir), staging(out_dir.parent, Path(os.path.abspath(out_dir)).name) as stage:
        (stage / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
        (stage / "compare.csv").write_text(compare_csv(rows))
        compare_png(results, stage / "compare.png")
        compare_pareto_png(
            rows,
            stage / "compare_pareto.png",
            f"{results[0].scenario}, seed {results[0].seed}: goodput lost against in-band oscillation "
            "(lower left is better)",
        )
        (stage / "compare.md").write_text(compare_md(results, "compare.png", "compare_pareto.png"))
        out_dir.mkdir(exist_ok=True)
        written = []
        for name in FILES:
            target = out_dir / name
            shutil.move(str(stage / name), target)
            written.append(target)
    return written
