"""The hierarchy as daemons: a building daemon per building and the campus coordinator's daemon, over real loopback
Modbus TCP, against the plant served by PlantServer (docs/daemon.md, "The hierarchy"; issue #13).

The register map first (`dimmer-building-v1`: what a building serves and its parent reads and writes, through
pymodbus's own client as well as ours), then whole runs with the faults between the levels: none, the coordinator
lost (each building holds its budget for the lease, then its safe budget), a building daemon lost (the coordinator
plans it at its worst case; its racks fall to their own devices' safe cap), and a slow link. Each run checks what
the plant recorded: no breaker tripped, the interconnect limit and the ramp rule held once the daemons settled.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.cli import sim_config
from dimmer.control.coordinator import BuildingReports
from dimmer.daemon import registers as R
from dimmer.daemon.building_device import BuildingDevice
from dimmer.daemon.building_server import BuildingServer
from dimmer.daemon.bus import DeviceRefused, ModbusTcpBus
from dimmer.daemon.config import validate_config
from dimmer.daemon.coordinator_daemon import CoordinatorDaemon
from dimmer.daemon.handles import tcp_bus_factory
from dimmer.daemon.loop import Daemon
from dimmer.errors import InputError
from dimmer.sim_hierarchy import building_config, coordinator_config
from gridsim.plant.grid import overlimit_s
from gridsim.scenario import LoadedScenario, load_scenario
from gridsim.serve import PlantServer
from tests.test_daemon_faults import overlimit_times, pcc_overlimit_s, ramp_over_s

# Two buildings of 8 GB300 racks (64 active GPUs each) behind a 1.55 MW interconnect: a priority-10 job in b0, a
# priority-1 job in b1. Uncontrolled the grid peaks at 1.88 MW (81 of 90 s over the limit); the flat controller
# and the in-process hierarchy hold it after their first seconds.
SCENARIO = """
name = "two-small-buildings"
seed = 5
duration_s = {duration}

[site]
gpu = "gb300"
gpus_per_rack = 72
active_gpus_per_rack = 64
spare_rack_frac = 0.0

[site.pcc]
limit_mw = 1.55
ramp_mw_per_min = 1.0
ramp_window_s = 10

[[site.levels]]
level = "building"
count = 2
rating_kw = 1000

[[site.levels]]
level = "rack"
count = 8

[site.storage.bess]
power_mw = 0.4
energy_mwh = 0.2

[[jobs]]
name = "train"
priority = 10
racks = [0, 8]
swing_frac = 0.35
iteration_s = 2.0
compute_frac = 0.7

[[jobs]]
name = "eval"
priority = 1
racks = [8, 16]
swing_frac = 0.5
iteration_s = 1.0
compute_frac = 0.8
"""
SPEED = 5.0
STALE_S = 5.0
LEASE_S = 10.0  # the rack devices' and the budgets' (dimmer-campus's lease_s default)
SETTLED_S = 25.0
WALL_LIMIT_S = 60.0


# -- the register map -------------------------------------------------------------------------------------------------


def _report(n_groups: int = 2) -> BuildingReports:
    one, groups = np.ones(1), np.ones((1, n_groups))
    return BuildingReports(
        t_s=np.zeros(1), import_w=one * 812_345.0, bound_w=one * 900_000.0, prior_w=one * 12_500.0,
        measured=np.ones(1, dtype=bool), return_w=one * 0.0, return_gpus=one * 0.0, base_w=one * 30_000.0,
        group_w=groups * [[400_000.0, 470_000.0]], floor_w=groups * [[200_000.0, 230_000.0]],
        demand_w=groups * [[500_000.0, 520_000.0]], back_w=one * 0.0, fill_w=one * 55_000.0,
    )  # fmt: skip


def test_a_coordinator_reports_as_flexibility_what_its_buildings_could_shed_and_its_battery(tmp_path: Path) -> None:
    """What the coordinator's VEN reports as available flexibility: each heard building's job groups above their
    floors (400-200 + 470-230 kW here), plus the battery's discharge headroom while it is online above its floor."""
    from dimmer.daemon.coordinator_daemon import sheddable_w
    from tests.test_dimmer_controller import _obs

    path = tmp_path / "two.toml"
    path.write_text(SCENARIO.format(duration=10))
    site = load_scenario(path).site()
    for online, soc, power, extra in ((True, 0.5, 100e3, 0.3e6), (False, 0.5, 0.0, 0.0), (True, 0.05, 0.0, 0.0)):
        obs = _obs(site, 1.0, 1000.0, bess_online=online, bess_soc_frac=soc, bess_power_w=power)
        assert sheddable_w(_report(), obs, site) == pytest.approx(440e3 + extra), (online, soc)
    unheard = replace(_report(), t_s=np.full(1, -np.inf))
    assert math.isnan(sheddable_w(unheard, _obs(site, 1.0, 1000.0), site))


