"""The fault library (scenarios/faults/): dimmer against every injected fault, each held to its written expectation.

Each scenario's `description` states the fault and what dimmer must hold. The table EXPECTED below is the same promise
in numbers, one row per file: where the physics allows it, zero trips and zero seconds over the interconnect limit and
the ramp limit; where it does not (a meter that lies, commands that arrive late, a campus returning from backup all at
once), a bound measured with dimmer plus a margin, so that a regression past the documented degradation fails.
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

# file name -> bounds (measured with dimmer, then a margin; see docs/reliability.md for the figures)
EXPECTED: dict[str, Bound] = {
    # telemetry: a stale PCC meter is seen as stale; the curtailment is still met, at a goodput cost (measured 5.8 %)
    "pcc-stale": Bound(goodput_loss_pct=7.0),
    # a stuck meter looks fresh: the limit holds but the caps swing (measured 143 s of ramp violation, 9.4 % lost)
    "meter-stuck": Bound(ramp_s=170.0, goodput_loss_pct=11.0),
    "racks-nan-row": Bound(goodput_loss_pct=8.5),  # measured 7.0 %
    # a false 2x reading makes dimmer shed, and the recovery breaks the ramp limit (measured 100 s)
    "meter-spike": Bound(ramp_s=120.0),
    # an under-reading meter is believed: over the curtailed limit by a bounded amount (measured 575 s, 0.35 MW)
    "meter-drift": Bound(overlimit_s=600.0, excess_mw=0.45, goodput_loss_pct=3.0),
    # actuation: the healthy rows are shed harder and the limit holds (measured 3.7 %, 4.0 %, 7.1 % lost)
    "cap-writes-lost-row": Bound(goodput_loss_pct=4.5),
    "firmware-ignores-caps-row": Bound(goodput_loss_pct=5.0),
    "agents-down-row": Bound(goodput_loss_pct=8.5),
    # every command 10 s late: the curtailment is met late (measured 55 s over, by at most 0.12 MW; 7.5 % lost)
    "commands-delayed": Bound(overlimit_s=70.0, excess_mw=0.2, goodput_loss_pct=9.0),
    # storage: the crash at 300 s is ridden through without the failed store
    "bess-offline": HELD,
    # the BESS charges into the restart surge at 420 s (measured 1.3 s over, by 0.88 MW): a controller defect
    "bbu-failed": Bound(overlimit_s=3.0, excess_mw=1.1),
    "bbu-empty": HELD,
    "trays-disabled": HELD,
    # load
    "all-jobs-crash": HELD,
    "mass-restart": HELD,
    # the return from backup is one step of the whole campus: the ramp limit cannot hold (measured 189 s); the BESS
    # charging at full power into the return takes the import over the limit (measured 3.0 s, 1.23 MW): a defect
    "backup-transfer": Bound(overlimit_s=1.5, ramp_s=200.0, excess_mw=1.5),
    # grid
    "curtailment": Bound(goodput_loss_pct=4.8),  # measured 3.9 %
    "frequency-step": HELD,
    "hot-day-derate": Bound(goodput_loss_pct=5.6),  # measured 4.6 %
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
