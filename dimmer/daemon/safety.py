"""The daemon's own safety net, whatever the controller decided, and what every fail-safe writes.

- caps within the GPU's settable range; a rack with stale or missing telemetry (every rack, if the interconnect
  reading is stale) at or below the safe cap, never raised by it; a rack whose reading is late (not stale yet)
  keeps at most the cap last written;
- floors at or below caps (none on stale racks), BBU thresholds at least 0 W, BBU recharge within its rating, the
  battery setpoint within its rating.

`decide` steps the controller and falls back to `safe_actions` when it raises (FAILSAFE for that period).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import traceback

import numpy as np
import numpy.typing as npt

from dimmer.control import Controller
from dimmer.daemon.config import SafetySpec
from dimmer.observation import Actions, Observation, Reason
from dimmer.site import SiteModel

log = logging.getLogger("dimmer.daemon")

FloatArray = npt.NDArray[np.float64]


def safe_actions(site: SiteModel, safe_cap_w: float, last_cap_w: FloatArray | None) -> Actions:
    """What every fail-safe writes: caps at the safe level (never above a lower cap already written), no floors,
    the battery idle, BBUs as backup only."""
    cap = np.full(site.n_racks, safe_cap_w)
    if last_cap_w is not None:
        cap = np.fmin(cap, last_cap_w)
    return Actions(
        rack_cap_w=site.gpu.clamp_cap_w(cap),
        rack_floor_w=np.zeros(site.n_racks),
        bess_setpoint_w=0.0,
        rack_bbu_threshold_w=np.full(site.n_racks, np.inf),
        # within the BBU's rating, as every write must be (RackLimits)
        rack_bbu_recharge_w=np.minimum(site.rack_storage.bbu_recharge_w, site.rack_storage.bbu_power_w),
        job_suspend=np.zeros(site.n_jobs, dtype=bool),
    )


def enforce_safety(
    site: SiteModel,
    act: Actions,
    obs: Observation,
    safe_cap_w: float,
    stale_s: float,
    last_cap_w: FloatArray | None = None,
    hold_after_s: float = math.inf,
) -> tuple[Actions, int]:
    """Whatever the controller: caps in the GPU's range, stale racks (all of them if the PCC is stale) at or below
    the safe cap, floors at or below caps, BBU thresholds >= 0, the battery within its rating. A rack whose reading
    is older than `hold_after_s` (not stale yet, but no longer arriving) keeps at most the cap last written
    (`last_cap_w`): between a reading stopping and the stale limit, no cap rises on it. Returns the actions and the
    racks held."""
    gpu = site.gpu
    cap = np.asarray(act.rack_cap_w, dtype=np.float64)
    cap = np.where(np.isfinite(cap), cap, safe_cap_w)
    if last_cap_w is not None:
        late = ~np.isfinite(obs.rack_power_w) | (obs.rack_age_s > hold_after_s)
        if not (math.isfinite(obs.pcc_power_w) and obs.pcc_age_s <= hold_after_s):
            late = np.ones(site.n_racks, dtype=bool)
        cap = np.where(late, np.minimum(cap, last_cap_w), cap)
    stale = ~(np.isfinite(obs.rack_power_w) & (obs.rack_age_s <= stale_s))
    if not (math.isfinite(obs.pcc_power_w) and obs.pcc_age_s <= stale_s):
        stale = np.ones(site.n_racks, dtype=bool)
    held = stale & (cap > safe_cap_w)
    cap = gpu.clamp_cap_w(np.where(stale, np.minimum(cap, safe_cap_w), cap))
    floor = np.asarray(act.rack_floor_w, dtype=np.float64)
    floor = np.minimum(gpu.clamp_floor_w(np.nan_to_num(floor, nan=0.0)), cap)
    floor = np.where(stale, 0.0, floor)
    bess = act.bess_setpoint_w if math.isfinite(act.bess_setpoint_w) else 0.0
    bess = float(np.clip(bess, -site.bess.power_w, site.bess.power_w))
    thr = np.asarray(act.rack_bbu_threshold_w, dtype=np.float64)
    thr = np.maximum(np.where(np.isnan(thr), np.inf, thr), 0.0)  # below 0 W means the same as 0 W: always shave
    rech = np.clip(np.nan_to_num(act.rack_bbu_recharge_w, nan=0.0), 0.0, site.rack_storage.bbu_power_w)
    out = Actions(
        rack_cap_w=cap,
        rack_floor_w=floor,
        bess_setpoint_w=bess,
        rack_bbu_threshold_w=thr,
        rack_bbu_recharge_w=rech,
        job_suspend=act.job_suspend,
        gpu_ramp_up_w_per_s=act.gpu_ramp_up_w_per_s,
        gpu_ramp_down_w_per_s=act.gpu_ramp_down_w_per_s,
        planned_domain_w=act.planned_domain_w,
        reasons=act.reasons,
    )
    return out, int(held.sum())


def decide(
    controller: Controller, obs: Observation, site: SiteModel, safe_cap_w: float, last_cap_w: FloatArray | None
) -> tuple[Actions, str | None]:
    """`controller.step(obs)`, or, when it raises, the fail-safe actions with the reason; and the error (None when
    the controller answered). Logged; never raised."""
    try:
        return controller.step(obs), None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.error("controller %s failed, fail-safe caps this period: %s", controller.name, error)
        log.debug("%s", traceback.format_exc())
    act = safe_actions(site, safe_cap_w, last_cap_w)
    return dataclasses.replace(act, reasons=(Reason("safety", f"controller failed: {error}"),)), error


def safety_net(
    site: SiteModel,
    act: Actions,
    obs: Observation,
    safe_cap_w: float,
    safety: SafetySpec,
    period_s: float,
    last_cap_w: FloatArray | None,
    explain: bool = True,
) -> Actions:
    """`enforce_safety` with the config's staleness and hold; when racks were held at the safe cap (and `explain`),
    a reason saying so."""
    hold_after_s = safety.hold_after_periods * period_s
    act, held = enforce_safety(site, act, obs, safe_cap_w, safety.stale_s, last_cap_w, hold_after_s)
    if held and explain:
        reason = Reason("safety", f"stale telemetry: {held} rack cap(s) held at the safe level")
        act = dataclasses.replace(act, reasons=(*act.reasons, reason))
    return act
