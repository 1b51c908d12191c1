"""What an operator watches on the daemon's Prometheus endpoint: every device's state and reading age, each rack
device's lease state, whether the campus battery says it is on line, the build, and no *_created series. Each test
scrapes the real HTTP endpoint on loopback and parses what it serves with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import logging
import math
import platform
import socket
import threading
import time
import urllib.request
from importlib import metadata
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import dimmer
from dimmer.daemon.loop import CycleResult, Daemon
from dimmer.daemon.metrics import DaemonMetrics, DeviceStatus, is_loopback
from dimmer.daemon.netguard import ConnectionLimits
from dimmer.errors import InputError
from tests.daemon_fakes import RACK_UNITS, FakePlant, loaded_config

DEVICES = {"pcc": "meter", "bess": "battery", "row0": "racks", "row1": "racks"}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample the endpoint served, by sample name (families parsed by prometheus_client)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def by(rows: list[tuple[dict[str, str], float]], key: str) -> dict[str, float]:
    return {labels[key]: v for labels, v in rows}


def states(rows: list[tuple[dict[str, str], float]]) -> dict[str, str]:
    """device -> the state whose series is 1 (exactly one per device)."""
    out: dict[str, str] = {}
    for labels, v in rows:
        if v == 1.0:
            assert labels["device"] not in out, labels
            out[labels["device"]] = labels["state"]
    return out


def test_a_daemon_run_serves_device_states_ages_leases_battery_and_build() -> None:
    async def go() -> tuple[str, Daemon]:
        plant = FakePlant()
        scraped: list[str] = []

        def on_cycle(res: CycleResult) -> None:
            if res.n == 3 and d.metrics_port:
                scraped.append(scrape(d.metrics_port))

        d = Daemon(
            loaded_config(),
            bus_factory=plant.factory,
            metrics_address=("127.0.0.1", 0),
            speed=50.0,
            max_cycles=4,
            on_cycle=on_cycle,
        )
        await d.run()
        assert scraped, "the endpoint was not scraped"
        return scraped[0], d

    text, d = asyncio.run(go())
    got = samples(text)
    # every device, labelled by name and kind: a finite age (plant seconds), a state, exactly one of them set
    ages = got["dimmer_device_reading_age_seconds"]
    assert {labels["device"]: labels["kind"] for labels, _ in ages} == DEVICES
    assert all(0.0 <= v < 5.0 for _, v in ages)
    assert all(0.0 <= v < 5.0 for _, v in got["dimmer_device_data_age_seconds"])
    assert len(got["dimmer_device_state"]) == 4 * len(DEVICES)  # ok, stale, failed, never-read: every one, 0 or 1
    assert states(got["dimmer_device_state"]) == dict.fromkeys(DEVICES, "ok")
    assert {labels["kind"] for labels, _ in got["dimmer_device_state"]} == set(DEVICES.values())
    # each rack device's lease state, as its reading carries it
    lease = by(got["dimmer_rack_lease_state"], "device")
    assert set(lease) == {"row0", "row1"}
    for h in d.handles:
        if h.kind == "racks":
            assert h.last is not None and lease[h.name] == float(h.last.values["lease_state"])
            assert lease[h.name] in (0.0, 1.0, 2.0)
    # the battery says it is on line: one state set, no NaN anywhere in the battery's line
    assert by(got["dimmer_bess_online_state"], "state") == {"online": 1.0, "offline": 0.0, "unknown": 0.0}
    # the build
    ((info, one),) = got["dimmer_build_info"]
    assert one == 1.0
    assert info == {
        "version": dimmer.__version__,
        "python": platform.python_version(),
        "pymodbus": metadata.version("pymodbus"),
    }
    # no *_created series, for the counters and histograms that would have them
    assert not [name for name in got if name.endswith("_created")]
    assert "_created" not in text
    assert "dimmer_cycles_total" in got and "dimmer_cycle_seconds_bucket" in got  # (the series themselves stay)
    assert got["dimmer_mode"] and got["dimmer_comm_errors_total"]


def test_device_states_never_read_failed_stale_and_ages_from_the_endpoint() -> None:
    async def go() -> None:
        plant, clock = FakePlant(), FakeClock()
        plant.bus.fail("unreachable", units=[RACK_UNITS[1]], ops=["read"])  # row1 never answers
        d = Daemon(loaded_config(), bus_factory=plant.factory, clock=clock, metrics_address=None)
        port = d.metrics.serve(("127.0.0.1", 0))
        try:
            got = samples(scrape(port))  # before the first cycle: nothing read yet
            assert states(got["dimmer_device_state"]) == dict.fromkeys(DEVICES, "never-read")
            assert all(math.isinf(v) and v > 0 for _, v in got["dimmer_device_reading_age_seconds"])
            assert "dimmer_rack_lease_state" not in got  # unknown: no series
            assert by(got["dimmer_bess_online_state"], "state")["unknown"] == 1.0
            for _ in range(6):  # STARTING waits for row1 up to stale_s (5 s), then runs without it
                await d.cycle()
                clock.t += 1.0
                plant.tick()
            got = samples(scrape(port))
            assert states(got["dimmer_device_state"]) == {"pcc": "ok", "bess": "ok", "row0": "ok", "row1": "never-read"}
            assert by(got["dimmer_rack_lease_state"], "device").keys() == {"row0"}
            # the meter stops answering: its age grows, at the scrape, from its last good reading; flagged after 3
            plant.bus.heal()
            plant.bus.fail("unreachable", units=[1], ops=["read"])
            await d.cycle()
            clock.t += 2.5  # no cycle meanwhile: the age is the scrape's
            got = samples(scrape(port))
            age = by(got["dimmer_device_reading_age_seconds"], "device")
            assert age["pcc"] == pytest.approx(3.5) and age["row0"] == pytest.approx(2.5)
            assert states(got["dimmer_device_state"])["pcc"] == "ok"  # one failure: not flagged yet
            for _ in range(2):
                await d.cycle()
                clock.t += 1.0
            got = samples(scrape(port))
            assert states(got["dimmer_device_state"])["pcc"] == "failed"
            assert by(got["dimmer_device_reading_age_seconds"], "device")["pcc"] == pytest.approx(5.5)
            # the rack devices answer with an update_count that no longer moves: stale once older than stale_s,
            # while their reading age stays that of the last read
            plant.bus.heal()
            for i in range(7):
                await d.cycle()
                clock.t += 1.0
                plant.tick(move_counter=False)
                plant.set_meter(1.5e6 + 1e3 * i)  # the campus load moves: the meter is not frozen
            got = samples(scrape(port))
            st = states(got["dimmer_device_state"])
            assert st["row0"] == "stale" and st["row1"] == "stale" and st["pcc"] == "ok"
            data_age = by(got["dimmer_device_data_age_seconds"], "device")
            read_age = by(got["dimmer_device_reading_age_seconds"], "device")
            assert data_age["row0"] > 5.0 and read_age["row0"] == pytest.approx(1.0)
        finally:
            await d.shutdown()

    asyncio.run(go())


def test_battery_online_offline_unknown_without_nan() -> None:
    clock = FakeClock()
    m = DaemonMetrics(loaded_config().site, list(DEVICES), clock=clock)
    port = m.serve(("127.0.0.1", 0))
    try:

        def bess_state(**kw: Any) -> dict[str, float]:
            row = {"read_t_s": clock.t, "fresh_t_s": clock.t, "flagged": False, **kw}
            m.set_devices([DeviceStatus("bess", "battery", **row)], stale_s=5.0)
            got = samples(scrape(port))
            values = by(got["dimmer_bess_online_state"], "state")
            assert not any(math.isnan(v) for v in values.values())
            return values

        assert bess_state(online=1.0) == {"online": 1.0, "offline": 0.0, "unknown": 0.0}
        assert bess_state(online=0.0)["offline"] == 1.0
        assert bess_state(online=math.nan)["unknown"] == 1.0  # it does not say
        assert bess_state(online=1.0, fresh_t_s=clock.t - 6.0)["unknown"] == 1.0  # what it said is stale
        assert bess_state(online=1.0, read_t_s=math.nan, fresh_t_s=math.nan)["unknown"] == 1.0  # never read
        m.set_devices([DeviceStatus("pcc", "meter", clock.t, clock.t, False)], stale_s=5.0)
        assert "dimmer_bess_online_state" not in samples(scrape(port))  # no battery: no series
        # a lease state for each rack device that reports one
        m.set_devices(
            [
                DeviceStatus("row0", "racks", clock.t, clock.t, False, lease_state=2.0),
                DeviceStatus("row1", "racks", clock.t, clock.t, False, lease_state=math.nan),
            ],
            stale_s=5.0,
        )
        assert by(samples(scrape(port))["dimmer_rack_lease_state"], "device") == {"row0": 2.0}
    finally:
        m.close()


def test_non_loopback_metrics_endpoint_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        plant = FakePlant()
        d = Daemon(loaded_config(), bus_factory=plant.factory, metrics_address=(host, 0), speed=50.0, max_cycles=1)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dimmer.metrics"):
            asyncio.run(d.run())
        lines = [r.getMessage() for r in caplog.records if "not a loopback address" in r.getMessage()]
        assert len(lines) == (1 if warned else 0), (host, lines)
        if warned:
            assert lines[0].startswith("metrics endpoint on 0.0.0.0:") and "\n" not in lines[0]
    assert is_loopback("127.0.0.1") and is_loopback("127.3.0.1") and is_loopback("::1")
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.20.0.5")
    assert not is_loopback("dimmer.example")


def test_a_scrape_of_some_families_by_name_finds_them_without_created() -> None:
    m = DaemonMetrics(loaded_config().site, list(DEVICES))
    port = m.serve(("127.0.0.1", 0))
    try:
        m.cycles.inc()
        url = f"http://127.0.0.1:{port}/metrics?name[]=dimmer_cycles_total&name[]=dimmer_build_info"
        with urllib.request.urlopen(url, timeout=5) as r:
            got = samples(r.read().decode())
        assert set(got) == {"dimmer_cycles_total", "dimmer_build_info"}
        assert got["dimmer_cycles_total"] == [({}, 1.0)]
    finally:
        m.close()


def _serving_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def test_idle_connections_hold_at_most_the_cap_and_a_scraper_is_still_served() -> None:
    """Issue 12, item 11: prometheus-client started a thread for every connection, for ever; now at most the cap
    (4 here), a silent one is closed after the idle timeout (1 s here), and a scrape from another address is
    answered while a client holds 30 idle sockets."""
    m = DaemonMetrics(loaded_config().site, list(DEVICES))
    port = m.serve(("127.0.0.1", 0), ConnectionLimits(4, 1.0))
    idle: list[socket.socket] = []
    try:
        for _ in range(30):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5.0, source_address=("127.0.0.2", 0)))
        t_open = time.monotonic()  # the last idle connection was made before this
        assert "dimmer_cycles_total" in scrape(port)  # from 127.0.0.1
        assert _serving_threads() <= 4
        # the survivors are closed after the idle timeout, not before (generous upper bound: a loaded machine)
        while (n := _serving_threads()) > 0:
            assert time.monotonic() - t_open < 10.0, n
            time.sleep(0.05)
        assert time.monotonic() - t_open >= 0.9
        assert "dimmer_cycles_total" in scrape(port)
    finally:
        for s in idle:
            s.close()
        m.close()


def test_the_metrics_limits_are_config_keys_validated_like_every_key() -> None:
    d = loaded_config().config.daemon
    assert (d.metrics_max_connections, d.metrics_idle_timeout_s) == (8, 10.0)
    cfg = loaded_config(daemon={"metrics_max_connections": 2, "metrics_idle_timeout_s": 0.5}).config.daemon
    assert (cfg.metrics_max_connections, cfg.metrics_idle_timeout_s) == (2, 0.5)
    for key, bad in (("metrics_max_connections", 0), ("metrics_max_connections", 1.5), ("metrics_idle_timeout_s", 0)):
        with pytest.raises(InputError, match=f"daemon.{key}"):
            loaded_config(daemon={key: bad})
