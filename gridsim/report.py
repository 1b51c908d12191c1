"""Figures and the written report. matplotlib lives here and nowhere else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from gridsim.engine import SimResult


def time_axis(t_s: np.ndarray) -> tuple[np.ndarray, str]:
    span = float(t_s[-1]) if t_s.size else 0.0
    if span > 3 * 3600:
        return t_s / 3600, "time [h]"
    if span > 180:
        return t_s / 60, "time [min]"
    return t_s, "time [s]"


def overview_png(res: SimResult, path: Path) -> None:
    """One page a person reads at a glance: grid vs limits, frequency, storage, and what the jobs got."""
    t, tlabel = time_axis(res.t_s)
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True, constrained_layout=True)
    s = res.summary

    ax = axes[0]
    window = max(1, round(res.site.ramp_window_s / res.tick_s))
    kernel = np.ones(window) / window
    grid_avg = np.convolve(res.tick["grid_w"], kernel, mode="full")[: t.size]
    grid_avg[: window - 1] = np.nan  # not a whole window yet
    ax.plot(t, res.tick["demand_w"] / 1e6, color="0.75", lw=0.5, label="demand (uncapped, no storage)")
    ax.plot(t, res.tick["grid_w"] / 1e6, color="C0", lw=0.5, alpha=0.8, label="grid import at the PCC")
    ax.plot(t, grid_avg / 1e6, color="navy", lw=1.4, label=f"grid import, {res.site.ramp_window_s:g} s mean")
    ax.plot(t, res.tick["pcc_limit_w"] / 1e6, color="C3", ls="--", lw=1.2, label="interconnect limit")
    ax.set_ylabel("power [MW]")
    ax.set_title(
        f"{res.scenario} — controller {res.controller}: {s.get('breaker_trips', 0)} trips, "
        f"{s.get('pcc_overlimit_s', 0):.0f} s over limit, {s.get('ramp_violation_s', 0):.0f} s over ramp limit"
    )
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    ax.grid(alpha=0.3)

    ax = axes[1]
    ax.plot(t, (res.tick["freq_hz"] - res.nominal_hz) * 1e3, color="C2", lw=0.8)
    ax.axhline(0.0, color="0.5", lw=0.8)
    ax.set_ylabel(f"deviation from {res.nominal_hz:g} Hz [mHz]")
    ax.set_title("frequency of the surrounding system")
    ax.grid(alpha=0.3)

    ax = axes[2]
    tp, _ = time_axis(res.period_t_s)
    if res.site.bess.energy_j > 0:
        ax.plot(t, res.tick["bess_soc_frac"] * 100, color="C1", label="campus BESS")
        ax.axhline(res.site.bess.soc_min_frac * 100, color="C1", ls=":", lw=1)
    ax.plot(tp, res.period["bbu_soc_min_frac"] * 100, color="C4", label="rack BBU (lowest)")
    ax.plot(tp, res.period["bbu_soc_mean_frac"] * 100, color="C4", ls="--", label="rack BBU (mean)")
    ax.set_ylabel("state of charge [%]")
    ax.set_ylim(-2, 102)
    ax.set_title("storage")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[3]
    for j, name in enumerate(res.site.job_name[:8]):
        ax.plot(tp, res.period["job_cap_w"][:, j], lw=1, label=f"{name} cap")
        ax.plot(tp, res.period["job_speed_frac"][:, j] * res.site.gpu.rated_w, lw=0.8, ls=":",
                label=f"{name} speed × rated")  # fmt: skip
    ax.axhline(res.site.gpu.rated_w, color="0.5", ls="--", lw=0.8)
    ax.set_ylabel("per-GPU cap [W]")
    ax.set_xlabel(tlabel)
    ax.set_title("GPU power caps and job speed")
    if res.site.n_jobs:
        ax.legend(loc="lower right", fontsize=8, ncol=2)
    ax.grid(alpha=0.3)

    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(summary: dict[str, Any], trips: list[tuple[float, str]]) -> str:
    problems = []
    if summary["breaker_trips"]:
        where = ", ".join(sorted({d for _, d in trips})[:5])
        problems.append(f"{summary['breaker_trips']} breaker trip(s) ({where})")
    if summary["pcc_overlimit_s"] > 0:
        problems.append(f"{summary['pcc_overlimit_s']:.1f} s over the interconnect limit")
    if summary["ramp_violation_s"] > 0:
        problems.append(f"{summary['ramp_violation_s']:.1f} s over the utility ramp limit")
    return "Limits held." if not problems else "Limits NOT held: " + "; ".join(problems) + "."


def report_md(res: SimResult, figure: str) -> str:
    s = res.summary
    rows = "\n".join(f"| `{k}` | {_fmt(v)} |" for k, v in s.items())
    return (
        f"# {res.scenario} — controller `{res.controller}`, seed {res.seed}\n\n"
        f"**{verdict(s, res.trips)}**\n\n"
        f"| metric | value |\n|---|---|\n{rows}\n\n"
        f"![overview]({figure})\n"
    )


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
