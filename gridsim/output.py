"""Writes a run's results to a directory, all or nothing: files are written beside it and moved in at the end."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from gridsim.engine import SimResult
from gridsim.report import overview_png, report_md


def write_run(res: SimResult, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as tmp:
        stage = Path(tmp)
        (stage / "summary.json").write_text(json.dumps(res.summary, indent=2) + "\n")
        res.to_pandas().to_csv(stage / "timeseries.csv", index=False, float_format="%.6g")
        jobs = pd.DataFrame({"t_s": res.period_t_s})
        for j, name in enumerate(res.site.job_name):
            for key in ("job_cap_w", "job_floor_w", "job_speed_frac", "job_state"):
                jobs[f"{name}.{key.removeprefix('job_')}"] = res.period[key][:, j]
        jobs.to_csv(stage / "jobs.csv", index=False, float_format="%.6g")
        overview_png(res, stage / "overview.png")
        (stage / "report.md").write_text(report_md(res, "overview.png"))
        out_dir.mkdir(exist_ok=True)
        written = []
        for f in sorted(stage.iterdir()):
            target = out_dir / f.name
            shutil.move(str(f), target)
            written.append(target)
    return written
