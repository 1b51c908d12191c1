"""bench/soak.py's fault schedule: a valid scenario, every fault family drawn, each lasting fault undone, seeded."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gridsim.scenario import validate_scenario

BENCH = Path(__file__).resolve().parents[1] / "bench"
TWO_DAYS_S = 2 * 86_400.0


@pytest.fixture(scope="module")
def soak() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_soak", BENCH / "soak.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up by name
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_two_days_of_faults_validate_and_cover_every_family(soak: ModuleType) -> None:
    raw = soak.soak_scenario(TWO_DAYS_S, 600.0, seed=6, period_s=4.0)
    scenario = validate_scenario(raw, "soak")
    events = raw["events"]
    # one fault every 10 plant minutes on average: ~288 in two days (restores and pairs come on top)
    assert 200 < len(events) < 600
    assert all(e["at_s"] >= 300.0 for e in events)
    assert [e["at_s"] for e in events] == sorted(e["at_s"] for e in events)
    kinds = {e["kind"] for e in events}
    assert kinds >= {"telemetry", "actuation", "storage", "crash", "stop", "start", "backup_transfer", "curtail"}
    assert kinds >= {"frequency_step", "derate"}
    modes = {(e["kind"], e["mode"]) for e in events if "mode" in e}
    for mode in ("stale", "stuck", "nan", "spike", "drift"):
        assert ("telemetry", mode) in modes
    for mode in ("lost", "ignored", "delayed", "agent_down"):
        assert ("actuation", mode) in modes
    for mode in ("bess_offline", "bbu_failed", "bbu_empty", "trays_disabled"):
        assert ("storage", mode) in modes
    assert scenario.engine.control_period_s == 4.0


def test_every_lasting_fault_is_undone(soak: ModuleType) -> None:
    events = soak.soak_scenario(TWO_DAYS_S, 600.0, seed=7, period_s=1.0)["events"]
    end_s = TWO_DAYS_S - 2400.0
    for e in events:
        if e["kind"] in ("telemetry", "actuation", "storage", "backup_transfer"):
            assert e["at_s"] + e["duration_s"] < TWO_DAYS_S  # faults end before the run does
    # the last word on the limit, each rating and the jobs is the healthy one
    curtails = [e for e in events if e["kind"] == "curtail"]
    assert curtails and max(curtails, key=lambda e: e["at_s"])["limit_mw"] == soak.PCC_LIMIT_MW
    for domain in {e["domain"] for e in events if e["kind"] == "derate"}:
        last = max((e for e in events if e["kind"] == "derate" and e["domain"] == domain), key=lambda e: e["at_s"])
        assert last["factor"] == 1.0
    stops = sum(1 for e in events if e["kind"] == "stop")
    starts = sum(1 for e in events if e["kind"] == "start")
    assert stops == starts
    assert all(e["at_s"] < end_s for e in events if e["kind"] not in ("curtail", "derate", "start", "frequency_step"))


def test_the_schedule_is_seeded(soak: ModuleType) -> None:
    a = soak.soak_scenario(86_400.0, 600.0, seed=3, period_s=4.0)["events"]
    b = soak.soak_scenario(86_400.0, 600.0, seed=3, period_s=4.0)["events"]
    c = soak.soak_scenario(86_400.0, 600.0, seed=4, period_s=4.0)["events"]
    assert a == b
    assert a != c
