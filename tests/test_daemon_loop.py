"""The daemon loop against in-memory devices: modes, observation, writes, every fail-safe, state, metrics, audit."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
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
from dimmer.daemon.safety import NonFiniteLog
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
        # racks whose devices leave the peak register unset report no peak: NaN, and the controller keeps its prior
        assert obs.rack_load_peak_w is not None and np.all(np.isnan(obs.rack_load_peak_w))
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


RATED_W = 1400.0
RISE_W = 20.0  # the dimmer controller's cap_rise_w_per_s x the 1 s period: the most the start ramp may step


def start_step_w(d: Daemon) -> float:
    """The start ramp's step: the controller's rise rate, or half the site's ramp limit over all its GPUs."""
    site = d.loaded.site
    return min(RISE_W, 0.5 * site.ramp_limit_w_per_min / 60.0 * site.rectifier_eff / site.n_gpus)


def _saved_doc() -> dict[str, Any]:
    """A valid state document for `small_config`'s site, as a daemon saves it."""
    plant, clock = FakePlant(), FakeClock()
    d = make(plant, clock)
    doc = controller_state(d.controller, d.loaded.site)
    assert doc is not None
    return doc


def _write_doc(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc))


def _mutated(change: Any) -> Any:
    def write(path: Path, doc: dict[str, Any]) -> None:
        change(doc)
        _write_doc(path, doc)

    return write


def _text(text: str | bytes) -> Any:
    def write(path: Path, doc: dict[str, Any]) -> None:
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)

    return write


