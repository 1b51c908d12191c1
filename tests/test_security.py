"""Security (issue 6): what the daemon, the agent and the served plant expose and what they may write.

a. every network service listens on loopback unless told otherwise (the CLI and config defaults, and the address
   the OS reports for a server started with them);
b. every write the daemon makes goes to a writable device of its config, inside the register blocks that device's
   map declares writable, with values inside the ratings (caps in the GPU's range, floors under the caps, BBU
   thresholds >= 0, recharge within the BBU rating, the configured lease, the battery within its rating); anything
   else is refused before a frame goes on the wire;
c. an inconsistent config is refused at load with one line naming the file and the key;
d. the audit log holds every write the plant received, each with its reason;
e. a battery that goes off line (and comes back) is said in the log and in the audit record;
f. a request to a unit a server does not have gets exception 0x0B, and no ERROR or traceback in the log;
g. the served plant's lease fallback holds the interconnect limit as well as the breakers; a safe cap that would
   overdraw a breaker is refused, one that would put the interconnect over is a warning.

The daemon runs here against the plant served over real loopback TCP (gridsim.serve.PlantServer), which records
every write request it receives.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.cli import _parser as dimmer_parser
from dimmer.cli import main as dimmer_main
from dimmer.daemon import registers as R
from dimmer.daemon.agent import CapAgent
from dimmer.daemon.bus import DeviceRefused, ModbusTcpBus, WriteNotAllowed
from dimmer.daemon.config import DaemonSpec, parse_address, safe_cap_load_warnings, validate_config
from dimmer.daemon.devices import RackDevice, RackLimits, SunSpecBattery
from dimmer.daemon.loop import Daemon
from dimmer.daemon.metrics import DaemonMetrics
from dimmer.daemon.nvml import SimulatedGpus
from dimmer.errors import InputError
from gridsim.scenario import load_scenario
from gridsim.serve import (
    BATTERY_MODELS,
    BATTERY_UNIT,
    FIRST_RACK_UNIT,
    SUNSPEC_BASE,
    PlantServer,
    WriteRecord,
    add_serve_arguments,
    fallback_cap_w,
)
from tests.daemon_fakes import FakePlant, loaded_config
from tests.test_daemon_config import _write, small_site
from tests.test_daemon_faults import SCENARIO, SPEED, daemon_config, write_scenario

REPO = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"
GATEWAY_TARGET_FAILED = 0x0B


# -- a. loopback unless configured ----------------------------------------------------------------------------------


def test_command_line_and_config_defaults_are_loopback() -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["x.toml"]).host == LOOPBACK  # gridsim serve
    assert dimmer_parser().parse_args(["agent", "--sim-gpus", "2"]).host == LOOPBACK  # dimmer agent
    assert parse_address(DaemonSpec().metrics_address) == (LOOPBACK, 9108)  # the daemon's Prometheus endpoint
    loaded = validate_config(small_site(), "site.toml", Path("."))
    assert parse_address(loaded.config.daemon.metrics_address)[0] == LOOPBACK
    example = (REPO / "examples" / "site.toml").read_text()
    assert 'metrics_address = "127.0.0.1:9108"' in example


def test_servers_started_with_their_defaults_listen_on_loopback(tmp_path: Path) -> None:
    """Started with no address, each server's socket is bound to 127.0.0.1 (as the OS reports it), not 0.0.0.0."""
    loaded = write_scenario(tmp_path, 30.0)

    async def go() -> None:
        srv = PlantServer(loaded)  # gridsim serve's server (its port 0 is the CLI's --port; a fixed 5020 by default)
        await srv.start()
        try:
            assert srv.bound_address is not None and srv.bound_address[0] == LOOPBACK
        finally:
            await srv.stop()
        agent = CapAgent(SimulatedGpus(2), safe_cap_w=840.0)
        await agent.start(port=0)  # dimmer agent's server, host left to its default
        try:
            assert agent.server.bound_address is not None and agent.server.bound_address[0] == LOOPBACK
        finally:
            await agent.stop()

    asyncio.run(go())
    # the daemon's metrics endpoint, at the host of its config default (port 0: 9108 may be taken on this machine)
    m = DaemonMetrics(loaded_config().site, ["pcc"])
    m.serve((parse_address(DaemonSpec().metrics_address)[0], 0))
    try:
        assert m.bound_address is not None and m.bound_address[0] == LOOPBACK
    finally:
        m.close()


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) of the sockets listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            addr, hex_port = cols[1].rsplit(":", 1)
            if int(hex_port, 16) == port and cols[3] == "0A":  # 0A: LISTEN
                out.add(addr)
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_agent_command_line_listens_on_loopback_only() -> None:
    """`dimmer agent` with no --host: the kernel's own table shows one listener, on 127.0.0.1."""

    async def go() -> set[str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dimmer.cli", "agent", "--sim-gpus", "2", "--port", "0",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 20.0)).decode()
            assert line.startswith("listening on 127.0.0.1:"), line
            return _listening(int(line.rsplit(":", 1)[1]))
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 20.0)

    assert asyncio.run(go()) == {"0100007F"}  # 127.0.0.1, little-endian hex


