"""The house style every report figure shares: its size and resolution, the event marks on its time axis, shading
and legends. matplotlib's Agg backend is chosen here, on import, before anything draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gridsim.engine import SimResult
from gridsim.report.series import BoolArray, FloatArray, event_marks

DPI = 110
WIDTH_IN = 10.0  # 1,100 px at DPI
ONE_PANEL_IN = 4.6  # height of a one-panel figure: ~500 px
TWO_PANEL_IN = 6.4  # height of a two-panel figure: ~700 px
MAX_EVENT_LABELS = 12


def _new_figure(height_in: float, rows: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig, list(axes)


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=DPI)


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
