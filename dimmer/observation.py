"""What the controller knows (Observation) and what it decides (Actions).

Both are frozen dataclasses of numpy arrays; per-rack vectors are `(n_racks,)`, per-domain `(n_domains,)`,
per-job `(n_jobs,)`. A value nobody measured is NaN, never zero; each reading carries its age.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dimmer.site import SiteModel

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

LAYERS = ("grid", "capping", "emergency", "trough", "rack-storage", "safety", "baseline")


@dataclass(frozen=True)
class Observation:
    t_s: float
    # racks
    rack_power_w: FloatArray  # AC input from the supply (what the breakers carry), window mean; NaN where missing
    rack_load_w: FloatArray  # what the rack's IT load draws, before its BBU (power-shelf output); NaN where missing
    # age of each rack's latest reading that arrived (where this period's is missing: the last one's); inf if none
    rack_age_s: FloatArray
    rack_cap_w: FloatArray  # per-GPU power cap the GPUs report enforcing
    rack_floor_w: FloatArray  # per-GPU power floor in force
    rack_bbu_soc_frac: FloatArray
    rack_energized: BoolArray  # False under a tripped breaker
    # domains
    domain_power_w: FloatArray  # meter readings; NaN where missing
    domain_age_s: FloatArray
    domain_limit_w: FloatArray  # rating in force now (a derate lowers it)
    domain_thermal_frac: FloatArray  # breaker thermal state as a fraction of its trip point (1 = trips); NaN unknown
    # the interconnect
    pcc_power_w: float  # grid import (positive into the campus)
    pcc_age_s: float
    pcc_limit_w: float  # interconnect limit in force (a curtailment lowers it)
    ramp_limit_w_per_min: float
    grid_freq_hz: float
    # campus battery
    bess_soc_frac: float  # NaN when unknown
    bess_power_w: float  # positive = discharging into the campus
    bess_online: bool
    # jobs
    job_running: BoolArray  # drawing training power now (not down, suspended or finished)
    # the highest sample of rack_load_w's window (NVML's power samples, a power shelf's peak register): where the
    # racks report it, a swing's peak between two window means is measured, not assumed; None or NaN: not measured
    rack_load_peak_w: FloatArray | None = None
    # (n_jobs,) the scheduler has released the job (it finished or was cancelled): its racks idle until a job starts
    # on them again, which is a start (met by the start ceiling), not the return of what they drew. None, or False
    # for a job: not known, and a job that stopped may come back at any time at what it drew (a checkpoint stall, a
    # crash's restart)
    job_ended: BoolArray | None = None
    # the least import a parent asks this site to hold (a campus coordinator's floor on a building, where the campus
    # falls faster than the utility's ramp rule lets it and the battery cannot take the rest); NaN: none
    import_floor_w: float = math.nan
    # the voltage at the PCC (per unit of nominal), the latest RMS reading; NaN: not measured
    pcc_voltage_pu: float = math.nan

    @property
    def n_racks(self) -> int:
        return int(self.rack_power_w.shape[0])


@dataclass(frozen=True)
class Reason:
    """Why an action was taken: the layer, the domain (index or -1), the job (index or -1), and a phrase."""

    layer: str
    reason: str
    domain: int = -1
    job: int = -1
    value_w: float = float("nan")


@dataclass(frozen=True)
class Actions:
    rack_cap_w: FloatArray  # per-GPU power cap for each rack
    rack_floor_w: FloatArray  # per-GPU power floor (trough filling); 0 = none
    bess_setpoint_w: float  # positive = discharge into the campus, negative = charge
    rack_bbu_threshold_w: FloatArray  # a BBU discharges to hold its rack's draw at or below this; inf = backup only
    rack_bbu_recharge_w: FloatArray  # the most each BBU may recharge at
    job_suspend: BoolArray  # hard-stop: True suspends the whole job
    gpu_ramp_up_w_per_s: float = float("inf")  # firmware power-smoothing ramp limits, site-wide profile
    gpu_ramp_down_w_per_s: float = float("inf")
    planned_domain_w: FloatArray | None = None  # the controller's plan of each domain's load, for audit
    reasons: tuple[Reason, ...] = field(default=())

    @classmethod
    def hands_off(cls, site: SiteModel) -> Actions:
        """No caps, no floors, the battery idle, BBUs as backup only, nothing suspended."""
        return cls(
            rack_cap_w=np.full(site.n_racks, site.gpu.rated_w),
            rack_floor_w=np.zeros(site.n_racks),
            bess_setpoint_w=0.0,
            rack_bbu_threshold_w=np.full(site.n_racks, np.inf),
            rack_bbu_recharge_w=site.rack_storage.bbu_recharge_w.copy(),
            job_suspend=np.zeros(site.n_jobs, dtype=bool),
        )
