"""Baseline controllers, implemented honestly so that comparisons mean something.

Each is what its source describes, tuned sensibly; docs/controller_baselines.md gives the sources, the equations
and the parameter tables.

- `none`: no control at all. GPUs run uncapped, the campus battery idles, rack BBUs are backup only.
- `hard-stop`: suspend the lowest-priority running job under an overloaded domain, one more per period while the
  overload lasts; resume after the domains it touches have stayed quiet for a hold time, if its return fits.
- `dynamo`: Meta Dynamo (Wu et al., ISCA 2016): per-breaker three-band capping, leaf controllers every 3 s, upper
  levels every 9 s passing contractual budgets down; priority groups, high-bucket-first; per-rack caps, no storage.
- `smoothing`: GPU firmware power smoothing (NVIDIA Blackwell; Choukse et al. 2025): a power floor on the GPUs of
  running jobs and site-wide ramp-up / ramp-down limits; no caps, no storage.
- `peak-shave`: OpenEMS peak shaving with the campus battery (grid-without-battery = meter + battery), PID-filtered
  setpoint; no caps.

Every controller is pure (time only from `obs.t_s`), deterministic, and vectorised over racks and domains; the
only Python loops run over tree levels, priority groups or jobs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import Field, ValidationError, model_validator

from dimmer.control import register
from dimmer.errors import InputError, from_validation_error
from dimmer.observation import Actions, BoolArray, FloatArray, Observation, Reason
from dimmer.site import IntArray, SiteModel
from dimmer.siteconfig import Strict

_EPS_S = 1e-9  # time comparisons: 3 periods of 1.0 s make 3.0 s
# what a cut can leave over from float rounding of the waterfill's sums (1e-11 W on a 80 kW cut): not a cut, so the
# next priority group is not capped at its reading for it (racks whose readings differ leave such a residue)
_CUT_RESIDUE_W = 1e-6
_MAX_DOMAIN_REASONS = 16  # per step; the rest are summarised in one Reason (a reason per domain is not hot-path work)

_M = TypeVar("_M", bound=Strict)


def _parse(model: type[_M], params: Mapping[str, Any]) -> _M:
    """Validate a controller's `params`; a bad one raises the one-line InputError "controller: params.<key>: ..."."""
    try:
        return model.model_validate(dict(params))
    except ValidationError as exc:
        raise from_validation_error("controller", exc, ("params",)) from None


def _copy_hands_off(site: SiteModel) -> dict[str, Any]:
    base = Actions.hands_off(site)
    return {
        "rack_cap_w": base.rack_cap_w,
        "rack_floor_w": base.rack_floor_w,
        "bess_setpoint_w": 0.0,
        "rack_bbu_threshold_w": base.rack_bbu_threshold_w,
        "rack_bbu_recharge_w": base.rack_bbu_recharge_w,
        "job_suspend": base.job_suspend,
    }


class _Readings:
    """Rack and domain loads from an Observation, with every gap filled.

    A missing rack reading (NaN) keeps the rack's last reading (its rated draw before the first one: the safe side);
    a missing domain meter falls back to the sum of its racks' readings.
    """

    def __init__(self, site: SiteModel) -> None:
        self.site = site
        self.rack_w: FloatArray = site.rack_max_w().astype(np.float64, copy=True)

    def update(self, obs: Observation) -> tuple[FloatArray, FloatArray]:
        rack = obs.rack_power_w
        if np.isnan(rack).any():
            rack = np.where(np.isnan(rack), self.rack_w, rack)
        self.rack_w = np.array(rack, dtype=np.float64)
        dom = obs.domain_power_w
        if np.isnan(dom).any():
            dom = np.where(np.isnan(dom), self.site.domain_load_w(self.rack_w), dom)
        return self.rack_w, np.asarray(dom, dtype=np.float64)


def _limits_w(obs: Observation) -> FloatArray:
    """Each domain's limit in force; the campus (domain 0) also answers to the interconnect limit."""
    limit: FloatArray = np.array(obs.domain_limit_w, dtype=np.float64)
    if limit.size and math.isfinite(obs.pcc_limit_w):
        limit[0] = min(limit[0], obs.pcc_limit_w)
    return limit


def _domain_reasons(
    site: SiteModel, phrase: str, domains: IntArray, value_w: FloatArray, layer: str = "baseline"
) -> list[Reason]:
    """One Reason per domain (largest value first), at most _MAX_DOMAIN_REASONS, then one summary."""
    if domains.size == 0:
        return []
    order = np.argsort(-value_w, kind="stable")
    shown = order[:_MAX_DOMAIN_REASONS]
    out = [
        Reason(layer, f"{phrase} ({site.domain_name[d]})", domain=int(d), value_w=float(v))
        for d, v in zip(domains[shown].tolist(), value_w[shown].tolist(), strict=True)
    ]
    if order.size > shown.size:
        rest = order[shown.size :]
        out.append(Reason(layer, f"{phrase}: {rest.size} more domains", value_w=float(value_w[rest].sum())))
    return out


