"""`dimmer agent`: what a client may write, what is refused (and then changes nothing), who wrote what, and what
the status reports, over real loopback TCP (pymodbus client through the daemon's ModbusTcpBus)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from dimmer.daemon import agent_server
from dimmer.daemon import registers as R
from dimmer.daemon.agent import CapAgent
from dimmer.daemon.bus import DeviceRefused, ModbusTcpBus
from dimmer.daemon.devices import RackDevice
from dimmer.daemon.nvml import SimulatedGpus

LOOPBACK = "127.0.0.1"
LEASE_AT = R.RACK_HEADER.field("lease_s").offset  # 12: where the daemon's write span starts


def at0(v: float | np.ndarray) -> float:
    return float(np.asarray(v).reshape(-1)[0])


def words(
    cap: float = 1000.0,
    floor: float = 0.0,
    threshold: float = math.inf,
    recharge: float = 0.0,
    lease: float = 5.0,
    heartbeat: int = 1,
) -> list[int]:
    """lease_s, heartbeat and rack 0's command record: what the daemon writes from register 12."""
    return [
        *R.encode_float32([lease]),
        *R.encode_uint32([heartbeat]),
        *R.encode_float32([cap, floor, threshold, recharge]),
    ]


async def with_agent(
    gpus: SimulatedGpus, body: Callable[[CapAgent, ModbusTcpBus], Awaitable[None]], **kw: Any
) -> CapAgent:
    agent = CapAgent(gpus, safe_cap_w=kw.pop("safe_cap_w", 840.0), **kw)
    port = await agent.start(LOOPBACK, 0)
    bus = ModbusTcpBus(LOOPBACK, port, timeout_s=2.0, retries=0)
    try:
        await body(agent, bus)
    finally:
        await bus.close()
        await agent.stop()
    return agent


async def refused(bus: ModbusTcpBus, unit: int, address: int, values: list[int]) -> int:
    with pytest.raises(DeviceRefused) as info:
        await bus.write(unit, address, values)
    return info.value.code


BAD_VALUES = [
    ("cap NaN", {"cap": math.nan}),
    ("cap +inf", {"cap": math.inf}),
    ("cap -inf", {"cap": -math.inf}),
    ("cap negative", {"cap": -1.0}),
    ("cap above the map's 1e5 W", {"cap": 100_001.0}),
    ("floor NaN", {"floor": math.nan}),
    ("floor negative", {"floor": -5.0}),
    ("floor +inf", {"floor": math.inf}),
    ("BBU threshold NaN", {"threshold": math.nan}),
    ("BBU threshold negative", {"threshold": -1.0}),
    ("recharge +inf", {"recharge": math.inf}),
    ("recharge NaN", {"recharge": math.nan}),
    ("lease 0", {"lease": 0.0}),
    ("lease negative", {"lease": -3.0}),
    ("lease NaN", {"lease": math.nan}),
    ("lease +inf", {"lease": math.inf}),
    ("lease above the map's 86400 s", {"lease": 86_401.0}),
]


def test_values_out_of_range_get_exception_3_and_change_nothing() -> None:
    gpus = SimulatedGpus(4, min_w=200.0, max_w=1400.0, demand_w=1100.0)

    async def body(agent: CapAgent, bus: ModbusTcpBus) -> None:
        before = agent.image.copy()
        for label, bad in BAD_VALUES:
            code = await refused(bus, agent.unit, LEASE_AT, words(**bad))  # type: ignore[arg-type]
            assert code == 3, label
            assert np.array_equal(agent.image, before), label  # no register stored
            assert gpus.history == [], label  # no GPU limit set
            assert agent.last_write_s is None and agent.lease_state == R.LEASE_NONE, label  # no lease
            assert agent.server.writes[-1].refused == 3 and agent.server.writes[-1].client == LOOPBACK
        # half a float (only its high word): refused whole, as every device map refuses a value written in part,
        # with exception 2 (the address and count do not fit the data), whatever value it would have made
        assert await refused(bus, agent.unit, R.rack_cmd_address(0), [0x7FC0]) == 2
        assert await refused(bus, agent.unit, R.rack_cmd_address(0) + 1, [0x0000]) == 2  # its low word alone
        assert await refused(bus, agent.unit, LEASE_AT, [0x4000]) == 2  # a 2 s lease's high word
        assert np.array_equal(agent.image, before) and gpus.history == []
        # the in-range values the daemon writes are accepted: +inf BBU threshold (backup only), a cap of 0 W
        await bus.write(agent.unit, LEASE_AT, words(cap=0.0, threshold=math.inf, lease=86_400.0))
        assert np.allclose(gpus.limits_w, 200.0)  # 0 W is in the map's range; the GPUs' minimum is applied
        assert agent.lease_state == R.LEASE_HELD and agent.lease_s() == pytest.approx(10.0)
        n = len(BAD_VALUES) + 4
        assert agent.server.n_writes == n and agent.server.n_writes_refused == n - 1

    asyncio.run(with_agent(gpus, body))