def test_a_building_serves_its_report_and_holds_the_budget_it_is_written_for_its_lease() -> None:
    now = [100.0]

    async def go() -> None:
        srv = BuildingServer("b0", 1_000_000.0, 0.45, 2, clock=lambda: now[0])
        port = await srv.start()
        bus = ModbusTcpBus("127.0.0.1", port, timeout_s=2.0)
        dev = BuildingDevice(bus, 1, 2, 1_000_000.0)
        try:
            srv.publish(_report())
            r = await dev.read()
            assert r.ok, r.error
            assert r.values["import_w"] == pytest.approx(812_345.0, rel=1e-6)
            assert r.values["bound_w"] == pytest.approx(900_000.0, rel=1e-6)
            assert r.values["measured"] == 1.0 and r.values["update_count"] == 1.0
            assert np.allclose(r.values["group_w"], [400_000.0, 470_000.0], rtol=1e-6)
            assert np.allclose(r.values["demand_w"], [500_000.0, 520_000.0], rtol=1e-6)
            # before any budget: the safe one, its share of the interconnect limit in force
            assert srv.budget(1_550_000.0) == (pytest.approx(0.45 * 1_550_000.0), pytest.approx(math.nan, nan_ok=True))
            assert srv.state == R.BUDGET_NONE
            wrote = await dev.write_budget(700_000.0, 650_000.0, LEASE_S)
            assert wrote.heartbeat == 1
            ceiling, floor = srv.budget(1_550_000.0)
            assert (ceiling, floor) == (700_000.0, 650_000.0) and srv.state == R.BUDGET_HELD
            now[0] += LEASE_S + 0.5  # the lease runs out: the safe budget, never above the last one, no floor
            ceiling, floor = srv.budget(1_550_000.0)
            assert ceiling == pytest.approx(min(0.45 * 1_550_000.0, 700_000.0)) and math.isnan(floor)
            assert srv.state == R.BUDGET_SAFE and srv.lease_expiries == 1
            r = await dev.read()
            assert r.values["budget_state"] == R.BUDGET_SAFE
            assert r.values["ceiling_in_force_w"] == pytest.approx(ceiling, rel=1e-6)
        finally:
            await bus.close()
            await srv.stop()

    asyncio.run(go())


def _budget(lease_s: float, heartbeat: int, ceiling_w: float) -> list[int]:
    """The words of one budget write (lease, heartbeat, ceiling, no floor), encoded as the map declares them."""
    values = {"lease_s": lease_s, "heartbeat": heartbeat, "ceiling_w": ceiling_w, "floor_w": 0.0}
    return R.encode_block(R.BUILDING_HEADER, values)[R.BUDGET_AT : R.BUDGET_AT + R.BUDGET_LEN]


def test_the_building_map_refuses_what_it_does_not_declare_whoever_writes_it() -> None:
    """pymodbus's own client, not ours: a budget with a zero lease or a negative ceiling is refused with exception
    3 and changes nothing; a write to the report is refused with exception 2."""
    from pymodbus.client import AsyncModbusTcpClient

    async def go() -> None:
        srv = BuildingServer("b0", 1_000_000.0, 0.45, 2)
        port = await srv.start()
        client = AsyncModbusTcpClient("127.0.0.1", port=port)
        await client.connect()
        try:
            good = R.encode_block(
                R.BUILDING_HEADER, {"lease_s": 10.0, "heartbeat": 7, "ceiling_w": 5e5, "floor_w": 0.0}
            )
            words = good[R.BUDGET_AT : R.BUDGET_AT + R.BUDGET_LEN]
            rr = await client.write_registers(R.BUDGET_AT, words, device_id=1)
            assert not rr.isError() and srv.ceiling_w == 5e5
            zero_lease = R.encode_block(R.BUILDING_HEADER, {"lease_s": 0.0, "heartbeat": 8, "ceiling_w": 4e5})
            rr = await client.write_registers(
                R.BUDGET_AT, zero_lease[R.BUDGET_AT : R.BUDGET_AT + R.BUDGET_LEN], device_id=1
            )
            assert rr.isError() and rr.exception_code == 3
            negative = R.encode_block(R.BUILDING_HEADER, {"lease_s": 5.0, "heartbeat": 9, "ceiling_w": -1.0})
            rr = await client.write_registers(
                R.BUDGET_AT, negative[R.BUDGET_AT : R.BUDGET_AT + R.BUDGET_LEN], device_id=1
            )
            assert rr.isError() and rr.exception_code == 3
            rr = await client.write_registers(R.BUILDING_HEADER.offset("bound_w"), [0, 0], device_id=1)
            assert rr.isError() and rr.exception_code == 2
            assert srv.ceiling_w == 5e5 and srv.n_budgets == 1  # nothing refused reached the budget
        finally:
            client.close()
            await srv.stop()

    asyncio.run(go())


