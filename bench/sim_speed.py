"""Simulator speed: real-time factor for the issue's two reference runs, cost per tick against site size, and the
time `dimmer`'s `Controller.step` takes against site size.

    python3 bench/sim_speed.py              # all figures (about 2 minutes on 2 cores)
    python3 bench/sim_speed.py --quick      # shorter runs, same figures, noisier
    python3 bench/sim_speed.py --step       # only Controller.step: against size, and on the 1M campus's replay (1 min)
    python3 bench/sim_speed.py --issue      # only issue 13's runs: swing-8k (none), prometheus-campus (none, dimmer)

Prints figures; never passes or fails. Peak memory is measured in a child process per run (ru_maxrss). On a shared
machine wall time moves with what else runs; each run also prints its figure by the process's CPU time, and how many
of its control periods the plant took at once (gridsim/period.py) rather than tick by tick.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import campus, machine

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
SWING_8K = SCENARIOS / "swing-8k.toml"
# gpus < 0 in one_run: a scenario of the library, by this index
LIBRARY = {-1: SCENARIOS / "prometheus-campus.toml"}


def one_run(gpus: int, duration_s: float, controller: str = "none") -> dict[str, float]:
    """gpus == 0: the library's 8,192-GPU swing scenario; gpus < 0: the library scenario LIBRARY[gpus]; otherwise a
    generated campus of about `gpus` GPUs."""
    import numpy as np

    from dimmer.control import make_controller
    from gridsim.engine import Simulation
    from gridsim.scenario import load_scenario

    t0 = time.perf_counter()
    overrides = [f"duration_s={duration_s}", f"controller.name={controller}"]
    if gpus <= 0:
        loaded = load_scenario(SWING_8K if gpus == 0 else LIBRARY[gpus], overrides)
    else:
        loaded = campus(gpus, duration_s, controller)
    site = loaded.site()
    build_s = time.perf_counter() - t0
    sc = loaded.scenario
    ctrl = make_controller(controller, site, sc.controllers.get(controller, {}), source=loaded.source)
    sim = Simulation(loaded, site, ctrl, sc.seed)
    cpu0 = time.process_time()
    res = sim.run()
    cpu_s = time.process_time() - cpu0
    block = sim.period_block
    n_ticks = res.t_s.size
    n_periods = res.period_t_s.size
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "gpus": site.n_gpus,
        "racks": site.n_racks,
        "domains": site.n_domains,
        "sim_s": duration_s,
        "wall_s": res.wall_s,
        "x_realtime": duration_s / res.wall_s,
        "x_realtime_cpu": duration_s / cpu_s,
        "periods_whole": (block.taken if block is not None and sim.period_advance else 0) / n_periods,
        "us_per_tick": res.wall_s / n_ticks * 1e6,
        "site_build_s": build_s,
        "peak_rss_mb": peak_mb,
        "step_ms_p50": float(np.nanpercentile(res.step_ms, 50)) if np.isfinite(res.step_ms).any() else 0.0,
        "step_ms_p99": float(np.nanpercentile(res.step_ms, 99)) if np.isfinite(res.step_ms).any() else 0.0,
    }


def in_child(gpus: int, duration_s: float, controller: str = "none") -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(gpus), str(duration_s), controller],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--step", action="store_true", help="only dimmer's Controller.step against site size")
    ap.add_argument("--issue", action="store_true", help="only issue 13's three reference runs")
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(int(args.child[0]), float(args.child[1]), args.child[2])))
        return
    scale = 0.1 if args.quick else 1.0
    print(f"machine: {machine()}")
    if not args.step:
        issue_figures(scale)
        if args.issue:
            return
        plant_figures(scale)
    print("dimmer's Controller.step against size, and the plant with it (120 s simulated each; target 1 ms p50 at 1M):")
    print(f"  {'GPUs':>10} {'racks':>7} {'step p50 ms':>12} {'step p99 ms':>12} {'x real time':>12}")
    for gpus in (0, 138_240, 1_000_000):
        r = in_child(gpus, 120.0 * max(scale, 0.5), "dimmer")
        print(
            f"  {r['gpus']:>10,} {r['racks']:>7,} {r['step_ms_p50']:>12.2f} {r['step_ms_p99']:>12.2f} "
            f"{r['x_realtime']:>12.0f}"
        )
    replay_figures()


def replay_figures() -> None:
    """Controller.step alone on the library's 1M-GPU campus: bench/step_replay.py records a closed-loop run (its
    start, crash and restart) and steps a fresh controller through its observations, every decision checked."""
    import tempfile

    here = Path(__file__).resolve().parent
    print("dimmer's Controller.step on a replay of prometheus-campus.toml (300 s: a start at 180 s, a crash at 240 s):")
    with tempfile.TemporaryDirectory() as tmp:
        rec = str(Path(tmp) / "obs.pkl")
        scenario = str(here.parent / "scenarios" / "prometheus-campus.toml")
        record = [sys.executable, str(here / "step_replay.py"), "record", scenario, rec, "--set", "duration_s=300"]
        subprocess.run(record, check=True, capture_output=True)
        out = subprocess.run(
            [sys.executable, str(here / "step_replay.py"), "time", rec, "--repeat", "3"],
            check=True,
            capture_output=True,
            text=True,
        )
    for line in out.stdout.splitlines():
        if not line.startswith("machine"):
            print(f"  {line}")


def issue_figures(scale: float) -> None:
    """Issue 13's targets: swing-8k.toml with `none` at 5,000x; prometheus-campus.toml at 200x with `none` and 100x
    with `dimmer`, within 2 GB."""
    print("issue 13 (dt 0.1 s, control period 1 s):")
    runs = (
        ("swing-8k.toml, none", 0, 600.0, "none", "5,000x"),
        ("prometheus-campus.toml, none", -1, 120.0, "none", "200x, < 2 GB"),
        ("prometheus-campus.toml, dimmer", -1, 120.0, "dimmer", "100x, < 2 GB"),
    )
    for label, gpus, dur, controller, target in runs:
        r = in_child(gpus, max(dur * scale, 60.0), controller)
        print(
            f"  {label}: {r['sim_s']:.0f} s simulated in {r['wall_s']:.2f} s = {r['x_realtime']:.0f}x real time "
            f"({r['x_realtime_cpu']:.0f}x by CPU time), {r['periods_whole']:.0%} of periods at once, "
            f"peak RSS {r['peak_rss_mb']:.0f} MB (target {target})"
        )


def plant_figures(scale: float) -> None:
    """The plant alone: the reference runs and the cost per tick against size."""
    print("reference runs (controller none, dt 0.1 s):")
    runs = (
        ("swing-8k.toml (8,192-GPU job)", 0, 3600.0, "5,000x, issue 13"),
        ("1M-GPU campus, 10 min", 1_000_000, 600.0, "200x, < 2 GB, issue 13"),
        ("1M-GPU campus, 1 h (recording bound)", 1_000_000, 3600.0, "a few GB"),
    )
    for label, gpus, dur, target in runs:
        r = in_child(gpus, dur * scale)
        print(
            f"  {label}: {r['gpus']:,} GPUs in {r['racks']:,} racks, {r['sim_s']:.0f} s simulated in "
            f"{r['wall_s']:.1f} s = {r['x_realtime']:.0f}x real time, peak RSS {r['peak_rss_mb']:.0f} MB "
            f"(target {target}); site built in {r['site_build_s']:.2f} s"
        )
    print("cost per tick against size (60 s simulated each):")
    print(f"  {'GPUs':>10} {'racks':>7} {'us/tick':>9} {'us/tick/rack':>13}")
    for gpus in (1_000, 8_192, 32_768, 131_072, 500_000, 1_000_000):
        r = in_child(gpus, 60.0 * max(scale, 0.5))
        print(f"  {r['gpus']:>10,} {r['racks']:>7,} {r['us_per_tick']:>9.0f} {r['us_per_tick'] / r['racks']:>13.3f}")


if __name__ == "__main__":
    main()
