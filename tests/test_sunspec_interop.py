"""The daemon's SunSpec client against devices it did not lay out: registers built and interpreted by pysunspec2
(tests/sunspec_testdevice.py), served over Modbus TCP on loopback. What counts is what the *device* understood."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from dimmer.daemon.bus import ModbusTcpBus
from dimmer.daemon.devices import SunSpecBattery, SunSpecMeter
from tests.sunspec_testdevice import PysunspecBattery, PysunspecMeter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


async def _client(dev: PysunspecBattery | PysunspecMeter) -> tuple[int, ModbusTcpBus]:
    port = await dev.start()
    return port, ModbusTcpBus("127.0.0.1", port, timeout_s=1.0, retries=0)


@pytest.mark.parametrize("control", ["704", "124"])
def test_reads_soc_sign_and_state_of_a_pysunspec2_battery(control: str) -> None:
    async def go() -> None:
        dev = PysunspecBattery(control, soc_raw=612, soc_sf=-1, w_raw=-1500, w_sf=3)
        _, bus = await _client(dev)
        try:
            r = await SunSpecBattery(bus, 2).read()
            assert r.ok, r.error
            assert r.values["soc_frac"] == pytest.approx(0.612)  # SoC 612 x 10^-1 %
            assert r.values["power_w"] == -1.5e6  # 701 W < 0: absorbing, i.e. charging
            assert r.values["online"] == 1.0  # 802 CONNECTED, 701 ConnSt CONNECTED (= 1) and St ON (= 1)
            assert r.values["max_charge_w"] == 500e3 and r.values["max_discharge_w"] == 500e3
        finally:
            await bus.close()
            await dev.stop()

    run(go())


@pytest.mark.parametrize("wset_sf", [-1, 1, 2])
@pytest.mark.parametrize("power_w", [123_400.0, -250_000.0])
def test_704_setpoint_sign_scale_and_reversion_as_the_device_reads_them(wset_sf: int, power_w: float) -> None:
    async def go() -> None:
        clock = Clock()
        dev = PysunspecBattery("704", wset_sf=wset_sf, clock=clock)
        _, bus = await _client(dev)
        try:
            b = SunSpecBattery(bus, 2, max_power_w=500e3)
            w = await b.write_setpoint(power_w, 3.0)
            assert dev.setpoint_w() == pytest.approx(power_w, abs=10.0**wset_sf)  # + = discharge, device's own sf
            assert w.scale_factor == wset_sf and w.read_back and w.model == 704
            assert all(x.refused is None for x in dev.writes)  # nothing outside the writable points
            assert dev.point(704, "WSetRvrtTms").value == 3
            r = await b.read()
            assert r.values["setpoint_revert_s"] == 3.0
            clock.t += 2.0
            assert dev.setpoint_w() == pytest.approx(power_w, abs=10.0**wset_sf)  # not yet
            await b.write_setpoint(power_w / 2, 3.0)  # a new write restarts the reversion timer
            clock.t += 2.5
            assert dev.setpoint_w() == pytest.approx(power_w / 2, abs=10.0**wset_sf)
            clock.t += 1.0  # 3.5 s after the last write: the device reverts on its own
            assert dev.setpoint_w() == 0.0
            assert (await b.read()).values["setpoint_revert_s"] == 0.0
            hb = dev.point(802, "CtrlHb").value
            assert hb == 2  # the controller heartbeat, bumped after each setpoint
        finally:
            await bus.close()
            await dev.stop()

    run(go())


@pytest.mark.parametrize("power_w", [100_000.0, -50_000.0, 0.0])
def test_124_setpoint_through_the_charge_and_discharge_window(power_w: float) -> None:
    async def go() -> None:
        clock = Clock()
        dev = PysunspecBattery("124", clock=clock)
        _, bus = await _client(dev)
        try:
            b = SunSpecBattery(bus, 2)
            w = await b.write_setpoint(power_w, 4.0)
            assert w.model == 124 and w.read_back
            assert all(x.refused is None for x in dev.writes)
            assert dev.setpoint_w() == pytest.approx(power_w, abs=5.0)  # 0.01 % of 500 kW
            clock.t += 5.0
            assert dev.setpoint_w() == 0.0  # InOutWRte_RvrtTms passed: back to the device's own limits
        finally:
            await bus.close()
            await dev.stop()

    run(go())


def test_a_meter_at_base_50000_is_found_with_no_base_configured() -> None:
    async def go() -> None:
        dev = PysunspecMeter(12345, w_sf=2, base=50000)
        _, bus = await _client(dev)
        try:
            m = SunSpecMeter(bus, 1)
            r = await m.read()
            assert r.ok, r.error
            assert r.values["power_w"] == 1_234_500.0 and r.values["freq_hz"] == 60.0
            assert m.found_base == 50000 and m.identity["Mn"] == "pysunspec2-built"
        finally:
            await bus.close()
            await dev.stop()

    run(go())


def test_the_daemon_drives_a_pysunspec2_battery(tmp_path: Path) -> None:
    """The whole daemon, from a config with no SunSpec base, against a meter at 50000 and a battery laid out by
    pysunspec2, and GPU caps through the agent: the power the battery holds is the one the daemon decided, and it
    returns to 0 W on its own after `battery_revert_s` once the daemon dies without a last write."""
    from dimmer.daemon.agent import CapAgent
    from dimmer.daemon.config import validate_config
    from dimmer.daemon.loop import Daemon
    from dimmer.daemon.nvml import SimulatedGpus

    async def go() -> None:
        meter = PysunspecMeter(12000, w_sf=2, base=50000, unit=1)  # 1.2 MW against a 1 MW limit
        battery = PysunspecBattery("704", unit=2, soc_raw=600, soc_sf=-1, w_raw=0, wset_sf=0)
        meter_port, battery_port = await meter.start(), await battery.start()
        gpus = SimulatedGpus(4, demand_w=1000.0)
        agent = CapAgent(gpus, safe_cap_w=840.0, period_s=0.05)
        agent_port = await agent.start("127.0.0.1", 0)
        raw = {
            "site": {
                "gpu": "gb300",
                "gpus_per_rack": 4,
                "active_gpus_per_rack": 4,
                "spare_rack_frac": 0.0,
                "pcc": {"limit_mw": 1.0},
                "levels": [{"level": "row", "count": 1, "rating_kw": 100}, {"level": "rack", "count": 1}],
                "storage": {"bess": {"power_mw": 0.5, "energy_mwh": 0.25}},
            },
            "jobs": [{"name": "j", "gpus": 4}],
            "devices": [
                {"kind": "meter", "host": "127.0.0.1", "port": meter_port, "unit": 1, "timeout_s": 0.5},
                {"kind": "battery", "host": "127.0.0.1", "port": battery_port, "unit": 2, "timeout_s": 0.5},
                {
                    "kind": "racks",
                    "host": "127.0.0.1",
                    "port": agent_port,
                    "unit": 1,
                    "first_rack": 0,
                    "n_racks": 1,
                    "timeout_s": 0.5,
                },
            ],
            "safety": {"stale_s": 2.0, "lease_s": 2.0, "battery_revert_s": 1.0},
            "daemon": {"period_s": 0.1, "metrics_address": ""},
        }
        cfg = validate_config(raw, "pysunspec2.toml", tmp_path)
        decided: list[float] = []
        socs: list[float] = []

        def seen(res: object) -> None:
            decided.append(float(res.actions.bess_setpoint_w))  # type: ignore[attr-defined]
            socs.append(float(res.obs.bess_soc_frac))  # type: ignore[attr-defined]

        d = Daemon(cfg, metrics_address=None, on_cycle=seen)
        runner = asyncio.create_task(d.run())
        ticker = asyncio.create_task(agent.run())
        try:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if len(decided) >= 8:
                    break
            assert len(decided) >= 8
            assert socs[-1] == pytest.approx(0.6)  # 600 x 10^-1 % read through 802 SoC_SF
            assert max(decided) > 50e3  # the meter is over the limit: the battery discharges (+)
            d.request_stop(write_safe=False)  # the daemon dies: no last write
            await runner
            held = battery.setpoint_w()
            assert held == pytest.approx(decided[-1], abs=1.0)  # what the device holds is what was decided
            assert held > 0
            await asyncio.sleep(1.6)  # > battery_revert_s (1 s, rounded up) with no write
            assert battery.setpoint_w() == 0.0
            assert not any(w.refused for w in battery.writes)
            writable = battery.writable
            assert all(a in writable for w in battery.writes for a in range(w.address, w.address + len(w.words)))
        finally:
            if not runner.done():
                d.request_stop()
                await runner
            agent.request_stop()
            await ticker
            await meter.stop()
            await battery.stop()
        assert np.all(np.isfinite(decided)) and not math.isnan(held)

    run(go())
