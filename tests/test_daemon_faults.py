"""Faults over the wire: the daemon against the plant served over real loopback TCP, each fault injected mid-run.

Every end-to-end test runs a small plant (8 GB300 racks, one row, a campus battery; the interconnect limit binds)
served by PlantServer at SPEED x wall time and held until the daemon's first write, with the Daemon class in the same
process and event loop, and checks three things: what the daemon did (the caps and setpoints it decided and wrote),
what it said (audit log records, metrics, mode, log lines), and that the plant kept every limit the daemon could keep
(the plant's own record: breaker trips, interconnect overlimit, ramp violations). The server killed and restarted
runs `gridsim serve` in a child process, killed with SIGKILL and started again on the same port.

Also here, the two fixes these runs rely on: a bus request cancelled mid-flight by the caller's timeout drops its
connection, and `hold_until_first_write` makes a served run start exactly like the in-process run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import re
import signal
import socket
import struct
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.cli import SERVE_CODE, sim_config
from dimmer.daemon.bus import ModbusTcpBus
from dimmer.daemon.config import validate_config
from dimmer.daemon.devices import RackDevice, SunSpecBattery
from dimmer.daemon.loop import CycleResult, Daemon, Mode
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel
from gridsim.engine import SimResult, Simulation
from gridsim.metrics import summarize
from gridsim.plant.grid import overlimit_s, ramp_w_per_min
from gridsim.scenario import LoadedScenario, load_scenario
from gridsim.serve import BATTERY_UNIT, FIRST_RACK_UNIT, METER_UNIT, PlantServer

REPO = Path(__file__).resolve().parents[1]

# 8 GB300 NVL72 racks (64 active GPUs each) in one 900 kW row, one 448-GPU job swinging 35 % every 2 s. Hands-off
# the grid peaks at 0.87 MW: the 0.85 MW interconnect limit binds, and the dimmer controller holds it (with caps and
# the racks' BBUs) from about 16 s on. The 10 s ramp window makes the ramp limit measurable from 20 s on.
SCENARIO = """
name = "eight-racks-faults"
seed = 3
duration_s = {duration}

[site]
gpu = "gb300"
gpus_per_rack = 72
active_gpus_per_rack = 64
spare_rack_frac = 0.02

[site.pcc]
limit_mw = 0.85
ramp_mw_per_min = 0.5
ramp_window_s = 10

[[site.levels]]
level = "row"
count = 1
rating_kw = 900

[[site.levels]]
level = "rack"
count = 8

[site.storage.bess]
power_mw = 0.5
energy_mwh = 0.25

