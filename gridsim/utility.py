"""Utility events in a scenario: a utility's demand-response event stream, replayed into the interconnect limit.

    [[events]]
    kind = "utility_event"
    at_s = 600                  # the utility's start time: the first interval's start
    event_id = "evening-peak"   # optional, for the report
    ramp_up_s = 120             # before at_s the limit ramps down to the first interval's, reaching it at at_s
    recovery_s = 120            # after the last interval it ramps back over this
    intervals = [{ duration_s = 600, limit_mw = 16.0 }, { duration_s = 900, limit_mw = 14.5 }]

Each interval carries an import limit (`limit_mw`) or a load target (`target_mw`, planned on as a ceiling), the
same key in every interval of an event. The events become `dimmer.utility_events.UtilityEvent`s and the limit in
force is asked of the same `UtilitySchedule` the daemon asks for the events its OpenADR VEN accepted
(docs/utility.md): a scenario replays a utility's stream exactly as the daemon would plan on it. A utility ramp-limit
change (`ramp_mw_per_min`) is refused for now: the plant's ramp metric is measured against [site.pcc]'s.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from dimmer.siteconfig import Name, Strict
from dimmer.utility_events import Interval, UtilityEvent


class UtilityIntervalSpec(Strict):
    duration_s: float = Field(gt=0)  # inf: to the end of the run
    limit_mw: float | None = Field(default=None, gt=0)
    target_mw: float | None = Field(default=None, gt=0)
    ramp_mw_per_min: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one(self) -> UtilityIntervalSpec:
        if self.ramp_mw_per_min is not None:
            raise ValueError(
                "limit_mw or target_mw: a utility ramp-limit change is not replayed by gridsim yet (the ramp metric "
                "is measured against [site.pcc] ramp_mw_per_min)"
            )
        if (self.limit_mw is None) == (self.target_mw is None):
            raise ValueError("give exactly one of limit_mw or target_mw")
        return self


class UtilityEventSpec(Strict):
    """A utility's event, as the daemon's VEN accepts it: its intervals from `at_s`, with the utility's ramps."""

    kind: Literal["utility_event"]
    at_s: float = Field(ge=0)
    event_id: Name | None = None
    ramp_up_s: float = Field(default=0.0, ge=0, le=86400)
    recovery_s: float = Field(default=0.0, ge=0, le=86400)
    intervals: list[UtilityIntervalSpec] = Field(min_length=1, max_length=10_000)

    @model_validator(mode="after")
    def _same_signal(self) -> UtilityEventSpec:
        kinds = {iv.limit_mw is None for iv in self.intervals}
        if len(kinds) > 1:
            raise ValueError("the same key (limit_mw or target_mw) in every interval of an event")
        if any(math.isinf(iv.duration_s) for iv in self.intervals[:-1]):
            raise ValueError("an interval of duration_s = inf only last")
        return self

    def event(self, index: int) -> UtilityEvent:
        """This event as the daemon plans on it (`index`: its place in the scenario, for its default id)."""
        intervals, t = [], self.at_s
        for iv in self.intervals:
            mw = iv.limit_mw if iv.limit_mw is not None else iv.target_mw
            intervals.append(Interval(t, iv.duration_s, float(mw or 0.0) * 1e6))
            t += iv.duration_s
        kind: Literal["limit", "target"] = "limit" if self.intervals[0].limit_mw is not None else "target"
        return UtilityEvent(
            self.event_id or f"events[{index}]", kind, tuple(intervals), self.ramp_up_s, self.recovery_s
        )
