"""What the hierarchy costs against the flat controller, and what each of its levels costs to step.

    python3 bench/hierarchy.py            # prometheus-campus (1,013,760 GPUs, 44 buildings), its 600 s
    python3 bench/hierarchy.py --quick    # its first 120 s

Runs the library's 1M-GPU campus with `dimmer` (one controller over every rack) and `dimmer-campus` (a coordinator
over one controller per building, the link modelled) on the same plant and seed, and prints their summaries side by
side, then the time one step takes at each level: the flat controller over the whole campus, one building's
controller (what a building daemon computes each period), the coordinator (what the campus daemon computes), and
dimmer-campus as a whole (every building stepped in turn in one process, as the simulator runs it). Figures, never
pass or fail; the step times depend on the machine (printed first).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine

PROMETHEUS = Path(__file__).resolve().parents[1] / "scenarios" / "prometheus-campus.toml"
KEYS = (
    ("breaker_trips", "breaker trips", "{:.0f}"),
    ("pcc_overlimit_s", "over the interconnect limit [s]", "{:.1f}"),
    ("ramp_violation_s", "over the ramp limit [s]", "{:.1f}"),
    ("goodput_loss_power_pct", "goodput lost to power management [%]", "{:.2f}"),
    ("energy_overhead_pct", "energy overhead [%]", "{:.2f}"),
    ("bbu_cycles_per_day", "BBU cycles a day (worst rack)", "{:.2f}"),
    ("min_bbu_ride_through_s", "least BBU ride-through [s]", "{:.0f}"),
    ("max_grid_step_mw", "largest grid step [MW]", "{:.0f}"),
    ("band_rms_mw", "grid in-band RMS [MW]", "{:.1f}"),
)


class Timer:
    """Wall time of every call of one method, by the size of the site it ran on."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}

    def wrap(self, cls: type, method: str, label: Any) -> None:
        inner = getattr(cls, method)

        def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(obj, *args, **kwargs)
            self.ms.setdefault(label(obj), []).append((time.perf_counter() - t0) * 1e3)
            return out

        setattr(cls, method, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first 120 s only")
    args = ap.parse_args()

    from dimmer.control.campus import CampusHierarchy
    from dimmer.control.coordinator import CampusCoordinator
    from dimmer.control.dimmer import DimmerController
    from gridsim.engine import run
    from gridsim.metrics import summarize
    from gridsim.scenario import load_scenario

    timer = Timer()
    timer.wrap(DimmerController, "step", lambda c: f"dimmer controller, {c.site.n_racks:,} racks")
    timer.wrap(CampusCoordinator, "step", lambda c: f"coordinator, {c.max_w.size} buildings")
    timer.wrap(CampusHierarchy, "step", lambda c: "dimmer-campus, whole step (every building in turn)")

    overrides = ["duration_s=120"] if args.quick else []
    print(f"machine: {machine()}")
    rows: dict[str, dict[str, Any]] = {}
    for name in ("dimmer", "dimmer-campus"):
        t0 = time.perf_counter()
        res = run(load_scenario(PROMETHEUS, overrides), name)
        rows[name] = summarize(res)
        print(f"  ran {name}: {res.t_s[-1] + res.tick_s:.0f} s simulated in {time.perf_counter() - t0:.0f} s wall")
    site = res.site
    print(f"\n{PROMETHEUS.name}: {site.n_gpus:,} GPUs, {site.n_racks:,} racks, {site.n_domains:,} domains")
    print(f"  {'':40s} {'dimmer':>12s} {'dimmer-campus':>14s}")
    for key, label, fmt in KEYS:
        print(f"  {label:40s} {fmt.format(rows['dimmer'][key]):>12s} {fmt.format(rows['dimmer-campus'][key]):>14s}")
    print("\nstep time (ms):")
    print(f"  {'':58s} {'p50':>8s} {'p99':>8s} {'calls':>8s}")
    for label, ms in sorted(timer.ms.items()):
        a = np.asarray(ms)
        print(f"  {label:58s} {np.percentile(a, 50):8.2f} {np.percentile(a, 99):8.2f} {a.size:8d}")


if __name__ == "__main__":
    main()
