"""The campus battery as grid shaping plans on it, and the campus level it follows: one definition for the flat
controller (dimmer.py, layer 1) and the campus coordinator (coordinator.py), which shape the grid the same way."""

from __future__ import annotations

import math

from dimmer.control.filters import SwingLevel
from dimmer.control.rack_math import clip_float
from dimmer.site import BessRatings


def bess_room(b: BessRatings, soc: float, online: bool, reserve_frac: float) -> tuple[float, float, float]:
    """(discharge W the battery can give, the share of it to plan on, charge W it can take): the plan tapers over
    `reserve_frac` of SoC above the minimum; an offline, absent or unread battery gives and takes nothing."""
    if not online or b.energy_j <= 0 or not math.isfinite(soc):
        return 0.0, 0.0, 0.0
    discharge = b.power_w if soc > b.soc_min_frac + 1e-3 else 0.0
    charge = b.power_w if soc < b.soc_max_frac - 1e-3 else 0.0
    taper = clip_float((soc - b.soc_min_frac) / max(reserve_frac, 1e-6), 0.0, 1.0)
    return discharge, discharge * taper, charge


def soc_pull_w(
    b: BessRatings,
    soc: float,
    online: bool,
    target_frac: float,
    recovery_s: float,
    ramp_margin_frac: float,
    ramp_limit_w_per_min: float,
    ramp_window_s: float,
) -> float:
    """The slow SoC recovery: W to add to the grid target (positive: charge), toward `target_frac` with time
    constant `recovery_s`. An offline battery takes nothing: a pull toward its target would be a fall for the floors
    to fill. No larger than the share of a window's ramp the margin keeps for the unplanned: a battery reverts to 0 W
    when its controller goes silent, and a recovery charge is then a step the grid sees."""
    if b.energy_j <= 0 or not online or not math.isfinite(soc):
        return 0.0
    usable = (b.soc_max_frac - b.soc_min_frac) * b.energy_j
    pull = (target_frac - soc) * usable / recovery_s
    pull_max = min(b.power_w, (1.0 - ramp_margin_frac) * ramp_limit_w_per_min * ramp_window_s / 60)
    return clip_float(pull, -pull_max, pull_max)


def campus_level(period_s: float, level_s: float, ramp_window_s: float, tol_abs_w: float) -> SwingLevel:
    """The campus level the battery follows: the mean of at least `level_s` of readings. The swing's span is
    remembered for a few windows: long enough to bridge a window that misses a peak ... or the least whole number of
    the readings' own period above it (a mean over part of a period swings with it), for a period of up to a quarter
    of the utility's ramp window: four or more of them in one window average out in what the utility measures, so
    they are the swing; a slower one is a level the battery shapes (trace-hall's 36 s evaluation dips, averaged as a
    swing, cost 0.9 points more energy in floors)."""
    n_level = max(2, round(level_s / period_s))
    n_level_max = max(n_level, math.floor(ramp_window_s / 4.0 / period_s))
    return SwingLevel(n_level, tol_abs=tol_abs_w, memory=3 * n_level, max_length=n_level_max)
