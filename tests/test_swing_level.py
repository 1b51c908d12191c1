"""The campus level estimator (filters.SwingLevel) and the BBUs' half-cycle counter (rack_storage.HalfCycles)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dimmer.control.filters import SwingLevel
from dimmer.control.rack_storage import HalfCycles
from dimmer.wear import depth_weight


def test_an_aliased_swing_is_rejected_and_a_step_followed_within_two_readings() -> None:
    f = SwingLevel(6, tol_abs=0.1, memory=18)
    levels = [f.update(x) for x in [15.0, 14.0] * 6]
    assert levels[-1] == 14.5 and f.span == 1.0  # the alternation is the swing: its mean is the level
    assert f.update(10.0) == 14.5 and not f.stepped  # one reading no swing explains is held aside
    assert f.update(10.0) == 10.0 and f.stepped  # two in a row: the level has changed
    assert f.update(14.9) == 10.0  # held aside again ...
    assert f.update(10.05) == (10.0 + 10.0 + 14.9 + 10.05) / 4  # ... it was the swing: both join the window


def test_a_restarted_level_forgets_its_readings_and_a_nan_holds() -> None:
    f = SwingLevel(4)
    for x in (15.0, 11.0, 15.0, 11.0):
        f.update(x)
    assert f.level() == 13.0 and not f.warming
    assert f.update(float("nan")) == 13.0  # an untrusted reading is held, not averaged in
    f.restart()
    assert f.warming and np.isnan(f.level())
    assert f.update(7.0) == 7.0


@given(st.lists(st.floats(0.0, 1e7, allow_nan=False), min_size=1, max_size=60))
def test_the_level_stays_within_the_readings(xs: list[float]) -> None:
    f = SwingLevel(6, tol_abs=1.0)
    for x in xs:
        level = f.update(x)
        assert min(xs) - 1e-6 <= level <= max(xs) + 1e-6


def test_a_swing_slower_than_the_window_is_averaged_over_whole_periods() -> None:
    """An 8 s RL iteration read at 1 s (4 readings of training, 4 of rollouts): a mean over 6 readings swings with it,
    by a third of the swing; once the readings show their period the window spans one (8), and the level holds."""
    f = SwingLevel(6, tol_abs=0.1, max_length=40)
    fixed = SwingLevel(6, tol_abs=0.1)  # the window that cannot grow: what the level was
    wave = [8.4, 8.4, 8.4, 8.4, 5.3, 5.3, 5.3, 5.3] * 8
    levels = [f.update(x) for x in wave]
    fixed_levels = [fixed.update(x) for x in wave]
    assert f.period == 8 and f.window == 8
    assert np.ptp(levels[-16:]) < 1e-9 and abs(levels[-1] - 6.85) < 1e-9  # the mean of a whole period
    assert np.ptp(fixed_levels[-16:]) > 0.9  # (6 readings: 4 of one phase and 2 of the other, then the reverse)
    # a step is still followed within two readings, and the level is then the new load's
    assert f.update(12.0) == levels[-1] and not f.stepped
    assert f.update(12.0) == 12.0 and f.stepped


def test_a_swing_whose_phases_outlast_the_window_is_averaged_and_a_step_in_it_followed() -> None:
    """A 15 s RL iteration read at 1 s: 6 readings of training, 9 of rollouts. The 9 rollout readings fill the least
    window (6), so every change of phase lies beyond the window's band; restarted on each, the level followed the
    swing for good. Once the readings show their period, a reading within what its phase read one period ago is
    the swing: the level is the whole period's mean, and a step of the whole load is followed within two readings
    and read as a step once, the swing at the new level being the swing again."""
    wave = [12.0] * 6 + [9.6] * 9
    f = SwingLevel(6, tol_abs=0.065, max_length=15)
    levels = [f.update(x) for x in wave * 6]
    assert f.period == 15 and f.window == 15
    mean = (6 * 12.0 + 9 * 9.6) / 15
    assert np.ptp(levels[-30:]) < 1e-9 and abs(levels[-1] - mean) < 1e-9
    for drop, seen_at in ((3.5, 1), (2.0, 7)):  # a job stopped: the same swing lower, by more or less than its span
        g = SwingLevel(6, tol_abs=0.065, max_length=15)
        for x in wave * 6:
            g.update(x)
        shifted = [x - drop for x in wave * 3]
        after, steps = [], []
        for i, x in enumerate(shifted):
            after.append(g.update(x))
            if g.stepped:
                steps.append(i)
        # a step beyond the swing's band is followed at its second reading; one within it when a phase shows it
        # (the rollouts' readings lie under the band); either way once, and never again at the swing's new level
        assert steps == [seen_at] and after[seen_at] == shifted[seen_at]
        assert g.period == 15 and np.ptp(after[-15:]) < 1e-9 and abs(after[-1] - (mean - drop)) < 1e-9


def test_the_period_is_where_two_swings_line_up() -> None:
    """A 2.5 s pretraining swing read at 1 s repeats every 5 readings; beside a 15 s RL iteration the readings repeat
    only every 15. A window of 10 (two of the shorter period) swings with the RL job; the period found is 15."""
    t = np.arange(90)
    fast = 0.3 * np.cos(2 * np.pi * t / 5)
    slow = np.where(t % 15 < 6, 1.2, -1.2)
    f = SwingLevel(6, tol_abs=0.01, max_length=15)
    for x in 10.0 + fast + slow:
        f.update(float(x))
    assert f.period == 15 and f.window == 15


def test_an_aliased_swing_keeps_the_least_window_and_noise_or_a_ramp_shows_no_period() -> None:
    f = SwingLevel(6, max_length=40)
    for x in [15.0, 14.0] * 20:
        f.update(x)
    assert f.period == 2 and f.window == 6  # 6 readings already span whole periods of a 2-reading wobble
    rng = np.random.default_rng(3)
    noisy = SwingLevel(6, max_length=40)
    for x in 10.0 + rng.standard_normal(120):
        noisy.update(float(x))
    assert noisy.period == 0 and noisy.window == 6
    ramp = SwingLevel(6, max_length=40)
    for k in range(120):
        ramp.update(10.0 + 0.01 * k)
    assert ramp.period == 0 and ramp.window == 6


def test_a_period_longer_than_the_longest_window_keeps_the_least_one() -> None:
    f = SwingLevel(6, tol_abs=0.1, max_length=12)
    for x in ([8.0] * 9 + [5.0] * 9) * 6:  # an 18-reading period: more than max_length, not found
        f.update(x)
    assert f.window == 6


def test_half_cycles_charge_each_reversal_at_half_its_depth_weight() -> None:
    """SoC 1.0 -> 0.6 -> 1.0 on a 0.5 window: a 0.8-deep run down, closed by the turn, then one up."""
    c = HalfCycles(1, window_frac=0.5)
    spent = [float(c.update(np.array([s]))[0]) for s in (1.0, 0.8, 0.6, 0.8, 1.0, 0.9)]
    half = 0.5 * float(depth_weight(0.8))
    assert spent[:3] == [0.0, 0.0, 0.0]  # the run down is open: nothing closed yet
    assert spent[3] == half  # it turned at 0.6
    assert spent[5] == half  # and the run up closed at 1.0
    assert abs(c.open_depth()[0] - 0.2) < 1e-12  # the run down from 1.0, open


@given(st.lists(st.floats(0.5, 1.0), min_size=2, max_size=80))
def test_half_cycles_never_charge_less_than_nothing_nor_more_than_the_path(socs: list[float]) -> None:
    """Each closed half weighs at most half a full cycle; the total never exceeds half a cycle per reversal."""
    c = HalfCycles(1, window_frac=0.5)
    total = sum(float(c.update(np.array([s]))[0]) for s in socs)
    # (a reversal across a plateau is one too: 0.5, 1.0, 1.0, 0.5 turns once)
    path = [s for i, s in enumerate(socs) if i == 0 or s != socs[i - 1]]
    reversals = sum(1 for a, b, d in zip(path, path[1:], path[2:], strict=False) if (b - a) * (d - b) < 0)
    assert 0.0 <= total <= 0.5 * (reversals + 1) + 1e-12
