"""The breakers' heat in the summary: `max_breaker_heat_frac` and `breaker_overload_s` (docs/models.md, "Metrics"),
against the thermal model's closed form on a row held at a steady load above its rating that never trips, from the
heat its load had before the run (BreakerBank.warm)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from gridsim.engine import SimResult, run
from gridsim.metrics import summarize
from gridsim.plant.breakers import BreakerBank
from gridsim.scenario import load_scenario
from gridsim.tick import OVERLOAD_HEAT_FRAC

# one row of 4 racks, no swing: a steady load; the row's rating is set from that load in the test
ROW = """
name = "warm-row"
seed = 3
duration_s = 600
[site]
gpu = "gb300"
[site.pcc]
limit_mw = 5.0
ramp_mw_per_min = 100
[[site.levels]]
level = "row"
count = 1
rating_kw = {rating_kw}
[[site.levels]]
level = "rack"
count = 4
[[jobs]]
name = "steady"
racks = [0, 4]
swing_frac = 0.0
"""


def _run(tmp_path: Path, rating_kw: float, controller: str) -> tuple[dict[str, Any], SimResult, float]:
    """The run's summary, its result and the row breaker's τ."""
    p = tmp_path / "row.toml"
    p.write_text(ROW.format(rating_kw=rating_kw))
    sc = load_scenario(p)
    res = run(sc, controller=controller)
    tau_s = float(BreakerBank(res.site, sc.scenario.breakers).tau_s[1])
    return summarize(res), res, tau_s


def test_a_row_held_above_its_rating_heats_as_the_closed_form_says_without_tripping(tmp_path: Path) -> None:
    _, free, _ = _run(tmp_path, 5000.0, "none")  # the row's steady load, on a row far above it
    row_w = float(np.median(free.period["domain_w"][60:, 1]))
    ratio = 1.08  # above the rating, under the pickup (1.2 for a row's ul489): it heats past its rating's heat, no trip
    s, res, tau_s = _run(tmp_path, row_w / ratio / 1e3, "none")
    assert s["breaker_trips"] == 0
    r2 = ratio**2
    # it starts at the heat of carrying its rating (a load over it begins with the run), then
    # θ(t) = r² + (1 − r²)·exp(−t/τ), sampled at the end of each period: the last at the run's end
    assert math.isclose(s["max_breaker_heat_frac"], r2 + (1.0 - r2) * math.exp(-res.duration_s / tau_s), rel_tol=0.01)
    # counted from where θ passes 1.01² (1 % over the rating): t = τ·ln((r² − 1)/(r² − 1.01²))
    over_s = res.duration_s - tau_s * math.log((r2 - 1.0) / (r2 - OVERLOAD_HEAT_FRAC))
    assert 0 < over_s < res.duration_s  # (the case is one that crosses: the check below is not empty)
    assert abs(s["breaker_overload_s"] - over_s) <= 2.0 * res.period_t_s[1]  # (whole control periods)
    # a row under its rating starts, and stays, at that load's heat: never above its rating's
    under, _, _ = _run(tmp_path, row_w / 0.95 / 1e3, "none")
    assert math.isclose(under["max_breaker_heat_frac"], 0.95**2, rel_tol=0.01) and under["breaker_overload_s"] == 0.0
    # dimmer brings the overloaded row under its rating: its breaker heats a little past 1, then cools under it
    held, _, _ = _run(tmp_path, row_w / ratio / 1e3, "dimmer")
    assert held["breaker_trips"] == 0
    assert held["max_breaker_heat_frac"] < 1.0 + (r2 - 1.0) / 4
    assert held["breaker_overload_s"] < res.duration_s / 4
