"""Soak: the real daemon against the served plant for a long wall-clock run at high speed, with faults at random.

    python3 bench/soak.py                         # 30 wall minutes at 100x: ~50 h of plant time
    python3 bench/soak.py --minutes 3             # a short check of the harness
    python3 bench/soak.py --json out/soak.json    # also keep every window's figures

Three processes, as in production: the plant (gridsim.serve.PlantServer, the fault test site of scenarios/faults/:
48 GB300 NVL72 racks, 2 jobs, a 2 MW / 1 MWh battery, PCC 6 MW and 1 MW/min) in a child; the daemon
(dimmer.daemon.loop.Daemon with the config `dimmer run --sim` generates, audit log and state file on) in another
child; and this process between them, as a TCP proxy that misbehaves at random.

Faults, both kinds drawn from one seed:
- in the plant, as scenario events (gridsim/faults.py), one every `--fault-every-min` plant minutes on average:
  the PCC meter or a row's meter stale, stuck, NaN, spiking or drifting; a row's rack readings lost; cap writes lost
  or refused by firmware, commands late, host agents down; the battery offline; BBUs failed or drained; capacitor
  trays off; every job crashing, or stopped and restarted at once; the campus to backup and back; curtailments,
  frequency events, hot-day derates (each undone later); plus GPU failures at a rate of one per 200 GPU-hours.
- on the wire (this proxy), one every `--net-fault-every-s` wall seconds on average: every connection reset, a
  stall (nothing forwarded either way for up to 0.5 wall s, then delivered late, as TCP does after a partition)
  or a slow link (each chunk delayed by 1-10 ms for a while).

Measured: the daemon's resident memory (from /proc, sampled by this process) as a least-squares slope in MB per
hour over the run after its first tenth (allocator and caches warming up); the cycle time per window (p50, p99, max)
and the slope of the per-window p50, i.e. its drift; overruns and fail-safe cycles; and from the plant at the end:
breaker trips, seconds over the PCC and ramp limits, goodput lost. Prints figures; never passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import signal
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import first_json_line, machine, spawn_script

REPO = Path(__file__).resolve().parents[1]
SITE_SCENARIO = REPO / "scenarios" / "faults" / "curtailment.toml"  # the fault test site; its events are replaced
ROWS = [f"h0/r{i}" for i in range(6)]
PCC_LIMIT_MW = 6.0

# -- the scenario: the fault test site, days long, with faults drawn at random -------------------------------------


def fault_events(duration_s: float, every_s: float, rng: random.Random) -> list[dict[str, Any]]:
    """Faults at exponential intervals (mean `every_s`) from 300 s to 40 minutes before the end; each one that
    lasts is undone (restored limit, rating, jobs) by its own later event, so the run ends healthy."""
    events: list[dict[str, Any]] = []
    t = 300.0
    while True:
        t += rng.expovariate(1.0 / every_s)
        if t > duration_s - 2400.0:  # the longest fault and its undoing (2 x 900 s) end before the run does
            return events
        lasts = rng.uniform(60.0, 900.0)
        family = rng.choice(["telemetry", "telemetry", "actuation", "storage", "load", "grid"])
        if family == "telemetry":
            target = rng.choice(["pcc", "meter", "racks"])
            mode = rng.choice(["stale", "stuck", "nan"] + (["spike", "drift"] if target != "racks" else []))
            ev: dict[str, Any] = {"kind": "telemetry", "at_s": t, "duration_s": lasts, "target": target, "mode": mode}
            if target != "pcc":
                ev["domain"] = rng.choice(ROWS)
            if mode == "spike":
                ev["factor"] = rng.uniform(1.3, 2.0)
            elif mode == "drift":
                ev["factor"] = rng.uniform(-0.5, 0.5)
            events.append(ev)
        elif family == "actuation":
            mode = rng.choice(["lost", "ignored", "delayed", "agent_down"])
            ev = {"kind": "actuation", "at_s": t, "duration_s": lasts, "mode": mode}
            if mode == "delayed":
                ev["delay_s"] = rng.uniform(2.0, 10.0)
            else:
                ev["domain"] = rng.choice(ROWS)
            events.append(ev)
        elif family == "storage":
            mode = rng.choice(["bess_offline", "bbu_failed", "bbu_empty", "trays_disabled"])
            ev = {"kind": "storage", "at_s": t, "duration_s": lasts, "mode": mode}
            if mode != "bess_offline":
                ev["domain"] = rng.choice([*ROWS, "campus"])
            events.append(ev)
        elif family == "load":
            what = rng.choice(["crash", "restart", "backup"])
            if what == "crash":
                events.append({"kind": "crash", "at_s": t, "jobs": rng.choice([[], ["pretrain"], ["finetune"]])})
            elif what == "restart":
                events.append({"kind": "stop", "at_s": t, "jobs": []})
                events.append({"kind": "start", "at_s": t + rng.uniform(60.0, 600.0), "jobs": []})
            else:
                events.append({"kind": "backup_transfer", "at_s": t, "duration_s": rng.uniform(30.0, 300.0)})
        else:
            what = rng.choice(["curtail", "frequency", "derate"])
            if what == "curtail":
                events.append({"kind": "curtail", "at_s": t, "limit_mw": rng.uniform(4.4, 5.4), "over_s": 60.0})
                events.append({"kind": "curtail", "at_s": t + lasts * 2, "limit_mw": PCC_LIMIT_MW, "over_s": 60.0})
            elif what == "frequency":
                events.append({"kind": "frequency_step", "at_s": t, "load_mw": rng.choice([-1, 1]) * 1000.0})
                events.append({"kind": "frequency_step", "at_s": t + 30.0, "load_mw": 0.0})
            else:
                domain = rng.choice(["h0", *ROWS])
                events.append({"kind": "derate", "at_s": t, "domain": domain, "factor": rng.uniform(0.85, 0.95)})
                events.append({"kind": "derate", "at_s": t + lasts * 2, "domain": domain, "factor": 1.0})


def soak_scenario(duration_s: float, fault_every_s: float, seed: int, period_s: float) -> dict[str, Any]:
    from dimmer.tomlfile import read_toml

    raw = read_toml(SITE_SCENARIO, "scenario file")
    raw["name"] = "soak"
    raw["description"] = "bench/soak.py: the fault test site with faults drawn at random"
    raw["seed"] = seed
    raw["duration_s"] = duration_s
    raw["events"] = sorted(fault_events(duration_s, fault_every_s, random.Random(seed)), key=lambda e: e["at_s"])
    raw["engine"] = {"record_racks": 8, "control_period_s": period_s}  # days of series: a few racks, not all 48
    for job in raw["jobs"]:
        job["mtbi_gpu_h"] = 200.0  # about one GPU failure an hour per job: restarts on top of the drawn faults
    return raw


# -- the children ------------------------------------------------------------------------------------------------------


def plant_child(scenario_json: str, speed: float) -> int:
    """Serve the plant on a free loopback port; print its device map, then at the end its summary (JSON lines)."""
    from gridsim.scenario import LoadedScenario, validate_scenario
    from gridsim.serve import PlantServer

    raw = json.loads(Path(scenario_json).read_text())
    loaded = LoadedScenario(validate_scenario(raw, scenario_json), scenario_json, Path(scenario_json).parent)
    server = PlantServer(loaded, host="127.0.0.1", port=0, speed=speed, out_dir=None)

    async def main() -> int:
        await server.start()
        print(json.dumps(server.device_map()), flush=True)
        try:
            await server.done.wait()
        finally:
            await server.stop()
        print(json.dumps({"summary": server.summary, "error": server.error, "writes": len(server.writes)}), flush=True)
        return 1 if server.error else 0

    return asyncio.run(main())


def daemon_child(config_json: str, speed: float, window_s: float, trace_malloc: bool = False) -> int:
    """Run the daemon until SIGTERM; print one JSON line of cycle figures per `window_s` wall seconds. With
    `trace_malloc`, log at the end where the memory allocated since the first window went (slows the daemon)."""
    from dimmer.daemon.config import validate_config
    from dimmer.daemon.loop import CycleResult, Daemon

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raw = json.loads(Path(config_json).read_text())
    cfg = validate_config(raw, config_json, Path(config_json).parent)
    win = Window()

    def on_cycle(res: CycleResult) -> None:
        win.add(res)

    daemon = Daemon(cfg, speed=speed, metrics_address=None, on_cycle=on_cycle)
    period_wall_s = daemon.period_wall_s

    async def report() -> None:
        while True:
            await asyncio.sleep(window_s)
            print(json.dumps(win.flush(period_wall_s, daemon)), flush=True)

    async def main() -> None:
        daemon.install_signal_handlers()
        reporter = asyncio.create_task(report())
        if trace_malloc:
            asyncio.get_running_loop().call_later(window_s, start_tracing)
        try:
            await daemon.run()
        finally:
            reporter.cancel()
            print(json.dumps(win.flush(period_wall_s, daemon)), flush=True)
            if trace_malloc:
                report_growth()

    first: list[Any] = []

    def start_tracing() -> None:  # after one window: connections, discovery and caches are in place by then
        tracemalloc.start(8)
        first.append(tracemalloc.take_snapshot())

    def report_growth() -> None:
        if not first:
            return
        stats = tracemalloc.take_snapshot().compare_to(first[0], "traceback")
        log = logging.getLogger("soak")
        log.warning(
            "tracemalloc: %.2f MB more traced than after the first window", sum(s.size_diff for s in stats) / 1e6
        )
        for st in stats[:12]:
            log.warning(
                "tracemalloc: %+.1f kB in %+d blocks at\n  %s",
                st.size_diff / 1e3,
                st.count_diff,
                "\n  ".join(st.traceback.format()[-8:]),
            )

    asyncio.run(main())
    return 0


@dataclass
class Window:
    """Cycle figures since the last flush (a few hundred floats: this is the only bookkeeping in the daemon's
    process, and it is emptied every window)."""

    cycle_s: list[float] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=dict)
    writes_failed: int = 0
    t_plant_s: float = math.nan

    def add(self, res: Any) -> None:
        self.cycle_s.append(res.cycle_s)
        self.modes[res.mode.value] = self.modes.get(res.mode.value, 0) + 1
        self.writes_failed += res.writes_failed
        self.t_plant_s = res.obs.t_s

    def flush(self, period_wall_s: float, daemon: Any) -> dict[str, Any]:
        c = np.asarray(self.cycle_s) * 1e3
        out = {
            "wall_s": time.monotonic(),
            "t_plant_s": self.t_plant_s,
            "cycles": int(c.size),
            "p50_ms": float(np.percentile(c, 50)) if c.size else math.nan,
            "p99_ms": float(np.percentile(c, 99)) if c.size else math.nan,
            "max_ms": float(c.max()) if c.size else math.nan,
            "overruns": int(np.count_nonzero(c > period_wall_s * 1e3)),
            "modes": dict(self.modes),
            "writes_failed": self.writes_failed,
            "tasks": len(asyncio.all_tasks()),
            "fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else -1,
            "flagged": sum(1 for h in daemon.handles if getattr(h, "flagged", False)),
        }
        self.cycle_s.clear()
        self.modes.clear()
        self.writes_failed = 0
        return out


# -- the proxy: a link that misbehaves ---------------------------------------------------------------------------------


class ChaosProxy:
    """Forward loopback TCP to the plant; on command, reset every connection, stall the link, or slow it."""

    def __init__(self, upstream_port: int, rng: random.Random) -> None:
        self.upstream_port = upstream_port
        self.rng = rng
        self.conns: set[asyncio.StreamWriter] = set()
        self.stalled_until = 0.0
        self.slow_until = 0.0
        self.counts = {"reset": 0, "stall": 0, "slow": 0, "connections": 0}
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counts["connections"] += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        self.conns.update({writer, up_writer})
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)
        for w in (writer, up_writer):
            self.conns.discard(w)
            w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                now = time.monotonic()
                if now < self.stalled_until:
                    await asyncio.sleep(self.stalled_until - now)
                if time.monotonic() < self.slow_until:
                    await asyncio.sleep(self.rng.uniform(0.001, 0.010))
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def fault(self) -> str:
        kind = self.rng.choice(["reset", "stall", "slow"])
        now = time.monotonic()
        if kind == "reset":
            for w in list(self.conns):
                w.transport.abort()
        elif kind == "stall":
            self.stalled_until = now + self.rng.uniform(0.05, 0.5)
        else:
            self.slow_until = now + self.rng.uniform(1.0, 10.0)
        self.counts[kind] += 1
        return kind

    async def chaos(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(self.rng.expovariate(1.0 / every_s))
            self.fault()


# -- the parent --------------------------------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return math.nan


@dataclass
class Run:
    windows: list[dict[str, Any]] = field(default_factory=list)
    rss: list[tuple[float, float, float]] = field(default_factory=list)  # wall s, daemon MB, plant MB
    plant: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    net: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    audit_bytes: int = 0
    warnings: int = 0


async def soak(args: argparse.Namespace, tmp: Path) -> Run:
    from dimmer.cli import sim_config
    from gridsim.scenario import validate_scenario

    wall_s = args.minutes * 60.0
    duration_s = math.floor(wall_s * args.speed)
    raw = soak_scenario(duration_s, args.fault_every_min * 60.0, args.seed, args.period_s)
    scenario = validate_scenario(raw, "soak")
    (tmp / "scenario.json").write_text(json.dumps(raw))
    run = Run(events=raw["events"])

    me = Path(__file__).resolve()
    plant_args = ("--plant-child", str(tmp / "scenario.json"), repr(args.speed))
    plant = await spawn_script(me, *plant_args, log_path=tmp / "plant.log")
    device_map = await first_json_line(plant, tmp / "plant.log", "plant server")
    proxy = ChaosProxy(int(device_map["port"]), random.Random(args.seed + 1))
    device_map["port"] = await proxy.start()
    cfg = sim_config(scenario, device_map, "dimmer", tmp, args.speed)
    (tmp / "daemon.json").write_text(json.dumps(cfg))
    daemon = await spawn_script(
        me,
        "--daemon-child",
        str(tmp / "daemon.json"),
        repr(args.speed),
        repr(args.window_s),
        "trace" if args.tracemalloc else "-",
        log_path=tmp / "daemon.log",
    )
    t0 = time.monotonic()
    chaos = asyncio.create_task(proxy.chaos(args.net_fault_every_s)) if args.net_fault_every_s > 0 else None

    async def read_windows() -> None:
        assert daemon.stdout is not None
        while line := await daemon.stdout.readline():
            w = json.loads(line)
            w["wall_s"] -= t0
            run.windows.append(w)
            if args.verbose:
                print(
                    f"  {w['wall_s']:7.0f} s wall, plant {w['t_plant_s'] / 3600:6.2f} h: {w['cycles']} cycles, "
                    f"p50 {w['p50_ms']:.1f} ms, p99 {w['p99_ms']:.1f} ms, daemon {run.rss[-1][1]:.1f} MB",
                    flush=True,
                )

    async def sample_rss() -> None:
        while True:
            run.rss.append((time.monotonic() - t0, rss_mb(daemon.pid), rss_mb(plant.pid)))
            await asyncio.sleep(args.rss_every_s)

    sampler = asyncio.create_task(sample_rss())
    reader = asyncio.create_task(read_windows())
    assert plant.stdout is not None
    line = await plant.stdout.readline()  # the plant's summary, when its run has ended
    run.wall_s = time.monotonic() - t0
    run.plant = json.loads(line) if line else {"error": "the plant exited without a summary"}
    for task in (sampler, chaos):
        if task is not None:
            task.cancel()
    with contextlib.suppress(ProcessLookupError):
        daemon.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(daemon.wait(), timeout=30.0)
    except TimeoutError:
        daemon.kill()
        await daemon.wait()
    await reader
    await plant.wait()
    run.net = dict(proxy.counts)
    audit = tmp / "audit.jsonl"
    run.audit_bytes = audit.stat().st_size if audit.is_file() else 0
    run.warnings = sum(1 for ln in (tmp / "daemon.log").read_text(errors="replace").splitlines() if " WARNING " in ln)
    return run


def slope_per_h(t_s: np.ndarray, y: np.ndarray) -> float:
    ok = np.isfinite(y)
    if np.count_nonzero(ok) < 3:
        return math.nan
    return float(np.polyfit(t_s[ok] / 3600.0, y[ok], 1)[0])


def report(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    rss = np.asarray(run.rss, dtype=np.float64).reshape(-1, 3)
    settled = rss[rss[:, 0] >= 0.1 * run.wall_s]
    win = [w for w in run.windows if w["cycles"] > 0]
    t_w = np.asarray([w["wall_s"] for w in win])
    p50 = np.asarray([w["p50_ms"] for w in win])
    p99 = np.asarray([w["p99_ms"] for w in win])
    cycles = int(sum(w["cycles"] for w in win))
    third = max(1, len(win) // 3)
    modes: dict[str, int] = {}
    for w in win:
        for k, v in w["modes"].items():
            modes[k] = modes.get(k, 0) + v
    s = run.plant.get("summary") or {}
    kinds: dict[str, int] = {}
    for e in run.events:
        key = e["kind"] + (f"/{e['mode']}" if "mode" in e else "")
        kinds[key] = kinds.get(key, 0) + 1
    fig = {
        "machine": machine(),
        "speed_x": args.speed,
        "wall_min": round(run.wall_s / 60.0, 1),
        "plant_h": round(float(win[-1]["t_plant_s"]) / 3600.0, 1) if win else 0.0,
        "cycles": cycles,
        "period_s": args.period_s,
        "period_wall_ms": round(1e3 * args.period_s / args.speed, 1),
        "cycle_p50_ms_first_third": round(float(np.median(p50[:third])), 2) if win else None,
        "cycle_p50_ms_last_third": round(float(np.median(p50[-third:])), 2) if win else None,
        "cycle_p50_drift_ms_per_h": round(slope_per_h(t_w, p50), 3),
        "cycle_p99_ms_median_window": round(float(np.median(p99)), 2) if win else None,
        "cycle_max_ms": round(max(w["max_ms"] for w in win), 1) if win else None,
        "overruns": int(sum(w["overruns"] for w in win)),
        "modes": modes,
        "daemon_rss_mb_start": round(float(settled[0, 1]), 1) if len(settled) else None,
        "daemon_rss_mb_end": round(float(settled[-1, 1]), 1) if len(settled) else None,
        "daemon_rss_slope_mb_per_h": round(slope_per_h(settled[:, 0], settled[:, 1]), 3) if len(settled) else None,
        "plant_rss_mb_end": round(float(rss[-1, 2]), 1) if len(rss) else None,
        "daemon_tasks_first_last": [win[0]["tasks"], win[-1]["tasks"]] if win else None,
        "daemon_fds_first_last": [win[0]["fds"], win[-1]["fds"]] if win else None,
        "writes_failed": int(sum(w["writes_failed"] for w in win)),
        "daemon_warnings_logged": run.warnings,
        "audit_log_mb": round(run.audit_bytes / 1e6, 1),
        "plant_faults": kinds,
        "net_faults": run.net,
        "trips": s.get("breaker_trips"),
        "s_over_pcc_limit": s.get("pcc_overlimit_s"),
        "s_over_ramp_limit": s.get("ramp_violation_s"),
        "min_bess_soc_frac": s.get("min_bess_soc_frac"),
        "goodput_loss_power_pct": s.get("goodput_loss_power_pct"),
        "plant_error": run.plant.get("error"),
    }
    return fig


def print_report(fig: dict[str, Any]) -> None:
    print(f"machine: {fig['machine']}")
    print(
        f"soak: {fig['wall_min']} wall min at {fig['speed_x']:g}x = {fig['plant_h']} h of plant time; "
        f"{fig['cycles']:,} daemon cycles (period {fig['period_s']:g} s = {fig['period_wall_ms']} ms wall)"
    )
    faults = sum(fig["plant_faults"].values())
    net = fig["net_faults"]
    print(
        f"faults: {faults} plant events ({', '.join(f'{k} {v}' for k, v in sorted(fig['plant_faults'].items()))}); "
        f"network: {net.get('reset', 0)} resets, {net.get('stall', 0)} stalls, {net.get('slow', 0)} slow spells, "
        f"{net.get('connections', 0)} connections"
    )
    print(
        f"memory: daemon RSS {fig['daemon_rss_mb_start']} -> {fig['daemon_rss_mb_end']} MB, slope "
        f"{fig['daemon_rss_slope_mb_per_h']} MB/h (after the first tenth); plant {fig['plant_rss_mb_end']} MB at the "
        f"end; asyncio tasks {fig['daemon_tasks_first_last']}, open fds {fig['daemon_fds_first_last']}"
    )
    print(
        f"cycle: p50 {fig['cycle_p50_ms_first_third']} ms (first third) vs {fig['cycle_p50_ms_last_third']} ms "
        f"(last third), drift {fig['cycle_p50_drift_ms_per_h']} ms/h; median window p99 "
        f"{fig['cycle_p99_ms_median_window']} ms, max {fig['cycle_max_ms']} ms; {fig['overruns']} overruns; "
        f"modes {fig['modes']}; {fig['writes_failed']} writes failed; {fig['daemon_warnings_logged']} warnings logged; "
        f"audit log {fig['audit_log_mb']} MB"
    )
    print(
        f"plant: trips {fig['trips']}, {fig['s_over_pcc_limit']} s over the PCC limit, {fig['s_over_ramp_limit']} s "
        f"over the ramp limit, goodput lost {fig['goodput_loss_power_pct']} %"
        + (f"; plant error: {fig['plant_error']}" if fig["plant_error"] else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-clock minutes (default 30)")
    ap.add_argument("--speed", type=float, default=100.0, help="plant seconds per wall second (default 100)")
    ap.add_argument("--period-s", type=float, default=4.0, help="control period, plant seconds (default 4)")
    ap.add_argument("--seed", type=int, default=6, help="seed of the faults (default 6)")
    ap.add_argument("--fault-every-min", type=float, default=10.0, help="mean plant minutes between plant faults")
    ap.add_argument("--net-fault-every-s", type=float, default=60.0, help="mean wall s between link faults (0: none)")
    ap.add_argument("--window-s", type=float, default=30.0, help="wall seconds per cycle-time window (default 30)")
    ap.add_argument("--rss-every-s", type=float, default=5.0, help="wall seconds between RSS samples (default 5)")
    ap.add_argument("--json", type=Path, help="write the figures and every window here")
    ap.add_argument("--keep", type=Path, help="keep the run's files (logs, audit log, scenario) in this directory")
    ap.add_argument("--tracemalloc", action="store_true", help="log where the daemon's memory grew (slows it)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every window as it ends")
    ap.add_argument("--plant-child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--daemon-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plant_child:
        raise SystemExit(plant_child(args.plant_child[0], float(args.plant_child[1])))
    if args.daemon_child:
        c = args.daemon_child
        raise SystemExit(daemon_child(c[0], float(c[1]), float(c[2]), c[3] == "trace"))
    if not (args.minutes > 0 and args.speed > 0 and args.fault_every_min > 0 and args.window_s > 0):
        ap.error("--minutes, --speed, --fault-every-min and --window-s must be positive")
    if args.minutes * 60.0 * args.speed < 1200.0:
        ap.error("the run must cover at least 1,200 plant seconds (--minutes x 60 x --speed)")
    print(f"load average {os.getloadavg()[0]:.2f} before the run", flush=True)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        run = asyncio.run(soak(args, args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
            run = asyncio.run(soak(args, Path(tmp)))
    fig = report(run, args)
    print_report(fig)
    print(f"load average {os.getloadavg()[0]:.2f} after the run")
    if args.json:
        from dimmer.atomicfile import write_atomic

        payload = {"figures": fig, "windows": run.windows, "rss": run.rss}
        write_atomic(args.json, json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