def test_a_coordinator_refuses_a_building_daemon_of_another_size() -> None:
    async def go() -> None:
        srv = BuildingServer("b1", 2_000_000.0, 0.45, 2)
        port = await srv.start()
        bus = ModbusTcpBus("127.0.0.1", port, timeout_s=2.0)
        try:
            srv.publish(_report())
            r = await BuildingDevice(bus, 1, 2, 1_000_000.0).read()
            assert not r.ok and "another building's daemon" in str(r.error)
            with pytest.raises(DeviceRefused):  # a unit it does not serve
                await bus.read(5, 0, 4)
        finally:
            await bus.close()
            await srv.stop()

    asyncio.run(go())


def test_the_site_device_reads_a_building_its_own_domains_and_a_coordinator_the_campus_record(tmp_path: Path) -> None:
    from dimmer.control.building_split import building_parts
    from dimmer.daemon.devices import SiteDevice
    from gridsim.serve import SITE_UNIT

    path = tmp_path / "two.toml"
    path.write_text(SCENARIO.format(duration=20))
    loaded = load_scenario(path)

    async def go() -> None:
        srv = PlantServer(loaded, speed=SPEED)
        await srv.start()
        bus = ModbusTcpBus("127.0.0.1", srv.port, timeout_s=2.0)
        try:
            site = srv.site
            b1 = building_parts(site)[1]
            mine = np.concatenate(([b1.domain], b1.domains))
            building = SiteDevice(bus, SITE_UNIT, site.n_domains, site.n_jobs, read=mine)
            campus = SiteDevice(bus, SITE_UNIT, site.n_domains, site.n_jobs, read=[0], slots=[0], width=site.n_domains)
            for _ in range(200):
                r, c = await building.read(), await campus.read()
                if r.ok and r.values["update_count"] > 0 and r.values["update_count"] == c.values["update_count"]:
                    break
                await asyncio.sleep(0.02)
            assert r.ok and c.ok, (r.error, c.error)
            obs = srv.published[int(r.values["update_count"])]
            np.testing.assert_allclose(r.array("domain_power_w"), obs.domain_power_w[mine], rtol=1e-6)
            assert r.array("domain_power_w").size == mine.size
            whole = c.array("domain_power_w")
            assert whole.size == site.n_domains and np.isnan(whole[1:]).all()
            assert whole[0] == pytest.approx(obs.domain_power_w[0], rel=1e-6)
        finally:
            await bus.close()
            await srv.stop()

    asyncio.run(go())


# -- configs ----------------------------------------------------------------------------------------------------------


Change = Callable[[dict[str, Any]], None]


