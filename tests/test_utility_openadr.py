"""The daemon as an OpenADR 2.0b VEN, end to end on loopback: openleadr's own VTN (OpenADRServer) started here, the
real daemon loop (its VEN: openleadr's OpenADRClient) against the in-memory equipment of tests/daemon_fakes.py, closed
by a small plant: each rack draws its demand or what its written cap allows, the meter reads the racks less the
battery's setpoint. Signatures are off (plain HTTP on loopback, no certificates: docs/utility.md)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.daemon.loop import CycleResult, Daemon
from tests.daemon_fakes import FakePlant, loaded_config

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="DSA is deprecated")
    from openleadr import OpenADRServer

# openleadr's VTN keys its aiohttp app with a string (aiohttp asks for an AppKey): its code, not ours
pytestmark = pytest.mark.filterwarnings("ignore:It is recommended to use web.AppKey:UserWarning")

LIMIT_W = 2.0e6  # small_config's interconnect
EVENT_W = 1.2e6  # what the utility curtails it to
RACK_DEMAND_W = 100e3  # 16 racks: 1.6 MW, above the curtailed limit
VEN_ID = "ven-campus"


class Vtn:
    """openleadr's VTN on a free loopback port: registers one VEN, records its opt answers and its reports."""

    def __init__(self) -> None:
        self.server = OpenADRServer(
            vtn_id="UTILITY", http_port=0, http_host="127.0.0.1", requested_poll_freq=timedelta(seconds=1)
        )
        self.opts: dict[str, str] = {}
        self.reports: dict[str, list[float]] = {}
        self.server.add_handler("on_create_party_registration", self.on_register)
        self.server.add_handler("on_register_report", self.on_register_report)
        self.port = 0

    async def start(self) -> str:
        await self.server.run()
        self.port = int(self.server.app_runner.addresses[0][1])
        return f"http://127.0.0.1:{self.port}/OpenADR2/Simple/2.0b"

    async def stop(self) -> None:
        await self.server.stop()

    async def on_register(self, info: dict[str, Any]) -> tuple[str, str]:
        return VEN_ID, "reg-1"

    async def on_register_report(
        self,
        ven_id: str,
        resource_id: str,
        measurement: str,
        unit: str,
        scale: str,
        min_sampling_interval: timedelta,
        max_sampling_interval: timedelta,
    ) -> tuple[Any, timedelta]:
        async def update(data: list[tuple[datetime, float]]) -> None:
            self.reports.setdefault(resource_id, []).extend(v for _, v in data)

        return update, timedelta(seconds=1)

    def on_opt(self, ven_id: str, event_id: str, opt_type: str) -> None:
        self.opts[event_id] = opt_type

    def curtail(self, start: datetime, duration_s: float, ramp_up_s: float, recovery_s: float, kw: float) -> str:
        event_id = self.server.add_event(
            ven_id=VEN_ID,
            event_id="curtail-1",
            signal_name="LOAD_CONTROL",
            signal_type="x-loadControlSetpoint",
            intervals=[{"dtstart": start, "duration": timedelta(seconds=duration_s), "signal_payload": kw}],
            callback=self.on_opt,
        )
        # openleadr 0.5.36's add_raw_event rebuilds the active period from the intervals (it looks for it under
        # event_descriptor), dropping add_event's ramp_up_period and recovery_period: set them on the queued event
        period = self.server.events[VEN_ID][-1].active_period  # (a dict there)
        period["ramp_up_period"] = timedelta(seconds=ramp_up_s)
        period["recovery_period"] = timedelta(seconds=recovery_s)
        return str(event_id)


class ClosedPlant(FakePlant):
    """FakePlant whose racks draw min(demand, what the written cap allows) and whose meter reads the campus import."""

    def __init__(self, daemon_site: Any) -> None:
        super().__init__(rack_w=RACK_DEMAND_W, pcc_w=16 * RACK_DEMAND_W)
        self.site = daemon_site
        self.import_w = 16 * RACK_DEMAND_W

    def step(self) -> None:
        caps = self.caps_written()
        allowed = np.where(np.isfinite(caps), self.site.rack_power_w(np.nan_to_num(caps, nan=1400.0)), np.inf)
        self.rack_w = np.minimum(RACK_DEMAND_W, allowed)
        bess = self.battery_setpoint_w()
        self.import_w = float(self.rack_w.sum()) - (bess if math.isfinite(bess) else 0.0)
        self.set_meter(self.import_w)
        self.tick()


