"""`dimmer run --sim` as the hierarchy the product runs on a campus of buildings (docs/daemon.md, "The hierarchy").

With `--controller dimmer-campus` on a scenario of two buildings or more, `dimmer run --sim` starts, besides the
served plant, one building daemon per building (a process each: `dimmer run`'s daemon on its building's devices,
serving `dimmer-building-v1` on a loopback port the OS chose) and runs the campus coordinator's daemon in its own
process, over the plant's interconnect meter, battery and site device and the buildings' registers. Each building
daemon writes its own audit log, state file and cycle statistics in `<out>/<building>/`; `daemon.json` holds the
coordinator's and the buildings' cycle times (`coordinator_cycle_ms_p99`, `building_cycle_ms_p99`: the slowest
building's). A building daemon stops on SIGTERM (safe caps written, as any daemon) or on SIGUSR1 (the plant has
ended: nothing to make safe).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dimmer.atomicfile import write_atomic
from dimmer.errors import DimmerError

_MAIN = "import sys; from dimmer.sim_hierarchy import {0}; raise SystemExit({0}(sys.argv[1:]))"
CHILD_CODE = _MAIN.format("main_building")
STANDIN_CODE = _MAIN.format("main_standins")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
log = logging.getLogger("dimmer.sim")


def percentiles_ms(values: np.ndarray) -> dict[str, float | None]:
    cyc = np.sort(values)
    if cyc.size == 0:
        return {"p50": None, "p99": None, "max": None}
    at = min(cyc.size - 1, int(0.99 * cyc.size))
    return {"p50": round(float(cyc[cyc.size // 2]) * 1e3, 2), "p99": round(float(cyc[at]) * 1e3, 2),
            "max": round(float(cyc[-1]) * 1e3, 2)}  # fmt: skip


def building_config(flat: dict[str, Any], name: str, rack_start: int, rack_stop: int, params: dict[str, Any],
                    safe_share: float, out: Path) -> dict[str, Any]:  # fmt: skip
    """A building daemon's config from the flat daemon's (`cli.sim_config`): its racks' devices (racks counted from
    its first), the site device, the flat controller with the building parameters, its files in `out`."""
    devices = []
    for d in flat["devices"]:
        if d["kind"] == "racks":
            if not rack_start <= d["first_rack"] < rack_stop:
                continue
            d = d | {"first_rack": d["first_rack"] - rack_start}
        elif d["kind"] != "site":
            continue
        devices.append(d)
    daemon = flat["daemon"] | {"audit_log": str(out / "audit.jsonl"), "state_file": str(out / "state.json")}
    return flat | {
        "devices": devices,
        "controller": {"name": "dimmer", "params": params},
        "building": {"name": name, "serve": "127.0.0.1:0", "safe_share": safe_share},
        "daemon": daemon,
    }


def coordinator_config(flat: dict[str, Any], ports: dict[str, int]) -> dict[str, Any]:
    """The coordinator's config: the flat one's interconnect meter, battery and site device, and every building."""
    devices = [d for d in flat["devices"] if d["kind"] != "racks"]
    proto = next(d for d in devices if d["kind"] == "site")
    for name, port in ports.items():
        devices.append(
            {k: proto[k] for k in ("timeout_s", "retries", "backoff_s") if k in proto}
            | {"kind": "building", "name": f"building-{name}", "building": name, "host": "127.0.0.1", "port": port}
        )
    return flat | {"devices": devices}


class HierarchyRun:
    """The building daemons (children) and the coordinator (here) of one `run --sim`, with the `Daemon` interface
    `run_sim` drives: run(), request_stop(), and what daemon.json reports."""

    def __init__(self, flat: dict[str, Any], source: str, out: Path, speed: float, dry_run: bool,
                 on_cycle: Any = None, live: int | None = None) -> None:  # fmt: skip
        from dimmer.control.building_report import n_priority_groups
        from dimmer.control.building_split import building_parts
        from dimmer.control.campus import campus_params
        from dimmer.daemon.config import validate_config

        self.flat, self.source, self.out, self.speed, self.dry_run = flat, source, out, speed, dry_run
        self.on_cycle = on_cycle
        loaded = validate_config(flat, source, out)
        site = loaded.site
        self.parts = building_parts(site)
        _, building = campus_params(flat["controller"]["params"], source)
        margin = building.pcc_margin_frac
        total = sum(p.max_w for p in self.parts)
        self.configs: dict[str, dict[str, Any]] = {}
        for part in self.parts:
            share = margin * part.max_w / max(total, 1.0)
            params = dict(flat["controller"]["params"].get("building", {}))
            d = out / part.name
            self.configs[part.name] = building_config(flat, part.name, part.rack_start, part.rack_stop, params,
                                                      share, d)  # fmt: skip
        # a small machine runs the first `live` buildings' daemons; the rest are stand-ins (one process serving each
        # one's registers with a report fixed at its safe budget): their racks run uncontrolled, for timing only
        names = list(self.configs)
        self.standins = {} if live is None or live >= len(names) else {n: self.configs.pop(n) for n in names[live:]}
        self.standin_spec = [
            {"name": p.name, "max_w": p.max_w, "safe_share": margin * p.max_w / max(total, 1.0),
             "bound_w": margin * p.max_w / max(total, 1.0) * loaded.site.pcc_limit_w}
            for p in self.parts if p.name in self.standins
        ]  # fmt: skip
        self.n_groups = n_priority_groups(loaded.site)
        cores = os.cpu_count() or 1
        if len(self.configs) > 2 * cores:
            log.warning(
                "%d building daemons on %d cores beside the plant: their cycles will overrun (--live-buildings N "
                "runs N of them, the rest as stand-ins)", len(self.configs), cores,
            )  # fmt: skip
        self.children: dict[str, asyncio.subprocess.Process] = {}
        self.coordinator: Any = None
        self._stop_requested = False
        self._write_safe = True
        self._last_audit: dict[str, Any] | None = None

    async def _spawn(self, name: str) -> int:
        d = self.out / name
        d.mkdir(parents=True, exist_ok=True)
        for stale in ("audit.jsonl", "state.json", "daemon.json"):
            (d / stale).unlink(missing_ok=True)
        (d / "config.json").write_text(json.dumps(self.configs[name], indent=1) + "\n")
        args = [str(d / "config.json"), "--speed", repr(self.speed), "--stats", str(d / "daemon.json")]
        if self.dry_run:
            args.append("--dry-run")
        said = await self._start(name, CHILD_CODE, args, d / "daemon.log", f"building daemon {name}")
        return int(said["port"])

    async def _start(self, key: str, code: str, args: list[str], log_path: Path, what: str) -> dict[str, Any]:
        """A child process running `code`; what it says on its first line of stdout (JSON) once it serves."""
        with log_path.open("wb") as log_file:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, *args, stdout=asyncio.subprocess.PIPE, stderr=log_file
            )
        self.children[key] = proc
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=START_TIMEOUT_S)
        except TimeoutError:
            line = b""
        if not line:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise DimmerError(f"{what} did not start: {tail[0]}")
        said: dict[str, Any] = json.loads(line)
        return said

    async def run(self) -> None:
        from dimmer.daemon.config import validate_config
        from dimmer.daemon.coordinator_daemon import CoordinatorDaemon

        try:
            ports = dict(zip(self.configs, await asyncio.gather(*(self._spawn(n) for n in self.configs)), strict=True))
            if self.standins:
                ports |= await self._spawn_standins()
            ports = {p.name: ports[p.name] for p in self.parts}  # (in the site's order)
            cfg = validate_config(coordinator_config(self.flat, ports), self.source, self.out)
            self.coordinator = CoordinatorDaemon(cfg, speed=self.speed, on_cycle=self.on_cycle, dry_run=self.dry_run,
                                                 metrics_address=None)  # fmt: skip
            if self._stop_requested:
                self.coordinator.request_stop()
            await self.coordinator.run()
        finally:
            await self._stop_children()
            if self._last_audit is not None and self.coordinator is not None:
                self.coordinator.audit.reopen()
                self.coordinator.audit.write(self._last_audit)
                self.coordinator.audit.close()

    async def _spawn_standins(self) -> dict[str, int]:
        d = self.out / "standins"
        d.mkdir(parents=True, exist_ok=True)
        spec = {"n_groups": self.n_groups, "speed": self.speed, "buildings": self.standin_spec}
        (d / "standins.json").write_text(json.dumps(spec, indent=1) + "\n")
        said = await self._start("standins", STANDIN_CODE, [str(d / "standins.json")], d / "standins.log",
                                 "the stand-in buildings")  # fmt: skip
        ports: dict[str, int] = said["ports"]
        return ports

    @property
    def last(self) -> Any:
        """The coordinator's last cycle (None before its first)."""
        return None if self.coordinator is None else self.coordinator.last

    def request_stop(self, write_safe: bool = True, last_audit: dict[str, Any] | None = None) -> None:
        self._stop_requested = True
        self._write_safe = self._write_safe and write_safe
        self._last_audit = last_audit or self._last_audit
        if self.coordinator is not None:
            self.coordinator.request_stop()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def _stop_children(self) -> None:
        sig = signal.SIGTERM if self._write_safe else signal.SIGUSR1
        for proc in self.children.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)
        for name, proc in self.children.items():
            try:
                await asyncio.wait_for(proc.wait(), timeout=STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("building daemon %s did not stop within %g s: killed", name, STOP_TIMEOUT_S)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

    # -- what daemon.json says -------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        c = self.coordinator
        coord = percentiles_ms(c.cycle_s.values() if c is not None else np.zeros(0))
        coord_cpu = percentiles_ms(c.cycle_cpu_s.values() if c is not None else np.zeros(0))
        buildings: dict[str, Any] = {}
        for name in self.configs:  # (the live ones)
            path = self.out / name / "daemon.json"
            buildings[name] = json.loads(path.read_text()) if path.is_file() else {"end": "no statistics written"}
        p99 = [b.get("daemon_cycle_ms_p99") for b in buildings.values()]
        p50 = [b.get("daemon_cycle_ms_p50") for b in buildings.values()]
        known99 = [x for x in p99 if x is not None]
        known50 = [x for x in p50 if x is not None]
        return {
            "daemon_cycles": c.n_cycles if c is not None else 0,
            "daemon_overruns": c.n_overruns if c is not None else 0,
            "daemon_cycle_ms_p50": coord["p50"],
            "daemon_cycle_ms_p99": coord["p99"],
            "daemon_cycle_ms_max": coord["max"],
            "daemon_writes": c.n_writes if c is not None else 0,
            "coordinator_cycle_ms_p50": coord["p50"],
            "coordinator_cycle_ms_p99": coord["p99"],
            "coordinator_cycle_cpu_ms_p50": coord_cpu["p50"],
            "coordinator_cycle_cpu_ms_p99": coord_cpu["p99"],
            "building_cycle_ms_p50": max(known50) if known50 else None,
            "building_cycle_ms_p99": max(known99) if known99 else None,
            "buildings": buildings,
            "standin_buildings": sorted(self.standins),
            "last_cycle_mode": "running" if c is not None and c.last is not None else None,
            "stale_at_end": [h.name for h in c.handles if h.stuck] if c is not None else [],
        }


# -- a building daemon, as run --sim starts it -----------------------------------------------------------------------


def main_building(argv: Sequence[str]) -> int:
    """The child: run a building daemon from a JSON config, say its port on stdout, write its statistics at the end."""
    from dimmer.daemon.config import validate_config
    from dimmer.daemon.loop import Daemon

    ap = argparse.ArgumentParser(prog="dimmer-building")
    ap.add_argument("config", type=Path)
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--stats", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(list(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("dimmer.agent").setLevel(logging.WARNING)  # (a line per budget write otherwise)
    raw = json.loads(args.config.read_text())
    loaded = validate_config(raw, str(args.config), args.config.parent)

    def started(d: Daemon) -> None:
        assert d.building is not None
        sys.stdout.write(json.dumps({"port": d.building.port}) + "\n")
        sys.stdout.flush()

    async def main() -> Daemon:
        daemon = Daemon(loaded, speed=args.speed, dry_run=args.dry_run, metrics_address=None, on_started=started)
        daemon.install_signal_handlers()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: daemon.request_stop(write_safe=False))
        await daemon.run()
        return daemon

    daemon = asyncio.run(main())
    cyc = percentiles_ms(daemon.cycle_s.values())
    cpu = percentiles_ms(daemon.cycle_cpu_s.values())
    stats = {
        "daemon_cycles": daemon.n_cycles,
        "daemon_overruns": daemon.n_overruns,
        "daemon_cycle_ms_p50": cyc["p50"],
        "daemon_cycle_ms_p99": cyc["p99"],
        "daemon_cycle_ms_max": cyc["max"],
        "daemon_cycle_cpu_ms_p50": cpu["p50"],
        "daemon_cycle_cpu_ms_p99": cpu["p99"],
        "daemon_writes": daemon.n_writes,
        "budgets_received": daemon.building.server.n_budgets if daemon.building else 0,
        "lease_expiries": daemon.building.server.lease_expiries if daemon.building else 0,
        "last_cycle_mode": daemon.last.mode.value if daemon.last is not None else None,
    }
    write_atomic(args.stats, json.dumps(stats, indent=2) + "\n")
    return 0