def _flat(tmp_path: Path) -> tuple[LoadedScenario, dict[str, Any]]:
    path = tmp_path / "two.toml"
    path.write_text(SCENARIO.format(duration=60))
    loaded = load_scenario(path)
    device_map = {
        "host": "127.0.0.1",
        "port": 1502,
        "devices": [
            {"name": "pcc-meter", "kind": "sunspec-meter", "unit": 1, "base": 40000},
            {"name": "campus-battery", "kind": "sunspec-battery", "unit": 2, "base": 40000},
            {"name": "site", "kind": "site", "unit": 3},
            {"name": "racks-0", "kind": "rack", "unit": 10, "first_rack": 0, "n_racks": 8},
            {"name": "racks-1", "kind": "rack", "unit": 11, "first_rack": 8, "n_racks": 8},
        ],
    }
    return loaded, sim_config(loaded.scenario, device_map, "dimmer-campus", tmp_path, SPEED)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda c: c["building"].update(name="b7"), "building.name"),
        (lambda c: c["devices"].append({"kind": "battery", "host": "127.0.0.1", "unit": 2}), "devices[2].kind"),
        (lambda c: c["controller"].update(name="dimmer-campus"), "controller.name"),
        (lambda c: c["building"].update(allow=["not-a-network"]), "building.allow[0]"),
        (lambda c: c["building"].update(serve="127.0.0.1"), "building.serve"),
    ],
)
def test_a_bad_building_config_names_its_key(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], key: str
) -> None:
    _, flat = _flat(tmp_path)
    cfg = building_config(flat, "b1", 8, 16, {}, 0.45, tmp_path / "b1")
    validate_config(cfg, "b1.json", tmp_path)  # as generated: valid
    change(cfg)
    with pytest.raises(InputError) as exc:
        validate_config(cfg, "b1.json", tmp_path)
    assert exc.value.key == key


def test_a_building_daemon_counts_its_racks_from_its_first(tmp_path: Path) -> None:
    _, flat = _flat(tmp_path)
    loaded = validate_config(building_config(flat, "b1", 8, 16, {}, 0.45, tmp_path), "b1.json", tmp_path)
    assert loaded.role == "building" and loaded.site.n_racks == 8 and loaded.campus_site.n_racks == 16
    assert loaded.controller_params["pcc_margin_frac"] == 1.0  # the campus keeps the margin
    (racks,) = [d for d in loaded.config.devices if d.kind == "racks"]
    assert racks.first_rack == 0


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (lambda c: c["devices"].pop(), "devices"),  # no device for b1
        (lambda c: c["devices"].append(dict(c["devices"][-1], name="again")), "devices[5].building"),
        (lambda c: c["devices"][-1].update(building="b9"), "devices[4].building"),
        (lambda c: c["controller"].update(name="dimmer"), "controller.name"),
        (lambda c: c["controller"]["params"].update(lease_s=-1), "controller.params.lease_s"),
    ],
)
def test_a_bad_coordinator_config_names_its_key(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], key: str
) -> None:
    _, flat = _flat(tmp_path)
    cfg = coordinator_config(flat, {"b0": 5030, "b1": 5031})
    assert validate_config(cfg, "campus.json", tmp_path).role == "coordinator"
    change(cfg)
    with pytest.raises(InputError) as exc:
        validate_config(cfg, "campus.json", tmp_path)
    assert exc.value.key == key


# -- whole runs -------------------------------------------------------------------------------------------------------


@dataclass
class HierarchyRun:
    srv: PlantServer
    buildings: dict[str, Daemon]
    coordinator: CoordinatorDaemon
    samples: dict[str, Any] = field(default_factory=dict)

    @property
    def summary(self) -> dict[str, Any]:
        assert self.srv.summary is not None, self.srv.error
        return self.srv.summary


At = Callable[[float], Awaitable[None]]
Script = Callable[[HierarchyRun, At], Awaitable[None]]


class SlowBus:
    """A bus whose every request waits `delay_s` (wall) first: a slow link between the levels."""

    def __init__(self, bus: Any, delay_s: float) -> None:
        self.bus, self.delay_s = bus, delay_s

    async def read(self, unit: int, address: int, count: int) -> list[int]:
        await asyncio.sleep(self.delay_s)
        out: list[int] = await self.bus.read(unit, address, count)
        return out

    async def write(self, unit: int, address: int, values: list[int]) -> None:
        await asyncio.sleep(self.delay_s)
        await self.bus.write(unit, address, values)

    async def close(self) -> None:
        await self.bus.close()


