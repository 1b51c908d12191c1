"""`dimmer agent`: simulated GPUs served as a dimmer-rack-v1 device over real loopback TCP."""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.daemon import registers as R
from dimmer.daemon.agent import CapAgent
from dimmer.daemon.bus import DeviceRefused, ModbusTcpBus
from dimmer.daemon.config import validate_config
from dimmer.daemon.devices import RackDevice
from dimmer.daemon.loop import Daemon
from dimmer.daemon.nvml import GpuError, NvmlGpus, SimulatedGpus
from tests.daemon_fakes import meter_image

REPO = Path(__file__).resolve().parents[1]


def at0(v: float | np.ndarray) -> float:
    return float(np.asarray(v).reshape(-1)[0])


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def started(gpus: SimulatedGpus, clock: Clock, **kw: Any) -> tuple[CapAgent, RackDevice, ModbusTcpBus]:
    agent = CapAgent(gpus, safe_cap_w=kw.pop("safe_cap_w", 840.0), clock=clock, **kw)
    port = await agent.start("127.0.0.1", 0)
    bus = ModbusTcpBus("127.0.0.1", port, timeout_s=1.0, retries=0)
    dev = RackDevice(bus, agent.unit, kw.get("first_rack", 0), 1)
    return agent, dev, bus


def test_caps_reach_the_gpus_clamped_and_power_reads_back() -> None:
    async def go() -> None:
        gpus = SimulatedGpus(4, min_w=200.0, max_w=1400.0, demand_w=1100.0)
        clock = Clock()
        agent, dev, bus = await started(gpus, clock, first_rack=7, overhead_w=500.0)
        try:
            r = await dev.read()
            assert r.ok, r.error
            assert at0(r.values["power_w"]) == pytest.approx(4 * 1100.0 + 500.0)
            assert at0(r.values["cap_w"]) == pytest.approx(1400.0)
            assert r.values["lease_state"] == R.LEASE_NONE
            await dev.write(1000.0, 0.0, np.inf, 3000.0, lease_s=5.0)
            assert np.allclose(gpus.limits_w, 1000.0)
            agent.tick()
            r = await dev.read()
            assert at0(r.values["power_w"]) == pytest.approx(4 * 1000.0 + 500.0)  # now held at the cap
            assert at0(r.values["cap_w"]) == pytest.approx(1000.0)
            assert r.values["lease_state"] == R.LEASE_HELD
            await dev.write(50.0, 0.0, np.inf, 0.0, lease_s=5.0)  # below the GPU's range: its minimum
            assert np.allclose(gpus.limits_w, 200.0)
            await dev.write(5000.0, 0.0, np.inf, 0.0, lease_s=5.0)  # above: its maximum
            assert np.allclose(gpus.limits_w, 1400.0)
            n = len(gpus.history)
            await dev.write(5000.0, 0.0, np.inf, 0.0, lease_s=5.0)  # the same cap again: NVML is not called
            assert len(gpus.history) == n
        finally:
            await bus.close()
            await agent.stop()

    asyncio.run(go())


