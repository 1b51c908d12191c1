"""The daemon loop against in-memory devices: modes, observation, writes, every fail-safe, state, metrics, audit."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.daemon import registers as R
from dimmer.daemon.loop import (
    ALLOWED,
    CycleResult,
    Daemon,
    IllegalTransition,
    Mode,
    ModeMachine,
    SystemdNotifier,
)
from dimmer.daemon.state import controller_state, load_into, save_state_file
from tests.daemon_fakes import BATTERY_MODELS, BATTERY_UNIT, RACK_UNITS, SUNSPEC_BASE, FakePlant, loaded_config

SAFE_W = 0.6 * 1400.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(plant: FakePlant, clock: FakeClock, tmp: Path | None = None, **kw: Any) -> Daemon:
    sections = kw.pop("sections", {})
    return Daemon(loaded_config(tmp, **sections), bus_factory=plant.factory, clock=clock, metrics_address=None, **kw)


async def step(d: Daemon) -> CycleResult:
    res = await d.cycle()
    assert res is not None
    return res


async def cycles(d: Daemon, plant: FakePlant, clock: FakeClock, n: int, dt: float = 1.0) -> None:
    for _ in range(n):
        await d.cycle()
        clock.t += dt
        plant.tick()


# -- modes -------------------------------------------------------------------------------------------------------------


def test_mode_transitions() -> None:
    seen: list[tuple[Mode, Mode]] = []
    m = ModeMachine(lambda a, b: seen.append((a, b)))
    assert m.mode is Mode.STARTING
    m.to(Mode.RUNNING)
    m.to(Mode.RUNNING)  # staying is a no-op
    m.to(Mode.FAILSAFE)
    m.to(Mode.RUNNING)
    m.to(Mode.STOPPING)
    assert seen == [
        (Mode.STARTING, Mode.RUNNING),
        (Mode.RUNNING, Mode.FAILSAFE),
        (Mode.FAILSAFE, Mode.RUNNING),
        (Mode.RUNNING, Mode.STOPPING),
    ]
    for target in (Mode.RUNNING, Mode.FAILSAFE, Mode.STARTING):
        with pytest.raises(IllegalTransition):
            m.to(target)  # STOPPING is final
    m2 = ModeMachine()
    m2.to(Mode.RUNNING)
    with pytest.raises(IllegalTransition):
        m2.to(Mode.STARTING)  # never back to STARTING
    assert all(Mode.STARTING not in v for v in ALLOWED.values())


# -- the normal cycle --------------------------------------------------------------------------------------------------


def test_cycle_reads_decides_writes() -> None:
    async def go() -> None:
        plant, clock = FakePlant(rack_w=100e3, pcc_w=1.5e6), FakeClock()
        d = make(plant, clock)
        res = await step(d)
        obs = res.obs
        assert d.mode is Mode.RUNNING
        assert obs.pcc_power_w == pytest.approx(1.5e6, rel=1e-6)
        assert np.allclose(obs.rack_power_w, 100e3, rtol=1e-6)
        assert np.all(obs.rack_age_s == 0.0)
        assert obs.bess_online and obs.bess_soc_frac == pytest.approx(0.6)
        # nobody measures the hall and rows: NaN, never zero; no site device: thermal unknown
        assert np.all(np.isnan(obs.domain_power_w[1:])) and np.all(np.isinf(obs.domain_age_s[1:]))
        assert np.all(np.isnan(obs.domain_thermal_frac))
        # every rack got the cap the controller decided; the battery its setpoint
        assert np.allclose(plant.caps_written(), res.actions.rack_cap_w, rtol=1e-6)
        assert plant.writes_to(BATTERY_UNIT)
        assert plant.battery_setpoint_w() == pytest.approx(res.actions.bess_setpoint_w, abs=10.0)
        assert res.writes_ok == 3 and res.writes_failed == 0
        await d.shutdown()

    asyncio.run(go())


def test_missing_rack_device_is_nan_not_zero() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        plant.bus.fail("unreachable", units=[RACK_UNITS[1]], ops=["read"])
        d = make(plant, clock)
        # STARTING waits (writing nothing) for every device's first reading, at most stale_s (5 s)
        for _ in range(5):
            assert await d.cycle() is None
            assert d.mode is Mode.STARTING and plant.bus.writes == []
            clock.t += 1.0
            plant.tick()
        res = await d.cycle()  # then it goes on without the missing device
        assert res is not None and d.mode is Mode.RUNNING
        assert np.all(np.isfinite(res.obs.rack_power_w[:8]))
        assert np.all(np.isnan(res.obs.rack_power_w[8:])) and np.all(np.isinf(res.obs.rack_age_s[8:]))
        # never-read racks are not trusted: their caps go to the safe level at once
        assert np.all(res.actions.rack_cap_w[8:] <= SAFE_W + 1e-9)
        await d.shutdown()

    asyncio.run(go())


# -- fail-safes --------------------------------------------------------------------------------------------------------


def test_stale_meter_moves_caps_to_safe_and_loop_continues() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock)
        await cycles(d, plant, clock, 3)
        assert np.all(plant.caps_written() > SAFE_W)  # a light load: caps at rated
        plant.bus.fail("unreachable", units=[1], ops=["read"])  # the PCC meter stops answering
        ages = []
        for _ in range(8):
            res = await step(d)
            ages.append(res.obs.pcc_age_s)
            clock.t += 1.0
            plant.tick()
        assert ages[0] == pytest.approx(1.0) and ages[-1] == pytest.approx(8.0)  # the age grows, the value stays
        handle = next(h for h in d.handles if h.name == "pcc")
        assert handle.flagged  # flagged after fail_after (3) failures in a row, not before
        assert d.mode is Mode.RUNNING  # the loop keeps running
        assert np.all(plant.caps_written() <= SAFE_W + 1e-6)
        # the meter answers again: the flag clears, caps may rise again (slowly)
        plant.bus.heal()
        await cycles(d, plant, clock, 3)
        assert not handle.flagged

    asyncio.run(go())


def test_flag_is_debounced() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock)
        h = next(h for h in d.handles if h.name == "row0")
        plant.bus.fail("unreachable", units=[RACK_UNITS[0]], ops=["read"], times=2)
        await cycles(d, plant, clock, 2)
        assert h.failures["read"] == 2 and not h.flagged  # two failures: not yet
        await cycles(d, plant, clock, 1)
        assert h.failures["read"] == 0 and not h.flagged  # answered again
        plant.bus.fail("unreachable", units=[RACK_UNITS[0]], ops=["read"], times=3)
        await cycles(d, plant, clock, 3)
        assert h.flagged
        assert d.metrics.registry.get_sample_value("dimmer_device_up", {"device": "row0"}) == 0.0
        assert d.metrics.registry.get_sample_value("dimmer_comm_errors_total", {"device": "row0", "op": "read"}) == 5

    asyncio.run(go())


def test_stuck_update_counter_is_stale() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock)
        await cycles(d, plant, clock, 2)
        for _ in range(7):  # the rack devices answer, with the same update_count: old values
            res = await step(d)
            clock.t += 1.0
            plant.tick(move_counter=False)
        assert res.obs.rack_age_s[0] > 5.0
        assert all(h.stuck for h in d.handles if h.kind == "racks")
        assert np.all(plant.caps_written() <= SAFE_W + 1e-6)

    asyncio.run(go())


def test_a_battery_whose_802_heartbeat_stops_is_stale() -> None:
    """802 Hb is the battery's own heartbeat: while it moves the battery is used; once it stands still for longer
    than stale_s the battery answers with old values and is planned as off line (no setpoint relies on it)."""

    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        hb_at = SUNSPEC_BASE + R.model_offsets(list(BATTERY_MODELS))[802] + R.MODEL_802.offset("Hb")
        d = make(plant, clock)
        for hb in range(1, 5):
            plant.bus.set_words(BATTERY_UNIT, hb_at, [hb])
            res = await step(d)
            clock.t += 1.0
            plant.tick()
        assert res.obs.bess_online
        for _ in range(7):  # Hb stays at 4
            res = await step(d)
            clock.t += 1.0
            plant.tick()
        battery = next(h for h in d.handles if h.kind == "battery")
        assert battery.stuck and not res.obs.bess_online
        plant.bus.set_words(BATTERY_UNIT, hb_at, [5])  # it beats again
        await d.cycle()  # the reading that sees it move
        clock.t += 1.0
        res = await step(d)
        assert not battery.stuck and res.obs.bess_online

    asyncio.run(go())


def test_controller_exception_failsafe_then_recovers() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock)
        await cycles(d, plant, clock, 2)
        real = d.controller.step
        calls = {"n": 0}

        def broken(obs: Any) -> Any:
            calls["n"] += 1
            raise ZeroDivisionError("boom")

        d.controller.step = broken  # type: ignore[method-assign]
        res = await step(d)
        assert d.mode is Mode.FAILSAFE and res.mode is Mode.FAILSAFE
        assert np.allclose(plant.caps_written(), SAFE_W)
        assert res.actions.bess_setpoint_w == 0.0
        assert any("controller failed" in r.reason for r in res.actions.reasons)
        clock.t += 1.0
        plant.tick()
        await d.cycle()  # still broken: still FAILSAFE, still reading
        assert d.mode is Mode.FAILSAFE and calls["n"] == 2
        d.controller.step = real  # type: ignore[method-assign]
        clock.t += 1.0
        plant.tick()
        res = await step(d)
        assert d.mode is Mode.RUNNING
        assert d.metrics.registry.get_sample_value("dimmer_failsafe_entries_total") == 1.0
        # caps come back from the safe level at the controller's slew, never in one jump
        assert np.all(res.actions.rack_cap_w <= 1400.0)

    asyncio.run(go())


def test_refused_write_is_flagged_not_fatal() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock)
        plant.bus.fail("refused", code=3, units=[RACK_UNITS[1]], ops=["write"])
        for _ in range(4):
            res = await step(d)
            clock.t += 1.0
            plant.tick()
        assert res.writes_failed == 1 and res.writes_ok == 2
        h = next(h for h in d.handles if h.name == "row1")
        assert h.flagged and d.mode is Mode.RUNNING

    asyncio.run(go())


def test_read_only_devices_are_never_written() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        raw_devices = loaded_config().config.model_dump()["devices"]
        raw_devices[1]["read_only"] = True  # the battery
        raw_devices[3]["read_only"] = True  # rack row 1
        d = make(plant, clock, sections={"devices": raw_devices})
        await cycles(d, plant, clock, 3)
        await d.shutdown()  # the stop's safe caps respect read-only too
        assert not plant.writes_to(BATTERY_UNIT) and not plant.writes_to(RACK_UNITS[1])
        assert plant.writes_to(RACK_UNITS[0])

    asyncio.run(go())


def test_dry_run_never_writes() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock, dry_run=True)
        plant.bus.fail("unreachable", units=[1], ops=["read"])  # stale meter: safe caps are decided ...
        await cycles(d, plant, clock, 8)
        assert d.last is not None and np.all(d.last.actions.rack_cap_w <= SAFE_W + 1e-6)

        def broken(obs: Any) -> Any:
            raise ZeroDivisionError("boom")

        d.controller.step = broken  # type: ignore[method-assign]
        await d.cycle()  # ... and FAILSAFE ...
        await d.shutdown()  # ... and the stop: none of it is written
        assert plant.bus.writes == []
        assert plant.bus.reads > 0

    asyncio.run(go())


def test_stop_writes_safe_caps() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock)
        await cycles(d, plant, clock, 2)
        assert np.all(plant.caps_written() > SAFE_W)
        await d.shutdown()
        assert d.mode is Mode.STOPPING
        assert np.allclose(plant.caps_written(), SAFE_W)
        assert plant.battery_setpoint_w() == pytest.approx(0.0, abs=10.0)

    asyncio.run(go())


def test_run_loop_period_and_overruns() -> None:
    async def go() -> None:
        plant = FakePlant()
        loaded = loaded_config(daemon={"period_s": 1.0, "metrics_address": ""})
        # speed 50: a 20 ms wall period
        d = Daemon(loaded, bus_factory=plant.factory, metrics_address=None, speed=50.0, max_cycles=10)
        t0 = asyncio.get_running_loop().time()
        await d.run()
        wall = asyncio.get_running_loop().time() - t0
        assert d.n_cycles == 10
        assert 0.15 < wall < 2.0  # nine 20 ms waits, give or take a slow machine
        assert d.mode is Mode.STOPPING

    asyncio.run(go())


# -- state -------------------------------------------------------------------------------------------------------------


def test_state_saved_and_restored(tmp_path: Path) -> None:
    async def go() -> None:
        plant, clock = FakePlant(rack_w=130e3, pcc_w=2.05e6), FakeClock()
        sections = {"daemon": {"state_file": "state.json", "state_every": 2, "metrics_address": ""}}
        d = make(plant, clock, tmp_path, sections=sections)
        await cycles(d, plant, clock, 6)
        await d.shutdown()
        ctrl = d.controller
        assert (tmp_path / "state.json").is_file()
        d2 = make(plant, clock, tmp_path, sections=sections)
        assert d2._restored
        c1, c2 = ctrl, d2.controller
        assert np.array_equal(c1.cap_w, c2.cap_w)  # type: ignore[attr-defined]
        assert c1.grid_target_w == c2.grid_target_w  # type: ignore[attr-defined]
        assert np.array_equal(c1.domain_env._buf, c2.domain_env._buf, equal_nan=True)  # type: ignore[attr-defined]
        assert np.array_equal(c1.recent_rise_w, c2.recent_rise_w)  # type: ignore[attr-defined]
        # the import's history the ramp rule is read from (the utility's meter remembers it across a restart)
        assert c1.ramp_room.seen > 0  # type: ignore[attr-defined]
        assert c1.ramp_room.seen == c2.ramp_room.seen  # type: ignore[attr-defined]
        assert np.array_equal(c1.ramp_room.history_w, c2.ramp_room.history_w, equal_nan=True)  # type: ignore[attr-defined]
        assert c1.return_hold.spent_j == c2.return_hold.spent_j  # type: ignore[attr-defined]
        assert c1.pcc_check.sums[0] > 0  # type: ignore[attr-defined]
        assert np.array_equal(c1.pcc_check.sums, c2.pcc_check.sums)  # type: ignore[attr-defined]
        assert c2.t_last_s is None  # type: ignore[attr-defined]
        # the restored controller decides what the old one would have, one period on
        res = await step(d2)
        t_next = c1.t_last_s + d.loaded.config.daemon.period_s  # type: ignore[attr-defined]
        old = c1.step(dataclasses.replace(res.obs, t_s=t_next))
        assert np.array_equal(old.rack_cap_w, res.actions.rack_cap_w)
        assert old.bess_setpoint_w == pytest.approx(res.actions.bess_setpoint_w)

    asyncio.run(go())


def test_corrupt_or_mismatched_state_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plant, clock = FakePlant(), FakeClock()
    path = tmp_path / "state.json"
    sections = {"daemon": {"state_file": str(path), "metrics_address": ""}}
    path.write_text("{not json")
    d = make(plant, clock, tmp_path, sections=sections)
    assert not d._restored and "ignored" in caplog.text
    fresh_caps = d.controller.cap_w.copy()  # type: ignore[attr-defined]
    # a state from another site (a different job list)
    doc = controller_state(d.controller, d.loaded.site)
    assert doc is not None
    doc["site"]["jobs"] = ["other"]
    save_state_file(path, doc)
    assert not load_into(d.controller, d.loaded.site, path, 600.0)
    # a state too old, a cap out of range, a wrong shape: each ignored, the controller untouched
    for mutate in (
        lambda x: x.update(saved_at_unix_s=x["saved_at_unix_s"] - 3600),
        lambda x: x["state"].update(cap_w={"shape": [1], "data": [5000.0]}),
        lambda x: x["state"].update(floor_w={"shape": [3], "data": [0, 0, 0]}),
        lambda x: x["state"]["domain_env"].update(i=99),
        lambda x: x["state"].update(pcc_fit={"shape": [5], "data": ["nan", 0, 0, 0, 0]}),
        lambda x: x["state"].update(recent_rise_w={"shape": [1, 1], "data": [0.0]}),
        # an import history with a gap after a known reading, or a return hold that has burned less than nothing
        lambda x: x["state"]["ramp_history_w"].update(
            data=[1e6] * (len(x["state"]["ramp_history_w"]["data"]) - 1) + ["nan"]
        ),
        lambda x: x["state"].update(return_hold={"spent_j": -1.0, "released": False}),
    ):
        bad = controller_state(d.controller, d.loaded.site)
        assert bad is not None
        mutate(bad)
        save_state_file(path, bad)
        assert not load_into(d.controller, d.loaded.site, path, 600.0)
        assert np.array_equal(d.controller.cap_w, fresh_caps)  # type: ignore[attr-defined]
    good = controller_state(d.controller, d.loaded.site)
    assert good is not None
    save_state_file(path, good)
    assert load_into(d.controller, d.loaded.site, path, 600.0)
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary left behind


# -- reload ------------------------------------------------------------------------------------------------------------


def test_reload_keeps_old_config_when_new_is_invalid(tmp_path: Path) -> None:
    from tests.test_daemon_config import _write

    async def go() -> None:
        from tests.daemon_fakes import small_config

        plant, clock = FakePlant(), FakeClock()
        raw = small_config()
        path = _write(tmp_path, raw)
        loaded = loaded_config(tmp_path)
        d = Daemon(loaded, config_path=path, bus_factory=plant.factory, clock=clock, metrics_address=None)
        await cycles(d, plant, clock, 2)
        path.write_text(path.read_text().replace("n_racks = 8", "n_racks = 7", 1))  # racks 7 uncovered
        assert not await d.reload()
        assert d.loaded is loaded
        await cycles(d, plant, clock, 1)
        assert d.mode is Mode.RUNNING
        raw["safety"] = {"safe_cap_frac": 0.5}
        _write(tmp_path, raw)
        assert await d.reload()
        assert d.loaded.safe_cap_w == pytest.approx(700.0)
        # the controller's filters carried over
        assert d.controller.grid_target_w is not None  # type: ignore[attr-defined]
        await d.shutdown()
        assert np.allclose(plant.caps_written(), 700.0)

    asyncio.run(go())


# -- observability -----------------------------------------------------------------------------------------------------


def test_prometheus_endpoint_scraped_over_http() -> None:
    async def go() -> None:
        plant = FakePlant()
        loaded = loaded_config()
        scraped: list[str] = []

        def scrape(res: Any) -> None:
            if res.n == 3 and d.metrics_port:
                url = f"http://127.0.0.1:{d.metrics_port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as r:
                    scraped.append(r.read().decode())

        d = Daemon(
            loaded,
            bus_factory=plant.factory,
            metrics_address=("127.0.0.1", 0),
            speed=50.0,
            max_cycles=4,
            on_cycle=scrape,
        )
        await d.run()
        assert scraped, "the endpoint was not scraped"
        text = scraped[0]
        for name in (
            'dimmer_domain_measured_watts{domain="campus"} 1.5e+06',
            'dimmer_domain_limit_watts{domain="h0/r1"} 1.1e+06',
            "dimmer_domain_planned_watts{",
            "dimmer_domain_enforced_watts{",
            "dimmer_bess_soc_ratio 0.6",
            "dimmer_cycle_seconds_bucket{",
            "dimmer_cycle_overruns_total",
            'dimmer_comm_errors_total{device="pcc",op="read"} 0.0',
            'dimmer_mode{dimmer_mode="running"} 1.0',
            "dimmer_cycles_total 3.0",
        ):
            assert name in text, name
        assert "k0" not in text  # rack-level domains only on request

    asyncio.run(go())


def test_audit_log_records_decisions_and_writes(tmp_path: Path) -> None:
    async def go() -> None:
        plant, clock = FakePlant(rack_w=135e3, pcc_w=2.1e6), FakeClock()
        d = make(plant, clock, tmp_path, sections={"daemon": {"audit_log": "audit.jsonl", "metrics_address": ""}})
        await cycles(d, plant, clock, 3)
        await d.shutdown()
        lines = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
        assert [x.get("cycle") for x in lines[:3]] == [1, 2, 3]
        first = lines[0]
        assert first["mode"] == "running" and first["dry_run"] is False
        devices = {w["device"] for w in first["writes"]}
        assert devices == {"bess", "row0", "row1"}
        row0 = next(w for w in first["writes"] if w["device"] == "row0")
        assert row0["racks"] == [0, 8] and row0["ok"] is True
        assert sum(c for _, c in row0["cap_w"]) == 8  # run-length encoded caps cover the 8 racks
        # an overloaded campus (2.1 MW on a 2 MW interconnect): the controller said why it cut
        assert any(
            r["layer"] in ("grid", "capping", "emergency", "rack-storage") for x in lines[:3] for r in x["reasons"]
        )
        assert lines[-1]["event"] == "stop"
        # a battery write carries what went on the wire: the model, its scale factor, every request's raw words
        bess = next(w for w in first["writes"] if w["device"] == "bess")
        bw = bess["battery_write"]
        assert bw["model"] == 704 and bw["scale_factor"] == 1 and bw["read_back"] is True
        first_cycle = plant.writes_to(2)[:2]  # the reversion timer, then the setpoint (the heartbeat follows)
        assert [(r["address"], r["words"]) for r in bw["requests"]] == [(a, list(w)) for _, a, w in first_cycle]
        setpoint = next(r for r in bw["requests"] if len(r["words"]) == 6)["words"]
        assert float(R.decode_int32(setpoint[2:4])[0]) * 10 == pytest.approx(bess["setpoint_w"], abs=10)

    asyncio.run(go())


def test_watchdog_notifications(tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(sock_path))
    srv.settimeout(2.0)
    try:

        async def go() -> None:
            plant = FakePlant()
            d = Daemon(
                loaded_config(),
                bus_factory=plant.factory,
                metrics_address=None,
                speed=50.0,
                max_cycles=3,
                notifier=SystemdNotifier(str(sock_path)),
            )
            await d.run()

        asyncio.run(go())
        got = [srv.recv(256).decode() for _ in range(5)]
    finally:
        srv.close()
    assert got[0].startswith("READY=1")
    assert got[1:4] == ["WATCHDOG=1"] * 3
    assert got[4] == "STOPPING=1"


def test_notifier_without_socket_is_silent() -> None:
    n = SystemdNotifier("")
    assert n.address is None and not n.notify("READY=1")


def test_starting_waits_for_first_publication() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        plant.count = -1
        plant.tick()  # update_count 0: the rack devices have published nothing yet
        d = make(plant, clock)
        assert await d.cycle() is None
        clock.t += 1.0
        plant.tick()  # the first publication
        res = await d.cycle()
        assert res is not None and d.mode is Mode.RUNNING
        assert np.all(res.actions.rack_cap_w > SAFE_W)  # decided on a whole site: nothing cut for want of data

    asyncio.run(go())


def test_stop_before_any_write_leaves_devices_alone() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock)
        await d.shutdown()  # SIGTERM while STARTING: nothing was written, nothing is
        assert plant.bus.writes == [] and d.mode is Mode.STOPPING

    asyncio.run(go())


def test_recent_cycle_times_keep_a_fixed_footprint() -> None:
    from dimmer.daemon.metrics import RecentDurations

    ring = RecentDurations(size=100)
    buf = ring._buf
    assert len(ring) == 0 and ring.values().size == 0
    for i in range(250):
        ring.append(float(i))
    assert ring._buf is buf and buf.size == 100  # never reallocated
    assert len(ring) == 100
    assert sorted(ring.values().tolist()) == [float(i) for i in range(150, 250)]  # the latest 100


# -- a meter whose reading repeats ------------------------------------------------------------------------------------


def _repeat_meter(rack_w_at: Any, bess_w_at: Any, seconds: int = 8, with_racks: bool = True) -> list[bool]:
    """A PCC meter that reads 1.5 MW every second for `seconds`, beside racks drawing rack_w_at(t) each (16) and a
    battery discharging bess_w_at(t); returns the meter's stuck flag after each second's judgement."""
    from types import SimpleNamespace

    from dimmer.daemon.handles import DeviceHandle, judge_meters, note_reading

    loaded = loaded_config()
    meter = DeviceHandle("pcc", "meter", None, True, domain=0)
    battery = DeviceHandle("bess", "battery", None, True)
    rows = [DeviceHandle(f"row{i}", "racks", None, True, racks=slice(8 * i, 8 * i + 8)) for i in range(2)]
    handles = [meter, battery, *(rows if with_racks else [])]
    safety = loaded.config.safety
    out = []
    for t in range(seconds + 1):

        def reading(values: dict[str, Any], t: float = float(t)) -> Any:
            return SimpleNamespace(values=values, t_s=t, ok=True, error=None)

        note_reading(meter, reading({"power_w": 1.5e6}), safety, 1.0)
        note_reading(battery, reading({"power_w": bess_w_at(t), "soc_frac": 0.6, "online": 1.0}), safety, 1.0)
        for h in rows:
            note_reading(h, reading({"power_w": np.full(8, rack_w_at(t)), "update_count": t}), safety, 1.0)
        judge_meters(handles, loaded.site, loaded.limit_w, safety, 1.0)
        out.append(meter.stuck)
    return out


def test_a_repeating_meter_is_frozen_only_when_the_racks_under_it_moved() -> None:
    """frozen_meter_s (5 s) of one repeated reading: frozen while the racks swing 10 kW each (160 kW, 8 % of the
    2 MW limit against the 2 % that counts); not while the racks hold still, nor while the battery's discharge
    cancels their swing (a battery holding the import flat repeats a live meter's reading); with no racks to judge
    it by, frozen by time alone."""
    swing = lambda t: 100e3 + (10e3 if t % 2 else 0.0)  # noqa: E731
    moving = _repeat_meter(swing, lambda t: 0.0)
    assert not any(moving[:6]) and all(moving[6:])  # (the repeat has lasted more than 5 s from t = 6 s)
    assert not any(_repeat_meter(lambda t: 100e3, lambda t: 0.0))
    assert not any(_repeat_meter(swing, lambda t: 16 * (swing(t) - 100e3)))
    blind = _repeat_meter(lambda t: 100e3, lambda t: 0.0, with_racks=False)
    assert not any(blind[:6]) and all(blind[6:])
