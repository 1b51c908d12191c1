"""The `dimmer` command line. Exit status: 0 done, 2 bad input, 1 anything else.

dimmer run --config site.toml [--dry-run]       the daemon against real devices
dimmer run --sim [SCENARIO] [--speed X] [--out DIR] [--set KEY=VALUE ...]
                                                the daemon against the simulated plant over Modbus on loopback
dimmer check site.toml                          validate a site config; touches no device
dimmer agent [--gpus nvml | --sim-gpus N] ...   a GPU host's power limits as a dimmer-rack-v1 cap device
dimmer controllers                              the controllers this version provides
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dimmer import __version__
from dimmer.argtypes import real, whole
from dimmer.daemon.agent import LEASE_MAX_S
from dimmer.daemon.netguard import IDLE_TIMEOUT_S, MAX_CONNECTIONS
from dimmer.errors import DimmerError, InputError, ListenError
from dimmer.outpath import check_out_dir, out_dir_arg, writing
from dimmer.siteconfig import MAX_GPUS_PER_RACK

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIO = REPO / "scenarios" / "swing-8k.toml"
# `dimmer run --sim` with no scenario: the 8k-GPU swing, 10 plant minutes at 10x: about a minute of wall time.
# (10x leaves a 100 ms wall period for a ~30 ms cycle: room for a busy machine; 20x works on an idle one.)
DEFAULT_SIM_DURATION_S = 600.0
DEFAULT_SIM_SPEED = 10.0
# --speed of `run --sim`: below 0.01x a request's timeout (half a wall period) passes the bus's 30 s limit; above
# 100x the wall period (10 ms at a 1 s control period) is shorter than a daemon cycle, and the daemon falls behind
SIM_SPEED_RANGE = (0.01, 100.0)
SEED_MAX = 2**63 - 1  # numpy takes any size; this keeps a seed one int64 in every output that records it
# `dimmer agent`'s ranges (docs/daemon.md). The period: 10 ms is already a busy NVML poll, and an hour is past any
# lease worth having. A safe cap of 10 kW and 1 MW of host overhead are far past any GPU or host: bounds that keep
# NaN, inf and typos out, the GPU's own settable range is checked once the GPUs are open.
AGENT_PERIOD_RANGE_S = (0.01, 3600.0)
FIRST_RACK_MAX = 0xFFFFFFFF - 1  # the map's first_rack is a uint32, 0xFFFFFFFF reserved
SAFE_CAP_MAX_W = 10_000.0
OVERHEAD_MAX_W = 1e6


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # one line, option first, as an InputError reads: "dimmer: --period-s: a number of seconds in ..."
        sys.stderr.write(f"dimmer: {message.removeprefix('argument ')}\n")
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dimmer", description="Power-transient controller for AI training campuses.")
    p.add_argument("--version", action="version", version=f"dimmer {__version__}")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("controllers", help="list the controllers this version provides")

    run = sub.add_parser(
        "run", help="run the controller daemon (--config) or a demo against the simulated plant (--sim)"
    )
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", type=Path, help="site config (TOML): the daemon against real devices")
    src.add_argument("--sim", nargs="?", const=DEFAULT_SCENARIO, type=Path, metavar="SCENARIO",
                     help="serve SCENARIO's plant over Modbus on loopback and run the daemon against it "
                     f"(default: {DEFAULT_SCENARIO.name}, {DEFAULT_SIM_DURATION_S:g} s at "
                     f"{DEFAULT_SIM_SPEED:g}x)")  # fmt: skip
    run.add_argument("--dry-run", action="store_true", help="read and decide, never write")
    run.add_argument(
        "--speed",
        type=real(*SIM_SPEED_RANGE, what="plant seconds per wall second"),
        help=f"--sim: plant seconds per wall second, {SIM_SPEED_RANGE[0]:g} to {SIM_SPEED_RANGE[1]:g} "
        f"(default {DEFAULT_SIM_SPEED:g})",
    )
    run.add_argument("--out", type=out_dir_arg, help="--sim: output directory (default out/<scenario>-daemon)")
    run.add_argument("--controller", help="--sim: controller name (default dimmer)")
    run.add_argument("--seed", type=whole(0, SEED_MAX, what="a random seed"),
                     help="--sim: random seed, 0 to 2^63-1 (default: the scenario's)")  # fmt: skip
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="--sim: override a scenario key, e.g. --set duration_s=600")  # fmt: skip
    run.add_argument("--metrics", metavar="HOST:PORT", help="--sim: serve Prometheus metrics here (default: none)")
    run.add_argument("--quiet", action="store_true", help="--sim: no status line")
    run.add_argument("--live-buildings", type=whole(1, 10_000, what="a number of buildings"), metavar="N",
                     help="--sim with dimmer-campus: run the first N buildings' daemons, the rest as stand-ins "
                     "(their racks uncontrolled: for timing on a small machine)")  # fmt: skip

    chk = sub.add_parser("check", help="validate a site config without touching any device")
    chk.add_argument("config", type=Path)

    ag = sub.add_parser("agent", help="serve this host's GPU power limits as a dimmer-rack-v1 cap device")
    gpus = ag.add_mutually_exclusive_group()
    gpus.add_argument("--nvml", action="store_true", help="the GPUs NVML sees (default)")
    gpus.add_argument("--sim-gpus", type=whole(1, MAX_GPUS_PER_RACK, what="a number of GPUs (one rack's)"),
                      metavar="N", help=f"N simulated GPUs, 1 to {MAX_GPUS_PER_RACK} (no hardware; for demos and "
                      "tests)")  # fmt: skip
    ag.add_argument("--gpu-index", type=whole(0, MAX_GPUS_PER_RACK - 1, what="an NVML GPU index"), action="append",
                    metavar="I", help="only these NVML GPU indices (not with --sim-gpus)")  # fmt: skip
    ag.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; see docs/daemon.md)")
    ag.add_argument("--port", type=whole(0, 65535, what="a TCP port"), default=5020,
                    help="TCP port (default 5020; 0 picks a free one)")  # fmt: skip
    ag.add_argument("--allow", action="append", default=[], metavar="ADDR[/PREFIX]",
                    help="also accept connections from this address or network, e.g. the controller's "
                    "(repeatable; loopback is always accepted unless --no-loopback; any other client is "
                    "disconnected unread)")  # fmt: skip
    ag.add_argument("--no-loopback", action="store_true",
                    help="refuse loopback clients too (only the --allow addresses may connect)")  # fmt: skip
    ag.add_argument("--unit", type=whole(1, 247, what="a Modbus unit id"), default=1, help="Modbus unit id (default 1)")
    ag.add_argument("--first-rack", type=whole(0, FIRST_RACK_MAX, what="a rack index"), default=0,
                    help="the rack index this host is in the site config (default 0)")  # fmt: skip
    ag.add_argument("--period-s", type=real(*AGENT_PERIOD_RANGE_S, what="a number of seconds"), default=1.0,
                    help=f"refresh and lease check period, {AGENT_PERIOD_RANGE_S[0]:g} to "
                    f"{AGENT_PERIOD_RANGE_S[1]:g} s (default 1 s)")  # fmt: skip
    lease = ag.add_mutually_exclusive_group()
    lease.add_argument("--lease-periods", type=whole(1, 86400, what="a number of periods"), metavar="N",
                       help="fall back to the safe cap after N periods without a write (default 10)")  # fmt: skip
    lease.add_argument("--lease-s", type=real(0.0, LEASE_MAX_S, lo_open=True, what="a number of seconds"),
                       metavar="S", help="the same lease in seconds (at least one period, at most 86400)")  # fmt: skip
    cap = ag.add_mutually_exclusive_group()
    cap.add_argument("--safe-cap-w", type=real(0.0, SAFE_CAP_MAX_W, lo_open=True, what="a number of watts"),
                     help="the safe per-GPU cap in W (within every GPU's settable range)")  # fmt: skip
    cap.add_argument("--safe-cap-frac", type=real(0.0, 1.0, lo_open=True, what="a fraction"), default=0.6,
                     help="the safe cap as a fraction of max (0.6)")  # fmt: skip
    ag.add_argument("--overhead-w", type=real(0.0, OVERHEAD_MAX_W, what="a number of watts"), default=0.0,
                    help=f"host power beyond the GPUs, added to power_w, 0 to {OVERHEAD_MAX_W:g} W "
                    "(default 0)")  # fmt: skip
    ag.add_argument("--max-connections", type=whole(1, 10_000, what="a number of connections"),
                    default=MAX_CONNECTIONS,
                    help=f"Modbus connections served at once, 1 to 10000; one more closes the longest-silent "
                    f"connection of the client holding the most (default {MAX_CONNECTIONS})")  # fmt: skip
    ag.add_argument("--idle-timeout-s", type=real(0.0, 86_400.0, lo_open=True, what="a number of seconds"),
                    default=IDLE_TIMEOUT_S,
                    help=f"close a connection silent this long, at most 86400 s (default {IDLE_TIMEOUT_S:g} s; "
                    "keep it above the controller's period)")  # fmt: skip
    return p


# -- dimmer check ------------------------------------------------------------------------------------------------------


def _cmd_check(args: argparse.Namespace) -> int:
    from dimmer.daemon.config import check_files, describe, load_config, safe_cap_load_warnings

    loaded = load_config(args.config)
    check_files(loaded)  # the audit log and state file as `run` will open them
    print(describe(loaded))
    for w in safe_cap_load_warnings(loaded):
        print(f"warning: {w}")
    return 0


# -- dimmer run --config -----------------------------------------------------------------------------------------------


def _cmd_run_config(args: argparse.Namespace) -> int:
    from dimmer.daemon.config import check_files, load_config
    from dimmer.daemon.loop import run_daemon

    for opt in ("speed", "out", "controller", "seed", "metrics", "live_buildings"):
        if getattr(args, opt) is not None:
            raise InputError("--" + opt.replace("_", "-"), opt, "only with --sim")
    check_files(load_config(args.config))  # one line, exit 2, before any device is touched (the daemon loads it again)
    asyncio.run(run_daemon(args.config, dry_run=args.dry_run))
    return 0


# -- dimmer run --sim --------------------------------------------------------------------------------------------------


def sim_config(
    scenario: Any, device_map: dict[str, Any], controller: str, out_dir: Path, speed: float
) -> dict[str, Any]:
    """The daemon config (as TOML would give it) for a served scenario: its site and jobs, the devices the plant
    server exposes, the controller with the scenario's params for it, files in `out_dir`.

    Bus timeouts are wall-clock; the daemon's period and staleness are plant-clock (the daemon runs `speed` times
    faster than real time), so timeouts shrink with the speed but never below what loopback needs.
    """
    host, port = device_map["host"], int(device_map["port"])
    period_s = float(scenario.engine.control_period_s)
    # a request's timeout (wall seconds): a good part of the wall period, never below what a busy loopback needs
    timeout_s = min(max(0.5 * period_s / speed, 0.1), 10.0)
    devices: list[dict[str, Any]] = []
    kinds = {"sunspec-meter": "meter", "sunspec-battery": "battery", "rack": "racks", "site": "site"}
    for d in device_map["devices"]:
        kind = kinds.get(d["kind"], d["kind"])
        spec: dict[str, Any] = {"kind": kind, "host": host, "port": port, "unit": int(d["unit"])}
        spec["timeout_s"] = timeout_s
        spec["retries"] = 1
        spec["backoff_s"] = 0.01
        for key in ("name", "base", "domain", "first_rack", "n_racks", "read_only", "first_domain"):
            if d.get(key) is not None:
                spec[key] = d[key]
        if kind == "site" and "first_domain" in d:  # (a site split over units: this unit's domains)
            spec["n_domains"] = int(d["n_domains"])
        devices.append(spec)
    jobs = [
        j.model_dump(include={"name", "priority", "gpus", "racks", "building"}, exclude_none=True)
        for j in scenario.jobs
    ]
    params = dict(scenario.controllers.get(controller, {}))
    return {
        "site": scenario.site.model_dump(exclude_unset=True),
        "jobs": jobs,
        "devices": devices,
        "controller": {"name": controller, "params": params},
        # The plant runs faster than real time on a machine it shares: a scheduler hiccup of a fraction of a wall
        # second is seconds of plant time. Trust readings twice as long as the default so a hiccup is not taken for
        # a dead meter (the controller decides the same on fresh data; only the fail-safe's trigger moves).
        "safety": {"stale_s": 10.0},
        "daemon": {
            "period_s": period_s,
            "read_timeout_s": 0.9 * period_s,  # the devices share one endpoint: give the serialised reads room
            "metrics_address": "",
            "audit_log": str(out_dir / "audit.jsonl"),
            "state_file": str(out_dir / "state.json"),
        },
    }


class StatusLine:
    """One line on stderr, rewritten in place at most a few times a second: what the grid and the caps do."""

    def __init__(self, stream: Any = None, every_s: float = 0.25) -> None:
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self._last = 0.0
        self.shown = False

    def __call__(self, res: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        self.stream.write("\r" + self.text(res) + "\x1b[K")
        self.stream.flush()
        self.shown = True

    @staticmethod
    def text(res: Any) -> str:
        if hasattr(res, "budgets"):  # the hierarchy's coordinator (sim_hierarchy.py)
            obs, b = res.obs, res.budgets
            soc = obs.bess_soc_frac
            return (
                f"t {obs.t_s:7.0f} s | grid {obs.pcc_power_w / 1e6:6.2f} MW / limit {obs.pcc_limit_w / 1e6:5.1f} MW | "
                f"budgets {float(b.ceiling_w.sum()) / 1e6:6.2f} MW over {b.ceiling_w.size} buildings | "
                f"SoC {soc * 100:4.1f} % | coordinator cycle {res.cycle_s * 1e3:5.1f} ms"
            )
        obs, act = res.obs, res.actions
        cap = act.rack_cap_w
        soc = obs.bess_soc_frac
        soc_s = f"{soc * 100:4.1f} %" if math.isfinite(soc) else "  -- "
        return (
            f"t {obs.t_s:7.0f} s | grid {obs.pcc_power_w / 1e6:6.2f} MW / limit {obs.pcc_limit_w / 1e6:5.1f} MW | "
            f"cap min {cap.min():5.0f} mean {cap.mean():5.0f} W | SoC {soc_s} | {res.mode.value} | "
            f"cycle {res.cycle_s * 1e3:5.1f} ms"
        )

    def end(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


SERVE_CODE = "import sys; from gridsim.serve import main_serve; raise SystemExit(main_serve(sys.argv[1:]))"


async def start_plant_server(
    scenario_path: Path, overrides: list[str], *, speed: float, out_dir: Path, seed: int | None
) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
    """Start `gridsim serve` (PlantServer on a free loopback port) in a child process; return it and its device map.

    A process of its own: the plant and its Modbus server get a core and an interpreter lock of their own, so the
    daemon here is timed as it would be against real equipment. Its log goes to out_dir/serve.log.

    The child dies with this process: its stdin is a pipe whose only write end is here (never written), and with
    --stop-when-stdin-closes it stops, writing no outputs, when that pipe reads end-of-file. The kernel closes the
    pipe however this process ends (SIGKILL included), on Linux and macOS alike, and there is no window in which a
    death goes unseen (the pipe exists before the child does). PR_SET_PDEATHSIG was the other candidate: Linux only,
    it fires when the forking *thread* ends rather than the process, and it needs a getppid() re-check for a parent
    that died before the child called prctl.
    """
    args = [str(scenario_path), "--host", "127.0.0.1", "--port", "0", "--speed", repr(speed), "--out", str(out_dir)]
    args.append("--stop-when-stdin-closes")
    if seed is not None:
        args += ["--seed", str(seed)]
    for o in overrides:
        args += ["--set", o]
    log_file = (out_dir / "serve.log").open("wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SERVE_CODE,
            *args,
            stdin=asyncio.subprocess.PIPE,  # the lifeline (above); close_fds keeps it out of any other child
            stdout=asyncio.subprocess.PIPE,
            stderr=log_file,
        )
    finally:
        log_file.close()
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60.0)
    except TimeoutError:
        line = b""
    if not line:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        tail = (out_dir / "serve.log").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise DimmerError(f"the plant server did not start: {tail[0]}")
    return proc, json.loads(line)


# why a `run --sim` daemon stopped (daemon.json "end"): only PLANT_ENDED is a run controlled to its end
PLANT_ENDED = "plant ended"
PLANT_EXITED = "plant exited before its end"
STOPPED = "stopped"  # a signal (SIGTERM, SIGINT) or the daemon's own error
# how long the plant may take to write its outputs after its run (the figures of a long run take a while)
OUTPUTS_WAIT_S = 600.0
SIM_FILES = ("audit.jsonl", "state.json", "summary.json", "daemon.json", "serve.json")


async def _plant_end(proc: asyncio.subprocess.Process) -> tuple[str, float | None]:
    """Read the plant's stdout (after its device map) until it says its run ended (and at what plant time), or
    closes (it exited)."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        with contextlib.suppress(ValueError, AttributeError):
            said = json.loads(line)
            if said.get("event") == "ended":
                return PLANT_ENDED, float(said["t_s"])
    return PLANT_EXITED, None


