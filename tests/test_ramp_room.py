"""The ramp room against the rule as the simulator's metric measures it (gridsim.plant.grid.ramp_w_per_min): a level
held at either bound from now on keeps every window-mean change over the next window within the budget, and one a
little beyond the bound does not."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dimmer.control.ramp_room import RampRoom, ReturnHold
from gridsim.plant.grid import ramp_w_per_min

WINDOW_S = 20.0
N = 20  # readings a window at 1 s


def _room(history_w: list[float]) -> RampRoom:
    room = RampRoom(WINDOW_S, 1.0)
    for x in history_w:
        room.push(x)
    return room


def _worst_change_w(history_w: list[float], hold_w: float) -> float:
    """The largest |m(t) - m(t - W)| the metric measures over the window after `history_w`, the level held."""
    series = np.concatenate([np.asarray(history_w[-2 * N :]), np.full(N, hold_w)])
    ramp = ramp_w_per_min(series, 1.0, WINDOW_S)
    return float(np.max(np.abs(ramp[-N:]))) * WINDOW_S / 60.0


levels = st.lists(st.floats(0.0, 10e6, allow_nan=False), min_size=2 * N, max_size=3 * N)


@given(history=levels, budget=st.floats(0.05e6, 3e6))
def test_a_level_held_at_either_bound_keeps_the_rule(history: list[float], budget: float) -> None:
    lo, hi = _room(history).bounds(budget)
    assert lo <= hi
    if _worst_change_w(history, 0.5 * (lo + hi)) > budget * (1 + 1e-9) + 1e-3:
        return  # the history already breaks the budget: no level keeps it (the bounds meet at their midpoint)
    for hold in (lo, hi):
        assert _worst_change_w(history, hold) <= budget * (1 + 1e-9) + 1e-3


@given(history=levels, budget=st.floats(0.05e6, 3e6))
def test_the_bounds_are_tight(history: list[float], budget: float) -> None:
    lo, hi = _room(history).bounds(budget)
    if lo == hi:
        return
    beyond = 0.01 * budget + 1.0
    assert _worst_change_w(history, hi + beyond) > budget
    assert _worst_change_w(history, lo - beyond) > budget


@given(history=levels, budget=st.floats(0.05e6, 3e6))
def test_where_the_history_already_breaks_the_rule_the_level_is_one_the_import_has_drawn(
    history: list[float], budget: float
) -> None:
    """No level keeps a window already broken; the one that would pay it back may be far outside anything the site
    draws (a start whose step and the cut it drew both landed whole, caps 20 s late: -38 MW asked of a campus that
    had drawn 4.7-10.4 MW). The bounds then meet within what the import drew over the two windows."""
    lo, hi = _room(history).bounds(budget)
    if lo < hi or _worst_change_w(history, lo) <= budget * (1 + 1e-9) + 1e-3:
        return  # (a level keeps the rule: the room is the rule's own)
    seen = history[-2 * N :]
    assert min(seen) <= lo <= max(seen)


def test_a_step_up_and_a_larger_fall_leave_a_level_the_site_has_drawn() -> None:
    history = [5e6] * N + [8.4e6] * (N // 2) + [3.4e6] * (N // 2)
    lo, hi = _room(history).bounds(0.7e6)
    assert lo == hi and 3.4e6 <= lo <= 8.4e6


def test_a_settled_import_may_step_by_the_budget_and_not_more() -> None:
    room = _room([5e6] * (2 * N))
    lo, hi = room.bounds(0.7e6)
    assert math.isclose(hi, 5.7e6) and math.isclose(lo, 4.3e6)


def test_an_iterations_swing_leaves_the_room_around_its_mean() -> None:
    """An 8 s swing of 3 MW (6.8 MW mean) read as 1 s means under a 60 s rule: the window means barely move, so the
    room is centred on the mean, most of the budget either side; the swing's trough and peak readings lie outside it
    (a controller judges a fall or a rise on a level, not on a reading)."""
    room = RampRoom(60.0, 1.0)
    for k in range(130):
        room.push(8.3e6 if (k % 8) < 4 else 5.3e6)
    lo, hi = room.bounds(0.7e6)
    assert 6.8e6 - 0.7e6 <= lo < 6.8e6 - 0.5e6 and 6.8e6 + 0.5e6 < hi <= 6.8e6 + 0.7e6
    assert lo > 5.3e6 and hi < 8.3e6


def test_no_history_or_no_rule_leaves_every_level_and_a_lost_reading_holds_the_last() -> None:
    assert RampRoom(WINDOW_S, 1.0).bounds(1e6) == (-math.inf, math.inf)
    assert _room([1e6] * N).bounds(math.inf) == (-math.inf, math.inf)
    room = _room([1e6] * (2 * N))
    room.push(math.nan)
    assert np.all(room.history_w == 1e6)
    empty = RampRoom(WINDOW_S, 1.0)
    empty.push(math.nan)
    assert not empty.known


def test_a_stopped_jobs_return_is_held_until_the_hold_has_burned_what_a_release_would_cost() -> None:
    """The ski-rental rule: 2 MW of stopped jobs on 2,000 GPUs, the import 0.7 MW under their return held 2.3 MW over
    what the rule alone asks. Released, the return would climb 2.3 MW at 11.7 kW/s with the capped share falling
    from 2.3 MW to 0: 227k GPU-seconds, 6.8 GJ at 30 kJ each; held, 2.3 MW a second. So the hold lasts about
    2,960 s, then stays released however far the rule's room falls, until the jobs run again."""
    hold = ReturnHold(30e3)
    rate = 0.7e6 / 60.0
    args = {"return_w": 2e6, "return_gpus": 2000.0, "with_return_w": 5e6, "budget_w": 0.7e6, "rate_w_per_s": rate}
    lost_gpu_s = 0.5 * 2.3e6 / rate * 2.3e6 / 1000.0
    held = 0
    while hold.level_w(free_lo_w=2e6, dt_s=1.0, **args) == 4.3e6:
        held += 1
        assert held < 10_000
    assert held == math.ceil(30e3 * lost_gpu_s / 2.3e6)
    assert hold.level_w(free_lo_w=0.0, dt_s=1.0, **args) == -math.inf  # a deeper fall does not re-arm it
    assert hold.level_w(0.0, 0.0, 3e6, 2e6, 0.7e6, rate, 1.0) == -math.inf  # the jobs run again...
    assert hold.level_w(free_lo_w=2e6, dt_s=1.0, **args) == 4.3e6  # ...and the next stop is held afresh