def test_lease_falls_back_to_safe_cap_and_default_limits_restored() -> None:
    async def go() -> None:
        # the boards' default is 1250 W; the host was left at 1300 W (an earlier run that died, an admin)
        gpus = SimulatedGpus(2, min_w=200.0, max_w=1400.0, default_w=1250.0, start_w=1300.0)
        clock = Clock()
        agent, dev, bus = await started(gpus, clock, period_s=1.0, lease_periods=10)
        try:
            await dev.write(1200.0, 0.0, np.inf, 0.0, lease_s=3.0)  # the controller asks for a 3 s lease
            assert agent.lease_s() == pytest.approx(3.0)  # shorter than the agent's own 10 periods
            clock.t = 2.9
            agent.tick()
            assert np.allclose(gpus.limits_w, 1200.0)
            clock.t = 3.1  # no write for longer than the lease
            agent.tick()
            assert np.allclose(gpus.limits_w, 840.0)
            r = await dev.read()
            assert r.values["lease_state"] == R.LEASE_EXPIRED
            assert agent.lease_expiries == 1
            agent.tick()
            assert agent.lease_expiries == 1  # once per lapse
            await dev.write(600.0, 0.0, np.inf, 0.0, lease_s=3.0)  # the controller is back: a lower cap stays lower
            assert np.allclose(gpus.limits_w, 600.0)
            clock.t = 10.0
            agent.tick()
            assert np.allclose(gpus.limits_w, 600.0)  # the safe cap never raises a cap
        finally:
            await bus.close()
            await agent.stop()
        assert np.allclose(gpus.limits_w, 1250.0) and gpus.closed  # the default limits are back, not the 1300 W
        assert not agent.restore_failed

    asyncio.run(go())


def test_writes_outside_the_commands_are_refused() -> None:
    async def go() -> None:
        gpus = SimulatedGpus(1)
        agent, dev, bus = await started(gpus, Clock())
        try:
            with pytest.raises(DeviceRefused) as info:
                await bus.write(agent.unit, R.RACK_STATUS_BASE, [0, 0])  # the status records are read only
            assert info.value.code == 2
            with pytest.raises(DeviceRefused):
                await bus.write(agent.unit, 0, [0])  # the magic
            gpus.fail_next = 1  # the GPU refuses the limit: the controller hears "device failure"
            with pytest.raises(DeviceRefused) as info:
                await dev.write(900.0, 0.0, np.inf, 0.0, lease_s=5.0)
            assert info.value.code == 4
        finally:
            await bus.close()
            await agent.stop()

    asyncio.run(go())


def test_nvml_backend_absent_is_a_clear_error() -> None:
    try:
        importlib.import_module("pynvml")
    except ImportError:
        with pytest.raises(GpuError, match="nvidia-ml-py"):
            NvmlGpus()
        return
    try:
        gpus = NvmlGpus()
    except GpuError as exc:  # nvidia-ml-py installed, but no driver or no GPU here
        assert "NVML" in str(exc)
        return
    try:  # a GPU host: the backend reads sensible values (nothing is set)
        lo, hi = gpus.constraints_w()
        assert np.all(lo > 0) and np.all(hi >= lo)
        assert np.all(gpus.power_w() >= 0)
    finally:
        gpus.close()


def test_daemon_drives_agent_over_tcp(tmp_path: Path) -> None:
    """The daemon's caps reach simulated GPUs through the agent; a stale meter sends them to the safe cap."""
    from dimmer.daemon.agent import RegisterServer

    async def go() -> None:
        gpus = SimulatedGpus(4, demand_w=1000.0)
        agent = CapAgent(gpus, safe_cap_w=840.0, period_s=0.05)
        agent_port = await agent.start("127.0.0.1", 0)
        meter_words = np.zeros(40200, dtype=np.uint16)
        m = meter_image(100e3)
        meter_words[40000 : 40000 + len(m)] = m
        meter = RegisterServer({1: meter_words})
        meter_port = await meter.start("127.0.0.1", 0)
        raw = {
            "site": {
                "gpu": "gb300",
                "gpus_per_rack": 4,
                "active_gpus_per_rack": 4,
                "spare_rack_frac": 0.0,
                "pcc": {"limit_mw": 1.0},
                "levels": [{"level": "row", "count": 1, "rating_kw": 100}, {"level": "rack", "count": 1}],
            },
            "jobs": [{"name": "j", "gpus": 4}],
            "devices": [
                {"kind": "meter", "host": "127.0.0.1", "port": meter_port, "unit": 1, "timeout_s": 0.2},
                {
                    "kind": "racks",
                    "host": "127.0.0.1",
                    "port": agent_port,
                    "unit": 1,
                    "first_rack": 0,
                    "n_racks": 1,
                    "timeout_s": 0.2,
                    "retries": 0,
                },
            ],
            "safety": {"stale_s": 0.5, "lease_s": 1.0},
            "daemon": {"period_s": 0.1, "metrics_address": ""},
        }
        cfg = validate_config(raw, "agent.toml", tmp_path)
        seen: list[float] = []
        d = Daemon(cfg, metrics_address=None, on_cycle=lambda res: seen.append(float(res.actions.rack_cap_w[0])))
        runner = asyncio.create_task(d.run())
        ticker = asyncio.create_task(agent.run())
        await asyncio.sleep(0.6)
        assert seen and np.allclose(gpus.limits_w, seen[-1])  # what the daemon decided is what the GPUs hold
        assert seen[-1] > 840.0
        await meter.stop()  # the meter goes silent: after stale_s the caps go to the safe level
        await asyncio.sleep(1.2)
        assert np.allclose(gpus.limits_w, 840.0)
        d.request_stop()
        await runner
        agent.request_stop()
        await ticker
        assert np.allclose(gpus.limits_w, 1400.0)  # the agent restored the default limits

    asyncio.run(go())