def _truncated(path: Path, doc: dict[str, Any]) -> None:
    text = json.dumps(doc)
    path.write_text(text[: len(text) // 2])


def _json_nan_caps(path: Path, doc: dict[str, Any]) -> None:
    doc["state"]["cap_w"]["data"] = [float("nan")]
    path.write_text(json.dumps(doc))  # Python's json writes (and reads) a bare NaN


# every way a state file seen on a restart can be unusable (issue 12 item 4): each must start at the safe cap
UNUSABLE_STATES: dict[str, Any] = {
    "garbage": _text(b"\x00\x9f\xff\xfe garbage \x01\x02"),
    "not-json": _text("{not json"),
    "truncated-json": _truncated,
    "empty": _text(""),
    "whitespace": _text(" \n\t"),
    "directory": lambda path, doc: path.mkdir(),
    "nan-caps": _mutated(lambda x: x["state"].update(cap_w={"shape": [1], "data": ["nan"]})),
    "json-nan-caps": _json_nan_caps,
    "inf-caps": _mutated(lambda x: x["state"].update(cap_w={"shape": [1], "data": ["inf"]})),
    "caps-above-rated": _mutated(lambda x: x["state"].update(cap_w={"shape": [1], "data": [5000.0]})),
    "caps-below-min": _mutated(lambda x: x["state"].update(cap_w={"shape": [1], "data": [1.0]})),
    "floors-above-range": _mutated(lambda x: x["state"].update(floor_w={"shape": [16], "data": [5000.0] * 16})),
    "nan-grid-target": _mutated(lambda x: x["state"].update(grid_target_w="nan")),
    "inf-level-reading": _mutated(lambda x: x["state"]["bus_level"]["hist"]["data"].__setitem__(-1, "inf")),
    "negative-bbu-relief": _mutated(lambda x: x["state"].update(bbu_given_w={"shape": [16], "data": [-1.0] * 16})),
    "huge-number": _mutated(lambda x: x["state"].update(cap_w={"shape": [1], "data": [10**400]})),
    "json-list": _text("[1, 2, 3]"),
    "json-number": _text("42"),
    "format-only": _text('{"format": "dimmer-state-v1"}'),
    "state-a-list": _mutated(lambda x: x.update(state=[1, 2])),
    "deep-nesting": _text("[" * 100_000 + "]" * 100_000),
    "other-rack-count": _mutated(lambda x: x["site"].update(n_racks=32)),
    "other-site-jobs": _mutated(lambda x: x["site"].update(jobs=["other"])),
    "other-gpu": _mutated(lambda x: x["site"].update(gpu="h100")),
    "other-controller": _mutated(lambda x: x.update(controller="dynamo")),
    "too-old": _mutated(lambda x: x.update(saved_at_unix_s=x["saved_at_unix_s"] - 3600)),
    "from-the-future": _mutated(lambda x: x.update(saved_at_unix_s=x["saved_at_unix_s"] + 3600)),
    "no-saved-time": _mutated(lambda x: x.update(saved_at_unix_s="nan")),
}


@pytest.mark.parametrize("kind", list(UNUSABLE_STATES))
def test_restart_with_unusable_state_starts_at_safe_cap_and_rises_at_slew(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.json"
    UNUSABLE_STATES[kind](path, _saved_doc())
    caplog.clear()

    async def go() -> tuple[list[np.ndarray], float]:
        # nothing binds: a fresh controller would write rated (1,400 W) in the first period
        plant, clock = FakePlant(rack_w=100e3, pcc_w=1.5e6), FakeClock()
        sections = {"daemon": {"state_file": str(path), "audit_log": "audit.jsonl", "metrics_address": ""}}
        d = make(plant, clock, tmp_path, sections=sections)
        assert not d._restored and d.start_ramp is not None
        assert d.start_ramp.rise_w == pytest.approx(start_step_w(d))
        written = []
        for _ in range(12):
            await step(d)
            written.append(plant.caps_written())
            clock.t += 1.0
            plant.tick()
        await d.shutdown()
        return written, start_step_w(d)

    written, rise_w = asyncio.run(go())
    assert np.all(written[0] <= SAFE_W + 1e-6)
    steps = np.diff(np.stack(written), axis=0)
    assert steps.max() <= rise_w + 1e-3 <= RISE_W + 1e-3, f"a cap rose {steps.max():.1f} W in one period"
    assert np.all(written[-1] > written[0] + 5 * rise_w)  # and it does rise: the ramp is not a new ceiling
    # said once, in the log and the audit: which file, why, what the daemon does instead
    said = [r for r in caplog.records if "starting at the safe cap" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert str(path) in said[0].getMessage() and "ignored" in said[0].getMessage()
    events = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    state_events = [e for e in events if e.get("event") == "state"]
    assert len(state_events) == 1 and state_events[0]["refused"] is True and str(path) in state_events[0]["why"]


def test_restart_with_valid_state_restores_it_without_the_start_ramp(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.json"
    doc = _saved_doc()
    doc["state"]["cap_w"] = {"shape": [1], "data": [1300.0]}  # a cap the old process held, well above the safe cap
    _write_doc(path, doc)
    caplog.set_level(logging.INFO, logger="dimmer.daemon")

    async def go() -> None:
        plant, clock = FakePlant(rack_w=100e3, pcc_w=1.5e6), FakeClock()
        d = make(plant, clock, tmp_path, sections={"daemon": {"state_file": str(path), "metrics_address": ""}})
        assert d._restored and d.start_ramp is None
        assert d.controller.cap_w[0] == 1300.0  # type: ignore[attr-defined]
        res = await step(d)
        # the controller carries on from the cap it had, at its own slew: no drop to the safe cap, no jump to rated
        assert np.allclose(plant.caps_written(), res.actions.rack_cap_w)
        assert np.all(res.actions.rack_cap_w >= 1300.0) and np.all(res.actions.rack_cap_w <= 1300.0 + RISE_W)
        await d.shutdown()

    asyncio.run(go())
    assert "restored from" in caplog.text and "starting at the safe cap" not in caplog.text


def test_a_state_saved_before_the_level_followed_the_swing_period_is_restored_with_its_level_afresh(
    tmp_path: Path,
) -> None:
    """A state file from before the campus level's window followed the readings' period (its level buffer as long as
    the least window, no history): the rest is restored, the level learned afresh, rather than refusing the file and
    starting at the safe cap."""
    path = tmp_path / "state.json"
    doc = _saved_doc()
    doc["state"]["cap_w"] = {"shape": [1], "data": [1300.0]}
    level = doc["state"]["bus_level"]
    del level["hist"]
    level["buf"] = {"shape": [6], "data": [1.5e6] * 6}
    _write_doc(path, doc)
    plant, clock = FakePlant(rack_w=100e3, pcc_w=1.5e6), FakeClock()
    d = make(plant, clock, tmp_path, sections={"daemon": {"state_file": str(path), "metrics_address": ""}})
    assert d._restored and d.start_ramp is None
    assert d.controller.cap_w[0] == 1300.0  # type: ignore[attr-defined]
    assert d.controller.bus_level.warming  # type: ignore[attr-defined]


def test_first_start_without_state_file_starts_fresh_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dimmer.daemon")
    plant, clock = FakePlant(rack_w=100e3, pcc_w=1.5e6), FakeClock()
    d = make(plant, clock)  # no state_file configured: a first start, from the controller's fresh state
    assert d.start_ramp is None and "no state_file configured: starting fresh" in caplog.text


def test_start_ramp_ends_at_rated(tmp_path: Path) -> None:
    async def go() -> None:
        path = tmp_path / "state.json"
        path.write_text("{not json")
        plant, clock = FakePlant(rack_w=100e3, pcc_w=1.5e6), FakeClock()
        d = make(plant, clock, tmp_path, sections={"daemon": {"state_file": str(path), "metrics_address": ""}})
        assert d.start_ramp is not None
        first = (await step(d)).actions.rack_cap_w
        clock.t += 1.0
        plant.tick()
        second = (await step(d)).actions.rack_cap_w
        assert np.allclose(first, SAFE_W) and np.allclose(second, SAFE_W + start_step_w(d))
        # and it ends at rated: the ceiling gone, the controller alone again
        d.start_ramp.ceiling_w = RATED_W - 0.5 * start_step_w(d)
        await cycles(d, plant, clock, 2)
        assert d.start_ramp is None

    asyncio.run(go())


# -- what the controller decides that is not a number ------------------------------------------------------------------


def test_non_finite_actions_never_written_safe_values_instead_logged_once_per_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock)
        await cycles(d, plant, clock, 3)
        real = d.controller.step
        nan, inf = float("nan"), float("inf")

        def poisoned(obs: Any) -> Any:
            act = real(obs)
            cap = act.rack_cap_w.copy()
            cap[:4], cap[4], cap[5] = nan, inf, -inf
            thr = act.rack_bbu_threshold_w.copy()
            thr[0], thr[1], thr[2] = nan, -inf, inf  # +inf is "backup only", a valid threshold
            rech = act.rack_bbu_recharge_w.copy()
            rech[0], rech[1], rech[2] = nan, -inf, inf  # +inf: no limit but the BBU's rating, valid
            return dataclasses.replace(
                act,
                rack_cap_w=cap,
                rack_floor_w=np.full(act.rack_floor_w.shape, nan),
                bess_setpoint_w=nan,
                rack_bbu_threshold_w=thr,
                rack_bbu_recharge_w=rech,
            )

        d.controller.step = poisoned  # type: ignore[method-assign]
        caplog.clear()
        for _ in range(5):
            last = d.last_cap_w.copy()  # type: ignore[union-attr]
            res = await step(d)
            act = res.actions
            # the daemon carried on (RUNNING: the controller answered) and wrote only numbers, the safe ones
            assert d.mode is Mode.RUNNING and res.writes_failed == 0
            written = plant.caps_written()
            assert np.all(np.isfinite(written))
            assert np.allclose(written[:6], np.fmin(SAFE_W, last[:6]))
            assert np.all(act.rack_floor_w == 0.0)
            assert act.bess_setpoint_w == 0.0 and plant.battery_setpoint_w() == pytest.approx(0.0, abs=10.0)
            assert np.all(act.rack_bbu_threshold_w[:3] == inf)
            assert act.rack_bbu_recharge_w[0] == 0.0 and act.rack_bbu_recharge_w[1] == 0.0
            assert act.rack_bbu_recharge_w[2] == d.loaded.site.rack_storage.bbu_power_w[2]
            said = {r.reason for r in act.reasons if r.reason.startswith("non-finite")}
            assert len(said) == 5  # each field named in the audit's reasons, every period
            clock.t += 1.0
            plant.tick()
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        for name in ("rack_cap_w", "rack_floor_w", "bess_setpoint_w", "rack_bbu_threshold_w", "rack_bbu_recharge_w"):
            assert sum(f"non-finite {name} " in m for m in errors) == 1, name  # loud, once: not once a period

    asyncio.run(go())


def test_non_finite_log_is_rate_limited_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    nf = NonFiniteLog(every_s=60.0)
    for t in range(0, 125):
        nf.note("dimmer", {"rack_cap_w": 3}, float(t))
    nf.note("dimmer", {"bess_setpoint_w": 1}, 124.0)  # another kind: its own first report at once
    said = [r.getMessage() for r in caplog.records]
    assert sum("rack_cap_w" in m for m in said) == 3  # at 0, 60 and 120 s
    assert "60 period(s) since the last report" in said[1]
    assert sum("bess_setpoint_w" in m for m in said) == 1


def test_a_last_audit_record_asked_for_during_a_cycle_is_written_after_it(tmp_path: Path) -> None:
    """`dimmer run --sim` tells the daemon why it stops (the plant ended) while a cycle may be in flight: the reason
    is the audit log's last record, after that cycle's (written at once, a busy CI machine's last cycle landed after
    it)."""

    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        d = make(plant, clock, tmp_path, sections={"daemon": {"audit_log": "audit.jsonl", "metrics_address": ""}})
        await cycles(d, plant, clock, 2)
        in_flight = asyncio.ensure_future(d.cycle())  # scheduled, not yet run: the stop is asked for meanwhile
        d.request_stop(write_safe=False, last_audit={"event": "plant_ended", "t_s": 3.0})
        await in_flight
        await d.shutdown()

    asyncio.run(go())
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "plant_ended" and records[-1]["t_s"] == 3.0
    assert records[-2]["cycle"] == 3  # the cycle that was in flight, before it


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


def test_a_reload_whose_state_does_not_fit_restarts_the_start_ramp(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGHUP that changes the site so the controller's filters cannot carry over (here the job split in two) is a
    start without state: caps at most the safe cap at the next write, then rising at the start ramp's step, said
    once."""
    from tests.daemon_fakes import small_config
    from tests.test_daemon_config import _write

    async def go() -> tuple[np.ndarray, list[np.ndarray], float]:
        plant, clock = FakePlant(rack_w=100e3, pcc_w=1.5e6), FakeClock()
        raw = small_config()
        path = _write(tmp_path, raw)
        d = Daemon(
            loaded_config(tmp_path), config_path=path, bus_factory=plant.factory, clock=clock, metrics_address=None
        )
        await cycles(d, plant, clock, 3)
        before = plant.caps_written()
        assert d.start_ramp is None
        raw["jobs"] = [{**raw["jobs"][0], "gpus": 768}, {"name": "eval", "priority": 5, "gpus": 128}]
        _write(tmp_path, raw)
        caplog.clear()
        assert await d.reload()
        assert d.start_ramp is not None
        written = []
        for _ in range(6):
            await step(d)
            written.append(plant.caps_written())
            clock.t += 1.0
            plant.tick()
        rise_w = start_step_w(d)
        await d.shutdown()
        return before, written, rise_w

    before, written, rise_w = asyncio.run(go())
    assert np.all(before > SAFE_W + 100.0)  # nothing bound before: a drop to the safe cap is the ramp's doing
    assert np.all(written[0] <= SAFE_W + 1e-6)
    steps = np.diff(np.stack(written), axis=0)
    assert 0.0 < steps.max() <= rise_w + 1e-3
    said = [r for r in caplog.records if "starting at the safe cap" in r.getMessage()]
    assert len(said) == 1 and "does not fit the new config" in said[0].getMessage()


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
        # no state file: said once, first, then the cycles
        assert lines[0]["event"] == "state" and lines[0]["restored"] is False and lines[0]["refused"] is False
        lines = lines[1:]
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