def test_a_return_hold_needs_a_rule_a_price_and_room_to_keep() -> None:
    args = {"return_w": 2e6, "return_gpus": 2000.0, "with_return_w": 5e6, "rate_w_per_s": 0.7e6 / 60.0, "dt_s": 1.0}
    assert ReturnHold(0.0).level_w(free_lo_w=2e6, budget_w=0.7e6, **args) == -math.inf  # goodput worth nothing
    assert ReturnHold(30e3).level_w(free_lo_w=2e6, budget_w=math.inf, **args) == -math.inf  # no ramp rule
    assert ReturnHold(30e3).level_w(free_lo_w=4.5e6, budget_w=0.7e6, **args) == -math.inf  # the rule holds more


@given(st.floats(0.05, 0.95), st.floats(0.5e6, 4e6), st.floats(0.2e6, 1e6))
def test_a_step_inside_a_period_is_held_within_the_budget_less_the_straddle(
    at_frac: float, fall_w: float, budget_w: float
) -> None:
    """The rule measures its windows at every instant; the room reads whole periods. A fall that lands inside a
    period, the import then held at the room's floor on the budget less `straddle_w`, falls by no more than the budget
    in any window the rule measures at 0.1 s over the window the room plans (on the bare budget, a window that ends
    inside a period sees more of the fall than the period's mean shows: 2.5 % more at a 2.8 MW fall)."""
    ticks = 10  # a period of 1 s at 0.1 s
    before = np.full(2 * N * ticks, 5e6)
    step_at = round(at_frac * ticks)
    fall_period = np.where(np.arange(ticks) < step_at, 5e6, 5e6 - fall_w)
    room = _room([5e6] * (2 * N) + [float(fall_period.mean())])
    lo, _ = room.bounds(budget_w - room.straddle_w())
    level = max(lo, 5e6 - fall_w)
    series = np.concatenate([before, fall_period, np.full(N * ticks, level)])
    ramp = ramp_w_per_min(series, 0.1, WINDOW_S)
    worst_fall_w = -float(np.min(ramp[2 * N * ticks :])) * WINDOW_S / 60.0
    assert worst_fall_w <= budget_w * (1 + 1e-9)


def test_the_straddle_is_the_largest_change_between_periods_at_both_ends_of_a_window() -> None:
    room = _room([5e6] * 10 + [3e6] * 10 + [3.5e6] * 5)
    assert math.isclose(room.straddle_w(), 2 * 2e6 / N)
    assert RampRoom(WINDOW_S, 1.0).straddle_w() == 0.0  # nothing read: nothing to straddle