async def _line_with(stream: asyncio.StreamReader, text: str, timeout_s: float = 20.0) -> str:
    """Read lines until one contains `text` (all lines read so far, joined)."""
    seen = ""
    while text not in seen:
        line = (await asyncio.wait_for(stream.readline(), timeout_s)).decode()
        if not line:
            raise AssertionError(f"{text!r} never came; got:\n{seen}")
        seen += line
    return seen


def test_agent_command_line_serves_ignores_sighup_and_stops_on_sigterm() -> None:
    async def go() -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dimmer.cli", "agent", "--sim-gpus", "2", "--port", "0", "--period-s", "0.1",
            "--allow", "192.0.2.10",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 20.0)).decode()
            assert line.startswith("listening on 127.0.0.1:"), line
            port = int(line.rsplit(":", 1)[1])
            err = await _line_with(proc.stderr, "clients allowed: 127.0.0.0/8, ::1/128, 192.0.2.10/32")
            proc.send_signal(signal.SIGHUP)  # a reload signal (or a hung-up terminal): not a stop
            err += await _line_with(proc.stderr, "SIGHUP: ignored")
            bus = ModbusTcpBus("127.0.0.1", port, timeout_s=1.0)
            dev = RackDevice(bus, 1, 0, 1)
            r = await dev.read()
            assert r.ok and at0(r.values["power_w"]) == pytest.approx(2 * 1400.0)  # still serving after SIGHUP
            await dev.write(900.0, 0.0, np.inf, 0.0, lease_s=5.0)
            await bus.close()
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), 20.0)
            err += (await proc.stderr.read()).decode()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert rc == 0, err
        assert "default GPU limits restored (1400 W)" in err
        assert "write 1 from 127.0.0.1:" in err and "cap 900 W/GPU" in err
        assert "writes by client: 127.0.0.1 1 (0 refused)" in err

    asyncio.run(go())


