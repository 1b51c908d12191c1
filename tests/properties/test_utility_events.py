"""The utility event schedule (dimmer.utility_events): the limit in force never above the configured one nor above
any accepted active event's, the utility's start time and ramp followed, nothing touched outside an event's window."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.utility_events import Interval, UtilityEvent, UtilitySchedule

BASE_W = 20e6

times = st.floats(min_value=-100.0, max_value=2000.0, allow_nan=False)


@st.composite
def events(draw: st.DrawFn, kinds: tuple[str, ...] = ("limit", "target", "ramp")) -> UtilityEvent:
    start = draw(st.floats(min_value=0.0, max_value=1500.0))
    n = draw(st.integers(min_value=1, max_value=3))
    intervals, t = [], start
    for _ in range(n):
        dur = draw(st.floats(min_value=1.0, max_value=300.0))
        value = draw(st.floats(min_value=1e6, max_value=30e6))
        intervals.append(Interval(t, dur, value))
        t += dur + draw(st.sampled_from([0.0, 0.0, 5.0]))  # contiguous mostly, a gap now and then
    return UtilityEvent(
        event_id=f"e{draw(st.integers(0, 99))}",
        kind=draw(st.sampled_from(kinds)),
        intervals=tuple(intervals),
        ramp_up_s=draw(st.sampled_from([0.0, 10.0, 60.0, 300.0])),
        recovery_s=draw(st.sampled_from([0.0, 30.0, 120.0])),
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(events(), max_size=5), times)
def test_limit_never_above_base_nor_any_active_event(evs: list[UtilityEvent], t: float) -> None:
    sched = UtilitySchedule(evs)
    limit = sched.limit_w(t, BASE_W)
    assert limit <= BASE_W
    for e in evs:
        if e.kind != "ramp" and e.active(t):
            assert limit <= e.value_at(t)
    lowest_active = min((e.value_at(t) for e in evs if e.kind != "ramp" and e.active(t)), default=math.inf)
    assert limit <= min(BASE_W, lowest_active)
    if not any(e.window()[0] <= t < e.window()[1] for e in evs if e.kind != "ramp"):
        assert limit == BASE_W  # no event in its window: the configured limit, untouched


@settings(max_examples=200, deadline=None)
@given(events(kinds=("limit",)), st.floats(min_value=0.0, max_value=1.0))
def test_a_limit_follows_the_utilitys_start_and_ramp(e: UtilityEvent, frac: float) -> None:
    sched = UtilitySchedule([e])
    first = e.intervals[0].value
    lo = e.start_s - e.ramp_up_s
    assert sched.limit_w(lo - 1.0, BASE_W) == BASE_W  # before the ramp: nothing
    assert sched.limit_w(e.start_s, BASE_W) == min(BASE_W, first)  # at the utility's start: the event's value
    if e.ramp_up_s > 0:
        t = lo + frac * e.ramp_up_s
        expect = BASE_W + (first - BASE_W) * frac if first < BASE_W else BASE_W
        assert sched.limit_w(t, BASE_W) == pytest.approx(expect, rel=1e-9)
        # the ramp only falls (or holds), and never overshoots the event's value
        later = sched.limit_w(min(t + 1.0, e.start_s), BASE_W)
        assert later <= sched.limit_w(t, BASE_W) + 1e-6
        assert later >= min(first, BASE_W) - 1e-6
    last = e.intervals[-1].value
    assert sched.limit_w(e.end_s - 1e-6, BASE_W) <= last  # held to the end
    assert sched.limit_w(e.end_s + e.recovery_s, BASE_W) == BASE_W  # recovered


@settings(max_examples=200, deadline=None)
@given(st.lists(events(kinds=("ramp",)), min_size=1, max_size=4), times)
def test_ramp_limit_is_the_lowest_active(evs: list[UtilityEvent], t: float) -> None:
    base = 4e6
    sched = UtilitySchedule(evs)
    got = sched.ramp_limit_w_per_min(t, base)
    active = [e.value_at(t) for e in evs if e.active(t)]
    assert got == min([base, *active])
    assert sched.limit_w(t, BASE_W) == BASE_W  # a ramp limit limits no power


def test_target_is_a_ceiling_and_reported() -> None:
    e = UtilityEvent("t", "target", (Interval(100.0, 60.0, 15e6),))
    sched = UtilitySchedule([e])
    assert math.isnan(sched.target_w(99.0)) and sched.target_w(100.0) == 15e6
    got = sched.in_force(120.0, BASE_W, 4e6)
    assert got.limit_w == 15e6 and got.target_w == 15e6 and got.event_ids == ("t",)
    assert sched.in_force(161.0, BASE_W, 4e6).limit_w == BASE_W


def test_steps_between_intervals_and_an_open_ended_event() -> None:
    e = UtilityEvent("s", "limit", (Interval(0.0, 10.0, 16e6), Interval(10.0, math.inf, 12e6)), recovery_s=60.0)
    sched = UtilitySchedule([e])
    assert sched.limit_w(9.9, BASE_W) == 16e6 and sched.limit_w(10.0, BASE_W) == 12e6
    assert sched.limit_w(1e9, BASE_W) == 12e6  # until cancelled
    assert sched.without_ended(1e9).events == (e,)


def test_ended_events_are_dropped_and_bad_events_refused() -> None:
    e = UtilityEvent("a", "limit", (Interval(0.0, 10.0, 16e6),), recovery_s=5.0)
    assert UtilitySchedule([e]).without_ended(15.0).events == ()
    assert UtilitySchedule([e]).without_ended(14.9).events == (e,)
    for bad in (
        dict(kind="power", intervals=(Interval(0.0, 1.0, 1.0),)),
        dict(kind="limit", intervals=()),
        dict(kind="limit", intervals=(Interval(0.0, 0.0, 1.0),)),
        dict(kind="limit", intervals=(Interval(0.0, 1.0, -1.0),)),
        dict(kind="limit", intervals=(Interval(0.0, 1.0, 1.0),), ramp_up_s=-1.0),
    ):
        with pytest.raises(ValueError):
            UtilityEvent("x", **bad)
