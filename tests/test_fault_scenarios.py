"""The fault library (scenarios/faults/): dimmer against every injected fault, each held to its written expectation.

Each scenario's `description` states the fault and what dimmer must hold. The table EXPECTED below is the same promise
in numbers, one row per file: where the physics allows it, zero trips and zero seconds over the interconnect limit and
the ramp limit; where it does not (commands that arrive late, a restart surge between two control periods, a campus
returning from backup all at once), a bound measured with dimmer plus a margin, so that a regression past the
documented degradation fails. A PCC meter that lies (drifts, spikes, sticks) is held to the rack readings and no longer
costs a limit.
docs/reliability.md holds the measured figures, with `none` for contrast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gridsim.engine import SimResult, run
from gridsim.metrics import summarize
from gridsim.scenario import load_scenario

from .conftest import SCENARIOS

FAULTS = SCENARIOS / "faults"
LIBRARY = sorted(FAULTS.glob("*.toml"))


@dataclass(frozen=True)
class Bound:
    """Upper bounds on one run with dimmer: trips, seconds over the PCC limit and the ramp limit, goodput lost."""

    overlimit_s: float = 0.0
    ramp_s: float = 0.0
    goodput_loss_pct: float = 0.5  # power-weighted goodput lost, percent
    excess_mw: float = 0.0  # the worst excursion of the grid import over the PCC limit
    trips: int = 0


HELD = Bound()  # every limit held, no goodput lost beyond noise (measured 0.002-0.003 %)

# file name -> bounds (measured with dimmer, then a margin; see docs/reliability.md for the figures). Since issue
# #11 the rack BBUs are backup units first (shaving every iteration had cost 43-322 depth-weighted cycles a day and
# left 12-22 s of ride-through; now at most ~1 a day and 101 s), and the interconnect is held on the racks' bound
# (their peak readings plus the 15 % a swing may hide, at most their enforced caps): the battery takes that bound on
# at the ramp rate and the caps meanwhile, so curtailments cost goodput where the BBUs used to pay in cycles.
EXPECTED: dict[str, Bound] = {
    # telemetry: a stale PCC meter is seen as stale; the curtailment is still met, at a goodput cost (measured 7.3 %;
    # 5.8 % before issue #11)
    "pcc-stale": Bound(goodput_loss_pct=8.5),
    # a stuck meter looks fresh, but repeats itself while the racks move: the racks stand in and every limit holds
    # (measured 6.6 % lost; 5.8 % while a BBU's relief ran on past its wear allowance for the period in which its
    # cycle passed it, 143 s over the ramp limit and 9.4 % lost before the plausibility check)
    "meter-stuck": Bound(goodput_loss_pct=7.0),
    # a row's readings NaN (reported fresh): held for stale_s, then the row counts as missing (measured 6.9 %)
    "racks-nan-row": Bound(goodput_loss_pct=8.5),
    # a 2x reading no rack confirms is not believed (100 s over the ramp limit before the plausibility check; 0.30 %
    # lost while the band's top it was read as went into the racks' bound as unmetered load, measured 0 % since)
    "meter-spike": Bound(goodput_loss_pct=0.05),
    # an under-reading meter is caught once past the tolerance and the racks stand in (measured 7.9 % lost; before
    # the plausibility check 563-575 s over the curtailed limit, by up to 0.39 MW). It was 1.9 % while a running
    # rack's peak hold decayed from every 1 s peak: finetune's hold, 3 % lower, left its racks out of the bound's
    # cut, so the curtailment's first 313 kW fell on pretrain (priority 10, to 1,247 W) and stayed there; held in
    # full, the cut is finetune's first (priority 5, to 640 W), as the priority order says
    "meter-drift": Bound(goodput_loss_pct=9.0),
    # actuation: the healthy rows are shed harder and the limit holds; the rows that cannot be capped count at the
    # caps their GPUs report, not the ones sent (measured 6.8 %, 5.8 %, 9.5 % lost; firmware-ignores-caps-row was
    # 2.2 % while pretrain took the curtailment's first cut, as in meter-drift)
    "cap-writes-lost-row": Bound(goodput_loss_pct=7.0),
    "firmware-ignores-caps-row": Bound(goodput_loss_pct=6.2),
    # (dark agents: measured 9.5 %; 12.7 % while their readings were held for ever, reported 1 s old by the simulator)
    "agents-down-row": Bound(goodput_loss_pct=10.5),
    # every command 10 s late: the battery's setpoint is late too, and the caps the GPUs report lag the ones sent.
    # A cut still on its way is counted at the cap sent once a write has been seen to land 10 s on
    # (cap_landing.py), not made again every period (measured 0 s over, 0 s over the ramp limit, 4.8 % lost; 10.9 %
    # while each period's retry landed 10 s on; 3.1 s over by at most 0.03 MW while the BBUs' relief ran past its
    # allowance; before issue #11: 50 s over by up to 0.16 MW, 8.4 % lost)
    "commands-delayed": Bound(goodput_loss_pct=7.0),
    # storage: the crash at 300 s is ridden through without the failed store
    "bess-offline": HELD,
    # the restart surge at 420 s arrives between two control periods with no BBU to shield it (measured 0.4 s over,
    # by 1.0 MW; 1.3 s, 0.97 MW before issue #11)
    "bbu-failed": Bound(overlimit_s=1.6, excess_mw=1.1),
    "bbu-empty": HELD,
    "trays-disabled": HELD,
    # load
    "all-jobs-crash": HELD,
    "mass-restart": HELD,
    # the return from backup is one step of the whole campus: the ramp limit cannot hold (measured 192 s). The PCC
    # reads 0 on backup while the racks run: the check plans on the racks, so the return finds the battery ready
    # (measured 0 s over; 1.1 s, 1.22 MW before the plausibility check)
    "backup-transfer": Bound(ramp_s=200.0),
    # grid
    "curtailment": Bound(goodput_loss_pct=7.0),  # measured 5.2 % (4.5 % with the BBUs shaving, before issue #11)
    "frequency-step": HELD,
    # measured 1.3 %: the derated hall, its breaker cool, is brought under its rating at the ramp, then held at it
    # (1.6 % held 5 % under it; 6.4 % while each envelope over the rating cut it to the soft threshold at once; 4.3 %
    # with the BBUs shaving the hall's peaks at 322 cycles a day, before issue #11)
    "hot-day-derate": Bound(goodput_loss_pct=2.0),
}


def excess_mw(res: SimResult) -> float:
    return max(0.0, float(np.max(res.tick["grid_w"] - res.tick["pcc_limit_w"]))) / 1e6


def test_every_fault_file_has_an_expectation_and_every_expectation_a_file() -> None:
    assert sorted(p.stem for p in LIBRARY) == sorted(EXPECTED)


@pytest.mark.parametrize("path", LIBRARY, ids=[p.stem for p in LIBRARY])
def test_dimmer_keeps_its_written_promise_under_the_fault(path: Path) -> None:
    loaded = load_scenario(path)
    sc = loaded.scenario
    assert "FAULT:" in sc.description and "EXPECTED" in sc.description
    assert all(ev.at_s >= 120 for ev in sc.events)  # the controller has settled before the fault
    bound = EXPECTED[path.stem]
    res = run(loaded, controller="dimmer")
    s = summarize(res)
    got = (s["breaker_trips"], s["pcc_overlimit_s"], s["ramp_violation_s"], s["goodput_loss_power_pct"], excess_mw(res))
    assert s["breaker_trips"] <= bound.trips, got
    assert s["pcc_overlimit_s"] <= bound.overlimit_s, got
    assert s["ramp_violation_s"] <= bound.ramp_s, got
    assert s["goodput_loss_power_pct"] <= bound.goodput_loss_pct, got
    assert excess_mw(res) <= bound.excess_mw + 1e-9, got


@pytest.mark.parametrize("stem", ["curtailment", "meter-drift"])
def test_a_curtailment_cuts_the_lower_priority_job_first(stem: str) -> None:
    # (a rack whose peak hold had decayed below its cap dropped out of the bound's cut, and the cut fell on the
    # job above it: pretrain, priority 10, was capped to 1,247 W while finetune, priority 5, ran at 1,396 W)
    loaded = load_scenario(FAULTS / f"{stem}.toml")
    priority = np.array([job.priority for job in loaded.scenario.jobs])
    low, high = int(np.argmin(priority)), int(np.argmax(priority))
    res = run(loaded, controller="dimmer")
    caps = res.period["job_cap_w"]
    assert caps[:, low].min() < res.site.gpu.rated_w - 100.0  # the curtailment does cut
    assert np.all(caps[:, low] <= caps[:, high] + 1e-6), float(np.max(caps[:, low] - caps[:, high]))


def test_a_job_capped_flat_is_known_at_its_caps() -> None:
    """curtailment: the finetune job capped at 785 W reads flat now and then (every 79 s its peak readings show no
    swing). Counted at their caps its racks are known all the same (they draw no more), so the pretraining job's
    prior over its measured peaks stays margin, not load: 4.71 % of GPU time lost while each flat period dropped that
    relief for a period and cut caps that took minutes to rise back; now 3.4 %, and the limit still holds."""
    s = summarize(run(load_scenario(FAULTS / "curtailment.toml"), controller="dimmer"))
    assert s["pcc_overlimit_s"] == 0.0 and s["ramp_violation_s"] == 0.0 and s["breaker_trips"] == 0
    assert s["goodput_loss_power_pct"] < 4.0


def test_a_stale_pcc_meter_through_a_curtailment_moves_the_battery_on_the_racks_estimate() -> None:
    """pcc-stale with a ramp rule 30 % tighter (0.7 MW/min): the PCC meter is stale from 180 s to 420 s while the
    limit falls 6.0 -> 4.6 MW. Planned on the last reading held, 0.8 MW above the load the safe caps left, the
    battery discharged 0.5 MW toward it as the limit fell and took the import down past the rule (31 s over it);
    on the racks' estimate it need not move."""
    loaded = load_scenario(FAULTS / "pcc-stale.toml", ["site.pcc.ramp_mw_per_min=0.7", "duration_s=300"])
    s = summarize(run(loaded, controller="dimmer"))
    assert s["breaker_trips"] == 0
    assert s["pcc_overlimit_s"] == 0.0
    assert s["ramp_violation_s"] == 0.0
