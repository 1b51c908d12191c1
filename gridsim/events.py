"""Timed scenario events, applied by the engine at the tick they fall in."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dimmer.site import SiteModel
from dimmer.utility_events import UtilitySchedule
from gridsim.scenario import (
    CurtailEvent,
    DerateEvent,
    Event,
    FrequencyReplayEvent,
    FrequencyStepEvent,
    JobEvent,
    LoadedScenario,
)
from gridsim.utility import UtilityEventSpec


@dataclass
class PccLimitSchedule:
    """The interconnect limit over time: piecewise linear ramps from curtailment events, and below them whatever the
    utility's events ask (`utility`: the daemon's own schedule, dimmer.utility_events, ramping from the limit without
    them)."""

    base_w: float
    ramps: list[tuple[float, float, float]]  # (start_s, over_s, target_w), in time order
    utility: UtilitySchedule = field(default_factory=UtilitySchedule)

    @property
    def varies(self) -> bool:
        """Whether the limit ever leaves `base_w` (the engine records `base_w` at every tick otherwise)."""
        return bool(self.ramps) or bool(self.utility)

    def at(self, t_s: float) -> float:
        limit = self.base_w
        for start, over, target in self.ramps:
            if t_s < start:
                break
            frac = 1.0 if over <= 0 else min((t_s - start) / over, 1.0)
            limit = limit + (target - limit) * frac
        return self.utility.limit_w(t_s, limit) if self.utility else limit


def pcc_schedule(site: SiteModel, events: list[Event]) -> PccLimitSchedule:
    ramps = sorted((e.at_s, e.over_s, e.limit_mw * 1e6) for e in events if isinstance(e, CurtailEvent))
    utility = UtilitySchedule(e.event(i) for i, e in enumerate(events) if isinstance(e, UtilityEventSpec))
    return PccLimitSchedule(site.pcc_limit_w, ramps, utility)


def job_mask(site: SiteModel, ev: JobEvent) -> np.ndarray:
    if not ev.jobs:
        return np.ones(site.n_jobs, dtype=bool)
    return np.isin(np.asarray(site.job_name, dtype=object), ev.jobs)


__all__ = [
    "CurtailEvent",
    "DerateEvent",
    "FrequencyReplayEvent",
    "FrequencyStepEvent",
    "JobEvent",
    "LoadedScenario",
    "PccLimitSchedule",
    "UtilityEventSpec",
    "job_mask",
    "pcc_schedule",
]