def run_hierarchy(
    tmp_path: Path,
    duration_s: float,
    script: Script,
    link_delay_s: float = 0.0,
    building_period_s: float = 1.0,
    vtn: Any = None,
) -> HierarchyRun:
    """`vtn`: a utility's VTN (tests/test_utility_openadr.Vtn) started here, the coordinator its VEN."""
    path = tmp_path / "two.toml"
    path.write_text(SCENARIO.format(duration=duration_s))
    loaded = load_scenario(path)

    async def go() -> HierarchyRun:
        srv = PlantServer(loaded, speed=SPEED, hold_until_first_write=True)
        await srv.start()
        tasks: list[asyncio.Task[None]] = []
        try:
            flat = sim_config(loaded.scenario, srv.device_map(), "dimmer-campus", tmp_path, SPEED)
            flat["safety"] = {"stale_s": STALE_S, "lease_s": LEASE_S, "battery_revert_s": LEASE_S}
            buildings: dict[str, Daemon] = {}
            ready = {name: asyncio.Event() for name in ("b0", "b1")}
            for name, (lo, hi) in (("b0", (0, 8)), ("b1", (8, 16))):
                cfg = building_config(flat, name, lo, hi, {}, 0.97 * 0.5, tmp_path / name)
                period = {"period_s": building_period_s, "read_timeout_s": 0.9 * building_period_s}
                cfg["daemon"] = cfg["daemon"] | period
                d = Daemon(validate_config(cfg, name, tmp_path), speed=SPEED, metrics_address=None,
                           on_started=lambda _d, e=ready[name]: e.set())  # fmt: skip
                buildings[name] = d
                tasks.append(asyncio.create_task(d.run()))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ready.values())), 10.0)
            ports = {name: int(d.building.port) for name, d in buildings.items() if d.building is not None}
            plain = tcp_bus_factory()

            def factory(spec: Any) -> Any:
                bus = plain(spec)
                return SlowBus(bus, link_delay_s) if spec.kind == "building" and link_delay_s > 0 else bus

            raw = coordinator_config(flat, ports)
            if vtn is not None:
                url = await vtn.start()
                raw["utility"] = {"vtn_url": url, "ven_name": "campus", "poll_interval_s": 1, "report_interval_s": 1}
            cfg = validate_config(raw, "campus", tmp_path)
            coord = CoordinatorDaemon(cfg, speed=SPEED, bus_factory=factory, metrics_address=("127.0.0.1", 0))
            tasks.append(asyncio.create_task(coord.run()))
            run = HierarchyRun(srv, buildings, coord)

            async def at(t_s: float) -> None:
                while srv.plant_time_s() < t_s:
                    assert not srv.done.is_set(), f"the plant ended before t = {t_s} s"
                    await asyncio.sleep(0.005)

            await asyncio.wait_for(script(run, at), WALL_LIMIT_S)
            assert await srv.wait(WALL_LIMIT_S), "the plant did not finish"
        finally:
            for d in buildings.values():
                d.request_stop(write_safe=False)
            coord.request_stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await srv.stop()
            if vtn is not None:
                await vtn.stop()
        assert srv.error is None, srv.error
        return run

    return asyncio.run(go())


def assert_held(run: HierarchyRun, *, ramp_except: tuple[float, float] | None = None) -> None:
    s, res = run.summary, run.srv.result
    assert res is not None
    assert s["breaker_trips"] == 0
    assert pcc_overlimit_s(res, SETTLED_S) == 0.0, overlimit_times(res)
    windows = () if ramp_except is None else (ramp_except,)
    assert ramp_over_s(res, SETTLED_S, *windows) == 0.0, s["max_ramp_mw_per_min"]


async def _nothing(run: HierarchyRun, at: At) -> None:
    await at(1.0)


async def _scrape(run: HierarchyRun, at: At) -> None:
    import urllib.request

    await at(40.0)
    url = f"http://127.0.0.1:{run.coordinator.metrics_port}/metrics"
    run.samples["metrics"] = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())


@pytest.mark.slow
def test_the_hierarchy_as_daemons_holds_every_limit(tmp_path: Path) -> None:
    run = run_hierarchy(tmp_path, 70.0, _scrape)
    assert_held(run)
    # the coordinator's endpoint: each building's budget and bound, the interconnect, its cycles
    text = run.samples["metrics"]
    for name in ("b0", "b1"):
        budget = re.search(rf'^dimmer_building_budget_watts{{building="{name}"}} (\S+)$', text, re.M)
        bound = re.search(rf'^dimmer_building_bound_watts{{building="{name}"}} (\S+)$', text, re.M)
        assert budget is not None and bound is not None and 0 < float(budget.group(1)) < 1.1e6, name
        assert 0 < float(bound.group(1)) < 1.1e6
    cycles = re.search(r"^dimmer_cycles_total (\S+)$", text, re.M)
    assert cycles is not None and float(cycles.group(1)) >= 30
    for h in run.coordinator.buildings:  # each building's storage state, as its BBUs report it
        assert h.last is not None
        assert 0.5 <= h.last.values["bbu_soc_frac"] <= 1.0 and h.last.values["bbu_energy_j"] > 0
    for name, d in run.buildings.items():
        b = d.building
        assert b is not None and b.server.n_budgets >= 40 and b.server.lease_expiries == 0, name
    budgets = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines() if '"budgets_w"' in x]
    assert budgets and all(rec["unheard"] == [] for rec in budgets[5:])
    # every budget a number, within what the building could ever draw and its slack (2 % of that)
    most = run.coordinator.coordinator.max_w
    granted = np.array([rec["budgets_w"] for rec in budgets])
    assert np.all((granted > 0) & (granted <= 1.02 * most))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:It is recommended to use web.AppKey:UserWarning")  # openleadr's VTN, not ours
