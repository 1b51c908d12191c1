"""Figures and the written report of one run. matplotlib lives in this package (and in compare.png's and the
sweep's drawing) and nowhere else.

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

The pieces, each owning one idea (a name with a leading underscore is private to this package, not to its module):

    series.py           what the report reads from a SimResult: time axis, means, ramp envelope, spells, goodput
    text.py             the words: report.md, the verdict, the summary table, numbers in a sentence
    canvas.py           the house style of every figure: size, event marks, shading, legends (the Agg backend)
    grid_figures.py     grid.png, spectrum.png, frequency.png and overview.png
    campus_figures.py   domains.png, jobs.png, storage.png and goodput.png

This module holds the list of figures and draws them; everything a caller used from `gridsim.report` is here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gridsim.engine import SimResult
from gridsim.report.campus_figures import RMS_WINDOW_S, domains_png, goodput_png, jobs_png, storage_png
from gridsim.report.canvas import DPI, MAX_EVENT_LABELS, ONE_PANEL_IN, TWO_PANEL_IN, WIDTH_IN
from gridsim.report.grid_figures import frequency_png, grid_png, overview_png, spectrum_png
from gridsim.report.series import (
    MAX_JOB_MARKS,
    MAX_JOBS_SHOWN,
    TOP_DOMAINS,
    BoolArray,
    FloatArray,
    episodes,
    event_marks,
    goodput_series,
    ramp_envelope_w,
    spells,
    stressed_domains,
    time_axis,
    trailing_mean,
)
from gridsim.report.text import METRIC_INFO, ReportFigure, report_md, summary_table, verdict, verdict_line

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


__all__ = [
    "DPI",
    "FIGURES",
    "MAX_EVENT_LABELS",
    "MAX_JOBS_SHOWN",
    "MAX_JOB_MARKS",
    "METRIC_INFO",
    "ONE_PANEL_IN",
    "RMS_WINDOW_S",
    "TOP_DOMAINS",
    "TWO_PANEL_IN",
    "WIDTH_IN",
    "BoolArray",
    "FloatArray",
    "ReportFigure",
    "domains_png",
    "episodes",
    "event_marks",
    "frequency_png",
    "goodput_png",
    "goodput_series",
    "grid_png",
    "jobs_png",
    "overview_png",
    "ramp_envelope_w",
    "report_md",
    "spectrum_png",
    "spells",
    "storage_png",
    "stressed_domains",
    "summary_table",
    "time_axis",
    "trailing_mean",
    "verdict",
    "verdict_line",
    "write_figures",
]
