"""Utility events -> what the controller plans on: the import limit, the ramp limit and a load target over time.

Pure: no clock, no I/O, no protocol. Times are seconds on whatever axis the caller uses (the daemon: UTC epoch
seconds, as the utility's VTN stamps its events; gridsim: seconds since the scenario's start). The daemon's OpenADR
VEN (dimmer.daemon.utility_ven) and gridsim's `utility_event` scenario events both build `UtilityEvent`s and ask a
`UtilitySchedule`, so the simulator replays a utility's event stream exactly as the daemon would plan on it.

An event is one signal of one kind over one or more intervals:

    limit    an import limit at the interconnect, W (a curtailment)
    target   a load target, W: planned on as a ceiling on the import (the campus imports at most the target; it does
             not raise its load to meet a target above what it draws)
    ramp     the utility's ramp limit, W/min

The utility's start time and ramp: before its first interval starts, a limit or target event moves the limit in
force linearly from the limit without it (`base_w`) to its first interval's value over `ramp_up_s`, so the value is
in force when the event starts; after its last interval ends the limit returns to `base_w` linearly over
`recovery_s`. Between intervals the limit steps. A gap between two intervals holds the earlier interval's value. A
ramp-limit event steps at its start and end.

The limit in force is never above `base_w` nor above any event's value while that event is active, whatever the
other events say (the lowest wins); with no event in its window (ramp-up, active, recovery) it is `base_w`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

EventKind = Literal["limit", "target", "ramp"]
KINDS: tuple[str, ...] = ("limit", "target", "ramp")


@dataclass(frozen=True)
class Interval:
    start_s: float
    duration_s: float  # inf: until the event is cancelled
    value: float  # W for a limit or a target, W/min for a ramp limit

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True)
class UtilityEvent:
    """One accepted signal of a utility event: its kind, its intervals (sorted by start) and its ramps."""

    event_id: str
    kind: EventKind
    intervals: tuple[Interval, ...]
    ramp_up_s: float = 0.0
    recovery_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        if not self.intervals:
            raise ValueError("an event needs at least one interval")
        for iv in self.intervals:
            if not (math.isfinite(iv.start_s) and iv.duration_s > 0 and iv.value > 0 and not math.isnan(iv.value)):
                raise ValueError(f"an interval needs a finite start, a positive duration and value (got {iv})")
        if not (self.ramp_up_s >= 0 and self.recovery_s >= 0 and math.isfinite(self.ramp_up_s)):
            raise ValueError("ramp_up_s and recovery_s must be finite and non-negative")
        ordered = tuple(sorted(self.intervals, key=lambda iv: iv.start_s))
        object.__setattr__(self, "intervals", ordered)

    @property
    def start_s(self) -> float:
        return self.intervals[0].start_s

    @property
    def end_s(self) -> float:
        return max(iv.end_s for iv in self.intervals)

    @property
    def lowest(self) -> float:
        return min(iv.value for iv in self.intervals)

    def active(self, t_s: float) -> bool:
        return self.start_s <= t_s < self.end_s

    def value_at(self, t_s: float) -> float:
        """The value in force at `t_s` while the event is active (a gap holds the earlier interval's); NaN outside."""
        if not self.active(t_s):
            return math.nan
        value = self.intervals[0].value
        for iv in self.intervals:
            if iv.start_s > t_s:
                break
            value = iv.value
        return value

    def limit_at(self, t_s: float, base_w: float) -> float:
        """This event's limit at `t_s` over a limit of `base_w` without it: the ramp to its first value, its value,
        the recovery to `base_w`; inf outside all three (a ramp-limit event limits no power: inf)."""
        if self.kind == "ramp":
            return math.inf
        start, end = self.start_s, self.end_s
        if start <= t_s < end:
            return self.value_at(t_s)
        first, last = self.intervals[0].value, self.intervals[-1].value
        if not math.isfinite(base_w):  # nothing to ramp from: the event's own value over its whole window
            lo, hi = self.window()
            return (first if t_s < start else last) if lo <= t_s < hi else math.inf
        if start - self.ramp_up_s <= t_s < start:  # (a zero ramp-up never gets here)
            frac = (t_s - (start - self.ramp_up_s)) / self.ramp_up_s
            return base_w + (first - base_w) * frac if first < base_w else base_w
        if end <= t_s < end + self.recovery_s:
            frac = (t_s - end) / self.recovery_s
            return last + (base_w - last) * frac if last < base_w else base_w
        return math.inf

    def window(self) -> tuple[float, float]:
        """When this event can touch the limit in force: from its ramp-up's start to its recovery's end."""
        return self.start_s - self.ramp_up_s, self.end_s + self.recovery_s


@dataclass(frozen=True)
class InForce:
    """What the accepted events ask at one instant, over what holds without them."""

    limit_w: float  # the import limit in force: min(base, every limit and target event's)
    ramp_limit_w_per_min: float  # min(base, every active ramp event's)
    target_w: float  # the lowest active load target, NaN when none
    event_ids: tuple[str, ...]  # the events touching the limit now (ramping, active or recovering)


class UtilitySchedule:
    """The accepted events, asked for the limit, ramp limit and target in force at any instant."""

    def __init__(self, events: Iterable[UtilityEvent] = ()) -> None:
        self.events: tuple[UtilityEvent, ...] = tuple(sorted(events, key=lambda e: (e.start_s, e.event_id)))

    def __bool__(self) -> bool:
        return bool(self.events)

    def limit_w(self, t_s: float, base_w: float) -> float:
        limit = base_w
        for e in self.events:
            if e.kind != "ramp":
                limit = min(limit, e.limit_at(t_s, base_w))
        return limit

    def ramp_limit_w_per_min(self, t_s: float, base_w_per_min: float) -> float:
        ramp = base_w_per_min
        for e in self.events:
            if e.kind == "ramp" and e.active(t_s):
                ramp = min(ramp, e.value_at(t_s))
        return ramp

    def target_w(self, t_s: float) -> float:
        values = [e.value_at(t_s) for e in self.events if e.kind == "target" and e.active(t_s)]
        return min(values) if values else math.nan

    def in_force(self, t_s: float, base_limit_w: float, base_ramp_w_per_min: float) -> InForce:
        touching = tuple(e.event_id for e in self.events if e.window()[0] <= t_s < e.window()[1])
        return InForce(
            limit_w=self.limit_w(t_s, base_limit_w),
            ramp_limit_w_per_min=self.ramp_limit_w_per_min(t_s, base_ramp_w_per_min),
            target_w=self.target_w(t_s),
            event_ids=tuple(dict.fromkeys(touching)),
        )

    def without_ended(self, t_s: float) -> UtilitySchedule:
        """The schedule less the events whose window closed before `t_s` (they can touch nothing any more)."""
        return UtilitySchedule(e for e in self.events if e.window()[1] > t_s)