def test_openadr_curtailment_reaches_the_buildings_through_the_coordinator(tmp_path: Path) -> None:
    """The coordinator daemon as the campus's VEN: openleadr's own VTN on loopback curtails the interconnect from
    1.55 to 1.30 MW; the coordinator opts in, budgets its buildings under the limit in force, and the campus's
    import holds it once the buildings have come down, while its reports reach the VTN."""
    from tests.test_utility_openadr import Vtn

    event_w, ramp_up_s = 1.30e6, 2.0  # (wall seconds: 10 s of plant time at 5x)
    vtn = Vtn()

    async def curtail(run: HierarchyRun, at: At) -> None:
        coord = run.coordinator
        await at(SETTLED_S)
        assert coord.utility is not None and coord.utility.registered
        start = datetime.now(UTC) + timedelta(seconds=ramp_up_s + 1.0)
        vtn.curtail(start, 600.0, ramp_up_s, 0.0, kw=event_w / 1e3)
        # the event's start in plant time: the plant runs SPEED x the wall clock
        run.samples["t_event"] = run.srv.plant_time_s() + (start.timestamp() - time.time()) * SPEED
        await at(run.samples["t_event"] + 15.0)
        run.samples["limit_in_force"] = coord.last.obs.pcc_limit_w if coord.last is not None else math.nan
        run.samples["opt"] = vtn.opts.get("curtail-1")
        run.samples["pcc_age_s"] = coord.last.obs.pcc_age_s if coord.last is not None else math.nan
        run.samples["reports"] = {k: len(v) for k, v in vtn.reports.items()}

    run = run_hierarchy(tmp_path, 90.0, curtail, vtn=vtn)
    assert run.samples["opt"] == "optIn"
    assert run.samples["limit_in_force"] == pytest.approx(event_w)
    assert run.samples["pcc_age_s"] <= STALE_S  # the interconnect's meter planned on (its age was NaN: never)
    assert run.samples["reports"].get("import", 0) > 0 and run.samples["reports"].get("flexibility", 0) > 0
    res = run.srv.result
    assert res is not None and run.summary["breaker_trips"] == 0
    assert pcc_overlimit_s(res, SETTLED_S) == 0.0  # the scenario's own limit, throughout
    # the curtailed limit: held from 10 s after the event's start (the ramp rule's 1 MW/min takes 0.25 MW in 15 s,
    # and the utility's ramp-up began 10 s before the start) to the end of the run
    held = (res.t_s >= run.samples["t_event"] + 10.0) & (res.t_s < res.duration_s - 1.0)
    assert held.sum() > 100
    assert overlimit_s(res.tick["grid_w"][held], res.tick_s, event_w) == 0.0, float(res.tick["grid_w"][held].max())
    assert ramp_over_s(res, SETTLED_S) == 0.0


@pytest.mark.slow
def test_buildings_hold_their_budget_for_the_lease_when_the_coordinator_is_lost(tmp_path: Path) -> None:
    async def lose_parent(run: HierarchyRun, at: At) -> None:
        await at(30.0)
        run.samples["last"] = {n: d.building.server.ceiling_w for n, d in run.buildings.items() if d.building}
        run.coordinator.request_stop()
        await at(30.0 + LEASE_S / 2)
        run.samples["held"] = {n: d.building.server.state for n, d in run.buildings.items() if d.building}
        await at(30.0 + LEASE_S + 5.0)
        run.samples["after"] = {n: d.building.server.state for n, d in run.buildings.items() if d.building}

    run = run_hierarchy(tmp_path, 70.0, lose_parent)
    assert run.samples["held"] == {"b0": R.BUDGET_HELD, "b1": R.BUDGET_HELD}
    assert run.samples["after"] == {"b0": R.BUDGET_SAFE, "b1": R.BUDGET_SAFE}
    for name, d in run.buildings.items():
        assert d.building is not None and d.building.server.lease_expiries == 1, name
    assert_held(run)