# -- b. writes: only to the allow-list, only within range ---------------------------------------------------------


def _rack(bus: ModbusTcpBus, n: int = 8) -> RackDevice:
    return RackDevice(bus, FIRST_RACK_UNIT, 0, n, limits=RackLimits(200.0, 1400.0, 33e3, 10.0))


GOOD = {"cap_w": 1000.0, "floor_w": 0.0, "bbu_threshold_w": math.inf, "bbu_recharge_w": 3e3, "lease_s": 10.0}


@pytest.mark.parametrize(
    "forged",
    [
        {"cap_w": 1400.5},  # above the GB300's rating
        {"cap_w": 150.0},  # below its lowest settable cap
        {"cap_w": math.nan},
        {"cap_w": -math.inf},
        {"floor_w": 1000.5},  # a floor above the cap
        {"floor_w": -1.0},
        {"bbu_threshold_w": -1.0},
        {"bbu_threshold_w": math.nan},
        {"bbu_recharge_w": 33e3 + 1.0},  # beyond the BBU's rating
        {"lease_s": 0.0},
        {"lease_s": -5.0},
        {"lease_s": math.nan},
        {"lease_s": 10.5},  # longer than the configured lease
    ],
    ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()),
)
def test_forged_rack_command_is_refused_without_a_frame(tmp_path: Path, forged: dict[str, float]) -> None:
    loaded = write_scenario(tmp_path, 30.0)

    async def go() -> None:
        srv = PlantServer(loaded)
        await srv.start()
        bus = ModbusTcpBus(LOOPBACK, srv.port)
        try:
            rack = _rack(bus)
            args = {**GOOD, **forged}
            with pytest.raises(WriteNotAllowed):
                await rack.write(
                    args["cap_w"], args["floor_w"], args["bbu_threshold_w"], args["bbu_recharge_w"], args["lease_s"]
                )
            assert bus.requests == 0 and srv.writes == []  # nothing sent, nothing received
            await rack.write(**GOOD)  # the same device, a command in range: sent and taken
            assert bus.requests == 1 and [w.refused for w in srv.writes] == [None]
        finally:
            await bus.close()
            await srv.stop()

    asyncio.run(go())


@pytest.mark.parametrize("setpoint_w", [500e3 + 1.0, -500e3 - 1.0, math.nan, math.inf])
def test_forged_battery_setpoint_is_refused_without_a_frame(tmp_path: Path, setpoint_w: float) -> None:
    loaded = write_scenario(tmp_path, 30.0)  # a 0.5 MW battery

    async def go() -> None:
        srv = PlantServer(loaded)
        await srv.start()
        bus = ModbusTcpBus(LOOPBACK, srv.port)
        try:
            battery = SunSpecBattery(bus, BATTERY_UNIT, max_power_w=loaded.site().bess.power_w)
            with pytest.raises(WriteNotAllowed):
                await battery.write_setpoint(setpoint_w, 10.0)
            assert bus.requests == 0 and srv.writes == []  # not even the discovery reads
            await battery.write_setpoint(-500e3, 10.0)  # at the rating: allowed
            assert [w.refused for w in srv.writes] == [None, None, None]  # 704 timer, 704 setpoint, 802 heartbeat
        finally:
            await bus.close()
            await srv.stop()

    asyncio.run(go())


