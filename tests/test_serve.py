"""The plant served over Modbus TCP on loopback: read back, caps, leases, the battery, refusals, other clients."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from dimmer.cli import sim_config
from dimmer.daemon import registers as R
from dimmer.daemon.bus import DeviceRefused, ModbusTcpBus, WriteNotAllowed
from dimmer.daemon.config import validate_config
from dimmer.daemon.devices import RackDevice, SiteDevice, SunSpecBattery, SunSpecMeter
from dimmer.daemon.handles import build_devices, note_reading, tcp_bus_factory
from dimmer.daemon.observe import ObservationBuilder, Snapshot
from gridsim.engine import run as run_in_process
from gridsim.metrics import summarize
from gridsim.scenario import LoadedScenario, load_scenario
from gridsim.serve import BATTERY_MODELS, SUNSPEC_BASE, PlantServer, fallback_cap_w, main_serve
from gridsim.serve.maps import LEASE_AT, RackDevices, cap_settle_s

# 8 GB300 NVL72 racks in one row rated 900 kW (peak draw ~870 kW: no trip hands-off), one 448-GPU job
SCENARIO = """
name = "eight-racks"
seed = 3
duration_s = {duration}

[site]
gpu = "gb300"
gpus_per_rack = 72
active_gpus_per_rack = 64
spare_rack_frac = 0.02

[site.pcc]
limit_mw = 1.2
ramp_mw_per_min = 0.5
ramp_window_s = 60

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
TIMING_KEYS = {"controller", "controller_step_ms_p50", "controller_step_ms_p99", "sim_speed_x_realtime"}


def scenario(tmp_path: Path, duration: float = 40.0) -> LoadedScenario:
    p = tmp_path / "eight.toml"
    p.write_text(SCENARIO.format(duration=duration))
    return load_scenario(p)


def serve(loaded: LoadedScenario, body: Callable[[PlantServer], Awaitable[Any]], **kw: Any) -> Any:
    """Run `body(server)` against a started server; always stop it; bounded in wall time."""

    async def go() -> Any:
        srv = PlantServer(loaded, **kw)
        await srv.start()
        try:
            return await asyncio.wait_for(body(srv), 20)
        finally:
            await srv.stop()

    return asyncio.run(go())


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


# A write lands at the next control period, the plant observes its effect one period later, and the GPUs settle
# with a 0.3 s first-order lag (gridsim.plant.gpu): 3.5 plant seconds after a write its cap is in force to 0.1 %.
SETTLE_S = 3.5


async def settled(srv: PlantServer, t_write: float) -> Any:
    await until(lambda: srv.last_obs is not None and srv.last_obs.t_s >= t_write + SETTLE_S)
    return srv.last_obs


def devices(srv: PlantServer, bus: ModbusTcpBus) -> tuple[SunSpecMeter, SunSpecBattery, SiteDevice, RackDevice]:
    m = srv.device_map()
    site, rack = m["devices"][2], m["devices"][3]
    return (
        SunSpecMeter(bus, m["devices"][0]["unit"]),
        SunSpecBattery(bus, m["devices"][1]["unit"]),
        SiteDevice(bus, site["unit"], site["n_domains"], site["n_jobs"]),
        RackDevice(bus, rack["unit"], rack["first_rack"], rack["n_racks"]),
    )


def test_device_map(tmp_path: Path) -> None:
    srv = PlantServer(scenario(tmp_path))
    m = srv.device_map()
    assert [(d["kind"], d["unit"]) for d in m["devices"]] == [
        ("sunspec-meter", 1),
        ("sunspec-battery", 2),
        ("site", 3),
        ("rack", 10),
    ]
    assert m["devices"][3] | {} == {"name": "racks-0", "kind": "rack", "unit": 10, "first_rack": 0, "n_racks": 8}
    assert m["host"] == "127.0.0.1" and json.loads(json.dumps(m)) == m  # plain data


def test_units_for_a_large_site(tmp_path: Path) -> None:
    big = load_scenario(Path(__file__).resolve().parents[1] / "scenarios" / "swing-8k.toml")
    srv = PlantServer(big)
    racks = [d for d in srv.device_map()["devices"] if d["kind"] == "rack"]
    n = big.site().n_racks
    assert len(racks) == math.ceil(n / 64) and racks[-1]["unit"] == 10 + len(racks) - 1
    assert sum(d["n_racks"] for d in racks) == n and racks[-1]["first_rack"] == 64 * (len(racks) - 1)