def expected_limit_w(t: float, start: float, end: float, ramp_up_s: float, recovery_s: float) -> float:
    """The utility's schedule, written out: the configured limit, a linear ramp down to the event's over ramp_up_s
    before its start, the event's to its end, a linear return over recovery_s."""
    if start - ramp_up_s <= t < start:
        return LIMIT_W + (EVENT_W - LIMIT_W) * (t - (start - ramp_up_s)) / ramp_up_s
    if start <= t < end:
        return EVENT_W
    if end <= t < end + recovery_s:
        return EVENT_W + (LIMIT_W - EVENT_W) * (t - end) / recovery_s
    return LIMIT_W


async def until(cond: Any, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def utility_daemon(tmp_path: Path, url: str, **kw: Any) -> Daemon:
    loaded = loaded_config(
        tmp_path,
        site={
            "gpu": "gb300",
            "pcc": {"limit_mw": 2.0, "ramp_mw_per_min": 30.0},
            "levels": [
                {"level": "hall", "count": 1, "rating_mw": 2.1},
                {"level": "row", "count": 2, "rating_kw": 1100},
                {"level": "rack", "count": 8},
            ],
            "storage": {"bess": {"power_mw": 0.5, "energy_mwh": 0.25}},
        },
        daemon={"period_s": 0.2, "metrics_address": "", "audit_log": "audit.jsonl"},
        utility={"vtn_url": url, "ven_name": "campus", "poll_interval_s": 1, "report_interval_s": 1},
    )
    plant = ClosedPlant(loaded.site)
    d = Daemon(loaded, bus_factory=plant.factory, metrics_address=None, **kw)
    d.plant = plant  # type: ignore[attr-defined]
    return d


def test_openadr_event_sets_the_limit_on_the_utilitys_schedule_and_outlives_the_vtn(tmp_path: Path) -> None:
    ramp_up_s, duration_s, recovery_s = 2.0, 7.0, 1.0
    seen: list[tuple[float, float, float]] = []  # (wall time the VEN asked, limit in force, campus import)

    async def go() -> None:
        vtn = Vtn()
        url = await vtn.start()
        times: list[float] = []

        def wall() -> float:
            times.append(time.time())
            return times[-1]

        def on_cycle(res: CycleResult) -> None:
            d.plant.step()  # type: ignore[attr-defined]
            seen.append((times[-1], res.obs.pcc_limit_w, d.plant.import_w))  # type: ignore[attr-defined]

        d = utility_daemon(tmp_path, url, on_cycle=on_cycle)
        assert d.utility is not None
        d.utility.wall_clock = wall
        task = asyncio.create_task(d.run())
        vtn_stopped = False
        try:
            await until(lambda: d.utility is not None and d.utility.registered, 10.0, "the VEN's registration")
            start = datetime.now(UTC) + timedelta(seconds=3.5)
            vtn.curtail(start, duration_s, ramp_up_s, recovery_s, kw=EVENT_W / 1e3)
            t_start = start.timestamp()
            await until(lambda: vtn.opts.get("curtail-1") == "optIn", 5.0, "the VEN's optIn at the VTN")
            await until(lambda: time.time() > t_start + 1.5, 10.0, "the event under way")
            await until(lambda: bool(vtn.reports.get("import")), 5.0, "an import report")
            await vtn.stop()  # the VTN vanishes mid-event
            vtn_stopped = True
            await until(lambda: time.time() > t_start + duration_s + recovery_s + 1.0, 15.0, "the event's end")
        finally:
            d.request_stop()
            await asyncio.wait_for(task, 10.0)
            if not vtn_stopped:
                await vtn.stop()
        t_end = t_start + duration_s
        # every cycle's limit in force is the utility's schedule at the instant the VEN asked (nothing higher, ever)
        assert seen, "no cycles"
        for t, limit, _ in seen:
            assert limit == pytest.approx(expected_limit_w(t, t_start, t_end, ramp_up_s, recovery_s), rel=1e-6), t
        phases = {
            "before": [lim for t, lim, _ in seen if t < t_start - ramp_up_s],
            "ramp": [lim for t, lim, _ in seen if t_start - ramp_up_s <= t < t_start],
            "event": [lim for t, lim, _ in seen if t_start <= t < t_end],
            "after": [lim for t, lim, _ in seen if t >= t_end + recovery_s],
        }
        assert all(len(v) >= 2 for v in phases.values()), {k: len(v) for k, v in phases.items()}
        assert max(phases["before"]) == LIMIT_W and max(phases["after"]) == LIMIT_W
        assert all(EVENT_W < lim < LIMIT_W for lim in phases["ramp"][1:])
        assert phases["event"] == [EVENT_W] * len(phases["event"])  # through the VTN's disappearance, to its end
        # the campus holds it: the import at most the curtailed limit once the event has run 1.5 s
        held = [imp for t, _, imp in seen if t_start + 1.5 <= t < t_end]
        before = [imp for t, _, imp in seen if t < t_start - ramp_up_s]
        assert min(before[-3:]) > EVENT_W * 1.2  # (it had to move: 1.6 MW drawn before the event)
        assert held and max(held) <= EVENT_W * 1.01, max(held)
        # the VEN reported the campus's import to the VTN (W, as measured) and its flexibility
        assert vtn.reports["import"] and all(0 < v <= 1.7e6 for v in vtn.reports["import"])
        assert vtn.reports.get("flexibility")
        assert any(a.event_id == "curtail-1" and a.opt == "optIn" for a in d.utility.answers)
        audit = (tmp_path / "audit.jsonl").read_text()
        assert '"event":"utility"' in audit and "curtail-1" in audit

    asyncio.run(go())


def test_openadr_ven_registers_once_the_vtn_appears(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A VTN that is not there at start: the daemon runs on its configured limit, the VEN retries, then registers."""

    async def go() -> None:
        vtn = Vtn()
        url = await vtn.start()
        await vtn.stop()  # its port, now with nobody behind it
        d = utility_daemon(tmp_path, url)
        assert d.utility is not None
        task = asyncio.create_task(d.run())
        try:
            await until(lambda: d.n_cycles >= 3, 10.0, "cycles")
            assert not d.utility.registered and d.last is not None and d.last.obs.pcc_limit_w == LIMIT_W
            vtn2 = Vtn()
            vtn2.server.http_port = vtn.port
            await vtn2.start()
            try:
                await until(lambda: d.utility is not None and d.utility.registered, 10.0, "the registration")
            finally:
                await vtn2.stop()
        finally:
            d.request_stop()
            await asyncio.wait_for(task, 10.0)

    with caplog.at_level(logging.WARNING, logger="dimmer.utility"):
        asyncio.run(go())
    assert "no registration with" in caplog.text


def test_openadr_simple_level_ramp_limit_and_a_cancellation(tmp_path: Path) -> None:
    """A SIMPLE level and an x-rampLimit event from the VTN, both opted in to; the VTN then cancels the level event and
    the limit returns to the configured one, while the ramp limit holds; a price event is opted out of."""
    last: list[CycleResult] = []

    async def go() -> None:
        vtn = Vtn()
        url = await vtn.start()
        d = utility_daemon(tmp_path, url, on_cycle=last.append)
        assert d.utility is not None
        task = asyncio.create_task(d.run())
        try:
            await until(lambda: d.utility is not None and d.utility.registered, 10.0, "the VEN's registration")
            now = datetime.now(UTC)
            interval = [{"dtstart": now, "duration": timedelta(seconds=60), "signal_payload": 2.0}]
            for event_id, name, stype, payload in (
                ("level-2", "SIMPLE", "level", 2.0),
                ("ramp", "x-rampLimit", "setpoint", 100.0),  # kW/min ([utility] payload_unit)
                ("price", "ELECTRICITY_PRICE", "price", 0.3),
            ):
                iv = [{**interval[0], "signal_payload": payload}]
                vtn.server.add_event(VEN_ID, name, stype, iv, callback=vtn.on_opt, event_id=event_id)
            await until(lambda: len(vtn.opts) == 3, 8.0, "three answers at the VTN")
            assert vtn.opts == {"level-2": "optIn", "ramp": "optIn", "price": "optOut"}
            await until(lambda: bool(last) and last[-1].obs.pcc_limit_w == 0.75 * LIMIT_W, 5.0, "level 2's limit")
            assert last[-1].obs.ramp_limit_w_per_min == pytest.approx(100e3)
            vtn.server.cancel_event(VEN_ID, "level-2")
            await until(lambda: last[-1].obs.pcc_limit_w == LIMIT_W, 8.0, "the cancellation")
            assert last[-1].obs.ramp_limit_w_per_min == pytest.approx(100e3)
            assert [a.cancelled for a in d.utility.answers if a.event_id == "level-2"][-1]
        finally:
            d.request_stop()
            await asyncio.wait_for(task, 10.0)
            await vtn.stop()

    asyncio.run(go())