def test_only_the_declared_writable_blocks_can_be_written(tmp_path: Path) -> None:
    """The one door every write goes through (`_put`) refuses registers outside the device's writable blocks."""
    loaded = write_scenario(tmp_path, 30.0)

    async def go() -> None:
        srv = PlantServer(loaded)
        await srv.start()
        bus = ModbusTcpBus(LOOPBACK, srv.port)
        try:
            rack = _rack(bus, 8)
            for address, n in [(0, 2), (8, 1), (10, 2), (11, 2), (R.rack_cmd_address(8), 2), (R.RACK_STATUS_BASE, 2)]:
                with pytest.raises(WriteNotAllowed):  # magic, lease state, update count, past its 8 racks, status
                    await rack._put(address, [0] * n)
            battery = SunSpecBattery(bus, BATTERY_UNIT)
            with pytest.raises(WriteNotAllowed):  # before discovery it knows no writable register at all
                await battery._put(SUNSPEC_BASE, [0])
            await battery.discover()
            at = {k: SUNSPEC_BASE + v for k, v in R.model_offsets(list(BATTERY_MODELS)).items()}
            for address, n in [(at[701] + 10, 1), (at[704] + 21, 2), (at[704] + 33, 2), (at[704] + 55, 1),
                               (at[802] + 18, 1)]:  # fmt: skip
                # 701 W, before WSetEna, WSetRvrtRem, WSet_SF, the battery's own Hb: read-only in the definitions
                with pytest.raises(WriteNotAllowed):
                    await battery._put(address, [0] * n)
            requests = bus.requests
            assert srv.writes == []
            await battery._put(at[802] + 19, [7])  # CtrlHb: the one 802 register we write
            assert bus.requests == requests + 1 and srv.writes[-1].refused is None
        finally:
            await bus.close()
            await srv.stop()

    asyncio.run(go())


@dataclass
class Served:
    srv: PlantServer
    daemon: Daemon
    config: dict[str, Any]
    audit: list[dict[str, Any]]
    logs: list[logging.LogRecord]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


T_OFFLINE, T_ONLINE, T_STALL, T_UNSTALL, DURATION = 10.0, 18.0, 21.0, 30.0, 36.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    """One daemon run against the served plant (8 racks, a battery, a 0.85 MW interconnect that binds): control,
    the battery off line and back, the rack device's readings stalled (safe caps) and back, then a stop with safe
    caps. About 5 s of wall time."""
    tmp = tmp_path_factory.mktemp("served")
    loaded = write_scenario(tmp, DURATION)
    out = tmp / "daemon"
    collect = _Collect()
    logger = logging.getLogger("dimmer")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(collect)

    async def go() -> Served:
        srv = PlantServer(loaded, speed=SPEED, hold_until_first_write=True)
        await srv.start()
        try:
            raw = daemon_config(loaded, srv.device_map(), out)
            cfg = validate_config(raw, "served.toml", out)
            d = Daemon(cfg, speed=SPEED, metrics_address=None, max_cycles=int(DURATION) + 60)
            task = asyncio.create_task(d.run())

            async def at(t_s: float) -> None:
                while srv.plant_time_s() < t_s:
                    assert not srv.done.is_set() and not task.done()
                    await asyncio.sleep(0.005)

            try:
                await at(T_OFFLINE)
                srv.set_battery_online(False)
                await at(T_ONLINE)
                srv.set_battery_online(True)
                await at(T_STALL)
                srv.stall(FIRST_RACK_UNIT)
                await at(T_UNSTALL)
                srv.stall(FIRST_RACK_UNIT, False)
                assert await srv.wait(30.0)
            finally:
                d.request_stop()  # with safe caps: the plant still listens
                await asyncio.wait_for(task, 30.0)
        finally:
            await srv.stop()
        assert srv.error is None, srv.error
        audit = [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]
        return Served(srv, d, raw, audit, collect.records)

    try:
        return asyncio.run(go())
    finally:
        logger.removeHandler(collect)
        logger.setLevel(old_level)