[[jobs]]
name = "train"
priority = 10
gpus = 448
swing_frac = 0.35
iteration_s = 2.0
compute_frac = 0.7
"""
SPEED = 10.0  # plant (and daemon) seconds per wall second: a 1 s control period is 100 ms of wall time
PERIOD_S = 1.0  # the scenario's control period (the engine's default)
ITERATION_S = 2.0  # the job's iteration: its swing's peaks come this far apart
STALE_S = 5.0  # the daemon's defaults, in plant seconds (sim_config raises stale_s to 10 s: set back here)
FROZEN_METER_S = 5.0  # the daemon's default: a meter frozen this long is stale
LEASE_S = 10.0
SAFE_W = 0.6 * 1400.0  # the daemon's safe cap: safe_cap_frac x the GB300's rated 1400 W
SETTLED_S = 20.0  # from here on the controller holds the interconnect limit (16 s in process, with a margin)
CAP_RISE_W_PER_S = 20.0  # the dimmer controller's cap_rise_w_per_s
DEVICES = ("pcc-meter", "campus-battery", "site", "racks-0")
WALL_LIMIT_S = 30.0
TIMING_KEYS = {"controller", "controller_step_ms_p50", "controller_step_ms_p99", "sim_speed_x_realtime"}


def write_scenario(tmp_path: Path, duration_s: float) -> LoadedScenario:
    path = tmp_path / "faults.toml"
    path.write_text(SCENARIO.format(duration=duration_s))
    return load_scenario(path)


def daemon_config(loaded: LoadedScenario, device_map: dict[str, Any], out: Path) -> dict[str, Any]:
    raw = sim_config(loaded.scenario, device_map, "dimmer", out, SPEED)
    raw["safety"] = {"stale_s": STALE_S, "lease_s": LEASE_S, "battery_revert_s": LEASE_S}
    return raw


def caps_of(rec: dict[str, Any]) -> np.ndarray:
    """The per-GPU caps an audit record decided (run-length encoded there)."""
    return np.concatenate([np.full(int(n), float(v)) for v, n in rec["decided"]["cap_w"]])


def metric(d: Daemon, name: str, **labels: str) -> float:
    v = d.metrics.registry.get_sample_value(name, labels)
    assert v is not None, (name, labels)
    return float(v)


def pcc_overlimit_s(res: SimResult, t_from: float, t_to: float = math.inf) -> float:
    """Seconds the grid import spent above the interconnect limit in [t_from, t_to)."""
    m = (res.t_s >= t_from) & (res.t_s < t_to)
    return overlimit_s(res.tick["grid_w"][m], res.tick_s, res.tick["pcc_limit_w"][m])


def overlimit_times(res: SimResult) -> np.ndarray:
    return res.t_s[res.tick["grid_w"] > res.tick["pcc_limit_w"] * (1 + 1e-6)]


@dataclass
class Served:
    """One served run: the plant, the daemon, what the script sampled, and every audit cycle record with the plant
    time at which that cycle ended (`t_plant`)."""

    srv: PlantServer
    daemon: Daemon
    samples: dict[str, Any]
    records: list[dict[str, Any]]
    results: list[CycleResult]
    wall_s: float

    @property
    def res(self) -> SimResult:
        assert self.srv.result is not None, self.srv.error
        return self.srv.result

    @property
    def summary(self) -> dict[str, Any]:
        assert self.srv.summary is not None, self.srv.error
        return self.srv.summary

    def between(self, t_from: float, t_to: float = math.inf) -> list[dict[str, Any]]:
        return [r for r in self.records if t_from <= r["t_plant"] < t_to]


At = Callable[[float], Awaitable[None]]
Script = Callable[[PlantServer, Daemon, At, dict[str, Any]], Awaitable[None]]


def run_served(tmp_path: Path, duration_s: float, script: Script) -> Served:
    """Serve the scenario (held until the first write), run the daemon against it until the plant ends, and run
    `script(server, daemon, at, samples)` alongside (`await at(t)` waits for plant time t)."""
    loaded = write_scenario(tmp_path, duration_s)
    out = tmp_path / "daemon"

    async def go() -> Served:
        srv = PlantServer(loaded, speed=SPEED, hold_until_first_write=True)
        await srv.start()
        samples: dict[str, Any] = {}
        t_end: dict[int, float] = {}
        results: list[CycleResult] = []

        def on_cycle(r: CycleResult) -> None:
            t_end[r.n] = srv.plant_time_s()
            results.append(r)

        async def at(t_s: float) -> None:
            while srv.plant_time_s() < t_s:
                assert not srv.done.is_set(), f"the plant ended before t = {t_s} s"
                await asyncio.sleep(0.005)

        try:
            cfg = validate_config(daemon_config(loaded, srv.device_map(), out), "faults", out)
            d = Daemon(cfg, speed=SPEED, metrics_address=None, on_cycle=on_cycle, max_cycles=int(duration_s) + 60)
            t0 = time.monotonic()
            task = asyncio.create_task(d.run())
            try:
                await asyncio.wait_for(script(srv, d, at, samples), WALL_LIMIT_S)
                assert await srv.wait(WALL_LIMIT_S), "the plant did not finish"
            finally:
                d.request_stop(write_safe=False)
                await task
            wall = time.monotonic() - t0
        finally:
            await srv.stop()
        assert srv.error is None, srv.error
        records = []
        for line in (out / "audit.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "cycle" in rec and rec["cycle"] in t_end:
                records.append({**rec, "t_plant": t_end[rec["cycle"]]})
        return Served(srv, d, samples, records, results, wall)

    return asyncio.run(go())


def ramp_over_s(res: SimResult, since_s: float, *outside: tuple[float, float]) -> float:
    """Seconds over the ramp limit from `since_s` on, leaving out the ticks in each `outside` window, with the import
    taken as settled before then where it was just after (summary.json's count, with the run starting at `since_s`).

    The ramp window remembers: a start-up cut in the first seconds stayed in the utility's 60 s windows for a minute
    after it, and how large it was is the daemon's first cycles' timing (a loaded machine: 0.523 MW/min at 44.7 s
    against 0.5, where an idle one measures 0.445-0.456): what these tests hold is the daemon's conduct after it."""
    site, dt = res.site, res.tick_s
    keep = res.t_s >= since_s
    grid = res.tick["grid_w"][keep]
    if grid.size == 0:
        return 0.0
    ramps = ramp_w_per_min(grid, dt, site.ramp_window_s)  # (before since_s: the import as it was just after)
    over = np.abs(ramps) > site.ramp_limit_w_per_min * (1.0 + 1e-3)
    t = res.t_s[keep]
    for lo, hi in outside:
        over &= ~((t >= lo) & (t < hi))
    return float(np.count_nonzero(over)) * dt


def assert_limits_held(
    run: Served,
    *,
    pcc_from: float = SETTLED_S,
    pcc_except: tuple[float, float] | None = None,
    ramp_except: tuple[float, float] | None = None,
) -> None:
    """No breaker tripped, no ramp violation from `pcc_from` on (outside `ramp_except`: a step nobody controlled, as
    long as the utility's window measures it), and the grid import under the interconnect limit from `pcc_from` on
    (outside `pcc_except`, a window the daemon could not act in).

    The plant starts over its interconnect limit, and what the daemon cuts to bring it under is a fall the ramp
    window measures too: which of the two gives in its first seconds is the daemon's first cycles' timing (a loaded
    machine measured 0.509 MW/min of fall at 11 s against the 0.5 allowed), so both are held from `pcc_from` on."""
    s, res = run.summary, run.res
    assert s["breaker_trips"] == 0
    if ramp_except is None:
        assert ramp_over_s(res, pcc_from) == 0.0, s["max_ramp_mw_per_min"]
    else:
        assert ramp_over_s(res, pcc_from, ramp_except) == 0.0, s["max_ramp_mw_per_min"]
    if pcc_except is None:
        assert pcc_overlimit_s(res, pcc_from) == 0.0, overlimit_times(res)
    else:
        assert pcc_overlimit_s(res, pcc_from, pcc_except[0]) == 0.0, overlimit_times(res)
        assert pcc_overlimit_s(res, pcc_except[1]) == 0.0, overlimit_times(res)


def assert_no_rise_before_stale(run: Served, t_fault: float, cap_at_fault_w: float, what: str) -> None:
    """Until stale_s has passed, readings that stopped coming are not stale yet, but they are late: after
    hold_after_periods (1.5) no cap may rise on them. One period's rise (20 W/s) may come before the first missed
    read (over the plant time that period took: a cycle that ran late on a loaded machine is a longer period, and
    the rise is per second, so up to 1.5 periods of it)."""
    early = run.between(t_fault, t_fault + STALE_S + 1.5 * PERIOD_S)
    rise = max((float(np.max(caps_of(r))) for r in early), default=-math.inf) - cap_at_fault_w
    assert rise <= CAP_RISE_W_PER_S * 1.5 * PERIOD_S + 0.5, f"caps rose {rise:.0f} W in the first stale_s after {what}"


def rises(records: list[dict[str, Any]]) -> float:
    """The largest rise of any rack's decided cap from one record to the next (0 when none rose)."""
    caps = np.array([caps_of(r) for r in records])
    return float(np.max(np.diff(caps, axis=0), initial=0.0)) if len(caps) > 1 else 0.0


# -- the plant server dies and comes back ---------------------------------------------------------------------------


def test_server_outage_daemon_keeps_cycling_flags_goes_safe_and_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Modbus server closes its listener and every connection for 14 plant seconds (the plant keeps running),
    then listens again on the same port. Longer than the daemon's staleness (5 s) and than the devices' leases
    (10 s): the racks fall back to their own safe cap, the battery reverts to idle."""
    t_fault, t_back, duration = 30.0, 44.0, 64.0

    async def script(srv: PlantServer, d: Daemon, at: At, s: dict[str, Any]) -> None:
        await at(t_fault)
        s["port"] = srv.port
        s["cap_at_fault"] = float(np.max(srv.cmd_cap_w))
        await srv.pause_network()
        await at(t_back - 0.5)
        s["up"] = {n: metric(d, "dimmer_device_up", device=n) for n in DEVICES}
        s["read_errors"] = {n: metric(d, "dimmer_comm_errors_total", device=n, op="read") for n in DEVICES}
        s["mode"] = d.mode
        await at(t_back)
        await srv.resume_network()
        assert srv.port == s["port"]  # the same, fixed port

    with caplog.at_level(logging.INFO, logger="dimmer.daemon"):
        run = run_served(tmp_path, duration, script)
    d, s = run.daemon, run.samples

    # it kept cycling, once a period, in RUNNING mode
    during = run.between(t_fault, t_back)
    assert len(during) >= 0.8 * (t_back - t_fault) / PERIOD_S
    assert all(r["mode"] == "running" for r in run.records) and s["mode"] is Mode.RUNNING
    # every write in the outage failed, as unreachable or (a request in flight when the server closed, or a refused
    # connect that a loaded machine took longer than the daemon's wall timeout to report) timed out, nothing else;
    # once flagged, they fail fast (below). How long a cycle takes in wall time is the benchmarks' business.
    errors = [w.get("error") or "" for r in during[1:] for w in r["writes"]]
    assert errors and all(("DeviceUnreachable" in e) or ("no answer within" in e) for e in errors), set(errors)
    # what it said: every device flagged after fail_after (3) failed reads, every write failed, and why
    flagged = run.between(t_fault + 3.5 * PERIOD_S, t_back)
    assert flagged and all(sorted(r["flagged"]) == sorted(DEVICES) for r in flagged)
    assert all(not w["ok"] and "DeviceUnreachable" in w["error"] for r in flagged for w in r["writes"])
    assert s["up"] == dict.fromkeys(DEVICES, 0.0)
    assert all(v >= 3 for v in s["read_errors"].values())
    # once each, by its reads or by its writes: an outage that begins between a cycle's reads and its writes
    # fails the writes one cycle before the reads
    flags = [m for m in caplog.messages if re.search(r"flagged: 3 failed (reads|writes) in a row", m)]
    assert len(flags) == len(DEVICES) and {m.split()[1] for m in flags} == set(DEVICES)
    # caps down to the safe level once the readings are stale, and never up again while they are
    stale = run.between(t_fault + STALE_S + 1.5 * PERIOD_S, t_back)
    assert stale and all(np.all(caps_of(r) <= SAFE_W + 1e-6) for r in stale)
    assert all(any("stale telemetry" in x["reason"] for x in r["reasons"]) for r in stale)
    assert rises(stale) <= 0.0
    # recovered: reads and writes go through again, flags cleared, caps back under the daemon's control
    back = [r for r in run.between(t_back) if all(w["ok"] for w in r["writes"]) and not r["flagged"]]
    assert back, "never recovered"
    t_recovered = back[0]["t_plant"]
    assert t_recovered <= t_back + 12.0  # the bus's reconnection backoff, at most
    assert all(not r["flagged"] and all(w["ok"] for w in r["writes"]) for r in run.between(t_recovered))
    assert sum("answers again" in m for m in caplog.messages) == len(DEVICES)
    assert all(metric(d, "dimmer_device_up", device=n) == 1.0 for n in DEVICES)
    assert d.last_cap_w is not None
    np.testing.assert_allclose(run.srv.cmd_cap_w, d.last_cap_w, rtol=1e-6)  # the plant runs the daemon's caps
    assert not run.srv.dev_expired.any()
    # the plant: no write for longer than the lease, so the rack device fell back to its own safe cap meanwhile
    assert run.srv.lease_expiries == 1
    res = run.res
    lapsed = (res.period_t_s >= t_fault + LEASE_S + 2.0) & (res.period_t_s < t_back)
    np.testing.assert_allclose(res.period["rack_cap_w"][lapsed], run.srv.safe_cap_w, rtol=0.01)
    # Limits: kept throughout. Between the lapse and the recovery nobody controls the plant (the lapsed lease also
    # turns the BBUs to backup only, so the swing's peaks reach the grid): the racks' own fallback cap is sized to
    # keep every rack at it within the interconnect limit as well as the breakers (was 3.5 s over, 0.86 MW / 0.85).
    # The fallback itself is one step nobody controls: with the BBUs backup units, full (issue #11), none absorbs
    # it, and the battery has reverted: the utility's 10 s window sees it for that long (measured 3.3 s over the
    # 0.5 MW/min limit, at 0.60 MW/min; before issue #11 BBUs kept half-empty by shaving every peak absorbed it).
    lapse_s = t_fault + LEASE_S
    assert_limits_held(run, ramp_except=(lapse_s - PERIOD_S, lapse_s + run.res.site.ramp_window_s + 2.0 * PERIOD_S))
    assert run.summary["max_ramp_mw_per_min"] < 0.5 * 1.3  # the step: within 30 % of the limit
    assert_no_rise_before_stale(run, t_fault, s["cap_at_fault"], "every device stopped answering")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _start_gridsim_serve(scenario: Path, port: int, out: Path) -> tuple[asyncio.subprocess.Process, Any]:
    args = [str(scenario), "--port", str(port), "--speed", repr(SPEED), "--out", str(out), "--hold-until-first-write"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVE_CODE, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 20.0)
    assert line, "gridsim serve did not start"
    return proc, json.loads(line)


def test_server_process_killed_and_restarted_on_the_same_port(tmp_path: Path) -> None:
    """`gridsim serve` SIGKILLed mid-run, and a new one (a new plant: its update counters start again at 1) started
    on the same port: the daemon keeps cycling through it, flags every device, decides safe caps on stale readings,
    and drives the new plant as soon as it answers."""
    loaded = write_scenario(tmp_path, 26.0)  # the daemon stops 20 s into the second plant: its leases see it out
    scenario = tmp_path / "faults.toml"
    port = _free_port()
    out = tmp_path / "daemon"

    async def go() -> tuple[Daemon, list[tuple[float, CycleResult]], dict[str, float], int]:
        proc1, device_map = await _start_gridsim_serve(scenario, port, tmp_path / "plant1")
        cfg = validate_config(daemon_config(loaded, device_map, out), "faults", out)
        seen: list[tuple[float, CycleResult]] = []
        d = Daemon(cfg, speed=SPEED, metrics_address=None, on_cycle=lambda r: seen.append((time.monotonic(), r)))
        task = asyncio.create_task(d.run())
        marks: dict[str, float] = {}
        proc2: asyncio.subprocess.Process | None = None
        try:
            while d.n_cycles < 15:  # 15 plant seconds under control
                await asyncio.sleep(0.01)
            site = next(h for h in d.handles if h.name == "site")
            count_at_kill = site.last_count
            proc1.send_signal(signal.SIGKILL)
            await proc1.wait()
            marks["killed"] = time.monotonic()
            await asyncio.sleep(1.0)  # 10 plant seconds without a server (and the new one takes a while to start)
            proc2, map2 = await _start_gridsim_serve(scenario, port, tmp_path / "plant2")
            marks["restarted"] = time.monotonic()
            assert map2["port"] == port
            t0, restarted = time.monotonic(), False
            while not (restarted and site.last_count >= 20):  # the new plant's update counter: 20 s into its run
                assert time.monotonic() - t0 < WALL_LIMIT_S
                restarted = restarted or site.last_count < count_at_kill
                await asyncio.sleep(0.01)
            marks["checked"] = time.monotonic()
            d.request_stop(write_safe=False)
            await task
            rc2 = await asyncio.wait_for(proc2.wait(), WALL_LIMIT_S)
        finally:
            d.request_stop(write_safe=False)
            await task
            for p in (proc1, proc2):
                if p is not None and p.returncode is None:
                    p.kill()
                    await p.wait()
        return d, seen, marks, rc2

    d, seen, marks, rc2 = asyncio.run(go())
    records = {r["cycle"]: r for r in map(json.loads, (out / "audit.jsonl").read_text().splitlines()) if "cycle" in r}
    gap = [r for t, r in seen if marks["killed"] <= t < marks["restarted"]]
    after = [r for t, r in seen if marks["restarted"] <= t < marks["checked"]]
    # it kept cycling through the gap, in RUNNING mode, at its period
    gap_wall_s = marks["restarted"] - marks["killed"]
    assert len(gap) >= 0.7 * gap_wall_s * SPEED / PERIOD_S
    assert all(r.mode is Mode.RUNNING for _, r in seen)
    # said so: every device flagged, every write failed; caps at the safe level once the readings went stale
    late_gap = [records[r.n] for r in gap if r.obs.pcc_age_s > STALE_S]
    assert late_gap
    assert all(sorted(r["flagged"]) == sorted(DEVICES) for r in late_gap)
    assert all(not w["ok"] for r in late_gap for w in r["writes"])
    assert all(np.all(caps_of(r) <= SAFE_W + 1e-6) for r in late_gap)
    # the new plant: found, read (its counters restarted from 1: fresh readings, not stuck ones) and written
    assert after and all(records[r.n]["flagged"] == [] for r in after[-5:])
    assert all(not h.stuck and not h.flagged for h in d.handles)
    assert all(r.obs.pcc_age_s <= 2 * PERIOD_S for r in after[-5:])
    assert rc2 == 0
    assert not (tmp_path / "plant1" / "summary.json").exists()  # a killed server writes nothing
    served = json.loads((tmp_path / "plant2" / "serve.json").read_text())
    summary = json.loads((tmp_path / "plant2" / "summary.json").read_text())
    assert served["writes"] >= 30 and served["writes_refused"] == 0 and served["lease_expiries"] == 0
    assert summary["breaker_trips"] == 0
    # The new plant's first period runs hands-off (every GPU at rated) and its first control point brings the caps
    # the daemon decided on stale readings: a step nobody could ramp, which BBUs kept half-empty by shaving every peak
    # used to absorb before issue #11 (they are backup units now, full): the utility's 10 s window sees it for at
    # most that long (measured 0-3 s, by the timing of the kill).
    assert summary["ramp_violation_s"] <= 10.0  # the scenario's ramp_window_s
    # The daemon's filters carried over: the new plant is held under its interconnect limit from its first control
    # point on (its first period runs hands-off, as every run's does), where a fresh start takes ~16 s to settle.
    ts = np.genfromtxt(tmp_path / "plant2" / "timeseries.csv", delimiter=",", names=True)
    assert summary["pcc_overlimit_s"] <= PERIOD_S
    assert np.all(ts["grid_w"][ts["t_s"] >= PERIOD_S] <= ts["pcc_limit_w"][ts["t_s"] >= PERIOD_S] * (1 + 1e-6))


# -- a meter that stops updating ---------------------------------------------------------------------------------


def test_stalled_rack_meters_move_caps_to_safe_never_up_and_recover(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The rack device keeps answering, with readings frozen and its update counter stuck, for 12 plant seconds."""
    t_fault, t_back, duration = 30.0, 42.0, 60.0
    unit = FIRST_RACK_UNIT

    async def script(srv: PlantServer, d: Daemon, at: At, s: dict[str, Any]) -> None:
        await at(t_fault)
        s["cap_at_fault"] = float(np.max(srv.cmd_cap_w))
        srv.stall(unit)
        await at(t_back - 0.5)
        s["cmd_cap_w"] = srv.cmd_cap_w.copy()
        s["up"] = metric(d, "dimmer_device_up", device="racks-0")
        await at(t_back)
        srv.stall(unit, False)

    with caplog.at_level(logging.INFO, logger="dimmer.daemon"):
        run = run_served(tmp_path, duration, script)
    s = run.samples
    before = run.between(SETTLED_S, t_fault)
    assert all(np.all(caps_of(r) > SAFE_W + 50.0) for r in before)  # under control, above the safe level
    # said so: the device answers (not flagged) but is stale, once its counter has not moved for stale_s
    stale = run.between(t_fault + STALE_S + 1.5 * PERIOD_S, t_back)
    assert stale and all(r["stale"] == ["racks-0"] and r["flagged"] == [] for r in stale)
    assert all(any("stale telemetry" in x["reason"] for x in r["reasons"]) for r in stale)
    assert s["up"] == 1.0
    assert sum("update_count stuck" in m for m in caplog.messages) == 1
    assert sum("racks-0: updating again" in m for m in caplog.messages) == 1
    ages = [r.obs.rack_age_s[0] for r in run.results if r.n in {x["cycle"] for x in stale}]
    assert np.all(np.diff(ages) > 0) and ages[0] > STALE_S  # the readings age although the device answers
    # did so: caps to the safe level and never up while stale; written (the device takes writes) and enforced
    assert all(np.all(caps_of(r) <= SAFE_W + 1e-6) for r in stale)
    assert rises(stale) <= 0.0
    assert all(all(w["ok"] for w in r["writes"]) for r in stale)
    # at the safe level, or a little under it: "to safe, never up" leaves a cut of the same job below it free
    # (833 W once on a loaded clean-clone CI, 840 W on an idle machine)
    assert np.all(s["cmd_cap_w"] <= SAFE_W + 1e-6)
    np.testing.assert_allclose(s["cmd_cap_w"], SAFE_W, rtol=0.01)
    res = run.res
    held = (res.period_t_s >= t_fault + STALE_S + 3.0) & (res.period_t_s < t_back)
    np.testing.assert_allclose(res.period["rack_cap_w"][held], SAFE_W, rtol=0.01)
    # recovered: fresh again within a couple of periods, caps rise again, no faster than the controller's slew
    after = run.between(t_back + 2.0 * PERIOD_S)
    assert after and all(r["stale"] == [] for r in after)
    assert np.all(caps_of(after[-1]) > SAFE_W + 50.0)
    for a, b in itertools.pairwise(after):
        assert np.all(caps_of(b) - caps_of(a) <= CAP_RISE_W_PER_S * (b["t_s"] - a["t_s"]) + 1.0)
    # The fall to the safe cap is the safety layer's step, taken at once and not paced by the ramp rule
    # (docs/controller.md, 5. Safety): the utility's window measures it for a window after. Its size against the
    # 0.5 MW/min limit is the daemon's timing: 0.445-0.456 MW/min on an idle machine, 0.513-0.523 on a loaded one
    # (the code before 2026-12-06 evening too: 2 of 6 runs under load). Held outside that window.
    assert_limits_held(run, ramp_except=(t_fault + STALE_S, duration))
    assert_no_rise_before_stale(run, t_fault, s["cap_at_fault"], "the update counter stopped")


def test_stalled_pcc_meter_moves_caps_to_safe_never_up(tmp_path: Path) -> None:
    """The interconnect meter keeps answering with the value it had, for 12 plant seconds."""
    t_fault, t_back, duration = 30.0, 42.0, 48.0

    async def script(srv: PlantServer, d: Daemon, at: At, s: dict[str, Any]) -> None:
        await at(t_fault)
        s["cap_at_fault"] = float(np.max(srv.cmd_cap_w))
        srv.stall(METER_UNIT)
        await at(t_back)
        srv.stall(METER_UNIT, False)

    run = run_served(tmp_path, duration, script)
    stale = run.between(t_fault + STALE_S + 1.5 * PERIOD_S, t_back)
    assert stale and all("pcc-meter" in r["stale"] for r in stale), [r["stale"] for r in stale]
    assert all(np.all(caps_of(r) <= SAFE_W + 1e-6) for r in stale), [caps_of(r).max() for r in stale]
    # A SunSpec meter has no update counter: a frozen one is known only once its reading has not moved for
    # frozen_meter_s (5 s). Until then caps may rise at the controller's 20 W/s; after that, never above safe.
    during = run.between(t_fault, t_back)
    bound = run.samples["cap_at_fault"] + 20.0 * (FROZEN_METER_S + PERIOD_S) + 1e-6
    assert all(np.all(caps_of(r) <= bound) for r in during), [caps_of(r).max() for r in during]


# -- the battery drops off line -------------------------------------------------------------------------------------


def test_battery_offline_daemon_stops_planning_on_it_and_limits_hold(tmp_path: Path) -> None:
    """The campus battery goes off line for 14 plant seconds (it still answers: State and ConnSt say so)."""
    t_fault, t_back, duration = 30.0, 44.0, 60.0

    async def script(srv: PlantServer, d: Daemon, at: At, s: dict[str, Any]) -> None:
        await at(t_fault)
        srv.set_battery_online(False)
        await at(t_back - 0.5)
        s["soc"] = metric(d, "dimmer_bess_soc_ratio")
        s["up"] = metric(d, "dimmer_device_up", device="campus-battery")
        await at(t_back)
        srv.set_battery_online(True)
        await at(duration - 1.0)
        s["soc_back"] = metric(d, "dimmer_bess_soc_ratio")

    run = run_served(tmp_path, duration, script)
    s, res = run.samples, run.res
    setpoints = [r["decided"]["bess_setpoint_w"] for r in run.between(SETTLED_S, t_fault)]
    assert max(abs(x) for x in setpoints) > 5e3  # on line, the controller uses it
    # Off line (published at the plant's next period, read at the daemon's next cycle): not planned on from then on
    # (setpoint 0 W, still written: the battery answers).
    off = run.between(t_fault + 3.0 * PERIOD_S, t_back)
    assert off and all(r["decided"]["bess_setpoint_w"] == 0.0 for r in off), [
        (r["t_plant"], r["decided"]["bess_setpoint_w"]) for r in off
    ]
    assert all(w["ok"] and w["setpoint_w"] == 0.0 for r in off for w in r["writes"] if w["device"] == "campus-battery")
    assert all(r["flagged"] == [] for r in off)
    offline_obs = [r.obs for r in run.results if r.n in {x["cycle"] for x in off}]
    assert all(not o.bess_online and math.isnan(o.bess_soc_frac) for o in offline_obs)  # unknown, not zero
    assert math.isnan(s["soc"]) and s["up"] == 1.0  # says: no state of charge; the device itself answers
    m = (res.t_s >= t_fault + 2.0) & (res.t_s < t_back)
    assert np.all(np.abs(res.tick["bess_w"][m]) < 1.0)  # the plant: an off-line battery gives nothing
    # back on line: planned on again
    back = run.between(t_back + 3.0 * PERIOD_S)
    assert max(abs(r["decided"]["bess_setpoint_w"]) for r in back) > 1e3
    assert 0.0 < s["soc_back"] < 1.0
    # The trip is a step nobody commanded: what the battery gave leaves the grid side at once. The import may go over
    # the limit by no more than that, and only until the daemon has seen the trip (published at the plant's next
    # period, read at the daemon's next cycle) and cut for the swing's next peak: two periods and an iteration. The
    # same fault in process goes over for at most 1.6 s after it, whatever the phase of the swing it falls in.
    lost_w = float(res.tick["bess_w"][res.t_s < t_fault][-1])
    trip = (t_fault, t_fault + 2.0 * PERIOD_S + ITERATION_S)
    m = (res.t_s >= trip[0]) & (res.t_s < trip[1])
    assert np.all(res.tick["grid_w"][m] - res.tick["pcc_limit_w"][m] <= max(lost_w, 0.0) + 1.0), lost_w
    # and every limit held outside it, the battery's share covered by caps and the racks' BBUs
    assert_limits_held(run, pcc_except=trip)


# -- a write that is refused ------------------------------------------------------------------------------------------


def test_refused_writes_flagged_debounced_retried_each_cycle_loop_keeps_its_period(tmp_path: Path) -> None:
    """The rack device refuses every write (Modbus exception 6, busy) for 6 plant seconds: shorter than its lease,
    so it keeps the last commands it took."""
    t_fault, t_back, duration = 30.0, 36.0, 50.0
    unit = FIRST_RACK_UNIT

    async def script(srv: PlantServer, d: Daemon, at: At, s: dict[str, Any]) -> None:
        await at(t_fault)
        srv.refuse_writes(unit, 6)
        await at(t_back - 0.5)
        s["up"] = metric(d, "dimmer_device_up", device="racks-0")
        s["mode"] = d.mode
        await at(t_back)
        srv.refuse_writes(unit, None)

    run = run_served(tmp_path, duration, script)
    d, s, srv = run.daemon, run.samples, run.srv
    refusing = [r for r in run.records if any(not w["ok"] for w in r["writes"])]
    assert len(refusing) >= 4
    assert all(t_fault <= r["t_plant"] < t_back + 2 * PERIOD_S for r in refusing)
    for r in refusing:
        racks = [w for w in r["writes"] if w["device"] == "racks-0"]
        assert len(racks) == 1 and not racks[0]["ok"] and "exception 6 (server device busy)" in racks[0]["error"]
        assert all(w["ok"] for w in r["writes"] if w["device"] != "racks-0")  # the battery is written as usual
    # debounced: flagged from the third refusal in a row, not before; cleared at the first write that goes through
    assert [bool(r["flagged"]) for r in refusing[:3]] == [False, False, True]
    assert all(r["flagged"] == ["racks-0"] for r in refusing[2:])
    assert s["up"] == 0.0 and s["mode"] is Mode.RUNNING
    ok_after = [r for r in run.records if r["cycle"] > refusing[-1]["cycle"]]
    assert ok_after and ok_after[0]["flagged"] == [] and all(w["ok"] for w in ok_after[0]["writes"])
    assert metric(d, "dimmer_device_up", device="racks-0") == 1.0
    # retried next cycle: the server saw exactly one write a cycle, each refused, one period apart
    refused = [w for w in srv.writes if w.unit == unit and w.refused is not None]
    assert len(refused) == len(refusing) and all(w.refused == 6 for w in refused)
    gaps = np.diff([w.t_plant_s for w in refused])
    assert 0.9 * PERIOD_S < np.median(gaps) < 1.1 * PERIOD_S, gaps
    assert metric(d, "dimmer_comm_errors_total", device="racks-0", op="write") == len(refused)
    # the loop kept its period all along
    steps = np.diff([r["t_plant"] for r in run.between(SETTLED_S)])
    assert 0.95 * PERIOD_S < np.median(steps) < 1.05 * PERIOD_S, steps
    # the device kept the last caps it took (its lease outlasted the refusals): limits held throughout
    assert srv.lease_expiries == 0
    assert_limits_held(run)


# -- fix: a bus request cancelled mid-flight --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def slow_server(delays: list[float]) -> AsyncIterator[tuple[int, dict[str, int]]]:
    """A Modbus TCP server by hand: answers function 3 with every register = 1000 + the request's number, the i-th
    request after delays[i] seconds (0 beyond the list), one request at a time per connection. Counts connections and
    whether each late reply found its connection still open ("late_sent") or closed by the client ("late_closed")."""
    st = {"connections": 0, "requests": 0, "late_sent": 0, "late_closed": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        st["connections"] += 1
        try:
            while True:
                tid, _, length, unit = struct.unpack(">HHHB", await reader.readexactly(7))
                _, _, count = struct.unpack(">BHH", (await reader.readexactly(length - 1))[:5])
                i = st["requests"]
                st["requests"] += 1
                delay = delays[i] if i < len(delays) else 0.0
                if delay:
                    await asyncio.sleep(delay)
                    if reader.at_eof():
                        st["late_closed"] += 1
                        return
                    st["late_sent"] += 1
                pdu = struct.pack(">BB", 3, 2 * count) + struct.pack(f">{count}H", *[1000 + i] * count)
                writer.write(struct.pack(">HHHB", tid, 0, len(pdu) + 1, unit) + pdu)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], st
    finally:
        server.close()
        await server.wait_closed()


def test_bus_request_cancelled_mid_flight_drops_the_connection() -> None:
    """The daemon bounds every device read with its own timeout, shorter than the bus's: when it cancels a request
    on the wire, the connection goes with it, so the late reply is never read and the next request does not queue
    behind it on the server."""

    async def go() -> None:
        async with slow_server([0.5, 0.0, 0.5]) as (port, st):
            bus = ModbusTcpBus("127.0.0.1", port, timeout_s=2.0, retries=0)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(bus.read(1, 0, 2), 0.1)  # the caller gives up first
            assert not bus.connected and bus.errors == 1
            t0 = time.monotonic()
            assert await bus.read(1, 0, 2) == [1001, 1001]  # its own answer, on a new connection, at once
            assert time.monotonic() - t0 < 0.3
            # a task cancelled outright while its request is on the wire: the same
            task = asyncio.create_task(bus.read(1, 0, 2))
            await asyncio.sleep(0.1)
            assert bus.connected
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not bus.connected and bus.errors == 2
            await asyncio.sleep(0.6)  # past both late replies
            assert st == {"connections": 2, "requests": 3, "late_sent": 0, "late_closed": 2}
            assert await bus.read(1, 0, 2) == [1003, 1003]
            assert st["connections"] == 3
            await bus.close()

    asyncio.run(asyncio.wait_for(go(), 10))


def test_bus_request_cancelled_while_queued_keeps_the_connection() -> None:
    """Cancelling a request that is still waiting for its turn sends nothing and leaves the one on the wire alone."""

    async def go() -> None:
        async with slow_server([0.3]) as (port, st):
            bus = ModbusTcpBus("127.0.0.1", port, timeout_s=2.0, retries=0)
            first = asyncio.create_task(bus.read(1, 0, 1))
            await asyncio.sleep(0.05)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(bus.read(1, 0, 1), 0.1)  # queued behind `first`, given up
            assert await first == [1000]
            assert bus.connected and st["connections"] == 1 and st["requests"] == 1 and st["late_sent"] == 1
            assert await bus.read(1, 0, 1) == [1001]
            await bus.close()

    asyncio.run(asyncio.wait_for(go(), 10))


# -- hold_until_first_write -------------------------------------------------------------------------------------------


class ConstantCaps:
    """In-process twin of a client that writes the same commands once with a lease that never runs out."""

    name = "constant"

    def __init__(self, site: SiteModel, cap_w: float, recharge_w: np.ndarray) -> None:
        self.act = Actions.hands_off(site)
        self.act = Actions(
            rack_cap_w=np.full(site.n_racks, cap_w),
            rack_floor_w=self.act.rack_floor_w,
            bess_setpoint_w=0.0,
            rack_bbu_threshold_w=self.act.rack_bbu_threshold_w,
            rack_bbu_recharge_w=recharge_w,
            job_suspend=self.act.job_suspend,
        )

    def step(self, obs: Observation) -> Actions:
        return self.act


def test_hold_until_first_write_freezes_the_plant_then_runs_like_in_process(tmp_path: Path) -> None:
    loaded = write_scenario(tmp_path, 20.0)
    site = loaded.site()
    # float32 on the wire: the in-process twin uses the values the device decodes
    recharge_w = Actions.hands_off(site).rack_bbu_recharge_w.astype(np.float32).astype(np.float64)

    async def go() -> PlantServer:
        srv = PlantServer(loaded, speed=200.0, hold_until_first_write=True)
        await srv.start()
        try:
            t0 = time.monotonic()
            while srv.update_count < 1:
                assert time.monotonic() - t0 < 5.0
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.3)  # 60 plant seconds at 200x: the whole run, were it not held
            assert srv.holding and not srv.done.is_set()
            assert srv.update_count == 1 and srv.plant_time_s() == PERIOD_S  # frozen at the first control point
            assert srv.last_obs is not None and srv.last_obs.t_s == PERIOD_S
            bus = ModbusTcpBus("127.0.0.1", srv.port)
            rack = RackDevice(bus, FIRST_RACK_UNIT, 0, site.n_racks)
            r = await rack.read()
            assert r.ok and r.values["update_count"] == 1.0 and np.all(np.isfinite(r.array("power_w")))
            await rack.write(800.0, 0.0, np.inf, recharge_w, 86_400.0)  # the longest lease the map allows
            await SunSpecBattery(bus, BATTERY_UNIT).write_setpoint(0.0, 1e6)
            assert await srv.wait(10.0)
            await bus.close()
        finally:
            await srv.stop()
        return srv

    srv = asyncio.run(go())
    assert srv.error is None and srv.summary is not None and not srv.holding
    # the caps and the battery setpoint were written while held (the battery's heartbeat after: the plant had gone)
    assert [(w.unit, w.t_plant_s) for w in srv.writes[:2]] == [(FIRST_RACK_UNIT, PERIOD_S), (BATTERY_UNIT, PERIOD_S)]
    twin = Simulation(loaded, site, ConstantCaps(site, 800.0, recharge_w), loaded.scenario.seed).run()
    # the caps bind from the first control point on (hands-off the grid peaks at 0.87 MW): a late start would show
    assert np.max(twin.tick["grid_w"][twin.t_s >= 2.0]) < 0.8e6 < np.max(twin.tick["grid_w"][twin.t_s < PERIOD_S])
    assert srv.result is not None
    np.testing.assert_array_equal(srv.result.tick["grid_w"], twin.tick["grid_w"])  # tick for tick
    ref = summarize(twin)
    for k in ref:
        if k not in TIMING_KEYS:
            assert srv.summary[k] == ref[k], k


def test_stop_while_holding_ends_the_run(tmp_path: Path) -> None:
    async def go() -> PlantServer:
        srv = PlantServer(write_scenario(tmp_path, 20.0), speed=200.0, hold_until_first_write=True)
        await srv.start()
        while srv.update_count < 1:
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        await srv.stop()
        assert time.monotonic() - t0 < 2.0
        return srv

    srv = asyncio.run(asyncio.wait_for(go(), 10))
    assert srv.done.is_set() and srv.error == "stopped before the end of the run" and srv.summary is None
