"""The sweep's figures: one metric over the grid, as heatmaps, lines or bars, whichever the grid's axes allow.

matplotlib is imported inside the drawing functions only, so that planning and running a sweep never load it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from gridsim.compare import KEY_METRICS
from gridsim.sweep.plan import Scalar, SweepPlan, _fmt_value
from gridsim.sweep.results import holds_limits, short_key

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ZERO = 1e-6  # a metric below this in magnitude is shown as 0 (the accounting's rounding residue is ~1e-11 %)


# The metrics drawn, one figure each; the colour scale of each runs from good (light) to bad (dark).
FIGURE_METRICS = (
    "ramp_violation_s",
    "pcc_overlimit_s",
    "breaker_trips",
    "band_rms_mw",
    "goodput_loss_power_pct",
    "energy_overhead_pct",
    "min_bess_soc_frac",
)
LOWER_IS_WORSE = frozenset({"min_bess_soc_frac", "min_bbu_soc_frac", "goodput_pct"})
METRIC_LABEL = dict(KEY_METRICS)


def _metric(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan


def _cell_text(v: float) -> str:
    if math.isnan(v):
        return "–"
    return "0" if abs(v) < ZERO else f"{v:.3g}"


def sweep_figure(plan: SweepPlan, rows: Sequence[dict[str, Any]], metric: str, path: Path) -> str:
    """Draw `metric` over the grid into `path`; return the kind drawn: "heatmap", "lines" or "bars".

    Two numeric axes or more: a heatmap of the first two (columns, rows), one panel per combination of the
    others (e.g. per controller), one colour scale; cells outlined in green held every limit. One numeric axis:
    a line per combination of the others against it, hollow markers where a limit was broken. None: bars.
    """
    numeric = plan.numeric_axes
    title = f"{METRIC_LABEL.get(metric, metric)} — sweep {plan.name} on {plan.scenario_name}, {len(rows)} runs"
    if len(numeric) >= 2:
        fig, kind = _heatmaps(plan, rows, metric, title), "heatmap"
    elif len(numeric) == 1:
        fig, kind = _lines(plan, rows, metric, title), "lines"
    else:
        fig, kind = _bars(plan, rows, metric, title), "bars"
    fig.savefig(path, dpi=90)
    return kind


def _row_finder(plan: SweepPlan, rows: Sequence[dict[str, Any]]) -> Callable[[dict[str, Scalar]], dict[str, Any]]:
    """The row of the point with these grid values (every axis named)."""
    lookup = {tuple(p.values.values()): r for p, r in zip(plan.points, rows, strict=True)}
    keys = list(plan.axes)

    def row_at(values: dict[str, Scalar]) -> dict[str, Any]:
        return lookup[tuple(values[k] for k in keys)]

    return row_at


def _heatmaps(plan: SweepPlan, rows: Sequence[dict[str, Any]], metric: str, title: str) -> Figure:
    """The first two numeric axes as columns and rows, a panel per combination of the others, one colour scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    row_at = _row_finder(plan, rows)
    cmap = "YlOrRd_r" if metric in LOWER_IS_WORSE else "YlOrRd"
    finite = [v for r in rows if not math.isnan(v := _metric(r, metric))]
    vmin, vmax = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if vmax <= vmin:
        vmin, vmax = vmin - 0.5, vmax + 0.5

    xk, yk = plan.numeric_axes[0], plan.numeric_axes[1]
    panel_keys = [k for k in plan.axes if k not in (xk, yk)]
    panels = list(itertools.product(*(plan.axes[k] for k in panel_keys)))
    xs, ys = plan.axes[xk], plan.axes[yk]
    ncols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    w_panel, h_panel = 1.0 + 0.9 * len(xs), 1.3 + 0.55 * len(ys)
    fig = Figure(figsize=(ncols * w_panel + 1.6, nrows * h_panel + 1.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    image = None

    for i, combo in enumerate(panels):
        ax = axes[i // ncols][i % ncols]
        fixed = dict(zip(panel_keys, combo, strict=True))
        grid = np.full((len(ys), len(xs)), np.nan)
        held = np.zeros((len(ys), len(xs)), dtype=bool)
        for yi, yv in enumerate(ys):
            for xi, xv in enumerate(xs):
                r = row_at({**fixed, xk: xv, yk: yv})
                grid[yi, xi] = _metric(r, metric)
                held[yi, xi] = holds_limits(r)
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=vmin, vmax=vmax, origin="lower", aspect="auto")
        ax.set_facecolor("0.85")
        _label_cells(ax, grid, held, vmin, vmax, metric)
        ax.set_xticks(range(len(xs)), [_fmt_value(v) for v in xs])
        ax.set_yticks(range(len(ys)), [_fmt_value(v) for v in ys])
        ax.set_xlabel(xk, fontsize=8)
        ax.set_ylabel(yk, fontsize=8)
        if fixed:
            ax.set_title(", ".join(f"{short_key(k)} = {_fmt_value(v)}" for k, v in fixed.items()), fontsize=10)
    for j in range(len(panels), nrows * ncols):
        axes[j // ncols][j % ncols].set_visible(False)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.9, label=METRIC_LABEL.get(metric, metric))
    fig.suptitle(title + " (green outline: every limit held)", fontsize=10)
    return fig


def _label_cells(
    ax: Axes, grid: npt.NDArray[np.float64], held: npt.NDArray[np.bool_], vmin: float, vmax: float, metric: str
) -> None:
    """Each cell's value, in white on a dark cell; a green outline where every limit held."""
    from matplotlib.patches import Rectangle

    for yi in range(grid.shape[0]):
        for xi in range(grid.shape[1]):
            v = grid[yi, xi]
            frac = 0.0 if math.isnan(v) else (v - vmin) / (vmax - vmin)
            dark = (1 - frac) if metric in LOWER_IS_WORSE else frac
            ax.text(xi, yi, _cell_text(v), ha="center", va="center", fontsize=8,
                    color="white" if dark > 0.6 else "black")  # fmt: skip
            if held[yi, xi]:
                ax.add_patch(Rectangle((xi - 0.47, yi - 0.47), 0.94, 0.94, fill=False, ec="green", lw=2))


def _lines(plan: SweepPlan, rows: Sequence[dict[str, Any]], metric: str, title: str) -> Figure:
    """The metric against the one numeric axis, a line per combination of the others; hollow where a limit broke."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    row_at = _row_finder(plan, rows)
    xk = plan.numeric_axes[0]
    others = [k for k in plan.axes if k != xk]
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, combo in enumerate(itertools.product(*(plan.axes[k] for k in others))):
        fixed = dict(zip(others, combo, strict=True))
        xs = [float(v) for v in plan.axes[xk]]
        rs = [row_at({**fixed, xk: v}) for v in plan.axes[xk]]
        ys = [_metric(r, metric) for r in rs]
        colour = f"C{i % 10}"
        label = ", ".join(f"{short_key(k)} = {_fmt_value(v)}" for k, v in fixed.items()) or metric
        ax.plot(xs, ys, color=colour, lw=1.2, label=label)
        for x, y, r in zip(xs, ys, rs, strict=True):
            ax.plot([x], [y], "o", color=colour, mfc=colour if holds_limits(r) else "white", ms=7)
    ax.set_xlabel(xk)
    ax.set_ylabel(METRIC_LABEL.get(metric, metric))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title="filled: every limit held", title_fontsize=8)
    ax.set_title(title, fontsize=10)
    return fig


def _bars(plan: SweepPlan, rows: Sequence[dict[str, Any]], metric: str, title: str) -> Figure:
    """A bar per run (no numeric axis): green where every limit held, red where one broke."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 0.8 * len(rows) + 2), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = [", ".join(_fmt_value(v) for v in p.values.values()) for p in plan.points]
    vals = [_metric(r, metric) for r in rows]
    colours = ["C2" if holds_limits(r) else "C3" for r in rows]
    ax.bar(range(len(rows)), [0.0 if math.isnan(v) else v for v in vals], color=colours)
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(METRIC_LABEL.get(metric, metric))
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title + " (green: every limit held)", fontsize=10)
    return fig