def _allowed_spans(config: dict[str, Any]) -> dict[int, list[tuple[int, int]]]:
    """The allow-list, written out from docs/registers.md (not from the code under test): by unit, the registers a
    daemon may write. Rack devices: lease_s and heartbeat (12 .. 15) and the command records of its racks
    (16 + 8·i); the battery: 704 WSetEna .. WSetRvrt (+22 .. +27), WSetEnaRvrt and WSetRvrtTms (+30 .. +32), and
    802 CtrlHb (+19). Nothing else."""
    at: dict[int, int] = {}
    pos = SUNSPEC_BASE + 2
    for block in BATTERY_MODELS:
        at[block.model_id or 0] = pos
        pos += block.length
    out: dict[int, list[tuple[int, int]]] = {}
    for dev in config["devices"]:
        if dev.get("read_only"):
            continue
        if dev["kind"] == "racks":
            out[dev["unit"]] = [(12, 16 + 8 * dev["n_racks"])]
        elif dev["kind"] == "battery":
            out[dev["unit"]] = [
                (at[704] + 22, at[704] + 28),
                (at[704] + 30, at[704] + 33),
                (at[802] + 19, at[802] + 20),
            ]
    return out


def test_every_write_of_a_daemon_run_is_in_the_allow_list_and_in_range(served: Served) -> None:
    srv, site = served.srv, served.srv.site
    allowed = _allowed_spans(served.config)
    assert sorted(allowed) == [BATTERY_UNIT, FIRST_RACK_UNIT]  # the meter and the site device are never writable
    writes = srv.writes
    assert len(writes) > 2.5 * DURATION  # a rack write and two battery requests a period, and the stop
    assert {w.unit for w in writes} == set(allowed)
    for w in writes:
        assert any(a <= w.address and w.address + len(w.values) <= b for a, b in allowed[w.unit]), w
        assert w.refused is None, w  # the plant refused nothing: the daemon never sent what it would refuse
    gpu, lease_s = site.gpu, served.config["safety"]["lease_s"]
    racks = [w for w in writes if w.unit == FIRST_RACK_UNIT]
    for w in racks:
        assert w.address == 12 and len(w.values) == 4 + 8 * site.n_racks  # lease, heartbeat, every command
        assert R.decode_float32(w.values[0:2])[0] == lease_s
        cmd = R.decode_records(R.RACK_COMMAND, w.values[4:], site.n_racks, R.RACK_CMD_STRIDE)
        assert np.all((cmd["cap_w"] >= gpu.min_cap_w) & (cmd["cap_w"] <= gpu.rated_w * (1 + 1e-7)))
        assert np.all((cmd["floor_w"] >= 0) & (cmd["floor_w"] <= cmd["cap_w"]))
        assert np.all(cmd["bbu_threshold_w"] >= 0)  # +inf (backup only) included
        assert np.all((cmd["bbu_recharge_w"] >= 0) & (cmd["bbu_recharge_w"] <= site.rack_storage.bbu_power_w + 1))
    at704 = _allowed_spans(served.config)[BATTERY_UNIT][0][0] - 22
    sf = R.decode_sf(srv.words(BATTERY_UNIT, at704 + 55, 1)[0])  # WSet_SF (+55), the battery's own
    setpoints = [w for w in writes if w.unit == BATTERY_UNIT and w.address == at704 + 22]
    timers = [w for w in writes if w.unit == BATTERY_UNIT and w.address == at704 + 30]
    assert setpoints and len(timers) == len(setpoints)
    for w in setpoints:
        assert len(w.values) == 6 and list(w.values[:2]) == [1, 1]  # WSetEna ENABLED, WSetMod WATTS
        assert abs(float(R.apply_sf(R.decode_int32(w.values[2:4]), sf)[0])) <= site.bess.power_w
    for w in timers:
        assert len(w.values) == 3 and w.values[0] == 1 and R.decode_uint32(w.values[1:3])[0] > 0


