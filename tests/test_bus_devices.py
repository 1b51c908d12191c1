"""The register bus over real TCP against a pymodbus server, and the devices on an in-memory bus."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from dimmer.daemon import registers as R
from dimmer.daemon.bus import (
    DeviceError,
    DeviceReadOnly,
    DeviceRefused,
    DeviceUnreachable,
    InMemoryBus,
    ModbusTcpBus,
    RegisterBus,
)
from dimmer.daemon.devices import RackDevice, SiteDevice, SunSpecBattery, SunSpecMeter

# -- a pymodbus server to talk to ---------------------------------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.reads = 0
        self.writes = 0
        self.refuse_value_at: int | None = None


@contextlib.asynccontextmanager
async def modbus_server(port: int = 0, counter: Counter | None = None) -> AsyncIterator[int]:
    """Unit 1: holding registers 0..999 writable, 1000..1009 read-only; yields the bound port."""
    from pymodbus.constants import ExcCodes
    from pymodbus.server import ModbusTcpServer
    from pymodbus.simulator import DataType, SimData, SimDevice

    c = counter or Counter()

    async def action(fc: int, start: int, address: int, count: int, regs: list[int], values: Any) -> Any:
        if values is None:
            c.reads += 1
            return None
        c.writes += 1
        if c.refuse_value_at is not None and address <= c.refuse_value_at < address + count:
            return ExcCodes.ILLEGAL_VALUE
        return None

    dev = SimDevice(
        1,
        simdata=[
            SimData(0, count=1000, values=0, datatype=DataType.REGISTERS),
            SimData(1000, count=10, values=7, datatype=DataType.REGISTERS, readonly=True),
        ],
        action=action,
    )
    server = ModbusTcpServer([dev], address=("127.0.0.1", port))
    await server.serve_forever(background=True)
    try:
        transport: Any = server.transport
        yield int(transport.sockets[0].getsockname()[1])
    finally:
        await server.shutdown()
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[tuple[int, list[int]]]:
    """Accepts connections and requests, never answers; yields (port, [requests seen])."""
    seen = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(12):  # a read request is 12 bytes
                seen[0] += 1
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


# -- ModbusTcpBus --------------------------------------------------------------------------------------------------


def test_tcp_bus_is_a_register_bus_and_splits_large_requests() -> None:
    async def go() -> None:
        c = Counter()
        async with modbus_server(counter=c) as port:
            bus = ModbusTcpBus("127.0.0.1", port)
            assert isinstance(bus, RegisterBus)
            values = [(i * 7919) & 0xFFFF for i in range(300)]
            await bus.write(1, 100, values)
            assert c.writes == 3  # 300 registers in writes of at most 122 (the protocol allows 123)
            assert await bus.read(1, 100, 300) == values
            assert c.reads == 3  # 124 + 124 + 52 (the protocol allows 125)
            assert await bus.read(1, 1000, 2) == [7, 7]
            await bus.close()

    run(go())


def test_tcp_bus_translates_exception_replies_without_retrying() -> None:
    async def go() -> None:
        c = Counter()
        async with modbus_server(counter=c) as port:
            bus = ModbusTcpBus("127.0.0.1", port, retries=2)
            with pytest.raises(DeviceRefused) as e:
                await bus.write(1, 1000, [1])  # read-only
            assert e.value.code == 2 and isinstance(e.value, DeviceError)
            with pytest.raises(DeviceRefused) as e:
                await bus.read(1, 2000, 4)  # not mapped
            assert e.value.code == 2
            c.refuse_value_at = 5
            writes = c.writes
            with pytest.raises(DeviceRefused) as e:
                await bus.write(1, 0, [1] * 10)
            assert e.value.code == 3 and "illegal data value" in str(e.value)
            assert c.writes == writes + 1  # an answer is not retried
            assert await bus.read(1, 0, 1) == [0]  # and the connection is still fine
            await bus.close()

    run(go())


def test_tcp_bus_times_out_and_retries() -> None:
    async def go() -> None:
        async with silent_server() as (port, seen):
            bus = ModbusTcpBus("127.0.0.1", port, timeout_s=0.1, retries=2, backoff_s=0.02)
            t0 = time.monotonic()
            with pytest.raises(DeviceUnreachable) as e:
                await bus.read(1, 0, 2)
            elapsed = time.monotonic() - t0
            assert seen[0] == 3  # one try and two retries
            assert 0.3 <= elapsed < 1.5  # three timeouts of 0.1 s (+ backoff), not pymodbus's default 3 s
            assert "no reply" in str(e.value)
            await bus.close()

    run(go())


def test_tcp_bus_queued_requests_fail_fast_behind_a_hung_device() -> None:
    """Ten devices read concurrently from a hung endpoint: one request waits out its retries, the rest fail at once."""

    async def go() -> None:
        async with silent_server() as (port, seen):
            bus = ModbusTcpBus("127.0.0.1", port, timeout_s=0.1, retries=1, backoff_s=0.05)
            t0 = time.monotonic()
            results = await asyncio.gather(*(bus.read(u, 0, 2) for u in range(1, 11)), return_exceptions=True)
            elapsed = time.monotonic() - t0
            assert all(isinstance(r, DeviceUnreachable) for r in results), results
            assert seen[0] == 2  # the first request and its retry; the others never went on the wire
            assert elapsed < 0.6  # two timeouts of 0.1 s and a backoff, not 10 x 2 timeouts
            await bus.close()

    run(go())


def test_tcp_bus_dead_endpoint_fails_fast_during_backoff() -> None:
    async def go() -> None:
        async with modbus_server() as port:
            pass  # the port is now closed
        bus = ModbusTcpBus("127.0.0.1", port, timeout_s=0.2, retries=0, backoff_s=0.5)
        with pytest.raises(DeviceUnreachable, match="connection failed"):
            await bus.read(1, 0, 1)
        t0 = time.monotonic()
        with pytest.raises(DeviceUnreachable, match="next connection attempt"):
            await bus.read(1, 0, 1)
        assert time.monotonic() - t0 < 0.05  # no connection attempt while backing off
        await bus.close()

    run(go())


def test_tcp_bus_reconnects_after_the_server_restarts() -> None:
    async def go() -> None:
        async with modbus_server() as port:
            bus = ModbusTcpBus("127.0.0.1", port, timeout_s=0.2, retries=1, backoff_s=0.05)
            await bus.write(1, 0, [42])
            assert await bus.read(1, 0, 1) == [42]
        with pytest.raises(DeviceUnreachable):
            await bus.read(1, 0, 1)
        assert not bus.connected
        async with modbus_server(port) as port2:
            assert port2 == port
            await asyncio.sleep(0.3)  # past the backoff
            assert await bus.read(1, 0, 1) == [0]  # a fresh server, reached through a fresh connection
            assert bus.reconnects >= 1 and bus.connected
        await bus.close()

    run(go())


# -- devices on an in-memory bus ---------------------------------------------------------------------------------


def meter_bus(base: int = 40000, model: R.Block = R.MODEL_203) -> InMemoryBus:
    vals: dict[str, Any] = {"W": 12_345_000.0, "W_SF": 3, "Hz": 59.98, "Hz_SF": -2}
    if model is R.MODEL_213:
        vals = {"W": 12_345_678.0, "Hz": 59.98}
    bus = InMemoryBus()
    bus.set_words(7, base, R.sunspec_image([(R.MODEL_1, {"Mn": "ACME", "SN": "m-1"}), (model, vals)]))
    return bus


def test_meter_reads_power_and_frequency_in_one_request() -> None:
    async def go() -> None:
        bus = meter_bus()
        m = SunSpecMeter(bus, 7)
        r = await m.read()
        assert r.ok and r.values["power_w"] == 12_345_000.0 and r.values["freq_hz"] == pytest.approx(59.98)
        assert m.identity == {"Mn": "ACME", "Md": None, "SN": "m-1"}
        before = bus.reads
        r2 = await m.read()
        assert bus.reads - before == 1 and r2.t_s >= r.t_s
        assert m.read_only

    run(go())


@pytest.mark.parametrize("base", [0, 50000])
def test_meter_discovers_the_marker_and_float_model(base: int) -> None:
    async def go() -> None:
        r = await SunSpecMeter(meter_bus(base, R.MODEL_213), 7).read()  # no base: 40000, then 0, then 50000
        assert r.ok and r.values["power_w"] == pytest.approx(12_345_678.0)
        r = await SunSpecMeter(meter_bus(base, R.MODEL_213), 7, base=40000).read()  # looks at 40000 only
        assert not r.ok and "refused" in (r.error or "")
        assert math.isnan(r.scalar("power_w"))

    run(go())


def test_meter_finds_its_model_again_after_the_device_changed() -> None:
    async def go() -> None:
        bus = meter_bus()
        m = SunSpecMeter(bus, 7)
        assert (await m.read()).ok
        # the device is reconfigured: a longer common block moves model 203 along
        img = R.sunspec_image(
            [(R.MODEL_1, {}), (R.MODEL_713, {}), (R.MODEL_203, {"W": -5000.0, "W_SF": 0, "Hz_SF": -2})]
        )
        bus.set_words(7, 40000, img)
        r = await m.read()
        assert not r.ok and "model 203 expected" in (r.error or "")
        r = await m.read()
        assert r.ok and r.values["power_w"] == -5000.0

    run(go())


def battery_bus() -> InMemoryBus:
    bus = InMemoryBus()
    img = R.sunspec_image(
        [
            (R.MODEL_1, {"Mn": "ACME"}),
            (R.MODEL_701, {"W": -1_500_000.0, "W_SF": 3, "ConnSt": CONNECTED, "St": ON}),
            (R.MODEL_704, {"WSet_SF": 1, "WSetRvrtRem": 3}),
            (
                R.MODEL_802,
                {"SoC": 61.25, "SoC_SF": -2, "WChaRteMax": 6e6, "WDisChaRteMax": 5e6, "WChaDisChaMax_SF": 3},
            ),
        ]
    )
    bus.set_words(2, 40000, img)
    img802 = R.model_offsets([R.MODEL_1, R.MODEL_701, R.MODEL_704, R.MODEL_802])[802]
    bus.set_words(2, 40000 + img802 + R.MODEL_802.offset("State"), [R.BATTERY_CONNECTED])
    return bus


CONNECTED, ON = R.symbol(701, "ConnSt", "CONNECTED"), R.symbol(701, "St", "ON")


def test_battery_reads_power_soc_limits_and_state() -> None:
    async def go() -> None:
        b = SunSpecBattery(battery_bus(), 2)
        r = await b.read()
        assert r.ok, r.error
        v = r.values
        assert v["power_w"] == -1_500_000.0  # charging
        assert v["soc_frac"] == pytest.approx(0.6125)
        assert (v["max_charge_w"], v["max_discharge_w"]) == (6e6, 5e6)
        assert v["online"] == 1.0 and v["setpoint_revert_s"] == 3.0

    run(go())


def test_battery_setpoint_writes_two_writable_spans_reads_back_then_the_heartbeat() -> None:
    async def go() -> None:
        bus = battery_bus()
        b = SunSpecBattery(bus, 2)
        w = await b.write_setpoint(-2_345_670.0, 4.2)
        await b.write_setpoint(1000.0, 4.2)
        at = 40000 + R.model_offsets([R.MODEL_1, R.MODEL_701, R.MODEL_704, R.MODEL_802])[704]
        # the published 704 layout: WSetEnaRvrt +30, WSetRvrtTms +31 (uint32); WSetEna +22 .. WSetRvrt +26 (int32)
        (u1, a1, w1), (u2, a2, w2), (u3, a3, w3) = bus.writes[:3]
        assert (u1, a1, len(w1)) == (2, at + 30, 3) and w1 == [1, 0, 5]  # ENABLED, 5 s (rounded up)
        assert (u2, a2, len(w2)) == (2, at + 22, 6) and w2[:2] == [1, 1]  # ENABLED, WATTS (0-based)
        assert R.decode_int32(w2[2:4])[0] * 10 == -2_345_670.0  # scaled by the device's WSet_SF = 1 (at +55)
        assert R.decode_int32(w2[4:6])[0] == 0.0  # reverts to 0 W
        v = R.decode_block(R.MODEL_704, bus.get_words(2, at, R.MODEL_704.length))
        assert v["WSet"] == 1000.0 and math.isnan(v["WSetPct"])  # type: ignore[arg-type]  # never written
        at802 = 40000 + R.model_offsets([R.MODEL_1, R.MODEL_701, R.MODEL_704, R.MODEL_802])[802]
        assert (u3, a3, w3) == (2, at802 + 19, [1])
        assert bus.writes[5][2] == [2]  # heartbeat bumped again
        # no request touches a read-only point (WSetRvrtRem at +33, the scale factors)
        for _, a, words in bus.writes:
            assert R.span_allowed(b.writable_spans(), a, len(words))
        assert w.model == 704 and w.scale_factor == 1 and w.read_back
        assert w.as_audit()["requests"] == [{"address": at + 30, "words": w1}, {"address": at + 22, "words": w2}]
        with pytest.raises(ValueError):
            await b.write_setpoint(math.nan, 5)

    run(go())


def test_battery_setpoint_that_does_not_read_back_is_an_error() -> None:
    """A device that stores something else than what was written (a clamp, a stuck register) is not trusted."""

    class ClampingBus(InMemoryBus):
        async def write(self, unit: int, address: int, values: list[int]) -> None:
            await super().write(unit, address, [min(v, 100) for v in values])

    async def go() -> None:
        bus = ClampingBus()
        bus.set_words(2, 40000, battery_bus().get_words(2, 40000, 400))
        with pytest.raises(DeviceError, match="read back"):
            await SunSpecBattery(bus, 2).write_setpoint(50_000.0, 5)

    run(go())


def test_a_draft_layout_of_704_is_refused_not_misread() -> None:
    """The 2020 draft of 704 had L = 69: its WSet_SF sat where the published model keeps PFWInj.PF."""

    async def go() -> None:
        bus = InMemoryBus()
        draft = R.encode_block(R.MODEL_704, {"WSet_SF": 0})[2:] + [0xFFFF] * 4
        img = R.sunspec_image([(R.MODEL_1, {}), (R.MODEL_701, {"W_SF": 0})])[:-2]
        img += [704, 69, *draft, 0xFFFF, 0]
        bus.set_words(2, 40000, img)
        r = await SunSpecBattery(bus, 2).read()
        assert not r.ok and "model 704 has L = 69" in (r.error or "") and "L = 65" in (r.error or "")
        with pytest.raises(R.DecodeError):
            await SunSpecBattery(bus, 2).write_setpoint(1.0, 5)
        assert bus.writes == []

    run(go())


def test_battery_enums_are_the_published_ones() -> None:
    """701 ConnSt CONNECTED is 1 and DISCONNECTED 0 (the 2020 draft: 2 and 1): a connected battery is on line."""

    async def go() -> None:
        bus = battery_bus()
        at = 40000 + R.model_offsets([R.MODEL_1, R.MODEL_701])[701]
        b = SunSpecBattery(bus, 2)
        assert (await b.read()).values["online"] == 1.0
        bus.set_words(2, at + R.MODEL_701.offset("ConnSt"), [R.symbol(701, "ConnSt", "DISCONNECTED")])
        assert (await b.read()).values["online"] == 0.0
        bus.set_words(2, at + R.MODEL_701.offset("ConnSt"), [CONNECTED])
        bus.set_words(2, at + R.MODEL_701.offset("St"), [R.symbol(701, "St", "OFF")])
        assert (await b.read()).values["online"] == 0.0

    run(go())


def test_713_soc_uses_its_scale_factor() -> None:
    """713 SoC is scaled by Pct_SF (at +8: L = 7): SoC 612 with Pct_SF -1 is 61.2 %, not NaN and not 612 %."""

    async def go() -> None:
        bus = InMemoryBus()
        img = R.sunspec_image(
            [
                (R.MODEL_1, {}),
                (R.MODEL_701, {"W": 0.0, "W_SF": 0, "ConnSt": CONNECTED, "St": ON}),
                (R.MODEL_713, {"SoC": 61.2, "Pct_SF": -1}),
            ]
        )
        bus.set_words(2, 40000, img)
        r = await SunSpecBattery(bus, 2).read()
        assert r.ok, r.error
        assert r.values["soc_frac"] == pytest.approx(0.612) and r.values["online"] == 1.0

    run(go())


def test_read_only_devices_send_nothing() -> None:
    async def go() -> None:
        bus = battery_bus()
        with pytest.raises(DeviceReadOnly):
            await SunSpecBattery(bus, 2, read_only=True).write_setpoint(1.0, 5)
        rack = RackDevice(bus, 2, 0, 4, read_only=True)
        with pytest.raises(DeviceReadOnly):
            await rack.write(800.0, 0.0, math.inf, 1e3, 3.0)
        assert bus.writes == []

    run(go())


def rack_bus(n: int = 5, first: int = 64) -> InMemoryBus:
    bus = InMemoryBus()
    hdr = R.encode_block(
        R.RACK_HEADER,
        {"magic": "DMRK", "version": 1, "n_racks": n, "first_rack": first, "safe_cap_w": 700.0, "lease_state": 1},
    )
    status = R.encode_records(
        R.RACK_STATUS,
        {
            "power_w": np.arange(n, dtype=np.float64) * 1e3 + 1e5,
            "load_w": np.full(n, 9e4),
            "cap_w": np.full(n, 1200.0),
            "floor_w": np.zeros(n),
            "bbu_soc_frac": np.linspace(0.5, 1, n),
            "energized": np.ones(n),
        },
        n,
        R.RACK_STATUS_STRIDE,
    )
    bus.set_words(10, 0, hdr + [0] * (R.RACK_STATUS_BASE - len(hdr)) + status)
    bus.protect(10, 0, 12)
    return bus


def test_rack_device_reads_arrays_and_writes_one_span() -> None:
    async def go() -> None:
        bus = rack_bus()
        d = RackDevice(bus, 10, 64, 5)
        r = await d.read()
        assert r.ok, r.error
        np.testing.assert_array_equal(r.array("power_w"), np.arange(5) * 1e3 + 1e5)
        np.testing.assert_allclose(r.array("bbu_soc_frac"), np.linspace(0.5, 1, 5), rtol=1e-7)
        assert r.values["lease_state"] == 1.0 and r.values["safe_cap_w"] == 700.0
        assert d.racks == slice(64, 69)
        caps = np.array([800.0, 900.0, 1000.0, 1100.0, 1200.0])
        await d.write(caps, 0.0, np.inf, 3e3, 3.0)
        ((unit, addr, words),) = bus.writes
        assert (unit, addr, len(words)) == (10, 12, 4 + 8 * 5)
        hdr = R.decode_block(R.RACK_HEADER, bus.get_words(10, 0, 16))
        assert hdr["lease_s"] == 3.0 and hdr["heartbeat"] == 1.0
        cmd = R.decode_records(R.RACK_COMMAND, bus.get_words(10, 16, 40), 5, 8)
        np.testing.assert_array_equal(cmd["cap_w"], caps)
        assert np.all(cmd["bbu_threshold_w"] == np.inf)

    run(go())


def test_rack_device_rejects_a_device_serving_other_racks() -> None:
    async def go() -> None:
        r = await RackDevice(rack_bus(5, first=0), 10, 64, 5).read()
        assert not r.ok and "configured 5 from 64" in (r.error or "")
        assert np.all(np.isnan(r.array("cap_w")))

    run(go())


def test_site_device_reads_domains_and_jobs() -> None:
    async def go() -> None:
        bus = InMemoryBus()
        nd, nj = 300, 5
        hdr = R.encode_block(
            R.SITE_HEADER,
            {
                "magic": "DMST",
                "version": 1,
                "n_domains": nd,
                "n_jobs": nj,
                "pcc_limit_w": 1.8e7,
                "ramp_limit_w_per_min": 1.5e6,
                "grid_freq_hz": 50.01,
            },
        )
        bus.set_words(3, 0, hdr + [0] * (R.SITE_JOB_BASE - len(hdr)) + [1, 0, 2, 3, R.U16_NA])
        dom = {"power_w": np.arange(nd) * 1e3, "limit_w": np.full(nd, 2e6), "thermal_frac": np.full(nd, 0.5)}
        bus.set_words(3, R.SITE_DOMAIN_BASE, R.encode_records(R.SITE_DOMAIN, dom, nd, R.SITE_DOMAIN_STRIDE))
        r = await SiteDevice(bus, 3, nd, nj).read()
        assert r.ok, r.error
        np.testing.assert_array_equal(r.array("domain_power_w"), dom["power_w"])
        # a job's state: running, stopped (may come back), ended (released by the scheduler); out of range and not
        # implemented read as unknown
        np.testing.assert_array_equal(r.array("job_running")[:3], [1.0, 0.0, 0.0])
        np.testing.assert_array_equal(r.array("job_ended")[:3], [0.0, 0.0, 1.0])
        assert np.isnan(r.array("job_running")[3:]).all() and np.isnan(r.array("job_ended")[3:]).all()
        assert r.values["pcc_limit_w"] == 1.8e7 and r.values["grid_freq_hz"] == pytest.approx(50.01)
        assert r.requests == 1 + math.ceil(6 * nd / 124)

    run(go())


def test_failures_come_back_as_nan_readings_and_write_errors() -> None:
    async def go() -> None:
        bus = rack_bus()
        d = RackDevice(bus, 10, 64, 5)
        bus.fail("unreachable", times=1)
        r = await d.read()
        assert not r.ok and "no reply" in (r.error or "") and np.all(np.isnan(r.array("power_w")))
        assert (await d.read()).ok  # the fault was for one request
        bus.fail("refused", code=6, ops=("write",))
        with pytest.raises(DeviceRefused) as e:
            await d.write(800.0, 0.0, np.inf, 0.0, 3.0)
        assert e.value.code == 6
        assert (await d.read()).ok  # reads unaffected
        bus.heal()
        await d.write(800.0, 0.0, np.inf, 0.0, 3.0)
        assert len(bus.writes) == 1

    run(go())
