"""The files a finished sweep leaves beside its runs: results.csv (and .parquet), the figures and sweep.md, written all
or nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dimmer.outpath import staging, writing
from gridsim.sweep.figures import FIGURE_METRICS, METRIC_LABEL, ZERO
from gridsim.sweep.plan import SweepOutcome, SweepPlan, _fmt_value, _is_number
from gridsim.sweep.results import answers, holds_limits, parquet_available, result_rows, results_csv, results_parquet

# the table in sweep.md: summary key and column header
TABLE_METRICS: tuple[tuple[str, str], ...] = (
    ("breaker_trips", "trips"),
    ("pcc_overlimit_s", "over limit [s]"),
    ("ramp_violation_s", "over ramp [s]"),
    ("max_ramp_mw_per_min", "max ramp [MW/min]"),
    ("band_rms_mw", "band RMS [MW]"),
    ("goodput_loss_power_pct", "goodput lost [%]"),
    ("energy_overhead_pct", "overhead [%]"),
    ("min_bess_soc_frac", "min BESS SoC"),
)


def _md_cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "0" if abs(v) < ZERO else f"{v:.4g}"
    return str(v)


def sim_wall_s(rows: Sequence[dict[str, Any]]) -> float:
    """Wall time the simulations took, summed over runs: duration_s / sim_speed_x_realtime of each."""
    return sum(r["duration_s"] / r["sim_speed_x_realtime"] for r in rows if r.get("sim_speed_x_realtime"))


def sweep_md(plan: SweepPlan, rows: Sequence[dict[str, Any]], outcome: SweepOutcome, figures: Sequence[str]) -> str:
    grid = "".join(f"- `{k}`: {', '.join(_fmt_value(v) for v in vs)}\n" for k, vs in plan.axes.items())
    fixed = ", ".join(f"`{t}`" for t in plan.fixed) or "none"
    n = len(rows)
    head = "| run | " + " | ".join(f"`{k}`" for k in plan.axes) + " | " + " | ".join(h for _, h in TABLE_METRICS)
    aligns = ["---:|" if all(_is_number(v) for v in vs) else "---|" for vs in plan.axes.values()]
    head += " | limits |\n|---|" + "".join(aligns) + "---:|" * len(TABLE_METRICS) + "---|\n"
    body = "".join(
        f"| `{r['run_id']}` | "
        + " | ".join(_fmt_value(r[k]) for k in plan.axes)
        + " | "
        + " | ".join(_md_cell(r[k]) for k, _ in TABLE_METRICS)
        + f" | {'held' if holds_limits(r) else '**broken**'} |\n"
        for r in rows
    )
    figs = "".join(
        f"### {METRIC_LABEL.get(m, m)}\n\n![{m}]({f})\n\n" for m, f in zip(FIGURE_METRICS, figures, strict=True)
    )
    answer = "".join(f"- {line}\n" for line in answers(plan, rows))
    return (
        f"# Sweep `{plan.name}`: {n} runs of `{plan.scenario_name}`\n\n"
        f"Sweep file `{plan.source}`; scenario `{plan.scenario_path.name}`; fixed overrides: {fixed}. Grid:\n\n"
        f"{grid}\n"
        f"This attempt ran {len(outcome.ran)} run(s) in {outcome.wall_s:.1f} s wall time on {outcome.where} and "
        f"reused {len(outcome.reused)} from an earlier attempt; the simulations of all {n} took "
        f"{sim_wall_s(rows):.1f} s between them (simulated time over speed, summed).\n\n"
        f"## Answer\n\n"
        f'"Holds the limits": no breaker trip, never over the interconnect limit, never over the ramp limit.\n\n'
        f"{answer}\n"
        f"## Runs\n\n{head}{body}\n"
        f"Every summary key of every run is in `results.csv` (and `results.parquet` when pyarrow is installed); "
        f"each run's `summary.json` is in `runs/<run>/`.\n\n"
        f"## Figures\n\n{figs}"
    )


# draws one metric over the grid into a file and returns the kind drawn (`sweep_figure`, or a test's stand-in)
Draw = Callable[[SweepPlan, Sequence[dict[str, Any]], str, Path], str]


def write_outputs(plan: SweepPlan, outcome: SweepOutcome, out_dir: Path, draw: Draw) -> list[Path]:
    """`gridsim.sweep.write_sweep`, with the function that draws each figure passed in as `draw`."""
    missing = [p.run_id for p in plan.points if p.run_id not in outcome.summaries]
    if missing:
        raise ValueError(f"{len(missing)} runs have no summary")
    out_dir = Path(out_dir)
    rows = result_rows(plan, outcome.summaries)
    figures = [f"figures/{m}.png" for m in FIGURE_METRICS]
    names = ["results.csv", *(["results.parquet"] if parquet_available() else []), *figures, "sweep.md"]
    # staged inside out_dir (runs/ is there already), `.sweep.staging-<pid>-*`: a killed run's is removed next time
    with writing(out_dir), staging(out_dir, "sweep") as stage:
        (stage / "figures").mkdir()
        (stage / "results.csv").write_text(results_csv(plan, rows))
        if parquet_available():
            results_parquet(plan, rows, stage / "results.parquet")
        for m, f in zip(FIGURE_METRICS, figures, strict=True):
            draw(plan, rows, m, stage / f)
        (stage / "sweep.md").write_text(sweep_md(plan, rows, outcome, figures))
        (out_dir / "figures").mkdir(exist_ok=True)
        written = []
        for name in names:
            target = out_dir / name
            os.replace(stage / name, target)
            written.append(target)
    return written