def test_a_write_outside_the_ratings_is_refused_logged_counted_and_never_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon whose rack device was built with a cap range narrower than what the controller decides (standing in
    for a bug upstream): every such write is refused at the device, logged, counted and audited, and none reaches
    the plant; the battery's writes go on."""
    loaded = write_scenario(tmp_path, 60.0)
    out = tmp_path / "daemon"

    async def go() -> tuple[Daemon, list[WriteRecord]]:
        srv = PlantServer(loaded, speed=SPEED)
        await srv.start()
        try:
            cfg = validate_config(daemon_config(loaded, srv.device_map(), out), "narrow.toml", out)
            d = Daemon(cfg, speed=SPEED, metrics_address=None, max_cycles=6)
            rack = next(h for h in d.handles if h.kind == "racks")
            rack.device.limits = RackLimits(200.0, 300.0, 33e3, 10.0)  # the controller decides caps above 300 W
            await asyncio.wait_for(d.run(), 30.0)
        finally:
            await srv.stop()
        return d, srv.writes

    with caplog.at_level(logging.WARNING, logger="dimmer.daemon"):
        d, writes = asyncio.run(go())
    assert d.n_cycles == 6
    assert [w for w in writes if w.unit == FIRST_RACK_UNIT] == []  # not one frame to the racks
    assert any(w.unit == BATTERY_UNIT for w in writes)
    refused = d.metrics.registry.get_sample_value("dimmer_writes_refused_total", {"device": "racks-0"})
    assert refused is not None and refused >= 6  # every cycle's write, and the stop's
    assert sum("refused before sending" in m for m in caplog.messages) == refused
    records = [json.loads(x) for x in (out / "audit.jsonl").read_text().splitlines()]
    rack_writes = [w for r in records for w in r.get("writes", []) if w["device"] == "racks-0"]
    assert len(rack_writes) == refused
    assert all(not w["ok"] and w["error"].startswith("WriteNotAllowed") and "settable range" in w["error"]
               for w in rack_writes)  # fmt: skip


# -- d. the audit log: every write, with its reason -----------------------------------------------------------------


def _rle_values(rle: list[list[Any]]) -> np.ndarray:
    return np.concatenate([np.full(int(n), float(v)) for v, n in rle]) if rle else np.zeros(0)


