"""The daemon over real loopback TCP: dry-run against a server that records writes, SIGTERM and SIGHUP sent to a
daemon process, and the served 8k-GPU swing plant against the in-process simulation of the same scenario."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.daemon.agent import RegisterServer
from dimmer.daemon.config import validate_config
from dimmer.daemon.loop import Daemon
from tests.daemon_fakes import RACK_UNITS, decode_caps, server_images, small_config
from tests.test_daemon_config import _write

REPO = Path(__file__).resolve().parents[1]
SAFE_W = 0.6 * 1400.0


def tcp_config(port: int, **sections: Any) -> dict[str, Any]:
    raw = small_config(**sections)
    for d in raw["devices"]:
        d["port"] = port
        d["timeout_s"] = 0.2
        d["retries"] = 1
    return raw


async def until(cond: Any, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_dry_run_never_writes_over_tcp(tmp_path: Path) -> None:
    async def go() -> None:
        images, writable = server_images()
        server = RegisterServer(images, writable)
        port = await server.start()
        try:
            for dry in (True, False):
                raw = tcp_config(port, daemon={"period_s": 0.05, "metrics_address": ""})
                d = Daemon(validate_config(raw, "x", tmp_path), dry_run=dry, metrics_address=None, max_cycles=5)
                await d.run()
                assert d.n_cycles == 5 and server.reads > 0
                if dry:
                    assert server.writes == []  # not a cycle, not the stop's safe caps
                else:  # the same run without --dry-run writes: the server does record writes
                    assert {w.unit for w in server.writes} == {2, *RACK_UNITS}
        finally:
            await server.stop()

    asyncio.run(go())


async def _daemon_process(cfg: Path, *extra: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dimmer.cli", "run", "--config", str(cfg), *extra,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip


def test_sigterm_writes_safe_caps_and_exits_0(tmp_path: Path) -> None:
    async def go() -> None:
        images, writable = server_images(rack_w=60e3, pcc_w=1.0e6)  # a light load: caps at rated
        server = RegisterServer(images, writable)
        port = await server.start()
        raw = tcp_config(port, daemon={"period_s": 0.1, "metrics_address": "", "state_file": "state.json"})
        raw["safety"] = {"stale_s": 1.0, "lease_s": 1.0, "battery_revert_s": 1.0}
        cfg = _write(tmp_path, raw)
        proc = await _daemon_process(cfg)
        try:
            unit = RACK_UNITS[0]
            await until(lambda: any(w.unit == unit for w in server.writes), 20.0, "the first cap write")
            assert np.allclose(decode_caps(images[unit]), 1400.0)
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), 15.0)
        finally:
            if proc.returncode is None:
                proc.kill()
            await server.stop()
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode()
        assert rc == 0, err
        for u in RACK_UNITS:
            assert np.allclose(decode_caps(images[u]), SAFE_W), err
        assert "safe caps written to 3 of 3 devices" in err
        assert (tmp_path / "state.json").is_file()  # the state is saved at exit

    asyncio.run(go())


def test_sighup_keeps_old_config_if_new_is_invalid_then_applies_a_valid_one(tmp_path: Path) -> None:
    async def go() -> None:
        images, writable = server_images(rack_w=60e3, pcc_w=1.0e6)
        server = RegisterServer(images, writable)
        port = await server.start()
        raw = tcp_config(port, daemon={"period_s": 0.1, "metrics_address": ""})
        raw["safety"] = {"stale_s": 1.0, "lease_s": 1.0, "battery_revert_s": 1.0}
        cfg = _write(tmp_path, raw)
        proc = await _daemon_process(cfg)
        try:
            await until(lambda: len(server.writes) > 3, 20.0, "writes")
            cfg.write_text(cfg.read_text().replace("n_racks = 8", "n_racks = 7", 1))  # rack 7 uncovered: invalid
            proc.send_signal(signal.SIGHUP)
            n = len(server.writes)
            await until(lambda: len(server.writes) > n + 6, 10.0, "writes after the bad reload")
            assert proc.returncode is None  # still running, on the old config
            raw["safety"]["safe_cap_frac"] = 0.5  # a valid change
            _write(tmp_path, raw)
            proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), 15.0)
        finally:
            if proc.returncode is None:
                proc.kill()
            await server.stop()
        assert proc.stderr is not None
        err = (await proc.stderr.read()).decode()
        assert rc == 0, err
        assert "new config rejected, keeping the running one" in err and "devices: racks devices covering" in err
        assert "config reloaded" in err
        assert np.allclose(decode_caps(images[RACK_UNITS[0]]), 700.0)  # the reloaded safe cap was the one used

    asyncio.run(go())


def test_run_config_bad_file_exit_2(tmp_path: Path) -> None:
    from dimmer.cli import main

    assert main(["run", "--config", str(tmp_path / "missing.toml")]) == 2
    assert main(["run", "--config", str(tmp_path / "missing.toml"), "--speed", "3"]) == 2


def test_run_sim_bad_input_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from dimmer.cli import main

    assert main(["run", "--sim", str(REPO / "scenarios" / "swing-8k.toml"), "--set", "duration_s=-1"]) == 2
    assert "duration_s" in capsys.readouterr().err
    assert main(["run", "--sim", "--controller", "nope"]) == 2
    with pytest.raises(SystemExit) as info:  # out of its range (0.01..100): refused as it is parsed
        main(["run", "--sim", "--speed", "0"])
    assert info.value.code == 2 and "--speed: " in capsys.readouterr().err


DURATION_S = 600.0
SPEED = 10.0


@pytest.mark.slow
def test_served_swing_8k_matches_in_process(tmp_path: Path) -> None:
    """Ten plant minutes of the 8k-GPU swing, the daemon against the plant served over TCP at 10x, vs the same
    scenario and controller in one process: no trips, the interconnect and ramp limits held, the summary close."""
    from dimmer.cli import run_sim
    from gridsim.engine import run
    from gridsim.metrics import summarize
    from gridsim.scenario import load_scenario

    scenario = REPO / "scenarios" / "swing-8k.toml"
    overrides = [f"duration_s={DURATION_S:g}"]
    out = tmp_path
    served = asyncio.run(
        run_sim(scenario, overrides, speed=SPEED, out_dir=out, controller="dimmer", install_signals=False)
    )
    runs = [served]
    if served["daemon_overruns"] > 0.05 * served["daemon_cycles"]:
        # A machine too busy to keep a 100 ms period (a loaded CI host: 98.96 % goodput against 100 %, every limit
        # held) judges its own load, not the daemon: the same run at half the speed, on that machine, is compared.
        out = tmp_path / "half-speed"
        served = asyncio.run(
            run_sim(scenario, overrides, speed=SPEED / 2, out_dir=out, controller="dimmer", install_signals=False)
        )
        runs.append(served)
    res = run(load_scenario(scenario, overrides), controller="dimmer")
    local = summarize(res)
    local_t, local_grid = res.t_s, res.tick["grid_w"]
    (tmp_path / "compare.json").write_text(json.dumps({"served": served, "in_process": local}, indent=2))

    assert local["breaker_trips"] == 0
    for one in runs:  # every limit held, whether or not the machine kept the period
        assert one["plant_exit_status"] == 0
        assert one["duration_s"] == pytest.approx(DURATION_S)
        assert one["breaker_trips"] == 0
        assert one["pcc_overlimit_s"] == 0.0
        assert one["ramp_violation_s"] == 0.0
        assert one["max_ramp_mw_per_min"] <= 1.5  # the scenario's ramp limit
        assert one["peak_grid_mw"] <= 18.0  # the interconnect
    for key in ("grid_energy_mwh", "demand_energy_mwh"):
        assert served[key] == pytest.approx(local[key], rel=0.03), key
    assert served["goodput_pct"] == pytest.approx(local["goodput_pct"], abs=1.0)
    # The peak of either run is its start-up transient (the plant runs hands-off until the first write, in process
    # for one period, served until the daemon's first cycle, which a busy machine delays: 16.9 against 16.0 MW on a
    # clean-clone CI run): held under the interconnect above, and compared once both are under control, below.
    header = (out / "timeseries.csv").read_text().split("\n", 1)[0].split(",")
    cols = (header.index("t_s"), header.index("grid_w"))
    served_ts = np.loadtxt(out / "timeseries.csv", delimiter=",", skiprows=1, usecols=cols)
    # Once under control, the highest import is the battery charging under the bound (dimmer's in-process peak
    # after 60 s sits ~0.5 MW above the uncontrolled one), and when it charges served depends on how late the
    # daemon's cycles ran on the test machine (16.6 vs 16.0 MW seen on a loaded one): compare the distribution.
    served_late = served_ts[served_ts[:, 0] > 60.0, 1]
    local_late = local_grid[local_t > 60.0]
    assert float(np.median(served_late)) == pytest.approx(float(np.median(local_late)), rel=0.02)
    assert float(np.percentile(served_late, 99)) == pytest.approx(float(np.percentile(local_late, 99)), rel=0.05)
    # the daemon ran to the plant's end, on fresh devices. How well it kept its period (cycles, overruns, wall time)
    # is the machine's business, measured by bench/daemon_cycle.py: asserted here, a shared machine busy with another
    # run failed the test (257 overruns in 512 cycles) with every limit held and the grid within 2 % of in process.
    assert served["end"] == "plant ended" and served["last_cycle_mode"] == "running"
    assert served["daemon_cycles"] > 0 and served["stale_at_end"] == []