@pytest.mark.slow
def test_a_lost_building_daemon_is_planned_at_its_worst_case(tmp_path: Path) -> None:
    async def lose_child(run: HierarchyRun, at: At) -> None:
        await at(30.0)
        run.samples["sent"] = float(run.coordinator.coordinator.sent_w[1])
        run.buildings["b1"].request_stop(write_safe=False)  # gone: no safe caps, its registers no longer served
        await at(30.0 + STALE_S + 5.0)
        last = run.coordinator.last
        assert last is not None
        run.samples["b1_t"] = float(last.reports.t_s[1])
        run.samples["b0_budget"] = float(last.budgets.ceiling_w[0])

    run = run_hierarchy(tmp_path, 70.0, lose_child)
    assert run.samples["b1_t"] < 30.0  # its last report, from before it was lost
    records = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines() if '"unheard"' in x]
    assert any(rec["unheard"] == ["b1"] for rec in records)
    # planned at the most its last budget lets it draw, within that budget's lease: b0 gets what the room leaves
    room = 1.55e6 + 0.4e6  # the interconnect and the battery's rating
    assert run.samples["b0_budget"] + run.samples["sent"] <= room
    assert run.srv.racks.lease_expiries >= 1  # b1's racks fell to their own devices' safe cap
    # that fall is a step nobody controls (the devices' own fallback, a lease after the daemon went): the ramp rule
    # is held outside the window that measures it
    expiry = 30.0 + LEASE_S
    assert_held(run, ramp_except=(expiry - 2.0, expiry + run.srv.site.ramp_window_s + 2.0))


@pytest.mark.slow
def test_buildings_at_twice_their_coordinators_rate_keep_every_limit(tmp_path: Path) -> None:
    run = run_hierarchy(tmp_path, 70.0, _nothing, building_period_s=0.5)
    for d in run.buildings.values():
        assert d.n_cycles >= 2 * run.coordinator.n_cycles - 10  # (each at its own period)
        assert d.building is not None and d.building.server.lease_expiries == 0
    assert_held(run)


@pytest.mark.slow
def test_a_slow_link_between_the_levels_keeps_every_limit(tmp_path: Path) -> None:
    delay_s = 0.3 / SPEED  # 0.3 plant seconds each way, every request
    t0 = time.monotonic()
    run = run_hierarchy(tmp_path, 70.0, _nothing, link_delay_s=delay_s)
    assert time.monotonic() - t0 < WALL_LIMIT_S
    assert run.coordinator.n_cycles >= 40
    for d in run.buildings.values():
        assert d.building is not None and d.building.server.lease_expiries == 0
    assert_held(run)


@pytest.mark.parametrize(("name", "role"), [("building-b0.toml", "building"), ("coordinator.toml", "coordinator")])
def test_the_example_hierarchy_configs_are_valid(name: str, role: str) -> None:
    from dimmer.daemon.config import load_config

    loaded = load_config(Path(__file__).resolve().parents[1] / "examples" / name)
    assert loaded.role == role