def _audit_writes(audit: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for rec in audit:
        yield from rec.get("writes", [])


def test_every_write_the_plant_received_is_in_the_audit_log_with_its_reason(served: Served) -> None:
    """Walk the plant's record of the write requests it received, device by device, in order, alongside the audit
    log's writes: each request matches the next audit write with the same values (a battery setpoint is the
    requests its audit entry lists word for word, then the heartbeat), and every audit write carries a reason."""
    srv, site = served.srv, served.srv.site
    names = {d["unit"]: d["name"] for d in served.config["devices"]}
    audited = list(_audit_writes(served.audit))
    assert audited and all(isinstance(w.get("reason"), str) and w["reason"] for w in audited)
    racks = [w for w in audited if w["device"] == names[FIRST_RACK_UNIT]]
    i = 0
    for f in (w for w in srv.writes if w.unit == FIRST_RACK_UNIT):
        while i < len(racks) and not _same(f, racks[i], site.n_racks):
            i += 1  # an audited write that never reached the plant (the stall's, or a failed one)
        assert i < len(racks), f"a rack write at plant t = {f.t_plant_s:.1f} s is not in the audit log"
        i += 1
    # a battery setpoint is the requests its audit entry lists word for word (the 704 timer, the 704 setpoint),
    # then the 802 heartbeat
    bess = [w for w in audited if w["device"] == names[BATTERY_UNIT]]
    expected: list[tuple[int, tuple[int, ...]]] = []
    for w in bess:
        if "battery_write" in w:
            reqs = w["battery_write"]["requests"]
            setpoint = next(r["words"] for r in reqs if len(r["words"]) == 6)
            assert abs(float(R.decode_int32(setpoint[2:4])[0]) - w["setpoint_w"]) <= 0.56  # WSet_SF 0: watts
            expected += [(r["address"], tuple(r["words"])) for r in reqs]
    j, after_setpoint = 0, False
    for f in (w for w in srv.writes if w.unit == BATTERY_UNIT):
        if len(f.values) == 1:
            assert after_setpoint, "a heartbeat with no setpoint before it"
            after_setpoint = False
            continue
        while j < len(expected) and expected[j] != (f.address, tuple(f.values)):
            j += 1  # an audited request that never reached the plant
        assert j < len(expected), f"a battery write at plant t = {f.t_plant_s:.1f} s is not in the audit log"
        j += 1
        after_setpoint = len(f.values) == 6
    # the reasons say what decided: the controller, the safety net on stale telemetry, the stop
    reasons = [w["reason"] for w in audited]
    assert any(r.startswith("controller dimmer: ") for r in reasons)
    assert any(r.startswith("controller dimmer: ") and "stale telemetry" in r for r in reasons)
    stop = [r for r in served.audit if r.get("event") == "stop"]
    assert len(stop) == 1 and all(w["ok"] and w["reason"].startswith("stop: ") for w in stop[0]["writes"])
    # the last requests the plant received are the stop's: safe caps, the battery idle, and they are audited too
    last_rack = next(w for w in reversed(srv.writes) if w.unit == FIRST_RACK_UNIT)
    safe = served.daemon.loaded.safe_cap_w
    caps = R.decode_records(R.RACK_COMMAND, last_rack.values[4:], site.n_racks, R.RACK_CMD_STRIDE)["cap_w"]
    assert np.all(caps <= safe + 1e-3) and _same(last_rack, stop[0]["writes"][-1], site.n_racks)


def _same(f: WriteRecord, w: dict[str, Any], n_racks: int) -> bool:
    """Does the rack request `f` carry the values the audit write `w` says were written?"""
    if "cap_w" in w:
        if len(f.values) != 4 + 8 * n_racks:
            return False
        cmd = R.decode_records(R.RACK_COMMAND, f.values[4:], n_racks, R.RACK_CMD_STRIDE)
        lease = float(R.decode_float32(f.values[0:2])[0])
        return (
            bool(np.allclose(cmd["cap_w"], _rle_values(w["cap_w"]), atol=0.06))
            and bool(np.allclose(cmd["floor_w"], _rle_values(w["floor_w"]), atol=0.06))
            and lease == w["lease_s"]
        )
    return False


# -- e. a battery off line ------------------------------------------------------------------------------------------


def test_battery_going_off_line_and_back_is_logged_and_audited(served: Served) -> None:
    msgs = [(r.levelno, r.getMessage()) for r in served.logs if r.name == "dimmer.daemon"]
    off = [m for lvl, m in msgs if lvl == logging.WARNING and "campus-battery: reports itself off line" in m]
    back = [m for lvl, m in msgs if "campus-battery: on line again" in m]
    assert len(off) == 1 and len(back) == 1
    cycles = [r for r in served.audit if "cycle" in r]
    flags = [bool(r["offline"]) for r in cycles]
    assert all(r["offline"] in ([], ["campus-battery"]) for r in cycles)
    # one off-line stretch, as long as the plant kept it off (8 plant s: a cycle a second, give or take two)
    first, last = flags.index(True), len(flags) - 1 - flags[::-1].index(True)
    assert all(flags[first : last + 1]) and 6 <= last - first + 1 <= 10
    assert not any(flags[:first]) and not any(flags[last + 1 :])
    # while off line the controller did not plan on it: setpoint 0 W, written (the battery answers)
    assert all(r["decided"]["bess_setpoint_w"] == 0.0 for r in cycles[first + 1 : last + 1])


# -- f. a unit the server does not have ----------------------------------------------------------------------------


async def _ask(port: int, unit: int, pdu: bytes, tid: int) -> bytes:
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(tid.to_bytes(2, "big") + b"\x00\x00" + (len(pdu) + 1).to_bytes(2, "big") + bytes([unit]) + pdu)
        await writer.drain()
        head = await asyncio.wait_for(reader.readexactly(7), 2.0)
        assert int.from_bytes(head[:2], "big") == tid and head[6] == unit
        return await asyncio.wait_for(reader.readexactly(int.from_bytes(head[4:6], "big") - 1), 2.0)
    finally:
        writer.close()


READ = bytes([3, 0, 0, 0, 2])  # read 2 holding registers at 0
WRITE_ONE = bytes([6, 0, 16, 0, 1])  # write register 16
WRITE_MANY = bytes([16, 0, 16, 0, 1, 2, 0, 1])  # write 1 register at 16
READ_HIGH = bytes([3, 0x9C, 0x40, 0, 2])  # read 2 registers at 40000


def test_a_unit_the_server_does_not_have_gets_0x0b_and_no_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = write_scenario(tmp_path, 30.0)

    async def go() -> None:
        srv = PlantServer(loaded)
        await srv.start()
        agent = CapAgent(SimulatedGpus(2), safe_cap_w=840.0)
        agent_port = await agent.start(LOOPBACK, 0)
        try:
            tid = 0
            for port, known in ((srv.port, BATTERY_UNIT), (agent_port, agent.unit)):
                for unit in (0, 9, 200, 247, 255):
                    for pdu in (READ, WRITE_ONE, WRITE_MANY, READ_HIGH):
                        tid += 1
                        assert await _ask(port, unit, pdu, tid) == bytes([pdu[0] | 0x80, GATEWAY_TARGET_FAILED])
                # the units it has still answer (a catch-all must not swallow them)
                tid += 1
                assert (await _ask(port, known, READ_HIGH if known == BATTERY_UNIT else READ, tid))[0] == 3
                # the daemon's bus reports it as a refusal with the gateway code, not as a dead endpoint
                bus = ModbusTcpBus(LOOPBACK, port, retries=0)
                with pytest.raises(DeviceRefused) as e:
                    await bus.read(9, 0, 2)
                assert e.value.code == GATEWAY_TARGET_FAILED and "gateway target failed to respond" in str(e.value)
                await bus.close()
            assert srv.writes == [] and agent.server.writes == []
        finally:
            await agent.stop()
            await srv.stop()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(go())
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert "Traceback" not in caplog.text and "KeyError" not in caplog.text


# -- c. and g. config refusals and the safe cap ---------------------------------------------------------------------


def _row_rating(kw: float) -> Any:
    return lambda r: r["site"]["levels"][1].update(rating_kw=kw)


@pytest.mark.parametrize(
    ("mutate", "key", "expected"),
    [
        # safe caps the GPU cannot hold
        (lambda r: r.update(safety={"safe_cap_frac": 1.01}), "safety.safe_cap_frac", "above the gb300 rating"),
        (lambda r: r.update(safety={"safe_cap_frac": 0.14}), "safety.safe_cap_frac", "settable from 200 W"),
        # a safe cap at which the racks under a breaker overdraw it: 8 racks at 840 W draw 716 kW
        (_row_rating(700), "safety.safe_cap_frac", "would draw 716 kW, above its 700 kW breaker"),
        (_row_rating(250), "safety.safe_cap_frac", "200 W is the lowest, and still too much"),
        # operating limits above the breaker or the interconnect
        (lambda r: r.update(limits=[{"domain": "h0/r1", "limit_kw": 1100.5}]), "limits[0].limit_kw", "breaker"),
        (lambda r: r.update(limits=[{"domain": "h0", "limit_mw": 2.2}]), "limits[0].limit_mw", "breaker rating"),
        (lambda r: r.update(limits=[{"domain": "campus", "limit_mw": 2.01}]), "limits[0].limit_mw", "interconnect"),
        # an interconnect limit that is not positive
        (lambda r: r["site"]["pcc"].update(limit_mw=0.0), "site.pcc.limit_mw", "greater than 0"),
        (lambda r: r["site"]["pcc"].update(limit_mw=-1.0), "site.pcc.limit_mw", "greater than 0"),
        (lambda r: r.update(limits=[{"domain": "h0", "limit_kw": 0}]), "limits[0].limit_kw", "greater than 0"),
        # rack devices outside the site, overlapping, or leaving racks uncontrolled
        (lambda r: r["devices"][3].update(first_rack=9), "devices[3].n_racks", "racks within the site's 0..15"),
        (lambda r: r["devices"][3].update(first_rack=4), "devices[3].first_rack", "rack 4 repeats"),
        (lambda r: r["devices"][3].update(n_racks=7), "devices", "racks 15 of 0..15 have none"),
        (lambda r: r["devices"][3].update(n_racks=65), "devices[3].n_racks", "less than or equal to 64"),
        # two writers of the one battery, a unit outside 1..247
        (lambda r: r["devices"].append(dict(r["devices"][1], unit=5)), "devices[4].kind", "at most one battery"),
        (lambda r: r["devices"][2].update(unit=0), "devices[2].unit", "greater than or equal to 1"),
        # leases and reversion shorter than a period: the devices would fall back between two writes
        (lambda r: r.update(safety={"lease_s": 0.9}), "safety.lease_s", "at least the period"),
        (lambda r: r.update(safety={"battery_revert_s": 0.5}), "safety.battery_revert_s", "at least the period"),
    ],
)
def test_inconsistent_config_is_refused_at_load(mutate: Any, key: str, expected: str) -> None:
    raw = small_site()
    mutate(raw)
    with pytest.raises(InputError) as info:
        validate_config(raw, "site.toml", Path("."))
    err = info.value
    assert "\n" not in str(err) and str(err).startswith("site.toml: ")
    assert err.key == key, str(err)
    assert expected in err.expected, str(err)


def test_refusal_names_the_file_and_key_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = small_site()
    raw["site"]["levels"][1]["rating_kw"] = 700
    path = _write(tmp_path, raw)
    assert dimmer_main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"dimmer: {path}: safety.safe_cap_frac: at most 0.")
    # the safe cap it suggests is accepted, a hair above it is not
    frac = float(err.split("at most ")[1].split(":")[0])
    raw["safety"] = {"safe_cap_frac": frac}
    validate_config(raw, "x", Path("."))
    raw["safety"] = {"safe_cap_frac": frac + 0.002}
    with pytest.raises(InputError):
        validate_config(raw, "x", Path("."))


