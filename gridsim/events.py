"""Timed scenario events, applied by the engine at the tick they fall in."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dimmer.site import SiteModel
from gridsim.scenario import (
    CurtailEvent,
    DerateEvent,
    Event,
    FrequencyReplayEvent,
    FrequencyStepEvent,
    JobEvent,
    LoadedScenario,
)


@dataclass
class PccLimitSchedule:
    """The interconnect limit over time: piecewise linear ramps from curtailment events."""

    base_w: float
    ramps: list[tuple[float, float, float]]  # (start_s, over_s, target_w), in time order

    def at(self, t_s: float) -> float:
        limit = self.base_w
        for start, over, target in self.ramps:
            if t_s < start:
                break
            frac = 1.0 if over <= 0 else min((t_s - start) / over, 1.0)
            limit = limit + (target - limit) * frac
        return limit


def pcc_schedule(site: SiteModel, events: list[Event]) -> PccLimitSchedule:
    ramps = sorted((e.at_s, e.over_s, e.limit_mw * 1e6) for e in events if isinstance(e, CurtailEvent))
    return PccLimitSchedule(site.pcc_limit_w, ramps)


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
    "job_mask",
    "pcc_schedule",
]
