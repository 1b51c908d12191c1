"""The breakers' heat in the summary: `max_breaker_heat_frac` and `breaker_overload_s` (docs/models.md, "Metrics"),
against the thermal model's closed form on a row held at a steady load above its rating that never trips."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from gridsim.engine import SimResult, run
from gridsim.metrics import summarize
from gridsim.plant.breakers import BreakerBank
from gridsim.scenario import load_scenario

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
    ratio = 1.08  # above the rating, under the IEC pickup (1.15): it heats past the rating's steady state, no trip
    s, res, tau_s = _run(tmp_path, row_w / ratio / 1e3, "none")
    assert s["breaker_trips"] == 0
    r2 = ratio**2
    # θ(t) = r²(1 − exp(−t/τ)) from cold, sampled at the end of each period: the last at the run's end
    assert math.isclose(s["max_breaker_heat_frac"], r2 * -math.expm1(-res.duration_s / tau_s), rel_tol=0.01)
    over_s = res.duration_s - tau_s * math.log(r2 / (r2 - 1.0))  # above 1 from τ·ln(r²/(r²−1)) on
    assert 0 < over_s < res.duration_s  # (the case is one that crosses: the check below is not empty)
    assert abs(s["breaker_overload_s"] - over_s) <= 2.0 * res.period_t_s[1]  # (whole control periods)
    # and dimmer holds the row under its rating: no time above its steady heat
    held, _, _ = _run(tmp_path, row_w / ratio / 1e3, "dimmer")
    assert held["breaker_overload_s"] == 0.0 and held["max_breaker_heat_frac"] <= 1.0