def test_safe_cap_over_the_interconnect_is_a_warning_in_check_and_in_the_daemon_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """16 racks at the 840 W safe cap draw 1,431 kW: a 1.4 MW interconnect is a warning, not a refusal (a contract:
    the battery can cover the difference while failing safe; only breakers are refused)."""
    raw = small_site()
    raw["site"]["pcc"]["limit_mw"] = 1.4
    path = _write(tmp_path, raw)
    assert dimmer_main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    warning = "warning: campus: at the safe cap the racks under it could draw 1431 kW, above its 1400 kW interconnect"
    assert warning in out and "(safe_cap_frac <= 0.578 would hold it)" in out
    loaded = loaded_config(site={"pcc": {"limit_mw": 1.4, "ramp_mw_per_min": 0.4}})
    assert len(safe_cap_load_warnings(loaded)) == 1
    plant = FakePlant()
    d = Daemon(loaded, bus_factory=plant.factory, metrics_address=None, max_cycles=1)
    with caplog.at_level(logging.WARNING, logger="dimmer.daemon"):
        asyncio.run(d.run())
    assert sum(m.startswith("safe cap: campus: ") for m in caplog.messages) == 1


def test_the_served_fallback_cap_holds_the_interconnect_and_every_breaker(tmp_path: Path) -> None:
    """fallback_cap_w (what a served rack device falls back to when its lease runs out): every rack at it, with its
    fixed load and its BBU recharging, keeps every domain (the campus: the interconnect limit) within its rating, and
    it is the highest cap that does."""
    site = write_scenario(tmp_path, 30.0).site()  # 8 racks, a 900 kW row, a 0.85 MW interconnect
    cap = fallback_cap_w(site)

    def load(c: float) -> np.ndarray:
        rack = site.rack_power_w(np.full(site.n_racks, c)) + site.rack_storage.bbu_recharge_w
        return site.domain_load_w(rack)

    assert np.all(load(cap) <= site.domain_rating_w * (1 + 1e-9))
    assert load(cap)[0] == pytest.approx(site.pcc_limit_w, rel=1e-9)  # the interconnect binds, not the row
    assert np.any(load(cap + 1.0) > site.domain_rating_w)
    assert site.gpu.min_cap_w < cap < site.gpu.rated_w
    # a site whose racks overdraw the interconnect even at the lowest cap: the lowest cap
    tight = tmp_path / "tight.toml"
    tight.write_text(SCENARIO.format(duration=30.0).replace("limit_mw = 0.85", "limit_mw = 0.1"))
    assert fallback_cap_w(load_scenario(tight).site()) == site.gpu.min_cap_w
