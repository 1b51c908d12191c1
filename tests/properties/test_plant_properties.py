"""Whole-plant invariants on random small sites, random jobs and random controller actions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel
from gridsim.engine import Simulation
from gridsim.scenario import LoadedScenario, validate_scenario


class RandomActions:
    """A controller that commands random caps, floors, BBU thresholds and BESS setpoints: the plant must cope."""

    name = "random"

    def __init__(self, site: SiteModel, seed: int) -> None:
        self.site = site
        self.rng = np.random.default_rng(seed)

    def step(self, obs: Observation) -> Actions:
        n, g = self.site.n_racks, self.site.gpu
        rack_max = self.site.rack_max_w()
        return Actions(
            rack_cap_w=self.rng.uniform(0.0, 1.2 * g.rated_w, n),  # out of range on purpose: the plant clamps
            rack_floor_w=self.rng.uniform(0.0, g.rated_w, n) * (self.rng.random(n) < 0.3),
            bess_setpoint_w=float(self.rng.uniform(-2, 2) * max(self.site.bess.power_w, 1.0)),
            rack_bbu_threshold_w=np.where(self.rng.random(n) < 0.5, np.inf, rack_max * self.rng.uniform(0.3, 1, n)),
            rack_bbu_recharge_w=self.site.rack_storage.bbu_power_w * self.rng.random(n),
            job_suspend=self.rng.random(self.site.n_jobs) < 0.05,
            gpu_ramp_up_w_per_s=float(self.rng.choice([np.inf, 500.0])),
            gpu_ramp_down_w_per_s=float(self.rng.choice([np.inf, 300.0])),
        )


@st.composite
def small_scenarios(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    rows = draw(st.integers(1, 3))
    racks = draw(st.integers(1, 5))
    n_racks = rows * racks
    jobs = []
    free = n_racks
    for i in range(draw(st.integers(0, 3))):
        if free < 1:
            break
        take = draw(st.integers(1, free))
        start = n_racks - free
        jobs.append(
            {
                "name": f"j{i}",
                "racks": [start, start + take],
                "priority": draw(st.integers(0, 3)),
                "swing_frac": draw(st.floats(0.0, 0.6)),
                "iteration_s": draw(st.floats(0.3, 5.0)),
                "mtbi_gpu_h": draw(st.sampled_from([None, 5.0])),
                "recovery_s": 5.0,
                "checkpoint": {"mode": draw(st.sampled_from(["sync", "async", "none"])), "interval_s": 7.0},
            }
        )
        free -= take
    raw = {
        "name": "prop",
        "duration_s": draw(st.floats(5.0, 25.0)),
        "seed": draw(st.integers(0, 2**16)),
        "site": {
            "gpu": draw(st.sampled_from(["h100", "gb200", "gb300"])),
            "pcc": {"limit_mw": 0.14 * n_racks * draw(st.floats(0.5, 1.5))},
            "levels": [
                {"level": "row", "count": rows, "rating_kw": 120.0 * racks * draw(st.floats(0.4, 1.5))},
                {"level": "rack", "count": racks},
            ],
            "storage": {
                "bess": {
                    "power_mw": draw(st.sampled_from([0.0, 0.5])),
                    "energy_mwh": draw(st.sampled_from([0.0, 0.01])),
                },
                "bbu": {"kwh_per_rack": draw(st.floats(0.0, 1.0))},
            },
        },
        "jobs": jobs,
        "breakers": {"reclose_s": 3.0},
        "telemetry": {"dropout_prob": draw(st.sampled_from([0.0, 0.3]))},
    }
    return raw, draw(st.integers(0, 1000))


@given(small_scenarios())
def test_plant_invariants_hold_under_random_actions(case: tuple[dict[str, Any], int]) -> None:
    raw, ctrl_seed = case
    loaded = LoadedScenario(validate_scenario(raw, "prop"), "prop", Path("."))
    site = loaded.site()
    res = Simulation(loaded, site, RandomActions(site, ctrl_seed), loaded.scenario.seed).run()
    tick, dt, store = res.tick, res.tick_s, res.storage

    # no negative draw anywhere the grid can see
    assert np.all(tick["load_w"] >= 0) and np.all(tick["campus_w"] >= -1e-6) and np.all(tick["demand_w"] >= 0)
    # the grid import is the campus bus less the battery, every tick
    np.testing.assert_allclose(tick["grid_w"], tick["campus_w"] - tick["bess_w"], rtol=1e-12, atol=1e-6)
    # energy balance of rack storage over the run: campus = load + what the trays and BBUs took in net
    net = store["tray_energy_in_j"] - store["tray_energy_out_j"] + store["bbu_energy_in_j"] - store["bbu_energy_out_j"]
    assert abs(tick["campus_w"].sum() * dt - (tick["load_w"].sum() * dt + net)) <= 1e-6 * max(
        tick["load_w"].sum() * dt, 1.0
    )
    # battery bookkeeping: grid-side in/out minus losses is what the store gained; SoC within its window
    if site.bess.energy_j > 0:
        assert store["bess_loss_j"] >= -1e-6
        soc = tick["bess_soc_frac"]
        assert soc.min() >= site.bess.soc_min_frac - 1e-9 and soc.max() <= site.bess.soc_max_frac + 1e-9
    bbu = res.period["bbu_soc_min_frac"]
    if site.rack_storage.bbu_energy_j.max() > 0:
        assert bbu.min() >= site.rack_storage.bbu_soc_min_frac - 1e-9
    # caps in force stay within the GPU's settable range, whatever was commanded
    caps = res.period["rack_cap_w"]
    assert caps.min() >= site.gpu.min_cap_w - 1e-9 and caps.max() <= site.gpu.rated_w + 1e-9
    # goodput accounting closes
    acc = res.accounting
    losses = sum(acc[k] for k in acc if k not in ("allocated", "useful"))
    np.testing.assert_allclose(acc["allocated"], acc["useful"] + losses, rtol=1e-9, atol=1e-6)


@given(small_scenarios())
def test_same_seed_same_result(case: tuple[dict[str, Any], int]) -> None:
    raw, ctrl_seed = case
    loaded = LoadedScenario(validate_scenario(raw, "prop"), "prop", Path("."))
    runs = []
    for _ in range(2):
        site = loaded.site()
        runs.append(Simulation(loaded, site, RandomActions(site, ctrl_seed), 5).run())
    for key in runs[0].tick:
        np.testing.assert_array_equal(runs[0].tick[key], runs[1].tick[key])
