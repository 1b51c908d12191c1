"""`dimmer agent`'s client allow-list: who may connect, over real loopback TCP. Only loopback addresses are ever
contacted; "another address" is simulated by an allow-list that leaves loopback out."""

from __future__ import annotations

import asyncio
import logging
import struct

import numpy as np
import pytest

from dimmer.daemon.agent import AllowList, CapAgent
from dimmer.daemon.agent_server import client_host
from dimmer.daemon.bus import DeviceUnreachable, ModbusTcpBus
from dimmer.daemon.devices import RackDevice
from dimmer.daemon.nvml import SimulatedGpus

LOOPBACK = "127.0.0.1"
TEST_NET = "192.0.2.0/24"  # RFC 5737 documentation range: in the allow-list, never contacted


def frame(tid: int, unit: int, pdu: bytes) -> bytes:
    return struct.pack(">HHHB", tid, 0, len(pdu) + 1, unit) + pdu


async def raw_exchange(port: int, request: bytes) -> bytes:
    """Send one Modbus TCP frame on a fresh connection; everything the server sends back before it closes."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5.0)  # to EOF
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


def test_allow_list_parsing_and_membership() -> None:
    default = AllowList.parse()
    assert default.allows("127.0.0.1") and default.allows("127.10.20.30") and default.allows("::1")
    assert not default.allows("10.20.0.5") and not default.allows("not an address")
    allow = AllowList.parse(["10.20.0.5", "fd00:20::/64"])
    assert allow.allows("10.20.0.5") and not allow.allows("10.20.0.6")
    assert allow.allows("::ffff:10.20.0.5")  # an IPv4 client as a dual-stack listener sees it
    assert allow.allows("fd00:20::7") and not allow.allows("fd00:21::7")
    assert allow.allows("127.0.0.1")  # loopback unless told otherwise
    no_lo = AllowList.parse(["10.20.0.0/24"], loopback=False)
    assert no_lo.allows("10.20.0.99") and not no_lo.allows("127.0.0.1") and not no_lo.allows("::1")
    assert str(no_lo) == "10.20.0.0/24" and str(AllowList.parse(loopback=False)) == "nobody"
    for bad in ("controller.example", "10.20.0.5/24", "", "300.1.1.1", "10.20.0.0/33"):
        with pytest.raises(ValueError, match="an IP address or network"):
            AllowList.parse([bad])
    assert client_host("::ffff:127.0.0.1") == "127.0.0.1" and client_host("fe80::1%eth0") == "fe80::1"


def test_a_client_outside_the_allow_list_is_disconnected_unread(caplog: pytest.LogCaptureFixture) -> None:
    """The agent on 127.0.0.1 with an allow-list that leaves loopback out: our loopback client is refused."""
    gpus = SimulatedGpus(2)

    async def go() -> CapAgent:
        agent = CapAgent(gpus, safe_cap_w=840.0, allow=AllowList.parse([TEST_NET], loopback=False))
        port = await agent.start(LOOPBACK, 0)
        try:
            read = frame(1, agent.unit, bytes([3, 0, 0, 0, 2]))
            assert await raw_exchange(port, read) == b""  # no Modbus answer at all: the connection is closed
            assert agent.connections_refused == {LOOPBACK: 1}
            cap = bytes([16, 0, 16, 0, 2, 4]) + struct.pack(">f", 500.0)  # write the cap of rack 0
            assert await raw_exchange(port, frame(2, agent.unit, cap)) == b""
            assert agent.connections_refused == {LOOPBACK: 2}
            bus = ModbusTcpBus(LOOPBACK, port, timeout_s=1.0, retries=0)
            with pytest.raises(DeviceUnreachable):  # the daemon's bus sees a dead endpoint, not an answer
                await bus.read(agent.unit, 0, 2)
            await bus.close()
            assert agent.connections_refused[LOOPBACK] >= 3
            assert agent.server.n_writes == 0 and agent.server.reads == 0 and agent.writes_by_client == {}
            assert gpus.history == []  # nothing reached the GPUs
        finally:
            await agent.stop()
        return agent

    with caplog.at_level(logging.INFO):
        agent = asyncio.run(go())
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == [] and "Traceback" not in caplog.text
    refusals = [r for r in caplog.records if "refused: not in the allow-list (192.0.2.0/24)" in r.getMessage()]
    # logged for the 1st, 2nd, 4th, ... connection from one address: never more lines than refusals
    n = agent.connections_refused[LOOPBACK]
    assert refusals and all(r.levelno == logging.WARNING for r in refusals) and len(refusals) <= n
    assert refusals[0].getMessage().startswith("connection from 127.0.0.1:")
    assert "connections refused: 127.0.0.1" in caplog.text  # the summary at stop


def test_an_allowed_client_reads_and_writes() -> None:
    gpus = SimulatedGpus(2, demand_w=1000.0)

    async def go() -> None:
        agent = CapAgent(gpus, safe_cap_w=840.0, allow=AllowList.parse(["127.0.0.1"], loopback=False))
        port = await agent.start(LOOPBACK, 0)
        bus = ModbusTcpBus(LOOPBACK, port, timeout_s=1.0, retries=0)
        try:
            dev = RackDevice(bus, agent.unit, 0, 1)
            r = await dev.read()
            assert r.ok, r.error
            await dev.write(950.0, 0.0, np.inf, 0.0, lease_s=5.0)
            assert np.allclose(gpus.limits_w, 950.0)
            assert agent.writes_by_client == {LOOPBACK: 1} and agent.connections_refused == {}
        finally:
            await bus.close()
            await agent.stop()

    asyncio.run(go())
