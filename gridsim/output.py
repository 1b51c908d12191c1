"""Writes a run's results to a directory, all or nothing: files are written beside it and moved in at the end.

The staging directory is `.<out name>.staging-<pid>-<random>` beside the output directory (dimmer.outpath); one a
killed run left is removed by the next write there. A write that fails (a full disk) is one OutputError line.

summary.json     the metrics contract (docs/models.md, "Metrics")
timeseries.csv   every campus-level series at every tick
jobs.csv         per-job cap, floor, speed and state at every control period
report.md        the scenario, a verdict, the metrics with units, and the figures with captions
*.png            the figures (gridsim.report.FIGURES) and overview.png
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pandas as pd

from dimmer.outpath import staging, writing
from gridsim.engine import SimResult
from gridsim.report import report_md, write_figures


def write_run(res: SimResult, out_dir: Path, description: str | None = None) -> list[Path]:
    """Write every file of a run into `out_dir` (its summary filled by gridsim.metrics.summarize first).

    `description` is the scenario's question, printed at the top of report.md. Nothing lands in `out_dir` unless
    everything was written: the files are staged in a temporary directory beside it and moved in at the end.
    Returns the files written, sorted by name.
    """
    if not res.summary:
        raise ValueError("summarize the result before writing it (gridsim.metrics.summarize)")
    out_dir = Path(out_dir)
    with writing(out_dir), staging(out_dir.parent, Path(os.path.abspath(out_dir)).name) as stage:
        (stage / "summary.json").write_text(json.dumps(res.summary, indent=2) + "\n")
        res.to_pandas().to_csv(stage / "timeseries.csv", index=False, float_format="%.6g")
        jobs = pd.DataFrame({"t_s": res.period_t_s})
        for j, name in enumerate(res.site.job_name):
            for key in ("job_cap_w", "job_floor_w", "job_speed_frac", "job_state"):
                jobs[f"{name}.{key.removeprefix('job_')}"] = res.period[key][:, j]
        jobs.to_csv(stage / "jobs.csv", index=False, float_format="%.6g")
        figures = write_figures(res, stage)
        (stage / "report.md").write_text(report_md(res, figures=figures, description=description))
        out_dir.mkdir(exist_ok=True)
        written = []
        for f in sorted(stage.iterdir()):
            target = out_dir / f.name
            shutil.move(str(f), target)
            written.append(target)
    return written