async def plant_outputs_or_stop(proc: asyncio.subprocess.Process, timeout_s: float, on_signals: bool) -> bool:
    """Wait for the plant to write its outputs and exit. A SIGINT or SIGTERM meanwhile (with `on_signals`) abandons
    them: the plant is terminated and the answer is False (a stop we were asked for). The daemon has stopped by then,
    so its own stop handlers did nothing, and Ctrl-C at the end of a long run waited out its figures. Past
    `timeout_s` the plant is terminated too, and the answer is True: its exit status says it failed. A plant killed
    while writing leaves only its staging directory, which the next run into the same --out removes."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if on_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    exited = asyncio.ensure_future(proc.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({exited, stopped}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if on_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    if exited.done():
        return True
    exited.cancel()
    why = (
        "stopped while the plant wrote its outputs"
        if stop.is_set()
        else f"the plant's outputs took over {timeout_s:g} s"
    )
    logging.getLogger("dimmer.sim").warning("%s: abandoned", why)
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    await proc.wait()
    return not stop.is_set()


async def run_sim(
    scenario_path: Path,
    overrides: list[str],
    *,
    speed: float,
    out_dir: Path | None,
    controller: str,
    seed: int | None = None,
    dry_run: bool = False,
    metrics_address: tuple[str, int] | None = None,
    status: StatusLine | None = None,
    install_signals: bool = True,
    live_buildings: int | None = None,
) -> dict[str, Any]:
    """Serve the scenario's plant on a free loopback port, run the daemon against it until the scenario ends;
    return the plant's summary (also in out_dir/summary.json) plus the daemon's cycle statistics and `out_dir`.

    Every run starts fresh: the previous run's results in `out_dir` (SIM_FILES) are removed first, so the daemon
    restores no state and starts a new audit log. The plant starts over at t = 0, so a previous run's controller
    state would describe a plant that no longer exists: there is nothing to resume.

    The plant says on its stdout when its run has ended (before it spends seconds writing its outputs): the daemon
    stops then, cleanly, instead of reading frozen registers until it takes every device for stale."""
    from dimmer.control import controller_names
    from dimmer.control.building_split import building_parts
    from dimmer.daemon.config import validate_config
    from dimmer.daemon.loop import Daemon
    from dimmer.sim_hierarchy import HierarchyRun
    from gridsim.scenario import load_scenario

    log = logging.getLogger("dimmer.sim")
    if controller not in controller_names():
        raise InputError("--controller", "controller", f"one of {', '.join(controller_names())}")
    if live_buildings is not None and controller != "dimmer-campus":
        raise InputError("--live-buildings", "live_buildings", "only with --controller dimmer-campus")
    lo, hi = SIM_SPEED_RANGE
    if not (math.isfinite(speed) and lo <= speed <= hi):
        raise InputError("--speed", "speed", f"plant seconds per wall second in [{lo:g}, {hi:g}] (got {speed!r})")
    loaded = load_scenario(scenario_path, overrides)  # bad input is reported here, before anything starts
    given = out_dir or Path("out") / f"{loaded.scenario.name}-daemon"
    check_out_dir(given)  # before the plant starts: an unusable one was found only when the first file was opened
    # Resolved once, here: every path below is absolute. The daemon config resolves a relative file against its
    # base directory (this one), and a relative `out` put the audit and state in out/<name>/out/<name>/.
    out = given.resolve()
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)
        for stale in SIM_FILES:  # a new run starts fresh (above)
            (out / stale).unlink(missing_ok=True)
    proc, device_map = await start_plant_server(scenario_path, overrides, speed=speed, out_dir=out, seed=seed)
    daemon: Daemon | HierarchyRun | None = None
    plant: asyncio.Task[tuple[str, float | None]] | None = None
    end = STOPPED
    try:
        raw = sim_config(loaded.scenario, device_map, controller, out, speed)
        if controller == "dimmer-campus" and len(building_parts(loaded.site())) > 1:
            # the hierarchy as the product runs it: a daemon per building, the coordinator here (sim_hierarchy.py)
            daemon = HierarchyRun(
                raw, f"{scenario_path} (served)", out, speed, dry_run, on_cycle=status, live=live_buildings
            )
        else:
            cfg = validate_config(raw, f"{scenario_path} (served)", out)
            daemon = Daemon(cfg, dry_run=dry_run, speed=speed, metrics_address=metrics_address, on_cycle=status)
        if install_signals:
            daemon.install_signal_handlers()
        run = asyncio.create_task(daemon.run())
        plant = asyncio.create_task(_plant_end(proc))
        await asyncio.wait({run, plant}, return_when=asyncio.FIRST_COMPLETED)
        why: dict[str, Any] | None = None
        if plant.done():
            end, plant_t_s = plant.result()
            t_s = plant_t_s if plant_t_s is not None else daemon.last.obs.t_s if daemon.last is not None else 0.0
            # the daemon's last word in its audit: why it stopped (written as the log closes, after the record of a
            # cycle in flight now: written here, a busy machine's last cycle landed after it)
            why = {"event": "plant_ended" if end == PLANT_ENDED else "plant_exited", "t_s": round(t_s, 3)}
            log.info("%s at t = %g s: stopping the daemon", end, t_s)
        # the plant has ended (or we were told to stop): nothing to make safe
        daemon.request_stop(write_safe=False, last_audit=why)
        await run
        if end == PLANT_ENDED and not await plant_outputs_or_stop(proc, OUTPUTS_WAIT_S, install_signals):
            end = STOPPED
    finally:
        if plant is not None:
            plant.cancel()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        await proc.wait()
        if status is not None:
            status.end()
    summary_path = out / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    stats = {"end": end, **_daemon_stats(daemon), "daemon_speed_x": speed, "plant_exit_status": proc.returncode}
    with writing(out / "daemon.json"):
        (out / "daemon.json").write_text(json.dumps(stats, indent=2) + "\n")
    return {**summary, **stats, "out_dir": str(out)}


def _daemon_stats(daemon: Any) -> dict[str, Any]:
    """daemon.json's figures of the daemon (or of the hierarchy's coordinator and buildings: sim_hierarchy.py)."""
    if hasattr(daemon, "stats"):
        out: dict[str, Any] = daemon.stats()
        return out
    cyc = sorted(daemon.cycle_s.values().tolist())
    last = daemon.last
    return {
        "daemon_cycles": daemon.n_cycles,
        "daemon_overruns": daemon.n_overruns,
        "daemon_cycle_ms_p50": round(cyc[len(cyc) // 2] * 1e3, 2) if cyc else None,
        "daemon_cycle_ms_p99": round(cyc[min(len(cyc) - 1, int(0.99 * len(cyc)))] * 1e3, 2) if cyc else None,
        "daemon_cycle_ms_max": round(cyc[-1] * 1e3, 2) if cyc else None,
        "daemon_writes": daemon.n_writes,
        # how the last cycle found the devices: at a normal end, as fresh as during the run
        "last_cycle_mode": last.mode.value if last is not None else None,
        "stale_at_end": [h.name for h in daemon.handles if h.stuck],
    }


def _cmd_run_sim(args: argparse.Namespace) -> int:
    from dimmer.daemon.config import parse_address

    overrides = list(args.overrides)
    is_default = args.sim == DEFAULT_SCENARIO
    if is_default and not any(o.split("=", 1)[0].strip() == "duration_s" for o in overrides):
        overrides.insert(0, f"duration_s={DEFAULT_SIM_DURATION_S:g}")
    speed = DEFAULT_SIM_SPEED if args.speed is None else args.speed
    metrics: tuple[str, int] | None = None
    if args.metrics:
        try:
            metrics = parse_address(args.metrics)
        except ValueError as exc:
            raise InputError("--metrics", "metrics", str(exc)) from None
    status = None if args.quiet else StatusLine()
    summary = asyncio.run(
        run_sim(
            args.sim,
            overrides,
            speed=speed,
            out_dir=args.out,
            controller=args.controller or "dimmer",
            seed=args.seed,
            dry_run=args.dry_run,
            metrics_address=metrics,
            status=status,
            live_buildings=args.live_buildings,
        )
    )
    keys = ("breaker_trips", "pcc_overlimit_s", "ramp_violation_s", "max_ramp_mw_per_min", "peak_grid_mw",
            "goodput_pct", "daemon_cycles", "daemon_overruns", "daemon_cycle_ms_p50",
            "daemon_cycle_ms_p99")  # fmt: skip
    print(json.dumps({k: summary.get(k) for k in keys}))
    if "scenario" in summary:
        print(f"wrote {summary['out_dir']}/summary.json, audit.jsonl, daemon.json")
    else:  # stopped, or the plant failed, before it wrote its report
        print(f"wrote {summary['out_dir']}/audit.jsonl, daemon.json (the plant wrote no report)")
    end, status_code = summary["end"], summary["plant_exit_status"]
    if end == PLANT_EXITED or (end == PLANT_ENDED and status_code != 0):  # a stop we were asked for is no failure
        sys.stderr.write(f"dimmer: {end} (exit status {status_code}): see {summary['out_dir']}/serve.log\n")
        return 1
    return 0


# -- dimmer agent ------------------------------------------------------------------------------------------------------


def _agent_lease_s(args: argparse.Namespace) -> float:
    """`dimmer agent`'s own lease in seconds, from --lease-s or --lease-periods x --period-s: each option's range is
    checked when it is parsed; what two of them give together is checked here."""
    if args.lease_s is not None:
        opt, key, lease_s = "--lease-s", "lease_s", float(args.lease_s)
    else:
        periods = 10 if args.lease_periods is None else args.lease_periods
        opt, key, lease_s = "--lease-periods", "lease_periods", periods * args.period_s
    if lease_s < args.period_s:
        raise InputError(opt, key, f"a lease of at least one period ({args.period_s:g} s; got {lease_s:g} s)")
    if lease_s > LEASE_MAX_S:
        raise InputError(opt, key, f"a lease of at most {LEASE_MAX_S:g} s, the map's range (got {lease_s:g} s)")
    return lease_s


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cmd_agent(args: argparse.Namespace) -> int:
    import logging

    from dimmer.daemon.agent import AllowList, CapAgent
    from dimmer.daemon.netguard import ConnectionLimits
    from dimmer.daemon.nvml import GpuBackend, NvmlGpus, SimulatedGpus

    # every number's own range was checked as it was parsed (dimmer.argtypes); here what options give together
    lease_s = _agent_lease_s(args)
    limits = ConnectionLimits(args.max_connections, args.idle_timeout_s)
    try:
        allow = AllowList.parse(args.allow, loopback=not args.no_loopback)
    except ValueError as exc:
        raise InputError("--allow", "allow", str(exc)) from None
    if not allow.networks:
        raise InputError("--no-loopback", "allow", "at least one --allow address too (else no client may connect)")
    if args.sim_gpus is not None and args.gpu_index:
        raise InputError("--sim-gpus", "sim_gpus", "no --gpu-index with simulated GPUs (--gpu-index picks NVML GPUs)")
    if args.gpu_index and len(set(args.gpu_index)) != len(args.gpu_index):
        raise InputError("--gpu-index", "gpu_index", f"distinct GPU indices (got {args.gpu_index})")
    gpus: GpuBackend = SimulatedGpus(args.sim_gpus) if args.sim_gpus is not None else NvmlGpus(args.gpu_index)
    lo, hi = gpus.constraints_w()
    safe = args.safe_cap_w if args.safe_cap_w is not None else args.safe_cap_frac * float(hi.max())
    if not float(lo.max()) <= safe <= float(hi.min()):
        gpus.close()
        raise InputError(
            "--safe-cap-w",
            "safe_cap_w",
            f"within every GPU's settable range {lo.max():g}-{hi.min():g} W (got {safe:g})",
        )
    try:
        agent = CapAgent(
            gpus,
            safe_cap_w=safe,
            period_s=args.period_s,
            lease_s=lease_s,
            first_rack=args.first_rack,
            unit=args.unit,
            overhead_w=args.overhead_w,
            allow=allow,
            limits=limits,
        )
    except BaseException:
        gpus.close()
        raise
    log = logging.getLogger("dimmer.agent")
    if not _is_loopback(args.host) and not args.allow:
        log.warning("listening on %s, but only loopback clients may connect: add --allow CONTROLLER_ADDRESS", args.host)

    def on_sighup() -> None:  # not a stop: a hung-up terminal must not take the caps away (docs/daemon.md)
        log.info("SIGHUP: ignored (nothing to reload); SIGTERM or SIGINT stops the agent and restores the defaults")

    async def main() -> None:
        loop = asyncio.get_running_loop()  # the handlers first: from the first client on, a signal stops cleanly
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.request_stop)
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
        try:
            port = await agent.start(args.host, args.port)
        except ListenError:  # "cannot listen on host:port: why", exit status 2
            gpus.close()  # nothing was set yet: nothing to restore
            raise
        sys.stdout.write(f"listening on {args.host}:{port}\n")
        sys.stdout.flush()
        await agent.run()

    asyncio.run(main())
    if agent.restore_failed:
        raise DimmerError(
            "restoring the default GPU limits failed (see the log): check them with nvidia-smi -q -d POWER"
        )
    return 0


# -- main --------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from dimmer.daemon.metrics import setup_logging

    setup_logging(args.log_level)
    try:
        if args.command == "controllers":
            from dimmer.control import controller_names

            sys.stdout.write("\n".join(controller_names()) + "\n")
            return 0
        if args.command == "check":
            return _cmd_check(args)
        if args.command == "agent":
            return _cmd_agent(args)
        if args.config is not None:
            return _cmd_run_config(args)
        return _cmd_run_sim(args)
    except InputError as exc:
        sys.stderr.write(f"dimmer: {exc}\n")
        return 2
    except DimmerError as exc:
        sys.stderr.write(f"dimmer: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("dimmer: interrupted\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