@pytest.mark.parametrize(
    ("args", "prefix"),
    [
        (["run", "--sim", "--live-buildings", "2"], "--live-buildings: "),  # not dimmer-campus
        (["run", "--sim", "--controller", "dimmer-campus", "--live-buildings", "0"], "--live-buildings: "),
        (["run", "--config", "examples/coordinator.toml", "--live-buildings", "2"], "--live-buildings: "),
    ],
)
def test_live_buildings_is_refused_where_it_means_nothing(
    args: list[str], prefix: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dimmer.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("dimmer: " + prefix) and err.count("\n") == 1, err


def test_site_units_may_not_overlap_nor_pass_the_site(tmp_path: Path) -> None:
    _, flat = _flat(tmp_path)
    site = next(d for d in flat["devices"] if d["kind"] == "site")
    n = load_scenario(tmp_path / "two.toml").site().n_domains
    split = [site | {"name": "site-a", "first_domain": 0, "n_domains": 10}, site | {"name": "site-b", "unit": 4,
             "first_domain": 10, "n_domains": n - 10}]  # fmt: skip
    cfg = flat | {"devices": [d for d in flat["devices"] if d["kind"] != "site"] + split}
    assert validate_config(cfg, "split.json", tmp_path).role == "flat"  # two units, every domain once
    split[1]["first_domain"] = 9
    with pytest.raises(InputError) as exc:
        validate_config(cfg, "split.json", tmp_path)
    assert exc.value.key.endswith(".n_domains") or exc.value.key.endswith(".first_domain")
    split[1] |= {"first_domain": 5, "n_domains": 3}
    with pytest.raises(InputError) as exc:
        validate_config(cfg, "split.json", tmp_path)
    assert exc.value.key == f"devices[{len(cfg['devices']) - 1}].first_domain"


@pytest.mark.parametrize("role", ["flat", "b1", "coordinator"])
def test_a_site_split_over_units_reads_as_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    """A site of more domains than one unit holds (at a million GPUs: 15,093 against 10,874) is served over
    consecutive units; each daemon reads what it needs of each and sees the site's domains where they belong.
    (Here one unit holds 7 of the 19 domains, so the small campus is served over three.)"""
    from dimmer.daemon.handles import build_devices, note_reading
    from dimmer.daemon.observe import ObservationBuilder, Snapshot

    monkeypatch.setattr(R, "SITE_MAX_DOMAINS", 7)
    path = tmp_path / "two.toml"
    path.write_text(SCENARIO.format(duration=20))
    loaded = load_scenario(path)

    async def go() -> None:
        srv = PlantServer(loaded, speed=SPEED)
        assert len(srv.site_parts) == 3
        await srv.start()
        try:
            flat = sim_config(loaded.scenario, srv.device_map(), "dimmer-campus", tmp_path, SPEED)
            flat["controller"]["name"] = "dimmer"
            if role == "b1":
                raw = building_config(flat, "b1", 8, 16, {}, 0.45, tmp_path)
            elif role == "coordinator":
                raw = coordinator_config(
                    flat | {"controller": {"name": "dimmer-campus", "params": {}}}, {"b0": 1, "b1": 2}
                )
            else:
                raw = flat
            cfg = validate_config(raw, role, tmp_path)
            handles = [h for h in build_devices(cfg, tcp_bus_factory()) if h.kind == "site"]
            assert len(handles) == 3
            for _ in range(200):
                readings = [await h.device.read() for h in handles]
                counts = {r.values["update_count"] for r in readings}
                if all(r.ok for r in readings) and len(counts) == 1 and counts != {0.0}:
                    break
                await asyncio.sleep(0.02)
            assert all(r.ok for r in readings), [r.error for r in readings]
            for h, r in zip(handles, readings, strict=True):
                note_reading(h, r, cfg.config.safety, SPEED)
            obs = ObservationBuilder(cfg, handles, SPEED).build(Snapshot(time.monotonic(), 0.0, tuple(readings),
                                                                        tuple(r.t_s for r in readings)))  # fmt: skip
            published = srv.published[int(readings[0].values["update_count"])]
            if role == "flat":
                np.testing.assert_allclose(obs.domain_power_w, published.domain_power_w, rtol=1e-6)
            elif role == "b1":
                part = cfg.part
                assert part is not None
                mine = np.concatenate(([part.domain], part.domains))
                np.testing.assert_allclose(obs.domain_power_w, published.domain_power_w[mine], rtol=1e-6)
            else:
                assert obs.pcc_power_w == pytest.approx(published.domain_power_w[0], rel=1e-6)
                assert np.isnan(obs.domain_power_w[1:]).all()  # the campus's record only
            for h in handles:
                await h.device.bus.close()
        finally:
            await srv.stop()

    asyncio.run(go())


def test_a_coordinator_goes_on_through_a_sighup(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGHUP's default ends a process: under systemd a `reload` would have taken the campus's budgets away."""
    import os
    import signal

    _, flat = _flat(tmp_path)
    cfg = validate_config(coordinator_config(flat, {"b0": 5030, "b1": 5031}), "campus.json", tmp_path)

    async def go() -> None:
        coord = CoordinatorDaemon(cfg, metrics_address=None)
        coord.install_signal_handlers()
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            await asyncio.sleep(0.1)
        finally:
            coord.audit.close()
            coord.metrics.close()

    with caplog.at_level("WARNING", logger="dimmer.coordinator"):
        asyncio.run(go())
    assert any("does not reload" in r.getMessage() for r in caplog.records)