BAD_AGENT_ARGS = [
    (["--unit", "0"], "--unit: "),
    (["--safe-cap-w", "100"], "--safe-cap-w: "),
    (["--safe-cap-frac", "nan"], "--safe-cap-frac: "),
    (["--period-s", "nan"], "--period-s: "),
    (["--period-s", "inf"], "--period-s: "),
    (["--period-s", "0"], "--period-s: "),
    (["--period-s", "-1"], "--period-s: "),
    (["--lease-s", "nan"], "--lease-s: "),
    (["--lease-s", "inf"], "--lease-s: "),
    (["--lease-s", "0"], "--lease-s: "),
    (["--lease-s", "-5"], "--lease-s: "),
    (["--lease-s", "0.5"], "--lease-s: "),  # shorter than the 1 s period
    (["--lease-s", "90000"], "--lease-s: "),  # past the map's 86400 s
    (["--lease-periods", "0"], "--lease-periods: "),
    (["--lease-periods", "-2"], "--lease-periods: "),
    (["--period-s", "3600", "--lease-periods", "30"], "--lease-periods: "),  # 108000 s
    (["--overhead-w", "nan"], "--overhead-w: "),
    (["--overhead-w", "-1"], "--overhead-w: "),
    (["--first-rack", "-1"], "--first-rack: "),
    (["--allow", "controller.example"], "--allow: "),
    (["--allow", "10.20.0.5/24"], "--allow: "),
    (["--no-loopback"], "--no-loopback: "),
    (["--gpu-index", "0"], "--sim-gpus: "),
    # issue 12 item 10: every number finite and in its documented range, refused as it is parsed
    (["--period-s", "nan"], "--period-s: "),
    (["--period-s", "inf"], "--period-s: "),
    (["--period-s", "0.001"], "--period-s: "),
    (["--overhead-w", "inf"], "--overhead-w: "),
    (["--overhead-w", "2e6"], "--overhead-w: "),
    (["--first-rack", "4294967295"], "--first-rack: "),
    (["--unit", "0"], "--unit: "),
    (["--unit", "248"], "--unit: "),
    (["--port", "65536"], "--port: "),
    (["--port", "9" * 5000], "--port: "),
    (["--safe-cap-w", "nan"], "--safe-cap-w: "),
    (["--safe-cap-frac", "inf"], "--safe-cap-frac: "),
    (["--lease-periods", "1e3"], "--lease-periods: "),
    (["--max-connections", "0"], "--max-connections: "),
    (["--max-connections", "10001"], "--max-connections: "),
    (["--max-connections", "nan"], "--max-connections: "),
    (["--idle-timeout-s", "0"], "--idle-timeout-s: "),
    (["--idle-timeout-s", "nan"], "--idle-timeout-s: "),
    (["--idle-timeout-s", "inf"], "--idle-timeout-s: "),
    (["--idle-timeout-s", "86401"], "--idle-timeout-s: "),
]


@pytest.mark.parametrize(("extra", "prefix"), BAD_AGENT_ARGS)
def test_agent_command_line_bad_input(extra: list[str], prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dimmer.cli import main

    try:
        code = main(["agent", "--sim-gpus", "2", "--port", "0", *extra])
    except SystemExit as exc:  # a number out of its range is refused as it is parsed, as argparse refuses
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("dimmer: " + prefix) and err.count("\n") == 1, err


def test_agent_command_line_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from dimmer.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["agent", "--sim-gpus", "2", "--port", str(port)]) == 2  # as any address it cannot use
    err = capsys.readouterr().err
    assert err.startswith(f"dimmer: cannot listen on 127.0.0.1:{port}: ") and "in use" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_agent_command_line_lease_options_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    from dimmer.cli import main

    with pytest.raises(SystemExit) as info:
        main(["agent", "--sim-gpus", "2", "--lease-s", "5", "--lease-periods", "5"])
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_agent_connection_limits_reach_its_modbus_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-connections and --idle-timeout-s (default 32 and 120 s) are the agent's server's limits."""
    import dimmer.daemon.agent as agent_mod
    from dimmer.cli import main
    from dimmer.daemon.netguard import ConnectionLimits

    seen: list[ConnectionLimits | None] = []

    class Stop(Exception):
        pass

    def fake(gpus: Any, **kw: Any) -> None:
        seen.append(kw.get("limits"))
        raise Stop

    monkeypatch.setattr(agent_mod, "CapAgent", fake)
    cases = [
        ([], ConnectionLimits(32, 120.0)),
        (["--max-connections", "4", "--idle-timeout-s", "7.5"], ConnectionLimits(4, 7.5)),
    ]
    for extra, want in cases:
        with pytest.raises(Stop):
            main(["agent", "--sim-gpus", "2", "--port", "0", *extra])
        assert seen[-1] == want
