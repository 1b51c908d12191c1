"""`gridsim sweep`: one scenario run over a grid of overrides, on every local core or on a Dask cluster.

A sweep file names a scenario (relative to the sweep file), fixed overrides, and a grid:

    scenario = "../scenarios/swing-8k.toml"
    set = ["duration_s=900"]
    [grid]
    "site.storage.bess.energy_mwh" = [0.5, 1, 2, 4]
    "site.pcc.ramp_mw_per_min" = [0.5, 1.5, 3]
    controller = ["none", "dimmer"]          # the special key: which controller runs

`plan_sweep` reads and checks the file and builds every grid point (scenario validated, site built, controller
built) before anything runs, so a bad key or value is one InputError naming the sweep file and the key. `run_sweep`
runs the points that have no `runs/<id>/summary.json` yet (a run's id is a hash of its resolved scenario and
controller, so an interrupted sweep resumes and a changed scenario is re-run), writing each summary atomically as it
arrives. `write_sweep` then writes, all or nothing,

    results.csv        one row per run: run_id, the grid values, every summary key
    results.parquet    the same, when pyarrow is importable
    figures/<m>.png    one figure per metric in FIGURE_METRICS: heatmaps over two numeric axes, else lines or bars
    sweep.md           the answer, the table and the figures

The pieces, each owning one idea (a name with a leading underscore is private to this package, not to its module):

    plan.py      the types: SweepPlan, SweepPoint, SweepOutcome
    spec.py      the sweep file: its schema, the grid axes and the fixed overrides checked
    grid.py      the grid expanded into checked points and their run ids; plan_sweep
    execute.py   running the points locally or on Dask, and resuming; run_task, connect
    results.py   the result table and the answer
    figures.py   one metric over the grid: heatmaps, lines or bars
    output.py    results.csv, results.parquet, the figures and sweep.md, all or nothing

This module wires them together: `run_sweep` runs `run_task` and `write_sweep` draws with `sweep_figure`, both looked
up here when called, so that a test can replace either on this module. Every name callers used from
`gridsim.sweep` is here.

matplotlib is imported inside the figure functions only; dask.distributed inside `_dask_client` only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dimmer.errors import InputError as InputError
from gridsim.sweep.execute import Finished as Finished
from gridsim.sweep.execute import _dask_client as _dask_client
from gridsim.sweep.execute import connect, run_points
from gridsim.sweep.execute import run_task as run_task
from gridsim.sweep.figures import FIGURE_METRICS
from gridsim.sweep.figures import LOWER_IS_WORSE as LOWER_IS_WORSE
from gridsim.sweep.figures import METRIC_LABEL as METRIC_LABEL
from gridsim.sweep.figures import ZERO as ZERO
from gridsim.sweep.figures import sweep_figure as sweep_figure
from gridsim.sweep.grid import plan_sweep
from gridsim.sweep.grid import run_id as run_id
from gridsim.sweep.output import TABLE_METRICS as TABLE_METRICS
from gridsim.sweep.output import sim_wall_s as sim_wall_s
from gridsim.sweep.output import sweep_md as sweep_md
from gridsim.sweep.output import write_outputs
from gridsim.sweep.plan import CONTROLLER_KEY, SweepOutcome, SweepPlan, SweepPoint, SweepProgress
from gridsim.sweep.plan import Scalar as Scalar
from gridsim.sweep.plan import SweepError as SweepError
from gridsim.sweep.results import GOODPUT_OK_PCT as GOODPUT_OK_PCT
from gridsim.sweep.results import answers
from gridsim.sweep.results import holds_limits as holds_limits
from gridsim.sweep.results import parquet_available as parquet_available
from gridsim.sweep.results import result_columns as result_columns
from gridsim.sweep.results import result_rows as result_rows
from gridsim.sweep.results import results_csv as results_csv
from gridsim.sweep.results import results_parquet as results_parquet
from gridsim.sweep.results import short_key as short_key
from gridsim.sweep.spec import MAX_RUNS as MAX_RUNS
from gridsim.sweep.spec import SweepSpec as SweepSpec


def run_sweep(
    plan: SweepPlan,
    out_dir: Path,
    workers: int | None = None,
    client: Any = None,
    progress: SweepProgress | None = None,
) -> SweepOutcome:
    """Run every point of `plan` that has no summary in `out_dir/runs/<id>/` yet: on `client` (a dask.distributed
    Client) when given, else on `workers` local processes (default: every core; 1 runs in this process).

    Each summary is written atomically as its run finishes. A run that raises does not stop the others; it is
    listed in `failed` and has no summary (the next attempt runs it again).
    """
    return run_points(plan, out_dir, run_task, workers, client, progress)


def write_sweep(plan: SweepPlan, outcome: SweepOutcome, out_dir: Path) -> list[Path]:
    """results.csv, results.parquet (when pyarrow is importable), figures/*.png and sweep.md, all or nothing:
    staged in a temporary directory inside `out_dir` and moved into place at the end."""
    return write_outputs(plan, outcome, out_dir, sweep_figure)


__all__ = [
    "CONTROLLER_KEY",
    "FIGURE_METRICS",
    "SweepOutcome",
    "SweepPlan",
    "SweepPoint",
    "answers",
    "connect",
    "plan_sweep",
    "run_sweep",
    "write_sweep",
]
