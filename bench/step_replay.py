"""`Controller.step` on a replay: the observations of one closed-loop run, stepped again through a fresh controller.

    python3 bench/step_replay.py record scenarios/prometheus-campus.toml obs.pkl --set duration_s=300
    python3 bench/step_replay.py time obs.pkl [--repeat 5]      # step p50 / p99 / min over the replay
    python3 bench/step_replay.py digest scenarios/swing-8k.toml --set duration_s=300   # one line a run
    python3 bench/step_replay.py record campus:1000000 obs.pkl     # bench/sim_speed.py's generated 1M campus

A controller fed the observations its own closed loop produced decides what it decided there, so the replay is
the run's control work without the plant's. `record` keeps every observation and a digest of every decision;
`time` steps a fresh controller through them, checks every decision against the recorded digest (to the bit) and
prints the step's percentiles; `digest` runs a scenario closed loop and prints one hash of every decision the
controller took (actions, reasons, what it tells a parent): two builds that print the same hash decided alike.
Prints figures; never passes or fails.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine

from dimmer.control import Controller, make_controller
from dimmer.observation import Actions, Observation


def actions_digest(act: Actions, ctrl: Any) -> str:
    """One hash of every bit a step decided, and of what the controller tells a parent after it."""
    h = hashlib.sha256()
    for a in (act.rack_cap_w, act.rack_floor_w, act.rack_bbu_threshold_w, act.rack_bbu_recharge_w, act.job_suspend):
        h.update(np.ascontiguousarray(a).tobytes())
    if act.planned_domain_w is not None:
        h.update(np.ascontiguousarray(act.planned_domain_w).tobytes())
    h.update(np.array([act.bess_setpoint_w, act.gpu_ramp_up_w_per_s, act.gpu_ramp_down_w_per_s]).tobytes())
    h.update(repr(act.reasons).encode())
    for name in ("bound_w", "prior_w", "return_w", "return_gpus", "all_measured"):
        if hasattr(ctrl, name):
            h.update(repr(getattr(ctrl, name)).encode())
    for name in ("rack_bound_w", "rack_down"):
        if hasattr(ctrl, name):
            h.update(np.ascontiguousarray(getattr(ctrl, name)).tobytes())
    if hasattr(ctrl, "rack_back_w"):
        h.update(np.ascontiguousarray(ctrl.rack_back_w()).tobytes())
    return h.hexdigest()


class Recorder:
    """A controller that steps another and keeps what it saw and what it decided."""

    def __init__(self, inner: Controller, keep: bool) -> None:
        self.inner = inner
        self.name = inner.name
        self.keep = keep
        self.observations: list[Observation] = []
        self.digests: list[str] = []

    def step(self, obs: Observation) -> Actions:
        act = self.inner.step(obs)
        if self.keep:
            self.observations.append(obs)
        self.digests.append(actions_digest(act, self.inner))
        return act


def _load(scenario: str, sets: list[str]) -> Any:
    """A scenario file, or `campus:GPUS`: bench/common.py's generated campus of about that many GPUs (one job a
    building, three priorities; duration from `--set duration_s=...`, default 120 s)."""
    from gridsim.scenario import load_scenario

    if scenario.startswith("campus:"):
        from common import campus

        duration = next((float(x.split("=", 1)[1]) for x in sets if x.startswith("duration_s=")), 120.0)
        return campus(int(scenario.split(":", 1)[1]), duration, "dimmer")
    return load_scenario(scenario, sets)


def closed_loop(scenario: str, sets: list[str], controller: str, keep: bool) -> tuple[Recorder, Any]:
    from gridsim.engine import Simulation

    loaded = _load(scenario, sets)
    site = loaded.site()
    sc = loaded.scenario
    name = controller or sc.controller.name
    inner = make_controller(name, site, sc.controllers.get(name, {}), source=loaded.source)
    rec = Recorder(inner, keep)
    Simulation(loaded, site, rec, sc.seed).run()  # type: ignore[arg-type]
    return rec, loaded


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("scenario")
    r.add_argument("out")
    r.add_argument("--set", action="append", default=[])
    r.add_argument("--controller", default="dimmer")
    t = sub.add_parser("time")
    t.add_argument("file")
    t.add_argument("--repeat", type=int, default=3)
    t.add_argument("--profile", default="", help="write a cProfile of one pass to this file")
    t.add_argument("--dump", default="", help="append every step's time (ms, one a line) to this file")
    d = sub.add_parser("digest")
    d.add_argument("scenario")
    d.add_argument("--set", action="append", default=[])
    d.add_argument("--controller", default="dimmer")
    args = ap.parse_args()

    if args.cmd == "record":
        rec, _ = closed_loop(args.scenario, args.set, args.controller, keep=True)
        with open(args.out, "wb") as f:
            pickle.dump(
                {"scenario": args.scenario, "sets": args.set, "controller": args.controller,
                 "observations": rec.observations, "digests": rec.digests},
                f, protocol=pickle.HIGHEST_PROTOCOL,
            )  # fmt: skip
        print(f"{len(rec.observations)} observations recorded to {args.out}")
    elif args.cmd == "digest":
        rec, _ = closed_loop(args.scenario, args.set, args.controller, keep=False)
        total = hashlib.sha256("".join(rec.digests).encode()).hexdigest()
        print(f"{args.scenario} {' '.join(args.set)}: {len(rec.digests)} steps, digest {total[:16]}")
    else:
        replay(args.file, args.repeat, args.profile, args.dump)


def replay(path: str, repeat: int, profile: str, dump: str = "") -> None:

    with open(path, "rb") as f:
        rec = pickle.load(f)
    loaded = _load(rec["scenario"], rec["sets"])
    site = loaded.site()
    sc = loaded.scenario
    name = rec["controller"]
    observations: list[Observation] = rec["observations"]
    import dimmer

    print(f"machine: {machine()}; dimmer from {Path(dimmer.__file__).parent}")
    print(f"replay: {rec['scenario']} {' '.join(rec['sets'])}: {site.n_racks:,} racks, {site.n_domains:,} domains, "
          f"{len(observations)} steps")  # fmt: skip
    times: list[float] = []
    cpu: list[float] = []  # (the process's CPU time: on a shared machine, the work without the waits for a core)
    mismatched = 0
    for k in range(repeat + (1 if profile else 0)):
        ctrl = make_controller(name, site, sc.controllers.get(name, {}), source=loaded.source)
        if profile and k == repeat:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
            for obs in observations:
                ctrl.step(obs)
            prof.disable()
            prof.dump_stats(profile)
            break
        gc.collect()
        for i, obs in enumerate(observations):
            c0, t0 = time.process_time(), time.perf_counter()
            act = ctrl.step(obs)
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
            if actions_digest(act, ctrl) != rec["digests"][i]:
                mismatched += 1
    if dump:
        with open(dump, "a") as f:
            f.writelines(f"{x:.4f} {c:.4f}\n" for x, c in zip(times, cpu, strict=True))
    for what, ms in (("wall", np.array(times)), ("CPU", np.array(cpu))):
        print(f"step ms ({what}) over {repeat} passes: p50 {np.percentile(ms, 50):.2f}  "
              f"p99 {np.percentile(ms, 99):.2f}  min {ms.min():.2f}  mean {ms.mean():.2f}")  # fmt: skip
    print(f"decisions as recorded: {'all' if not mismatched else f'{mismatched} NOT'} "
          f"({len(observations) * repeat} steps checked to the bit)")  # fmt: skip


if __name__ == "__main__":
    main()
