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
    reversals = sum(1 for a, b, d in zip(socs, socs[1:], socs[2:], strict=False) if (b - a) * (d - b) < 0)
    assert 0.0 <= total <= 0.5 * (reversals + 1) + 1e-12