def test_writes_outside_the_served_rack_get_exception_2() -> None:
    gpus = SimulatedGpus(2)

    async def body(agent: CapAgent, bus: ModbusTcpBus) -> None:
        before = agent.image.copy()
        good = R.encode_float32([900.0, 0.0])
        assert await refused(bus, agent.unit, R.rack_cmd_address(1), good) == 2  # rack 1: this device has one rack
        assert await refused(bus, agent.unit, R.rack_cmd_address(63), good) == 2  # the last record of the map
        span = words(cap=900.0) + words(cap=900.0)[4:]  # 12 .. 32: rack 0 and rack 1 in one request
        assert await refused(bus, agent.unit, LEASE_AT, span) == 2
        assert await refused(bus, agent.unit, R.RACK_STATUS_BASE, [0, 0]) == 2  # status records: read only
        assert await refused(bus, agent.unit, 0, [0]) == 2  # the magic
        assert np.array_equal(agent.image, before) and gpus.history == []
        await bus.write(agent.unit, LEASE_AT, words(cap=900.0))  # rack 0 is fine
        assert np.allclose(gpus.limits_w, 900.0)

    asyncio.run(with_agent(gpus, body))


def test_a_limit_the_gpus_refuse_is_exception_4_and_leaves_registers_and_lease_alone() -> None:
    gpus = SimulatedGpus(2)

    async def body(agent: CapAgent, bus: ModbusTcpBus) -> None:
        before = agent.image.copy()
        gpus.fail_next = 1
        assert await refused(bus, agent.unit, LEASE_AT, words(cap=900.0)) == 4
        assert np.array_equal(agent.image, before)  # the cap is not stored: the next read does not show it
        assert agent.last_write_s is None and agent.lease_state == R.LEASE_NONE and agent.commanded_w is None
        await bus.write(agent.unit, LEASE_AT, words(cap=900.0))  # the same write again: it goes through
        assert np.allclose(gpus.limits_w, 900.0) and agent.lease_state == R.LEASE_HELD

    asyncio.run(with_agent(gpus, body))


def test_the_same_cap_again_restores_a_limit_changed_behind_the_agents_back() -> None:
    gpus = SimulatedGpus(4, min_w=200.0, max_w=1400.0, demand_w=1100.0)

    async def body(agent: CapAgent, bus: ModbusTcpBus) -> None:
        dev = RackDevice(bus, agent.unit, 0, 1)
        await dev.write(1000.0, 0.0, np.inf, 0.0, lease_s=5.0)
        assert np.allclose(gpus.limit_w(), 1000.0)
        gpus.set_limit_w(np.full(4, 1400.0))  # someone runs nvidia-smi -pl 1400 on the host
        await dev.write(1000.0, 0.0, np.inf, 0.0, lease_s=5.0)  # the controller repeats its cap
        assert np.allclose(gpus.limit_w(), 1000.0)

    asyncio.run(with_agent(gpus, body))


def test_status_reports_the_enforced_limit_not_the_requested_one() -> None:
    gpus = SimulatedGpus(4, min_w=200.0, max_w=1400.0, demand_w=1100.0)

    async def body(agent: CapAgent, bus: ModbusTcpBus) -> None:
        dev = RackDevice(bus, agent.unit, 0, 1)
        await dev.write(1000.0, 0.0, np.inf, 0.0, lease_s=5.0)
        gpus.external_w[:] = 900.0  # another limit in force below the agent's (a BMC's, say)
        agent.tick()
        r = await dev.read()
        assert r.ok, r.error
        assert np.allclose(gpus.limit_w(), 1000.0)  # what the agent asked for
        assert at0(r.values["cap_w"]) == pytest.approx(900.0)  # what the GPUs hold
        assert at0(r.values["power_w"]) == pytest.approx(4 * 900.0)
        gpus.external_w[:] = np.inf  # the other limit goes: the requested one is enforced again
        agent.tick()
        r = await dev.read()
        assert at0(r.values["cap_w"]) == pytest.approx(1000.0)

    asyncio.run(with_agent(gpus, body))


def test_every_write_counted_by_client_logged_and_history_bounded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(agent_server, "WRITES_KEPT", 4)
    gpus = SimulatedGpus(2)

    async def body(agent: CapAgent, bus: ModbusTcpBus) -> None:
        for k in range(9):
            await bus.write(agent.unit, LEASE_AT, words(cap=800.0 + k, heartbeat=k))
        await refused(bus, agent.unit, LEASE_AT, words(cap=math.nan))
        s = agent.server
        assert s.n_writes == 10 and s.n_writes_refused == 1
        assert agent.writes_by_client == {LOOPBACK: 10} and agent.refused_by_client == {LOOPBACK: 1}
        assert 4 <= len(s.writes) < 8  # the latest WRITES_KEPT to 2 x WRITES_KEPT are kept
        caps = [float(R.decode_float32(list(w.values[4:6]))[0]) for w in s.writes]  # the latest, oldest first
        assert math.isnan(caps[-1]) and s.writes[-1].refused == 3
        assert caps[:-1] == pytest.approx([800.0 + k for k in range(9)][-(len(caps) - 1) :])
        assert np.allclose(gpus.limits_w, 808.0)

    with caplog.at_level(logging.INFO, logger="dimmer.agent"):
        agent = asyncio.run(with_agent(gpus, body))
    lines = [
        r.getMessage() for r in caplog.records if r.name == "dimmer.agent" and " from 127.0.0.1:" in r.getMessage()
    ]
    accepted = [m for m in lines if m.startswith("write ") and "accepted" in m]
    rejected = [m for m in lines if m.startswith("write ") and "refused with exception 3" in m]
    assert len(accepted) == 9 and len(rejected) == 1
    assert accepted[0].startswith("write 1 from 127.0.0.1:") and "cap 800 W/GPU" in accepted[0]
    assert rejected[0].startswith("write 10 from 127.0.0.1:") and "cap_w nan" in rejected[0]
    assert f"writes by client: {LOOPBACK} 10 (1 refused)" in caplog.text  # the summary at stop
    assert agent.connections_refused == {}