def waterfill_cut(p: FloatArray, f: FloatArray, seg: IntArray, need: FloatArray) -> FloatArray:
    """High-bucket-first cut within segments: the highest items come down first, to a common level.

    For items `p` (with floors `f <= p`) in segments `seg` (values in [0, len(need))), find per segment the level
    λ with  Σ_i clip(p_i − λ, 0, p_i − f_i) = need  and return each item's cut clip(p_i − λ, 0, p_i − f_i). This is
    the bucket algorithm in the limit of fine buckets: the highest consumer is cut to the next-highest level, then
    both to the next, until the cut is met; no item goes below its floor. A segment whose need exceeds what its
    floors allow is cut to the floors; need <= 0 cuts nothing. Exact, O(n log n), no loop over segments.

    Raising caps is the same problem negated: waterfill_cut(-c, -c_max, seg, budget) raises the lowest caps first.
    """
    n = p.shape[0]
    n_seg = need.shape[0]
    out = np.zeros(n)
    if n == 0 or n_seg == 0:
        return out
    # breakpoints of the piecewise-linear total cut: p (one more item cut below it), f (one item at its floor)
    v = np.concatenate([p, f])
    d = np.concatenate([np.ones(n), -np.ones(n)])
    s = np.concatenate([seg, seg])
    order = np.lexsort((-v, s))  # by segment, then descending value (stable: p before an equal f)
    v, d, s = v[order], d[order], s[order]
    slope = np.cumsum(d)  # each segment's deltas sum to 0, so the global sum restarts at every segment
    gap = np.zeros(2 * n)
    gap[:-1] = v[:-1] - v[1:]
    after = np.cumsum(slope * gap)  # cut (plus the earlier segments' totals) once lambda reaches the next breakpoint
    before = after - slope * gap
    counts = np.bincount(s, minlength=n_seg)
    starts = np.cumsum(counts) - counts
    base = before[np.minimum(starts, 2 * n - 1)]
    need_s = need[s]
    reached = (after - base[s]) >= need_s
    k = starts + np.bincount(s, weights=~reached, minlength=n_seg).astype(np.int64)
    crosses = k < starts + counts
    kk = np.minimum(k, 2 * n - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lam = v[kk] - (need - (before[kk] - base)) / slope[kk]
    lam = np.where(slope[kk] > 0, lam, v[kk])
    lam = np.where(crosses, lam, -np.inf)
    lam = np.where(need > 0, lam, np.inf)
    np.clip(p - lam[seg], 0.0, p - f, out=out)
    return out


# ---------------------------------------------------------------------------------------------------- none


class NoControl:
    name = "none"

    def __init__(self, site: SiteModel) -> None:
        self._actions = Actions.hands_off(site)

    def step(self, obs: Observation) -> Actions:
        return self._actions


@register("none")
def _make_none(site: SiteModel, params: Mapping[str, Any]) -> NoControl:
    if params:
        raise InputError("controller", f"params.{next(iter(params))}", "the none controller takes no parameters")
    return NoControl(site)


# ---------------------------------------------------------------------------------------------------- hard-stop


class HardStopParams(Strict):
    """Suspend whole jobs when a domain is overloaded (the practice the product contrasts with dimming)."""

    stop_frac: float = Field(default=1.0, gt=0.0, le=2.0)  # suspend above this fraction of the limit
    release_frac: float = Field(default=0.85, gt=0.0, le=2.0)  # quiet below this fraction of the limit...
    hold_s: float = Field(default=300.0, ge=0.0)  # ...for this long before a job comes back

    @model_validator(mode="after")
    def _bands(self) -> HardStopParams:
        if self.release_frac >= self.stop_frac:
            raise ValueError("release_frac must be below stop_frac")
        return self


class HardStop:
    """Suspend the lowest-priority running job under each overloaded domain; resume when it fits again.

    Per period: a domain is overloaded when its load, less the relief still expected from jobs just suspended, is
    above stop_frac x its limit (the campus also against the PCC limit). Tree levels are taken bottom-up; each
    overloaded domain not already relieved by a job chosen this period suspends its lowest-priority running job
    (ties: the one drawing most under it, then the lowest index). A suspended job resumes, one per period and the
    highest priority first, when every domain it touches has stayed below release_frac x its limit for hold_s and
    its return (its racks' highest readings while it ran, less what they draw now) keeps every one of them at or
    below min(stop_frac, 1) x its limit. After a resume no other job resumes until the controller has seen the
    returning job run for two periods (so the meters include it) or hold_s has passed. Caps stay at rated.
    """

    name = "hard-stop"

    def __init__(self, site: SiteModel, params: HardStopParams) -> None:
        self.site = site
        self.p = params
        n_jobs, n_racks = site.n_jobs, site.n_racks
        run_rack = (site.rack_job >= 0) & ~site.rack_is_spare
        self._rack_slot = np.where(run_rack, site.rack_job, n_jobs)  # n_jobs = "no running job here"
        onehot = np.zeros((n_jobs, n_racks))
        onehot[site.rack_job[run_rack], np.flatnonzero(run_rack)] = 1.0
        self._job_racks = onehot
        self._touch: BoolArray = site.domain_load_w(onehot) > 0.0 if n_jobs else np.zeros((0, site.n_domains), bool)
        idle_rack_w = site.rack_power_w(np.full(n_racks, site.gpu.idle_w))
        self._job_idle_dom_w = site.domain_load_w(onehot * idle_rack_w) if n_jobs else np.zeros((0, site.n_domains))
        self._levels_bottom_up = [
            np.flatnonzero(site.domain_level == lv) for lv in sorted(set(site.domain_level.tolist()), reverse=True)
        ]
        self._readings = _Readings(site)
        self._suspended = np.zeros(n_jobs, dtype=bool)
        self._pending_relief_w = np.zeros((n_jobs, site.n_domains))  # expected drop not yet in the readings
        self._pending_until_s = np.full(n_jobs, -math.inf)
        self._last_high_s = np.full(site.n_domains, -math.inf)
        self._peak_rack_w = np.zeros(n_racks)
        self._returning = -1  # the job last resumed, until its power shows in the readings
        self._returning_since_s = -math.inf
        self._returning_seen = 0
        self._prev_t_s = math.nan
        self._base = _copy_hands_off(site)

    @property
    def suspended(self) -> BoolArray:
        return self._suspended.copy()

    def step(self, obs: Observation) -> Actions:
        site, p = self.site, self.p
        t = obs.t_s
        period_s = t - self._prev_t_s if math.isfinite(self._prev_t_s) and t > self._prev_t_s else 1.0
        self._prev_t_s = t
        rack_w, dom_w = self._readings.update(obs)
        limit = _limits_w(obs)
        n_jobs = site.n_jobs
        running = np.asarray(obs.job_running, dtype=bool) & ~self._suspended
        # what each running rack draws at most while its job runs: the estimate of its return
        rack_running = np.append(running, False)[self._rack_slot]
        np.maximum(self._peak_rack_w, rack_w, out=self._peak_rack_w, where=rack_running)
        # relief from a suspension counts until a reading taken wholly after it arrives
        age_s = float(np.nanmax(obs.domain_age_s)) if obs.domain_age_s.size else 0.0
        pending = t < self._pending_until_s
        load = dom_w - self._pending_relief_w[pending].sum(axis=0) if pending.any() else dom_w
        self._last_high_s[load >= p.release_frac * limit] = t
        over = load > p.stop_frac * limit
        reasons: list[Reason] = []
        chosen = np.zeros(n_jobs, dtype=bool)
        if over.any() and n_jobs:
            job_dom_w = site.domain_load_w(self._job_racks * rack_w)  # (n_jobs, n_domains)
            for level in self._levels_bottom_up:
                doms = level[over[level]]
                if doms.size == 0:
                    continue
                doms = doms[~self._touch[chosen][:, doms].any(axis=0)]  # already relieved this period
                cand = self._touch[:, doms] & (running & ~chosen)[:, None]
                has = cand.any(axis=0)
                doms, cand = doms[has], cand[:, has]
                if doms.size == 0:
                    continue
                prio = np.where(cand, site.job_priority[:, None], np.iinfo(np.int64).max).T
                draw = np.where(cand, job_dom_w[:, doms], 0.0).T
                pick = np.lexsort((-draw, prio), axis=-1)[:, 0]  # per domain: lowest priority, most power
                chosen[pick] = True
                reasons += [
                    Reason(
                        "baseline",
                        f"suspend: {site.domain_name[d]} over {p.stop_frac:g} of its limit",
                        domain=int(d),
                        job=int(j),
                        value_w=float(load[d]),
                    )
                    for d, j in zip(
                        doms[:_MAX_DOMAIN_REASONS].tolist(), pick[:_MAX_DOMAIN_REASONS].tolist(), strict=True
                    )
                ]
            new = np.flatnonzero(chosen)
            self._pending_relief_w[new] = np.maximum(job_dom_w[new] - self._job_idle_dom_w[new], 0.0)
            self._pending_until_s[new] = t + age_s + period_s - _EPS_S
            self._suspended |= chosen
        elif self._suspended.any():
            reasons += self._maybe_resume(obs, rack_w, load, limit)
        if not reasons:
            phrase = "overloaded, but no running job to suspend" if over.any() else "every domain within its limit"
            reasons.append(Reason("baseline", f"hard-stop: {phrase}"))
        return Actions(
            rack_cap_w=self._base["rack_cap_w"].copy(),
            rack_floor_w=self._base["rack_floor_w"].copy(),
            bess_setpoint_w=0.0,
            rack_bbu_threshold_w=self._base["rack_bbu_threshold_w"].copy(),
            rack_bbu_recharge_w=self._base["rack_bbu_recharge_w"].copy(),
            job_suspend=self._suspended.copy(),
            reasons=tuple(reasons),
        )

    def _maybe_resume(self, obs: Observation, rack_w: FloatArray, load: FloatArray, limit: FloatArray) -> list[Reason]:
        site, p = self.site, self.p
        t = obs.t_s
        if self._returning >= 0:
            j = self._returning
            self._returning_seen = self._returning_seen + 1 if obs.job_running[j] else 0
            if self._returning_seen >= 2 or t - self._returning_since_s >= p.hold_s - _EPS_S:
                self._returning = -1
            else:
                return [Reason("baseline", "hold: a resumed job is still coming back", job=j)]
        sus = np.flatnonzero(self._suspended)
        touch = self._touch[sus]
        quiet = (t - self._last_high_s) >= p.hold_s - _EPS_S
        is_quiet: BoolArray = ~np.any(touch & ~quiet, axis=1)
        back_rack_w = np.maximum(self._peak_rack_w - rack_w, 0.0)
        back_w = site.domain_load_w(self._job_racks[sus] * back_rack_w)
        fits: BoolArray = ~np.any(touch & (load + back_w > min(p.stop_frac, 1.0) * limit), axis=1)
        ok = is_quiet & fits
        if not ok.any():
            return [
                Reason(
                    "baseline",
                    "held suspended: " + ("its return would overload a domain" if q else "waiting for the hold"),
                    job=int(j),
                )
                for j, q in zip(sus.tolist(), is_quiet.tolist(), strict=True)
            ]
        cands = sus[ok]
        j = int(cands[np.argmax(site.job_priority[cands])])  # highest priority first; ties: lowest index
        self._suspended[j] = False
        self._returning, self._returning_since_s, self._returning_seen = j, t, 0
        self._pending_until_s[j] = -math.inf
        return [Reason("baseline", "resume: its domains stayed quiet and its return fits", job=j)]


@register("hard-stop")
def _make_hard_stop(site: SiteModel, params: Mapping[str, Any]) -> HardStop:
    return HardStop(site, _parse(HardStopParams, params))


# ---------------------------------------------------------------------------------------------------- dynamo


class DynamoParams(Strict):
    """Meta Dynamo (Wu et al., ISCA 2016): three bands per breaker, as fractions of its limit."""

    capping_threshold_frac: float = Field(default=0.99, gt=0.0, le=1.5)
    capping_target_frac: float = Field(default=0.95, gt=0.0, le=1.5)
    uncapping_threshold_frac: float = Field(default=0.90, gt=0.0, le=1.5)
    leaf_period_s: float = Field(default=3.0, gt=0.0, le=3600.0)  # Dynamo: leaf controllers every 3 s
    upper_period_s: float = Field(default=9.0, gt=0.0, le=3600.0)  # Dynamo: upper levels every 9 s
    # SLA floor: no rack is capped below this per-GPU power (default: the GPU's lowest settable cap)
    sla_floor_w: float | None = Field(default=None, gt=0.0)
    # what a cycle reads: the highest telemetry reading since the controller's last cycle ("max"), or only the
    # latest one ("last": Dynamo's single pull per cycle, which chases a swing faster than the cycle)
    reading: Literal["max", "last"] = "max"

    @model_validator(mode="after")
    def _bands(self) -> DynamoParams:
        if not self.uncapping_threshold_frac < self.capping_target_frac < self.capping_threshold_frac:
            raise ValueError("need uncapping_threshold_frac < capping_target_frac < capping_threshold_frac")
        return self


class Dynamo:
    """Per-breaker three-band power capping with priority groups and high-bucket-first, per rack.

    Leaf controllers (the lowest level above the racks) run every leaf_period_s, upper levels every upper_period_s
    (counted on obs.t_s; both run on the first step). For a domain with load P, rating in force R (the campus: and
    the PCC limit) and contract B from its parent (inf if none), the effective limit is L = min(R, B / target) and
      - cap    when P > threshold x L (or P > B when the contract binds): cut P − target x L;
      - uncap  when P < uncap x L: release up to target x L − P;
      - hold   in between.
    A leaf's cut goes to its racks, lowest priority group first, high-bucket-first within a group (waterfill_cut on
    the racks' readings, above the SLA floor); the new cap of a cut rack is the per-GPU draw that gives its reading
    less its cut (never above its previous cap). A release raises caps highest priority group first, lowest caps
    first, by at most the headroom (counted as cap power, so the step is conservative). An upper domain's cut goes to
    its children the same way over their priority-group loads, and each child cut gets the contract
    B = its load − its cut (its share of the parent's target); a releasing parent splits its headroom evenly over its
    contracted children and lifts a contract once it no longer binds. Caps also never exceed what keeps a rack
    under its own breaker rating in force. A cycle reads the highest telemetry reading since that controller's last
    cycle (reading = "max") or only the latest ("last"). No storage: the battery idles, BBUs are backup only.
    """

    name = "dynamo"

    def __init__(self, site: SiteModel, params: DynamoParams) -> None:
        self.site = site
        self.p = params
        gpu = site.gpu
        n = site.n_racks
        self._min_cap_w = float(gpu.min_cap_w)
        self._rated_w = float(gpu.rated_w)
        floor_w = params.sla_floor_w if params.sla_floor_w is not None else self._min_cap_w
        self._fixed_w = site.rack_power_w(np.zeros(n))
        self._gain = site.rack_power_w(np.ones(n)) - self._fixed_w
        self._floor_rack_w = self._gain * floor_w + self._fixed_w
        self._top_rack_w = self._gain * self._rated_w + self._fixed_w

        rack_level = int(site.domain_level.max())
        self._rack_dom = np.flatnonzero(site.domain_level == rack_level)
        levels = sorted(set(site.domain_level[site.domain_level < rack_level].tolist()))
        # (the campus has level 0, so a site whose only level is the racks has the campus as its leaf)
        self._leaf = np.flatnonzero(site.domain_level == levels[-1])
        leaf_start = site.domain_rack_start[self._leaf]
        self._leaf_of_rack = np.searchsorted(leaf_start, np.arange(n), side="right") - 1
        # upper levels, top-down: (domains of the level, their children, each child's parent position)
        self._upper: list[tuple[IntArray, IntArray, IntArray]] = []
        for lv in levels[:-1]:
            doms = np.flatnonzero(site.domain_level == lv)
            kids = np.flatnonzero(np.isin(site.domain_parent, doms))
            self._upper.append((doms, kids, np.searchsorted(doms, site.domain_parent[kids]).astype(np.int64)))

        prio = np.where(site.rack_job >= 0, site.job_priority[np.maximum(site.rack_job, 0)], -1)
        groups = sorted(set(prio.tolist()))
        self._groups: list[tuple[int, IntArray, FloatArray]] = [
            (g, np.flatnonzero(prio == g), (prio == g).astype(np.float64)) for g in groups
        ]
        self._readings = _Readings(site)
        # highest readings since the last leaf / upper cycle
        self._leaf_rack_max_w = np.full(n, -np.inf)
        self._leaf_dom_max_w = np.full(site.n_domains, -np.inf)
        self._upper_rack_max_w = np.full(n, -np.inf)
        self._upper_dom_max_w = np.full(site.n_domains, -np.inf)
        self._cap_w = np.full(n, self._rated_w)
        self._contract_w = np.full(site.n_domains, np.inf)
        self._next_leaf_s = math.nan
        self._next_upper_s = math.nan
        self.leaf_cycles = 0
        self.upper_cycles = 0
        self._base = _copy_hands_off(site)

    @property
    def contract_w(self) -> FloatArray:
        """(n_domains,) the budgets upper levels have passed down (inf: no contract)."""
        return self._contract_w.copy()

    def _due(self, t: float, next_s: float, period_s: float) -> tuple[bool, float]:
        if not math.isfinite(next_s):
            return True, t + period_s
        if t < next_s - _EPS_S:
            return False, next_s
        while next_s <= t + _EPS_S:
            next_s += period_s
        return True, next_s

    def _bands(self, load: FloatArray, rating: FloatArray, contract: FloatArray) -> tuple[FloatArray, FloatArray]:
        """The cut each domain needs (0 if none) and the headroom it may release (0 if none)."""
        p = self.p
        by_contract = contract / p.capping_target_frac
        binding = by_contract < rating
        lim = np.where(binding, by_contract, rating)
        threshold = np.where(binding, contract, p.capping_threshold_frac * lim)
        target = p.capping_target_frac * lim
        cut = np.where(load > threshold, load - target, 0.0)
        head = np.where(load < p.uncapping_threshold_frac * lim, target - load, 0.0)
        return cut, head

    def _cycle_readings(
        self, rack_w: FloatArray, dom_w: FloatArray, rack_max_w: FloatArray, dom_max_w: FloatArray
    ) -> tuple[FloatArray, FloatArray]:
        """What a cycle acts on (the highest readings since the last one, or the latest); restarts the maxima."""
        if self.p.reading == "max":
            rack_w, dom_w = rack_max_w.copy(), dom_max_w.copy()
        rack_max_w.fill(-np.inf)
        dom_max_w.fill(-np.inf)
        return rack_w, dom_w

    def step(self, obs: Observation) -> Actions:
        t = obs.t_s
        rack_w, dom_w = self._readings.update(obs)
        for m, x in (
            (self._leaf_rack_max_w, rack_w),
            (self._leaf_dom_max_w, dom_w),
            (self._upper_rack_max_w, rack_w),
            (self._upper_dom_max_w, dom_w),
        ):
            np.maximum(m, x, out=m)
        limit = _limits_w(obs)
        reasons: list[Reason] = []
        run_upper, self._next_upper_s = self._due(t, self._next_upper_s, self.p.upper_period_s)
        run_leaf, self._next_leaf_s = self._due(t, self._next_leaf_s, self.p.leaf_period_s)
        if run_upper and self._upper:
            self.upper_cycles += 1
            r_w, d_w = self._cycle_readings(rack_w, dom_w, self._upper_rack_max_w, self._upper_dom_max_w)
            reasons += self._upper_cycle(r_w, d_w, limit)
        if run_leaf:
            self.leaf_cycles += 1
            r_w, d_w = self._cycle_readings(rack_w, dom_w, self._leaf_rack_max_w, self._leaf_dom_max_w)
            reasons += self._leaf_cycle(r_w, d_w, limit)
        # a rack never draws more than its own breaker's rating in force (its draw at the cap)
        rack_bound_w = (limit[self._rack_dom] - self._fixed_w) / self._gain
        cap = np.clip(np.minimum(self._cap_w, rack_bound_w), self._min_cap_w, self._rated_w)
        if not reasons:
            phrase = "dynamo: every breaker within its bands" if run_leaf else "dynamo: caps held between cycles"
            reasons.append(Reason("baseline", phrase))
        return Actions(
            rack_cap_w=cap,
            rack_floor_w=self._base["rack_floor_w"].copy(),
            bess_setpoint_w=0.0,
            rack_bbu_threshold_w=self._base["rack_bbu_threshold_w"].copy(),
            rack_bbu_recharge_w=self._base["rack_bbu_recharge_w"].copy(),
            job_suspend=self._base["job_suspend"].copy(),
            reasons=tuple(reasons),
        )

    def _leaf_cycle(self, rack_w: FloatArray, dom_w: FloatArray, limit: FloatArray) -> list[Reason]:
        leaf = self._leaf
        floor_rack_w = np.minimum(self._floor_rack_w, rack_w)
        cut, head = self._bands(dom_w[leaf], limit[leaf], self._contract_w[leaf])
        reasons: list[Reason] = []
        n_leaf = leaf.shape[0]
        if (cut > 0).any():
            remaining = cut.copy()
            for _, idx, _ in self._groups:  # lowest priority first
                if not (remaining > 0).any():
                    break
                seg = self._leaf_of_rack[idx]
                x = waterfill_cut(rack_w[idx], floor_rack_w[idx], seg, remaining)
                remaining -= np.bincount(seg, weights=x, minlength=n_leaf)
                remaining[remaining < _CUT_RESIDUE_W] = 0.0
                hit = x > 0
                r = idx[hit]
                new_cap = (rack_w[r] - x[hit] - self._fixed_w[r]) / self._gain[r]
                self._cap_w[r] = np.minimum(self._cap_w[r], np.maximum(new_cap, self._min_cap_w))
            acted = np.flatnonzero(cut > 0)
            reasons += _domain_reasons(
                self.site, "dynamo leaf: over the capping threshold, cut", leaf[acted], cut[acted]
            )
        if (head > 0).any():
            remaining = head.copy()
            cap_pw = self._gain * self._cap_w + self._fixed_w
            for _, idx, _ in reversed(self._groups):  # highest priority first
                if not (remaining > 0).any():
                    break
                sub = idx[self._cap_w[idx] < self._rated_w]
                if sub.size == 0:
                    continue
                seg = self._leaf_of_rack[sub]
                inc = waterfill_cut(-cap_pw[sub], -self._top_rack_w[sub], seg, remaining)
                remaining -= np.bincount(seg, weights=inc, minlength=n_leaf)
                raised = self._cap_w[sub] + inc / self._gain[sub]
                raised[raised > self._rated_w - 1e-6] = self._rated_w  # released in full (no rounding residue)
                self._cap_w[sub] = raised
            released = head - remaining
            acted = np.flatnonzero(released > 0)
            reasons += _domain_reasons(
                self.site, "dynamo leaf: under the uncapping threshold, release", leaf[acted], released[acted]
            )
        return reasons

    def _upper_cycle(self, rack_w: FloatArray, dom_w: FloatArray, limit: FloatArray) -> list[Reason]:
        site = self.site
        floor_rack_w = np.minimum(self._floor_rack_w, rack_w)
        reasons: list[Reason] = []
        contract = self._contract_w
        for doms, kids, seg in self._upper:  # top-down: a parent's new contract binds its children's cut
            cut, head = self._bands(dom_w[doms], limit[doms], contract[doms])
            if (cut > 0).any():
                remaining = cut.copy()
                x = np.zeros(kids.shape[0])
                for _, _, mask in self._groups:
                    if not (remaining > 0).any():
                        break
                    g_w = site.domain_load_w(rack_w * mask)[kids]
                    f_w = site.domain_load_w(floor_rack_w * mask)[kids]
                    xg = waterfill_cut(g_w, np.minimum(f_w, g_w), seg, remaining)
                    remaining -= np.bincount(seg, weights=xg, minlength=doms.shape[0])
                    remaining[remaining < _CUT_RESIDUE_W] = 0.0
                    x += xg
                hit = x > 0
                contract[kids[hit]] = np.minimum(contract[kids[hit]], dom_w[kids[hit]] - x[hit])
                acted = np.flatnonzero(cut > 0)
                reasons += _domain_reasons(
                    site, "dynamo upper: over the capping threshold, budgets to children", doms[acted], cut[acted]
                )
            if (head > 0).any():
                bound = np.isfinite(contract[kids]) & (head[seg] > 0)
                if bound.any():
                    count = np.bincount(seg[bound], minlength=doms.shape[0])
                    grown = contract[kids] + head[seg] / np.maximum(count[seg], 1)
                    lifted = grown >= self.p.capping_target_frac * limit[kids]
                    contract[kids] = np.where(bound, np.where(lifted, np.inf, grown), contract[kids])
                    acted = np.flatnonzero((head > 0) & (count > 0))
                    reasons += _domain_reasons(
                        site, "dynamo upper: under the uncapping threshold, budgets raised", doms[acted], head[acted]
                    )
        return reasons


@register("dynamo")
def _make_dynamo(site: SiteModel, params: Mapping[str, Any]) -> Dynamo:
    p = _parse(DynamoParams, params)
    if p.sla_floor_w is not None and not site.gpu.min_cap_w <= p.sla_floor_w <= site.gpu.rated_w:
        raise InputError(
            "controller",
            "params.sla_floor_w",
            f"a per-GPU power within the {site.gpu.name} cap range {site.gpu.min_cap_w:g}-{site.gpu.rated_w:g} W "
            f"(got {p.sla_floor_w:g})",
        )
    return Dynamo(site, p)


# ---------------------------------------------------------------------------------------------------- smoothing


class SmoothingParams(Strict):
    """GPU firmware power smoothing: a floor on running GPUs and ramp-rate limits (NVML; Choukse et al. 2025)."""

    # per-GPU floor as a fraction of rated (Blackwell: 0-90 %); 0.8 fills ~2/3 of a 35 % trough (docs)
    floor_frac: float = Field(default=0.8, ge=0.0, le=1.0)
    # per-GPU ramp limits; default: the utility's ramp limit spread over the GPUs that run jobs (docs)
    ramp_up_w_per_s: float | None = Field(default=None, gt=0.0)
    ramp_down_w_per_s: float | None = Field(default=None, gt=0.0)


def derived_ramp_w_per_s(site: SiteModel) -> float:
    """Per-GPU ramp limit that keeps the site within the utility ramp if every job GPU ramps together.

    r = ramp_limit_w_per_min / 60 / Σ (active GPUs / rectifier efficiency) over the racks that run jobs (all racks if
    none do): the AC power of the racks moves by Σ gain x r per second. inf when the utility sets no ramp limit.
    """
    if not math.isfinite(site.ramp_limit_w_per_min):
        return math.inf
    run = (site.rack_job >= 0) & ~site.rack_is_spare
    if not run.any():
        run = np.ones(site.n_racks, dtype=bool)
    gain_w_per_w = float(np.sum(site.rack_active_gpus[run])) / site.rectifier_eff
    return site.ramp_limit_w_per_min / 60.0 / gain_w_per_w


class Smoothing:
    """Power floor on the GPUs of running jobs, released at the ramp-down rate; site-wide ramp limits; no caps.

    The floor target is floor_frac x rated on the active GPUs of every non-spare rack whose job is running
    (obs.job_running), 0 elsewhere. The commanded floor moves toward its target by at most ramp_up x dt up and
    ramp_down x dt down per period (dt from obs.t_s), so a crashed job's floor, which holds the load up, is let go
    no faster than the grid may ramp down. No caps, the battery idles, BBUs are backup only.
    """

    name = "smoothing"

    def __init__(self, site: SiteModel, params: SmoothingParams) -> None:
        self.site = site
        self.p = params
        derived = derived_ramp_w_per_s(site)
        self.ramp_up_w_per_s = params.ramp_up_w_per_s if params.ramp_up_w_per_s is not None else derived
        self.ramp_down_w_per_s = params.ramp_down_w_per_s if params.ramp_down_w_per_s is not None else derived
        self._floor_target_w = float(site.gpu.clamp_floor_w(params.floor_frac * site.gpu.rated_w))
        run = (site.rack_job >= 0) & ~site.rack_is_spare
        self._rack_slot = np.where(run, site.rack_job, site.n_jobs)
        # one running rack per job (placement gives every job one): all of a job's racks share its floor
        self._job_rack = np.asarray(
            [int(np.flatnonzero(run & (site.rack_job == j))[0]) for j in range(site.n_jobs)], dtype=np.int64
        )
        self._floor_w = np.zeros(site.n_racks)
        self._prev_t_s = 0.0
        self._base = _copy_hands_off(site)

    def step(self, obs: Observation) -> Actions:
        dt = max(obs.t_s - self._prev_t_s, 0.0)
        self._prev_t_s = obs.t_s
        job_on = np.append(np.asarray(obs.job_running, dtype=bool), False)
        target = job_on[self._rack_slot] * self._floor_target_w
        f = self._floor_w
        np.minimum(target, f + self.ramp_up_w_per_s * dt, out=target)
        np.maximum(target, f - self.ramp_down_w_per_s * dt, out=target)
        np.maximum(target, 0.0, out=target)
        self._floor_w = target
        reasons: list[Reason] = []
        job_floor_w = target[self._job_rack]
        for j in np.flatnonzero(job_floor_w > 0.0).tolist():  # a loop over jobs, not racks
            phrase = (
                "floor on a running job" if obs.job_running[j] else "job stopped, floor released at the ramp-down rate"
            )
            reasons.append(Reason("baseline", f"smoothing: {phrase}", job=j, value_w=float(job_floor_w[j])))
        if not reasons:
            reasons.append(Reason("baseline", "smoothing: ramp limits only (no job running)"))
        return Actions(
            rack_cap_w=self._base["rack_cap_w"].copy(),
            rack_floor_w=target.copy(),
            bess_setpoint_w=0.0,
            rack_bbu_threshold_w=self._base["rack_bbu_threshold_w"].copy(),
            rack_bbu_recharge_w=self._base["rack_bbu_recharge_w"].copy(),
            job_suspend=self._base["job_suspend"].copy(),
            gpu_ramp_up_w_per_s=self.ramp_up_w_per_s,
            gpu_ramp_down_w_per_s=self.ramp_down_w_per_s,
            reasons=tuple(reasons),
        )


@register("smoothing")
def _make_smoothing(site: SiteModel, params: Mapping[str, Any]) -> Smoothing:
    p = _parse(SmoothingParams, params)
    if p.floor_frac > site.gpu.floor_max_frac:
        raise InputError(
            "controller",
            "params.floor_frac",
            f"at most {site.gpu.floor_max_frac:g} (the {site.gpu.name} floor range) (got {p.floor_frac:g})",
        )
    return Smoothing(site, p)


# ---------------------------------------------------------------------------------------------------- peak-shave


class PeakShaveParams(Strict):
    """OpenEMS Controller.Ess.PeakShaving with the ESS PID filter (io.openems.edge.common.filter.PidFilter)."""

    peak_mw: float | None = Field(default=None, gt=0.0)  # default: peak_frac x the PCC limit in force
    recharge_mw: float | None = Field(default=None, ge=0.0)  # default: recharge_frac x the PCC limit in force
    peak_frac: float = Field(default=0.95, gt=0.0, le=2.0)
    recharge_frac: float = Field(default=0.8, ge=0.0, le=2.0)
    kp: float = Field(default=0.3, ge=0.0, le=10.0)  # OpenEMS PidFilter.DEFAULT_P
    ki: float = Field(default=0.3, ge=0.0, le=10.0)  # OpenEMS PidFilter.DEFAULT_I
    kd: float = Field(default=0.1, ge=0.0, le=10.0)  # OpenEMS PidFilter.DEFAULT_D

    @model_validator(mode="after")
    def _settings(self) -> PeakShaveParams:
        if self.recharge_frac >= self.peak_frac:
            raise ValueError("recharge_frac must be below peak_frac")
        if self.peak_mw is not None and self.recharge_mw is not None and self.recharge_mw >= self.peak_mw:
            raise ValueError("recharge_mw must be below peak_mw")
        return self


class PeakShave:
    """Campus battery peak shaving, OpenEMS style, once per control period (OpenEMS cycle: 1 s).

    grid_without_battery = meter + battery (discharge +). Above the peak setting the battery is asked for
    grid_without_battery − peak (discharge); at or below the recharge setting for grid_without_battery − recharge
    (charge, negative); else 0. The request passes OpenEMS' PID filter against the battery's measured power:
    out = kp e + clamp(ki Σe, lo, hi) − kd Δinput, clamped to [lo, hi], where lo = −P_max unless the SoC is at
    soc_max (then 0: no charging) and hi = P_max unless it is at soc_min (then 0: no discharging). Σe is also kept
    within ±P_max / ki (anti-windup). No caps; BBUs are backup only.
    """

    name = "peak-shave"

    def __init__(self, site: SiteModel, params: PeakShaveParams) -> None:
        self.site = site
        self.p = params
        self._peak_w = params.peak_mw * 1e6 if params.peak_mw is not None else None
        self._recharge_w = params.recharge_mw * 1e6 if params.recharge_mw is not None else None
        self._p_max_w = float(site.bess.power_w)
        self._sum_max = self._p_max_w / params.ki if params.ki > 0 else math.inf
        self._soc_min = float(site.bess.soc_min_frac)
        self._soc_max = float(site.bess.soc_max_frac)
        self._readings = _Readings(site)
        self._first = True
        self._last_input_w = 0.0
        self._error_sum_w = 0.0
        self._base = _copy_hands_off(site)

    def settings_w(self, pcc_limit_w: float) -> tuple[float, float]:
        """(peak, recharge) in force under the PCC limit `pcc_limit_w` (recharge never above peak)."""
        peak = self._peak_w if self._peak_w is not None else self.p.peak_frac * pcc_limit_w
        recharge = self._recharge_w if self._recharge_w is not None else self.p.recharge_frac * pcc_limit_w
        return peak, min(recharge, peak)

    def _reset(self) -> None:
        self._first = True
        self._error_sum_w = 0.0

    def _pid(self, input_w: float, target_w: float, lo_w: float, hi_w: float) -> float:
        p = self.p
        target_w = min(max(target_w, lo_w), hi_w)
        error = target_w - input_w
        if error == 0.0:
            return target_w
        if self._first:
            self._last_input_w = input_w
            self._first = False
        out_i = min(max(p.ki * self._error_sum_w, lo_w), hi_w)
        out_d = -p.kd * (input_w - self._last_input_w)
        self._last_input_w = input_w
        out = p.kp * error + out_i + out_d
        self._error_sum_w = min(max(self._error_sum_w + error, -self._sum_max), self._sum_max)
        return min(max(out, lo_w), hi_w)

    def step(self, obs: Observation) -> Actions:
        soc = obs.bess_soc_frac
        bess_w = obs.bess_power_w if math.isfinite(obs.bess_power_w) else 0.0
        setpoint = 0.0
        if not obs.bess_online or not math.isfinite(soc) or self._p_max_w <= 0.0:
            self._reset()
            reason = Reason("baseline", "peak-shave: battery offline or unknown, idle")
        else:
            meter_w = obs.pcc_power_w
            if not math.isfinite(meter_w):
                _, dom_w = self._readings.update(obs)
                meter_w = float(dom_w[0]) - bess_w
            grid_wo_w = meter_w + bess_w
            peak, recharge = self.settings_w(obs.pcc_limit_w)
            if grid_wo_w >= peak:
                target, phrase = grid_wo_w - peak, "peak-shave: above the peak setting, discharge"
            elif grid_wo_w <= recharge:
                target, phrase = grid_wo_w - recharge, "peak-shave: below the recharge setting, recharge"
            else:
                target, phrase = 0.0, "peak-shave: between the settings, idle"
            lo = -self._p_max_w if soc < self._soc_max - 1e-9 else 0.0
            hi = self._p_max_w if soc > self._soc_min + 1e-9 else 0.0
            setpoint = self._pid(bess_w, target, lo, hi)
            reason = Reason("baseline", phrase, domain=0, value_w=setpoint)
        return Actions(
            rack_cap_w=self._base["rack_cap_w"].copy(),
            rack_floor_w=self._base["rack_floor_w"].copy(),
            bess_setpoint_w=float(setpoint),
            rack_bbu_threshold_w=self._base["rack_bbu_threshold_w"].copy(),
            rack_bbu_recharge_w=self._base["rack_bbu_recharge_w"].copy(),
            job_suspend=self._base["job_suspend"].copy(),
            reasons=(reason,),
        )


@register("peak-shave")
def _make_peak_shave(site: SiteModel, params: Mapping[str, Any]) -> PeakShave:
    p = _parse(PeakShaveParams, params)
    ctrl = PeakShave(site, p)
    peak, _ = ctrl.settings_w(site.pcc_limit_w)
    recharge = p.recharge_frac * site.pcc_limit_w
    if p.recharge_mw is not None and p.recharge_mw * 1e6 >= peak:
        raise InputError(
            "controller", "params.recharge_mw", f"below the peak setting {peak / 1e6:g} MW (got {p.recharge_mw:g})"
        )
    if p.peak_mw is not None and p.recharge_mw is None and recharge >= peak:
        raise InputError(
            "controller",
            "params.peak_mw",
            f"above the recharge setting {recharge / 1e6:g} MW (recharge_frac x the PCC limit) (got {p.peak_mw:g})",
        )
    return ctrl


__all__ = [
    "Dynamo",
    "DynamoParams",
    "HardStop",
    "HardStopParams",
    "NoControl",
    "PeakShave",
    "PeakShaveParams",
    "Smoothing",
    "SmoothingParams",
    "derived_ramp_w_per_s",
    "waterfill_cut",
]