def main_standins(argv: Sequence[str]) -> int:
    """Stand-in buildings for a timing run on a small machine: each one's dimmer-building-v1 registers served on a
    port of its own, its report fixed at its safe budget and published every period (a fresh update counter), its
    budgets taken and counted. Ports on stdout; runs until SIGTERM, SIGINT or SIGUSR1."""
    from dimmer.control.coordinator import BuildingReports
    from dimmer.daemon.building_server import BuildingServer

    spec = json.loads(Path(argv[0]).read_text())
    n_g, speed = int(spec["n_groups"]), float(spec["speed"])

    async def main() -> None:
        servers = {
            b["name"]: BuildingServer(b["name"], b["max_w"], b["safe_share"], n_g, speed=speed)
            for b in spec["buildings"]
        }
        ports = {name: await srv.start() for name, srv in servers.items()}
        sys.stdout.write(json.dumps({"ports": ports}) + "\n")
        sys.stdout.flush()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.add_signal_handler(sig, stop.set)
        one, groups = np.ones(1), np.zeros((1, n_g))
        reports = {
            b["name"]: BuildingReports(
                t_s=np.zeros(1), import_w=one * b["bound_w"], bound_w=one * b["bound_w"], prior_w=one * 0.0,
                measured=np.ones(1, dtype=bool), return_w=one * 0.0, return_gpus=one * 0.0, base_w=one * b["bound_w"],
                group_w=groups, floor_w=groups, demand_w=groups, back_w=one * 0.0, fill_w=one * 0.0,
            )
            for b in spec["buildings"]
        }  # fmt: skip
        while not stop.is_set():
            for name, srv in servers.items():
                srv.publish(reports[name])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0 / speed)
        for srv in servers.values():
            await srv.stop()

    asyncio.run(main())
    return 0
