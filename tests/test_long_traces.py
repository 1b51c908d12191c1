"""A month or a year of measured power: duration_s up to 366 days at a sizing tick, and the library's PDU month."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gridsim.cli import main
from gridsim.scenario import load_scenario

from .conftest import SCENARIOS
from .test_trace_formats import PDU, ROWS, _csv, _scenario, _shared


def test_a_year_is_allowed_at_a_sizing_tick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    year = 366 * 86400
    sc = _scenario(tmp_path, _csv(ROWS), 'trace_level = "gpu"')
    ok = ["--set", f"duration_s={year}", "--set", "engine.tick_s=300", "--set", "engine.control_period_s=300"]
    assert main(["validate", str(sc), *ok]) == 0
    capsys.readouterr()
    assert main(["validate", str(sc), "--set", f"duration_s={year + 86400}"]) == 2
    assert "duration_s" in capsys.readouterr().err


def test_pdu_month_library_scenario_reads_the_shared_month(tmp_path: Path) -> None:
    _shared(PDU)
    loaded = load_scenario(SCENARIOS / "long" / "pdu-month.toml")
    assert loaded.scenario.duration_s == 31 * 86400
    job = loaded.scenario.jobs[0]
    assert loaded.resolve(str(job.trace_path)).resolve() == PDU.resolve()


def test_pdu_month_replays_the_measured_utilisation_at_campus_scale() -> None:
    """Two days of the month, uncontrolled: every running rack draws the PDU's utilisation x a rack's full draw
    (136.6 kW AC, host and rectifier loss included once), sample for sample; the spare racks draw idle."""
    from gridsim.engine import run
    from gridsim.plant.trace import load_raw_trace

    raw, _ = load_raw_trace(_shared(PDU), "pdu-util", "s", "k")
    loaded = load_scenario(SCENARIOS / "long" / "pdu-month.toml", ["duration_s=172800"])
    res = run(loaded, controller="none")
    site = loaded.site()
    full_w = site.gpus_per_rack * (site.gpu.rated_w + site.gpu.host_overhead_w) / site.rectifier_eff
    t = np.asarray(res.t_s)
    demand = np.asarray(res.tick["demand_w"])
    spare = int(site.rack_is_spare.sum())
    idle_rack_w = float(site.rack_power_w(np.full(site.n_racks, site.gpu.idle_w))[0])
    on_sample = np.isin(t, raw.t_s)  # the 60 s ticks that fall on the 5-minute samples
    assert on_sample.sum() == 576  # two days of 5-minute samples
    util = np.interp(t[on_sample], raw.t_s, raw.power_w[:, 0])
    expected = (site.n_racks - spare) * full_w * util + spare * idle_rack_w
    np.testing.assert_allclose(demand[on_sample], expected, rtol=1e-6)
    assert demand.min() > 66e6 and demand.max() < 85e6
