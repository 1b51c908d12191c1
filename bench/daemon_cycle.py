"""Daemon cycle time: one full cycle (read every rack meter, decide, write every cap) over Modbus TCP on loopback.

    python3 bench/daemon_cycle.py                  # job-start-32k.toml (576 racks), 300 cycles at speed 1 (~5.5 min)
    python3 bench/daemon_cycle.py --cycles 60      # shorter, noisier
    python3 bench/daemon_cycle.py --gpus 131072    # a generated campus of about that many GPUs (bench/common.py)

The plant (gridsim.serve.PlantServer) runs in a child process, as `dimmer run --sim` runs it, so the plant and the
daemon each get a core and an interpreter lock; the real `dimmer.daemon.loop.Daemon` runs here against it with the
config `dimmer run --sim` generates (dimmer.cli.sim_config: every device on the one served endpoint). The plant
advances in wall time x speed, so the controller sees the scenario unfold (job-start-32k's job starts at 180 s).

The Daemon publishes only the whole cycle (`CycleResult.cycle_s`) and the controller step, so the phases are
measured from outside, on this instance only: each device's `read()` / `write()` / `write_setpoint()` and the
daemon's `cycle()` are wrapped with timers. read = first read start -> last read end (the concurrent gather);
decide = last read end -> first write start (snapshot, Observation, Controller.step, safety net, write plan);
write = first write start -> last write end; cycle = the daemon's own cycle_s (read start -> last write);
cycle + bookkeeping = the whole `cycle()` call (adds metrics, audit record, state file). Requests per cycle are
the Modbus requests the bus sent (ModbusTcpBus.requests). The first --warmup cycles (connections, SunSpec
discovery) are left out.

Prints figures; never passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import campus, first_json_line, machine, spawn_script

from gridsim.scenario import LoadedScenario

JOB_START_32K = Path(__file__).resolve().parents[1] / "scenarios" / "job-start-32k.toml"
TARGET_P99_MS = 250.0  # the target for a 32,768-GPU site


def load_source(source: str, duration_s: float) -> LoadedScenario:
    """`gpus:N`: a generated campus of about N GPUs (bench/common.py); anything else: a scenario file."""
    from gridsim.scenario import load_scenario

    if source.startswith("gpus:"):
        return campus(int(source[5:]), duration_s, controller="dimmer")
    return load_scenario(Path(source), [f"duration_s={duration_s:g}"])


# -- the child: the served plant ---------------------------------------------------------------------------------------


def serve_child(source: str, speed: float, duration_s: float) -> int:
    """Serve the plant on a free loopback port; print its device map (one JSON line); run until the end."""
    from gridsim.serve import PlantServer

    server = PlantServer(load_source(source, duration_s), host="127.0.0.1", port=0, speed=speed, out_dir=None)

    async def main() -> int:
        await server.start()
        sys.stdout.write(json.dumps(server.device_map()) + "\n")
        sys.stdout.flush()
        try:
            await server.done.wait()
        finally:
            await server.stop()
        return 1 if server.error else 0

    return asyncio.run(main())


async def start_child(
    source: str, speed: float, duration_s: float, log_path: Path
) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    args = ("--serve-child", source, repr(speed), repr(duration_s))
    proc = await spawn_script(Path(__file__).resolve(), *args, log_path=log_path)
    return proc, await first_json_line(proc, log_path, "plant server")


# -- the parent: the daemon, timed from outside ------------------------------------------------------------------------


@dataclass
class Phases:
    """Per-cycle timer marks (perf_counter seconds), filled by the wrappers and cleared at each cycle start."""

    read_t0: float = math.inf
    read_t1: float = -math.inf
    write_t0: float = math.inf
    write_t1: float = -math.inf
    read_requests: int = 0
    reads_failed: int = 0

    def clear(self) -> None:
        self.read_t0, self.read_t1, self.write_t0, self.write_t1 = math.inf, -math.inf, math.inf, -math.inf
        self.read_requests = 0
        self.reads_failed = 0


@dataclass
class Samples:
    cols: dict[str, list[float]] = field(default_factory=dict)

    def add(self, **values: float) -> None:
        for k, v in values.items():
            self.cols.setdefault(k, []).append(v)

    def arr(self, key: str) -> np.ndarray[Any, np.dtype[np.float64]]:
        return np.asarray(self.cols.get(key, []), dtype=np.float64)


def instrument(daemon: Any, warmup: int, period_wall_s: float) -> Samples:
    """Wrap this daemon's devices and its cycle() with timers (instance attributes only: the classes are untouched)."""
    ph = Phases()
    samples = Samples()
    buses = list({id(b): b for b in (getattr(h.device, "bus", None) for h in daemon.handles) if b is not None}.values())
    last_start = [math.nan]

    def bus_requests() -> int:
        return sum(int(getattr(b, "requests", 0)) for b in buses)

    for h in daemon.handles:
        dev = h.device
        read = dev.read

        async def timed_read(read: Callable[[], Awaitable[Any]] = read) -> Any:
            t0 = time.perf_counter()
            r = await read()
            t1 = time.perf_counter()
            ph.read_t0, ph.read_t1 = min(ph.read_t0, t0), max(ph.read_t1, t1)
            ph.read_requests += int(getattr(r, "requests", 0))
            ph.reads_failed += 0 if r.ok else 1
            return r

        dev.read = timed_read
        for name in ("write", "write_setpoint"):
            fn = getattr(dev, name, None)
            if fn is None:
                continue

            async def timed_write(*args: Any, _fn: Callable[..., Awaitable[Any]] = fn, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await _fn(*args, **kwargs)
                finally:
                    t1 = time.perf_counter()
                    ph.write_t0, ph.write_t1 = min(ph.write_t0, t0), max(ph.write_t1, t1)

            setattr(dev, name, timed_write)

    cycle = daemon.cycle

    async def timed_cycle() -> Any:
        ph.clear()
        n0 = bus_requests()
        t0 = time.perf_counter()
        res = await cycle()
        t1 = time.perf_counter()
        start_gap = t0 - last_start[0]
        last_start[0] = t0
        if res is None or res.n <= warmup:
            return res
        wrote = math.isfinite(ph.write_t0)
        samples.add(
            read_ms=(ph.read_t1 - ph.read_t0) * 1e3,
            decide_ms=((ph.write_t0 if wrote else t1) - ph.read_t1) * 1e3,
            step_ms=res.step_s * 1e3,
            write_ms=(ph.write_t1 - ph.write_t0) * 1e3 if wrote else 0.0,
            cycle_ms=res.cycle_s * 1e3,
            full_ms=(t1 - t0) * 1e3,
            start_gap_ms=start_gap * 1e3,
            requests=bus_requests() - n0,
            read_requests=ph.read_requests,
            reads_failed=ph.reads_failed,
            writes_ok=res.writes_ok,
            writes_failed=res.writes_failed,
            overrun=float(t1 - t0 > period_wall_s),
            failsafe=float(res.mode.value != "running"),
            t_plant_s=res.obs.t_s,
            cap_min_w=float(np.min(res.actions.rack_cap_w)),
            cap_mean_w=float(np.mean(res.actions.rack_cap_w)),
            pcc_mw=res.obs.pcc_power_w / 1e6,
        )
        return res

    daemon.cycle = timed_cycle
    return samples


async def bench(source: str, cycles: int, warmup: int, speed: float, controller: str) -> None:
    from dimmer.cli import sim_config
    from dimmer.daemon.config import validate_config
    from dimmer.daemon.loop import Daemon

    probe = load_source(source, 60.0)
    period_s = float(probe.scenario.engine.control_period_s)
    # plant seconds: the measured cycles, the warm-up, and room for the start (connections, discovery)
    duration_s = float(math.ceil((cycles + warmup) * period_s + 120.0))
    loaded = load_source(source, duration_s)
    site = loaded.site()
    with tempfile.TemporaryDirectory(prefix="daemon-cycle-") as tmp:
        out = Path(tmp)
        t_spawn = time.perf_counter()
        proc, device_map = await start_child(source, speed, duration_s, out / "serve.log")
        spawn_s = time.perf_counter() - t_spawn
        try:
            raw = sim_config(loaded.scenario, device_map, controller, out, speed)
            cfg = validate_config(raw, f"{source} (served)", out)
            daemon = Daemon(cfg, speed=speed, metrics_address=None, max_cycles=cycles + warmup)
            samples = instrument(daemon, warmup, daemon.period_wall_s)
            run = asyncio.create_task(daemon.run())
            ended = asyncio.create_task(proc.wait())
            t_run = time.perf_counter()
            await asyncio.wait({run, ended}, return_when=asyncio.FIRST_COMPLETED)
            daemon.request_stop(write_safe=False)
            await run
            wall_s = time.perf_counter() - t_run
            if ended.done():
                print(f"note: the plant ended first (exit status {proc.returncode})")
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
            await proc.wait()
    report(loaded, site, device_map, samples, daemon, cycles, speed, controller, spawn_s, wall_s)


def _pct(a: np.ndarray[Any, np.dtype[np.float64]]) -> str:
    if a.size == 0:
        return "   (no samples)"
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return f"{p50:8.1f} {p95:8.1f} {p99:8.1f} {a.max():8.1f}"


def report(
    loaded: LoadedScenario,
    site: Any,
    device_map: dict[str, Any],
    s: Samples,
    daemon: Any,
    cycles: int,
    speed: float,
    controller: str,
    spawn_s: float,
    wall_s: float,
) -> None:
    n = s.arr("full_ms").size
    rack_devs = sum(1 for d in device_map["devices"] if d["kind"] == "rack")
    print(
        f"site: {loaded.scenario.name}: {site.n_gpus:,} GPUs in {site.n_racks:,} racks, {site.n_domains} domains; "
        f"{len(device_map['devices'])} devices ({rack_devs} rack devices of <= 64 racks) on one loopback endpoint"
    )
    print(
        f"run: controller {controller}, period {daemon.loaded.config.daemon.period_s:g} s at speed {speed:g} "
        f"({daemon.period_wall_s * 1e3:.0f} ms wall); {n} cycles measured of {daemon.n_cycles} "
        f"(first {daemon.n_cycles - n} left out); plant server up in {spawn_s:.1f} s; daemon ran {wall_s:.0f} s"
    )
    if n == 0:
        print("no cycles measured")
        return
    req, rreq = s.arr("requests"), s.arr("read_requests")
    print(
        f"requests per cycle: {np.median(req):.0f} (reads {np.median(rreq):.0f}, writes "
        f"{np.median(req - rreq):.0f}; min {req.min():.0f}, max {req.max():.0f}); "
        f"writes ok {s.arr('writes_ok').sum():.0f}, failed {s.arr('writes_failed').sum():.0f}; "
        f"reads failed {s.arr('reads_failed').sum():.0f}"
    )
    print(f"  {'ms':<44} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8}")
    rows = (
        ("read (all devices, concurrent)", "read_ms"),
        ("decide (snapshot -> obs -> step -> safety)", "decide_ms"),
        ("  of which Controller.step", "step_ms"),
        ("write (all caps + battery setpoint)", "write_ms"),
        ("cycle (read -> last write: daemon cycle_s)", "cycle_ms"),
        ("cycle + bookkeeping (metrics, audit, state)", "full_ms"),
        ("cycle start to next cycle start", "start_gap_ms"),
    )
    for label, key in rows:
        a = s.arr(key)
        if key == "start_gap_ms":
            a = a[np.isfinite(a)]
        print(f"  {label:<44} {_pct(a)}")
    cyc = s.arr("cycle_ms")
    p99 = float(np.percentile(cyc, 99))
    print(
        f"overruns: {s.arr('overrun').sum():.0f} of {n} measured cycles longer than the period "
        f"(the daemon counted {daemon.n_overruns} in all {daemon.n_cycles}); failsafe cycles "
        f"{s.arr('failsafe').sum():.0f}; cycles over {TARGET_P99_MS:.0f} ms: {(cyc > TARGET_P99_MS).sum()}"
    )
    t = s.arr("t_plant_s")
    print(
        f"plant: t {t.min():.0f}-{t.max():.0f} s, grid {s.arr('pcc_mw').min():.1f}-{s.arr('pcc_mw').max():.1f} MW; "
        f"caps decided: min {s.arr('cap_min_w').min():.0f} W, mean {s.arr('cap_mean_w').min():.0f}-"
        f"{s.arr('cap_mean_w').max():.0f} W"
    )
    print(f"cycle p99 {p99:.1f} ms (target: p99 < {TARGET_P99_MS:.0f} ms for a 32,768-GPU site)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--cycles", type=int, default=300, help="cycles measured (default 300)")
    ap.add_argument("--warmup", type=int, default=5, help="first cycles left out (default 5)")
    ap.add_argument("--speed", type=float, default=1.0, help="plant seconds per wall second (default 1)")
    ap.add_argument("--gpus", type=int, help="a generated campus of about this many GPUs instead of job-start-32k")
    ap.add_argument("--scenario", type=Path, default=JOB_START_32K, help="scenario file (default job-start-32k)")
    ap.add_argument("--controller", default="dimmer", help="controller name (default dimmer)")
    ap.add_argument("--serve-child", nargs=3, metavar=("SOURCE", "SPEED", "DURATION_S"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_child:
        raise SystemExit(serve_child(args.serve_child[0], float(args.serve_child[1]), float(args.serve_child[2])))
    if args.cycles < 1 or args.warmup < 0 or not args.speed > 0:
        ap.error("--cycles >= 1, --warmup >= 0 and --speed > 0")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    source = f"gpus:{args.gpus}" if args.gpus else str(args.scenario)
    load = os.getloadavg()
    print(f"machine: {machine()}; load average {load[0]:.2f} before the run")
    asyncio.run(bench(source, args.cycles, args.warmup, args.speed, args.controller))
    print(f"load average {os.getloadavg()[0]:.2f} after the run")


if __name__ == "__main__":
    main()
