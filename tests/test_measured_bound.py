"""Where every running rack's peak is measured and no battery may cover the hidden-peak prior's excess over them,
the interconnect's bound check holds the measured bound alone: it is every rack at its peak at once.

bess-trip-headroom (scenarios/sites/): peaks 2 % under a 5.7 MW limit, and a battery that trips at 600 s. Held to
the battery's cover, the prior's excess kept the evaluation job capped at 1,081 W from the trip to the end, 290 kW
under a limit no peak came near (0.37 points of the site's GPU time, where the uncontrolled site holds every limit).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gridsim.engine import run
from gridsim.metrics import summarize
from gridsim.scenario import load_scenario

SITE = Path(__file__).resolve().parents[1] / "scenarios" / "sites" / "bess-trip-headroom.toml"


def test_a_battery_lost_under_measured_peaks_leaves_the_jobs_at_their_rated_caps() -> None:
    loaded = load_scenario(SITE, ["duration_s=880"])  # (to the second checkpoint: its return is another matter)
    res = run(loaded, "dimmer")
    site = loaded.site()
    eval_job = site.job_name.index("eval")
    t, cap_w = res.period_t_s, res.period["job_cap_w"][:, eval_job]
    after = t >= 660.0  # (the trip at 600 s, and its first minute)
    assert np.all(cap_w[after] >= site.gpu.rated_w - 1.0), cap_w[after].min()
    s = summarize(res)
    assert s["breaker_trips"] == 0 and s["pcc_overlimit_s"] == 0.0 and s["ramp_violation_s"] == 0.0
    assert np.all(res.tick["bess_w"][res.t_s >= 601.0] == 0.0)  # (the battery is gone: the caps and BBUs alone)
