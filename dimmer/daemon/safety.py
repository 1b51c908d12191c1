"""The daemon's own safety net, whatever the controller decided, and what every fail-safe writes.

- caps within the GPU's settable range; a rack with stale or missing telemetry (every rack, if the interconnect
  reading is stale) at or below the safe cap, never raised by it; a rack whose reading is late (not stale yet)
  keeps at most the cap last written;
- floors at or below caps (none on stale racks), BBU thresholds at least 0 W, BBU recharge within its rating, the
  battery setpoint within its rating;
- a value the controller decided that is not a number is never written; in its place, what is safe for that field
  (SAFE_FOR_NON_FINITE): a cap at the safe cap (never above a lower cap already written), no floor, the battery
  idle, the BBU as backup only, no recharge. `NonFiniteLog` says so loudly, once per field a minute.

`decide` steps the controller and falls back to `safe_actions` when it raises (FAILSAFE for that period).
`StartRamp` paces a start without trusted state: caps at most the safe cap at the first write, rising from there at
the controller's cap rise rate.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import traceback
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dimmer.control import Controller
from dimmer.daemon.config import SafetySpec
from dimmer.observation import Actions, Observation, Reason
from dimmer.site import SiteModel

log = logging.getLogger("dimmer.daemon")

FloatArray = npt.NDArray[np.float64]

# What is written in place of a value the controller decided that is not a number (NaN and +-inf for caps, floors
# and the setpoint; NaN and -inf for a BBU threshold and recharge limit, whose +inf is in the Actions contract:
# "backup only", "no limit but the rating"). Each is the choice that adds no load and spends no stored energy: the
# safe cap for the rack, no floor, the battery idle, the BBU kept as backup, no recharge this period. (The
# simulator's engine reads a NaN cap or floor as "no change"; here a controller's NaN is a fault the daemon cannot
# tell from a meant "no change", so it gets the fail-safe value.)
SAFE_FOR_NON_FINITE: dict[str, str] = {
    "rack_cap_w": "the safe cap (at most the cap last written)",
    "rack_floor_w": "no floor (0 W)",
    "bess_setpoint_w": "the battery idle (0 W)",
    "rack_bbu_threshold_w": "BBU as backup only (threshold +inf)",
    "rack_bbu_recharge_w": "no recharge (0 W)",
}


@dataclass
class NonFiniteLog:
    """Says loudly (an error) that the controller decided a value that is not a number, and what was written
    instead: once per field, then at most once every `every_s` (with the count since), so a controller that keeps
    deciding NaN cannot flood the log."""

    every_s: float = 60.0
    _last_s: dict[str, float] = field(default_factory=dict)
    _since: dict[str, int] = field(default_factory=dict)

    def note(self, controller: str, bad: dict[str, int], now_s: float) -> None:
        for name, n in bad.items():
            self._since[name] = self._since.get(name, 0) + 1
            last = self._last_s.get(name)
            if last is not None and now_s - last < self.every_s:
                continue
            log.error(
                "controller %s decided a non-finite %s (%d value(s); %d period(s) since the last report): "
                "never written, %s instead",
                controller,
                name,
                n,
                self._since[name],
                SAFE_FOR_NON_FINITE[name],
            )
            self._last_s[name], self._since[name] = now_s, 0


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
    bad: dict[str, int] | None = None,
) -> tuple[Actions, int]:
    """Whatever the controller: caps in the GPU's range, stale racks (all of them if the PCC is stale) at or below
    the safe cap, floors at or below caps, BBU thresholds >= 0, the battery within its rating. A rack whose reading
    is older than `hold_after_s` (not stale yet, but no longer arriving) keeps at most the cap last written
    (`last_cap_w`): between a reading stopping and the stale limit, no cap rises on it. A value that is not a number
    gets SAFE_FOR_NON_FINITE's; `bad` (when given) is filled with how many of each field's values were. Returns the
    actions and the racks held."""
    gpu = site.gpu
    found: dict[str, int] = {}

    def refuse(name: str, values: FloatArray, ok: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        n = int(values.size - np.count_nonzero(ok))
        if n:
            found[name] = n
        return ok

    cap = np.asarray(act.rack_cap_w, dtype=np.float64)
    fallback = np.full(site.n_racks, safe_cap_w) if last_cap_w is None else np.fmin(safe_cap_w, last_cap_w)
    cap = np.where(refuse("rack_cap_w", cap, np.isfinite(cap)), cap, fallback)
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
    floor = np.where(refuse("rack_floor_w", floor, np.isfinite(floor)), floor, 0.0)
    floor = np.minimum(gpu.clamp_floor_w(floor), cap)
    floor = np.where(stale, 0.0, floor)
    bess = float(act.bess_setpoint_w)
    if not math.isfinite(bess):
        found["bess_setpoint_w"] = 1
        bess = 0.0
    bess = float(np.clip(bess, -site.bess.power_w, site.bess.power_w))
    thr = np.asarray(act.rack_bbu_threshold_w, dtype=np.float64)
    thr = np.where(refuse("rack_bbu_threshold_w", thr, ~np.isnan(thr) & (thr > -np.inf)), thr, np.inf)
    thr = np.maximum(thr, 0.0)  # below 0 W means the same as 0 W: always shave
    rech = np.asarray(act.rack_bbu_recharge_w, dtype=np.float64)
    rech = np.where(refuse("rack_bbu_recharge_w", rech, ~np.isnan(rech) & (rech > -np.inf)), rech, 0.0)
    rech = np.clip(rech, 0.0, site.rack_storage.bbu_power_w)
    if bad is not None:
        bad.update(found)
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


@dataclass
class StartRamp:
    """A start without trusted state (no state file, or one refused): every rack's cap at most `ceiling_w`, which
    starts at the safe cap and rises by `rise_w` (the controller's cap rise rate x the period) after each period the
    controller decided, until it reaches rated and the ramp ends. A fresh controller would otherwise write rated at
    once: up to ~1.2 kW a GPU in one period during a binding curtailment, before any reading has shown the load."""

    ceiling_w: float
    rise_w: float  # W per GPU per period
    rated_w: float

    @property
    def active(self) -> bool:
        return self.ceiling_w < self.rated_w

    def apply(self, act: Actions) -> Actions:
        """`act` with every cap at most the ceiling (floors at most the caps), and a reason where it held one."""
        if not self.active:
            return act
        cap = np.minimum(act.rack_cap_w, self.ceiling_w)
        held = int(np.count_nonzero(cap < act.rack_cap_w))
        if not held:
            return act
        why = (
            f"start without trusted state: {held} rack cap(s) held at {self.ceiling_w:.0f} W,"
            f" rising {self.rise_w:g} W a period"
        )
        return dataclasses.replace(
            act,
            rack_cap_w=cap,
            rack_floor_w=np.minimum(act.rack_floor_w, cap),
            reasons=(*act.reasons, Reason("safety", why)),
        )

    def advance(self) -> None:
        self.ceiling_w = min(self.ceiling_w + self.rise_w, self.rated_w)


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
    non_finite: NonFiniteLog | None = None,
    controller: str = "",
    now_s: float = 0.0,
) -> Actions:
    """`enforce_safety` with the config's staleness and hold; when racks were held at the safe cap (and `explain`),
    a reason saying so; when a value was not a number, a reason naming the field and what was written instead
    (always), logged through `non_finite` (at `now_s`, seconds on any monotonic clock)."""
    hold_after_s = safety.hold_after_periods * period_s
    bad: dict[str, int] = {}
    act, held = enforce_safety(site, act, obs, safe_cap_w, safety.stale_s, last_cap_w, hold_after_s, bad)
    reasons: list[Reason] = []
    if held and explain:
        reasons.append(Reason("safety", f"stale telemetry: {held} rack cap(s) held at the safe level"))
    for name, n in bad.items():
        reasons.append(Reason("safety", f"non-finite {name} ({n}) refused: {SAFE_FOR_NON_FINITE[name]} written"))
    if bad and non_finite is not None:
        non_finite.note(controller, bad, now_s)
    if reasons:
        act = dataclasses.replace(act, reasons=(*act.reasons, *reasons))
    return act