def test_a_job_the_scheduler_ended_is_served_as_ended_not_stopped(tmp_path: Path) -> None:
    """A job record carries the job's state over Modbus TCP (dimmer-site-v1, docs/registers.md): a job stopped by
    the scheduler (gridsim's stop event: STOPPING, then DONE) reads as ended, not as a stop that may come back; the
    job beside it as running."""
    p = tmp_path / "two-jobs.toml"
    text = SCENARIO.format(duration=30.0).replace("gpus = 448", "gpus = 256")
    text += '\n[[jobs]]\nname = "eval"\npriority = 2\ngpus = 128\nswing_frac = 0.3\niteration_s = 1.0\n'
    text += '\n[[events]]\nkind = "stop"\nat_s = 2.0\njobs = ["eval"]\n'
    p.write_text(text)
    loaded = load_scenario(p)

    async def body(srv: PlantServer) -> None:
        bus = ModbusTcpBus("127.0.0.1", srv.port)
        site = devices(srv, bus)[2]
        await until(lambda: srv.last_obs is not None and srv.last_obs.t_s >= 4.0, timeout_s=10.0)
        s = await site.read()
        assert s.ok, s.error
        np.testing.assert_array_equal(s.array("job_running"), [1.0, 0.0])
        np.testing.assert_array_equal(s.array("job_ended"), [0.0, 1.0])
        # ... and the daemon's Observation carries it to the controller
        cfg = validate_config(sim_config(loaded.scenario, srv.device_map(), "dimmer", tmp_path, 20.0), "x", tmp_path)
        handles = [h for h in build_devices(cfg, tcp_bus_factory()) if h.kind == "site"]
        r = await handles[0].device.read()
        assert r.ok, r.error
        note_reading(handles[0], r, cfg.config.safety, 20.0)
        obs = ObservationBuilder(cfg, handles, 20.0).build(Snapshot(time.monotonic(), 0.0, (r,), (r.t_s,)))
        assert obs.job_ended is not None
        np.testing.assert_array_equal(obs.job_running, [True, False])
        np.testing.assert_array_equal(obs.job_ended, [False, True])
        await handles[0].device.bus.close()

    serve(loaded, body, speed=20.0)


def test_served_plant_reads_back_its_observation(tmp_path: Path) -> None:
    async def body(srv: PlantServer) -> None:
        bus = ModbusTcpBus("127.0.0.1", srv.port)
        meter, battery, site, rack = devices(srv, bus)
        await until(lambda: srv.update_count >= 3)
        for _ in range(20):  # a read that did not straddle a publication
            r = await rack.read()
            s = await site.read()
            if r.values["update_count"] == s.values["update_count"] == srv.update_count:
                break
        assert r.ok and s.ok, (r.error, s.error)
        obs = srv.published[int(r.values["update_count"])]
        np.testing.assert_allclose(r.array("power_w"), obs.rack_power_w, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r.array("load_w"), obs.rack_load_w, rtol=1e-6, atol=1e-6)
        assert obs.rack_load_peak_w is not None  # in units of 100 W, rounded up: never under the peak drawn
        peak_w = r.array("load_peak_hw") * 100.0
        assert np.all(peak_w >= obs.rack_load_peak_w) and np.all(peak_w < obs.rack_load_peak_w + 100.0)
        np.testing.assert_allclose(r.array("cap_w"), obs.rack_cap_w, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(r.array("bbu_soc_frac"), obs.rack_bbu_soc_frac, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(r.array("energized"), obs.rack_energized.astype(float))
        np.testing.assert_allclose(s.array("domain_power_w"), obs.domain_power_w, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(s.array("domain_limit_w"), obs.domain_limit_w, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(s.array("domain_thermal_frac"), obs.domain_thermal_frac, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(s.array("job_running"), obs.job_running.astype(float))
        assert obs.job_ended is not None
        np.testing.assert_array_equal(s.array("job_ended"), obs.job_ended.astype(float))
        assert s.values["pcc_limit_w"] == obs.pcc_limit_w and s.values["ramp_limit_w_per_min"] == 0.5e6
        assert s.values["grid_freq_hz"] == pytest.approx(obs.grid_freq_hz, abs=1e-4)
        assert r.values["lease_state"] == 0 and r.values["safe_cap_w"] == pytest.approx(srv.safe_cap_w)
        for _ in range(20):  # (the SunSpec devices have no update counter: reads no publication came between)
            last, count = srv.last_obs, srv.update_count
            m, b = await meter.read(), await battery.read()
            if srv.update_count == count:
                break
        assert m.ok and b.ok, (m.error, b.error)
        assert last is not None and srv.update_count == count
        resolution_w = 10.0**srv.meter_sf  # int16 + W_SF
        assert abs(m.values["power_w"] - last.pcc_power_w) <= resolution_w  # type: ignore[operator]
        assert b.values["soc_frac"] == pytest.approx(last.bess_soc_frac, abs=1e-4)
        assert b.values["online"] == 1.0 and b.values["max_discharge_w"] == 0.5e6
        assert meter.identity["Mn"] == "dimmer-gridsim"
        await bus.close()

    serve(scenario(tmp_path), body, speed=20.0)


def test_writing_caps_moves_the_plant_caps(tmp_path: Path) -> None:
    async def body(srv: PlantServer) -> None:
        bus = ModbusTcpBus("127.0.0.1", srv.port)
        _, _, _, rack = devices(srv, bus)
        caps = np.array([600.0, 700.0, 800.0, 900.0, 1000.0, 1100.0, 1200.0, 1300.0])
        t_first = srv.plant_time_s()
        while srv.plant_time_s() < t_first + 6:
            await rack.write(caps, 0.0, np.inf, 2e3, 5.0)
            await asyncio.sleep(0.02)
        obs = srv.last_obs
        assert obs is not None
        np.testing.assert_allclose(obs.rack_cap_w, caps, rtol=1e-6)  # the GPUs enforce what was written
        r = await rack.read()
        np.testing.assert_allclose(r.array("cap_w"), caps, rtol=1e-6)
        assert r.values["lease_state"] == 1.0
        # capped racks draw less than the uncapped peak (1400 W per GPU)
        assert obs.rack_power_w[0] < srv.site.rack_max_w()[0] * 0.7
        assert all(w.unit == 10 and w.refused is None for w in srv.writes)
        await bus.close()

    serve(scenario(tmp_path), body, speed=20.0)


def test_lease_expiry_drops_caps_to_the_safe_cap(tmp_path: Path) -> None:
    loaded = scenario(tmp_path)
    safe = fallback_cap_w(loaded.site())
    assert 600 < safe < 1400  # the row's rating binds: 900 kW for 8 racks

    async def body(srv: PlantServer) -> None:
        bus = ModbusTcpBus("127.0.0.1", srv.port)
        _, _, _, rack = devices(srv, bus)
        await until(lambda: srv.update_count >= 2)
        await rack.write(600.0, 0.0, np.inf, 2e3, 5.0)  # one write, a 5 s lease, then silence
        t_write = srv.plant_time_s()
        obs = await settled(srv, t_write)
        np.testing.assert_allclose(obs.rack_cap_w, 600.0, rtol=2e-3)  # lease held
        assert (await rack.read()).values["lease_state"] == R.LEASE_HELD
        obs = await settled(srv, t_write + 5.0)
        np.testing.assert_allclose(obs.rack_cap_w, safe, rtol=2e-3)  # expired: the device's own safe cap
        r = await rack.read()
        assert r.values["lease_state"] == R.LEASE_EXPIRED and srv.lease_expiries == 1
        await rack.write(700.0, 0.0, np.inf, 2e3, 5.0)  # a new write takes the lease back
        obs = await settled(srv, srv.plant_time_s())
        np.testing.assert_allclose(obs.rack_cap_w, 700.0, rtol=2e-3)
        await bus.close()

    serve(loaded, body, speed=20.0)


def test_a_lapsed_lease_sets_the_safe_cap_first_and_releases_the_bbus_once_it_has_taken_hold(
    tmp_path: Path,
) -> None:
    """On lapse the cap drops at once; the BBUs keep shaving (their last commands) until the GPUs draw the
    fallback cap, then go backup only and recharge at their rating."""
    loaded = scenario(tmp_path)
    site = loaded.site()
    settle_s = cap_settle_s(loaded.scenario)
    assert settle_s == pytest.approx(7.0 * loaded.scenario.gpu.tau_s)  # in band, no actuation latency
    oob = loaded.scenario.model_copy(update={"gpu": loaded.scenario.gpu.model_copy(update={"path": "oob"})})
    assert cap_settle_s(oob) == loaded.scenario.gpu.oob_delay_s
    racks = RackDevices(site, 800.0, settle_s)
    nr = int(racks.count[0])
    img = racks.images[0]
    words = np.asarray(img.words, dtype=np.int64)
    words[LEASE_AT : LEASE_AT + 2] = R.encode_float32([5.0])
    cmds = {"cap_w": 1200.0, "floor_w": 0.0, "bbu_threshold_w": 90e3, "bbu_recharge_w": 1e3}
    cmd = R.encode_records(R.RACK_COMMAND, cmds, nr, R.RACK_CMD_STRIDE)
    words[R.RACK_CMD_BASE : R.RACK_CMD_BASE + len(cmd)] = cmd
    assert racks.write(0, LEASE_AT, words[LEASE_AT : R.rack_cmd_address(nr)].tolist(), 10.0) is None

    def in_force(t_s: float) -> tuple[npt.NDArray[np.float64], ...]:
        racks.update_leases(t_s)
        return racks.commands()

    cap, _, thr, rec = in_force(14.9)  # held
    assert np.all(cap == 1200.0) and np.all(thr == 90e3) and np.all(rec == 1e3)
    cap, floor, thr, rec = in_force(15.1)  # lapsed: the cap at once, the BBUs still as told
    assert np.all(cap == 800.0) and np.all(floor == 0.0) and np.all(thr == 90e3) and np.all(rec == 1e3)
    assert racks.lease_expiries == 1
    cap, _, thr, rec = in_force(15.0 + settle_s + 0.1)  # the cap has taken hold: backup only
    assert np.all(cap == 800.0) and np.all(np.isinf(thr))
    np.testing.assert_array_equal(rec, racks.hands.rack_bbu_recharge_w)
    assert racks.lease_expiries == 1


def test_battery_setpoint_and_reversion(tmp_path: Path) -> None:
    async def body(srv: PlantServer) -> None:
        bus = ModbusTcpBus("127.0.0.1", srv.port)
        _, battery, _, _ = devices(srv, bus)
        await until(lambda: srv.update_count >= 2)
        await battery.write_setpoint(-200e3, 4.0)  # charge at 200 kW; revert to 0 W after 4 s without a write
        t = srv.plant_time_s()
        await until(lambda: srv.last_obs is not None and srv.last_obs.t_s >= t + 2.5)
        assert srv.last_obs is not None
        assert srv.last_obs.bess_power_w == pytest.approx(-200e3, rel=0.05)
        b = await battery.read()
        assert b.values["power_w"] == pytest.approx(-200e3, rel=0.05)
        assert 0 < b.scalar("setpoint_revert_s") <= 4
        await until(lambda: srv.last_obs is not None and srv.last_obs.t_s >= t + 8)
        assert abs(srv.last_obs.bess_power_w) < 5e3  # reverted to 0 W (first-order response)
        await bus.close()

    serve(scenario(tmp_path), body, speed=20.0)


def test_refused_writes_apply_nothing_and_are_recorded(tmp_path: Path) -> None:
    async def body(srv: PlantServer) -> None:
        bus = ModbusTcpBus("127.0.0.1", srv.port)
        _, battery, _, rack = devices(srv, bus)
        nan_caps = np.array([800.0] * 7 + [math.nan])
        with pytest.raises(WriteNotAllowed):  # the daemon's device sends no NaN cap at all
            await rack.write(nan_caps, 0.0, np.inf, 0.0, 3.0)
        assert srv.writes == []
        # forged on the wire, the served device refuses it
        cmds = {"cap_w": nan_caps, "floor_w": np.zeros(8), "bbu_threshold_w": np.full(8, np.inf)}
        cmds["bbu_recharge_w"] = np.zeros(8)
        words = R.encode_float32(3.0) + R.encode_uint32(1) + R.encode_records(R.RACK_COMMAND, cmds, 8, 8)
        with pytest.raises(DeviceRefused) as e:
            await bus.write(10, R.RACK_HEADER.field("lease_s").offset, words)
        assert e.value.code == 3
        assert np.all(srv.cmd_cap_w == srv.site.gpu.rated_w)  # nothing of it applied
        with pytest.raises(DeviceRefused) as e:
            await bus.write(3, 8, [0, 0])  # the site device is read only
        assert e.value.code == 2
        with pytest.raises(DeviceRefused) as e:
            await bus.write(10, 528, [0, 0])  # status records are read only
        assert e.value.code == 2
        with pytest.raises(DeviceRefused) as e:
            await battery.write_setpoint(2e6, 5.0)  # beyond the battery's 0.5 MW
        assert e.value.code == 3
        srv.refuse_writes(10, 4)
        with pytest.raises(DeviceRefused) as e:
            await rack.write(800.0, 0.0, np.inf, 0.0, 3.0)
        assert e.value.code == 4
        srv.refuse_writes(10, None)
        await rack.write(800.0, 0.0, np.inf, 0.0, 3.0)
        # the battery's first request (WSetEnaRvrt, WSetRvrtTms) is in range: accepted; its setpoint is not
        assert [w.refused for w in srv.writes] == [3, 2, 2, None, 3, 4, None]
        await bus.close()

    serve(scenario(tmp_path), body, speed=20.0)


def test_the_write_history_is_bounded_and_the_counts_are_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A days-long served run must not grow with every write: the latest writes are kept, every one is counted."""
    import gridsim.serve.plant

    monkeypatch.setattr(gridsim.serve.plant, "WRITES_KEPT", 4)

    async def body(srv: PlantServer) -> None:
        bus = ModbusTcpBus("127.0.0.1", srv.port)
        _, _, _, rack = devices(srv, bus)
        for i in range(11):
            await rack.write(800.0 + i, 0.0, np.inf, 0.0, 3.0)
        srv.refuse_writes(10, 4)
        with pytest.raises(DeviceRefused):
            await rack.write(700.0, 0.0, np.inf, 0.0, 3.0)
        assert srv.n_writes == 12 and srv.n_writes_refused == 1
        assert 4 <= len(srv.writes) < 8  # the latest, oldest dropped in halves
        assert [w.refused for w in srv.writes[-2:]] == [None, 4]
        assert srv.writes == sorted(srv.writes, key=lambda w: w.t_wall_s)
        await bus.close()

    serve(scenario(tmp_path), body, speed=20.0)


def test_an_unwritten_served_plant_is_the_hands_off_plant(tmp_path: Path) -> None:
    """Nobody writes: the served run is exactly the in-process run with no controller (engine unchanged)."""
    loaded = scenario(tmp_path, duration=30.0)

    async def body(srv: PlantServer) -> PlantServer:
        assert await srv.wait(15)
        return srv

    srv = serve(loaded, body, speed=1e6)
    assert srv.error is None and srv.summary is not None and srv.writes == []
    ref = summarize(run_in_process(loaded, controller="none"))
    for k in ref:
        if k not in TIMING_KEYS:
            assert srv.summary[k] == ref[k], k
    assert srv.summary["controller"] == "daemon"


def test_fault_injection_restart_stall_and_battery_offline(tmp_path: Path) -> None:
    async def body(srv: PlantServer) -> None:
        bus = ModbusTcpBus("127.0.0.1", srv.port, timeout_s=0.2, retries=0, backoff_s=0.05)
        _, battery, site, rack = devices(srv, bus)
        await until(lambda: srv.update_count >= 2)
        assert (await rack.read()).ok
        # the server dies and comes back on the same port; the plant keeps running meanwhile
        await srv.pause_network()
        r = await rack.read()
        assert not r.ok and np.all(np.isnan(r.array("power_w")))
        before = srv.update_count
        await srv.resume_network()
        await until(lambda: srv.update_count >= before + 2)
        await asyncio.sleep(0.1)  # past the bus's backoff
        r = await rack.read()
        assert r.ok, r.error
        assert r.values["update_count"] >= before + 2
        # a device that stops updating keeps answering, with a counter that no longer moves
        srv.stall(10)
        first = (await rack.read()).scalar("update_count")
        await until(lambda: srv.update_count >= first + 3)
        assert (await rack.read()).values["update_count"] == first
        assert (await site.read()).scalar("update_count") >= first + 3
        srv.stall(10, False)
        # the battery drops off line
        srv.set_battery_online(False)
        await until(lambda: srv.last_obs is not None and not srv.last_obs.bess_online)
        await asyncio.sleep(0.1)
        b = await battery.read()
        assert b.ok and b.values["online"] == 0.0
        assert math.isnan(b.scalar("soc_frac"))  # unknown, not zero
        await bus.close()

    serve(scenario(tmp_path), body, speed=20.0)


def test_hold_until_first_write_waits_for_every_rack_device_and_the_battery_setpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held at the first control point, the plant starts when every rack device and the battery's setpoint are
    in: not at the daemon's first battery request (the reversion points), which comes before its setpoint."""
    import gridsim.serve.worker

    monkeypatch.setattr(gridsim.serve.worker, "HOLD_GRACE_WALL_S", 30.0)  # no start on the grace period here

    async def body(srv: PlantServer) -> None:
        bus = ModbusTcpBus("127.0.0.1", srv.port)
        _, battery, _, rack = devices(srv, bus)
        await until(lambda: srv.update_count >= 1)
        period = srv.loaded.scenario.engine.control_period_s
        await rack.write(800.0, 0.0, np.inf, 0.0, 30.0)
        at704 = SUNSPEC_BASE + R.model_offsets(list(BATTERY_MODELS))[704]
        revert = R.encode_block(R.MODEL_704, {"WSetEnaRvrt": 1, "WSetRvrtTms": 10})[30:33]
        await bus.write(2, at704 + 30, revert)  # the daemon's first battery request
        await asyncio.sleep(0.2)
        assert srv.holding and srv.plant_time_s() == period and srv.update_count == 1
        await battery.write_setpoint(-100e3, 10.0)
        await until(lambda: not srv.holding)
        assert [w.t_plant_s for w in srv.writes[:3]] == [period] * 3
        obs = await settled(srv, period)
        assert obs.bess_power_w == pytest.approx(-100e3, rel=0.05)
        await bus.close()

    serve(scenario(tmp_path), body, speed=20.0, hold_until_first_write=True)


# -- other Modbus implementations -----------------------------------------------------------------------------


def _mbap(tid: int, unit: int, pdu: bytes) -> bytes:
    return struct.pack(">HHHB", tid, 0, len(pdu) + 1, unit) + pdu


def _transact(sock: socket.socket, tid: int, unit: int, pdu: bytes) -> bytes:
    sock.sendall(_mbap(tid, unit, pdu))
    head = b""
    while len(head) < 7:
        head += sock.recv(7 - len(head))
    rtid, proto, length, runit = struct.unpack(">HHHB", head)
    assert (rtid, proto, runit) == (tid, 0, unit)
    body = b""
    while len(body) < length - 1:
        body += sock.recv(length - 1 - len(body))
    return body


def test_a_hand_written_modbus_client_reads_the_meter_and_writes_a_cap(tmp_path: Path) -> None:
    """MBAP header + function 3 / 16 by hand with struct: nothing of pymodbus on the client side."""

    def client(port: int) -> tuple[list[int], list[int], bytes, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            r = _transact(s, 1, 1, struct.pack(">BHH", 3, 40000, 2))  # "SunS"
            marker = list(struct.unpack(">BB2H", r)[2:])
            r = _transact(s, 2, 1, struct.pack(">BHH", 3, 40070, 23))  # model 203 from its ID register
            fc, nbytes = struct.unpack(">BB", r[:2])
            assert (fc, nbytes) == (3, 46)
            meter = list(struct.unpack(">23H", r[2:]))
            # lease 30 s, heartbeat 1, rack 0: cap 900 W, floor 0, BBU threshold +inf, recharge 1 kW
            regs = struct.pack(">fIffff", 30.0, 1, 900.0, 0.0, math.inf, 1000.0)
            pdu = struct.pack(">BHHB", 16, 12, len(regs) // 2, len(regs)) + regs
            ok = _transact(s, 3, 10, pdu)
            bad = _transact(s, 4, 10, struct.pack(">BHHB", 16, 16, 2, 4) + struct.pack(">f", math.nan))
            return marker, meter, ok, bad

    async def body(srv: PlantServer) -> None:
        await until(lambda: srv.update_count >= 2)
        marker, meter, ok, bad = await asyncio.to_thread(client, srv.port)
        assert marker == [0x5375, 0x6E53]
        assert meter[:2] == [203, 105]
        w_sf = R.decode_sf(meter[22])
        assert w_sf == srv.meter_sf
        w = R.decode_int16([meter[18]])[0] * 10.0**w_sf
        assert srv.last_obs is not None and abs(w - srv.last_obs.pcc_power_w) < 0.2 * srv.last_obs.pcc_power_w
        assert ok == struct.pack(">BHH", 16, 12, 12)  # echo of address and count
        assert bad == struct.pack(">BB", 16 | 0x80, 3)  # exception: illegal data value
        assert srv.cmd_cap_w[0] == 900.0 and srv.cmd_cap_w[1] == srv.site.gpu.rated_w
        obs = await settled(srv, srv.plant_time_s())
        assert obs.rack_cap_w[0] == pytest.approx(900.0, rel=2e-3)
        assert obs.rack_cap_w[1] == srv.site.gpu.rated_w

    serve(scenario(tmp_path), body, speed=20.0)


@pytest.mark.skipif(shutil.which("mbpoll") is None, reason="mbpoll (Debian package mbpoll) is not installed")
def test_mbpoll_reads_the_meter_and_writes_a_cap(tmp_path: Path) -> None:
    def mbpoll(port: int, *args: str) -> str:
        cmd = ["mbpoll", "-m", "tcp", "-p", str(port), "-0", "-1", "-o", "2", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
        return out.stdout

    async def body(srv: PlantServer) -> None:
        await until(lambda: srv.update_count >= 2)
        port = srv.port
        text = await asyncio.to_thread(mbpoll, port, "-a", "1", "-r", "40000", "-c", "2", "-t", "4:hex", "127.0.0.1")
        assert "0x5375" in text and "0x6E53" in text
        text = await asyncio.to_thread(mbpoll, port, "-a", "1", "-r", "40088", "-c", "1", "-t", "4", "127.0.0.1")
        raw = int(text.split("[40088]:")[1].split()[0])
        assert srv.last_obs is not None
        assert abs(raw * 10.0**srv.meter_sf - srv.last_obs.pcc_power_w) < 0.2 * srv.last_obs.pcc_power_w
        # a lease of 30 s, then rack 0's cap, as big-endian-word floats
        await asyncio.to_thread(mbpoll, port, "-a", "10", "-r", "12", "-t", "4:float", "-B", "127.0.0.1", "30")
        await asyncio.to_thread(mbpoll, port, "-a", "10", "-r", "16", "-t", "4:float", "-B", "127.0.0.1", "950")
        assert srv.cmd_cap_w[0] == 950.0 and srv.dev_lease_s[0] == 30.0
        obs = await settled(srv, srv.plant_time_s())
        assert obs.rack_cap_w[0] == pytest.approx(950.0, rel=2e-3)

    serve(scenario(tmp_path), body, speed=20.0)


# -- the command line --------------------------------------------------------------------------------------------


def test_main_serve_runs_and_writes_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario(tmp_path, duration=10.0)
    out = tmp_path / "out"
    code = main_serve([str(tmp_path / "eight.toml"), "--port", "0", "--speed", "1000", "--out", str(out)])
    assert code == 0
    device_map = json.loads(capsys.readouterr().out.splitlines()[0])
    assert device_map["port"] > 0 and device_map["devices"][0]["unit"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["duration_s"] == 10.0 and summary["scenario"] == "eight-racks"
    served = json.loads((out / "serve.json").read_text())
    assert served["writes"] == 0 and served["device_map"]["devices"][3]["n_racks"] == 8
    assert (out / "timeseries.csv").is_file() and (out / "report.md").is_file()


def test_main_serve_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main_serve([str(tmp_path / "missing.toml"), "--port", "0"]) == 2
    assert "missing.toml" in capsys.readouterr().err
    scenario(tmp_path)
    assert main_serve([str(tmp_path / "eight.toml"), "--speed", "0"]) == 2
    assert "speed" in capsys.readouterr().err


def test_main_serve_connection_limits_are_vetted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario(tmp_path)
    for opt, bad in (("--max-connections", "0"), ("--max-connections", "100000"), ("--idle-timeout-s", "nan"),
                     ("--idle-timeout-s", "0"), ("--idle-timeout-s", "inf")):  # fmt: skip
        assert main_serve([str(tmp_path / "eight.toml"), "--port", "0", opt, bad]) == 2, (opt, bad)
        err = capsys.readouterr().err
        assert err.startswith(f"gridsim: {opt}: ") and err.count("\n") == 1, err
