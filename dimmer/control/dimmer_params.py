"""The dimmer controller's parameters: every threshold, gain and period, with its default and why.

Kept apart from the controller (dimmer.py) so the step reads without them; docs/controller.md explains each.
"""

from __future__ import annotations

from pydantic import Field, ValidationInfo, field_validator

from dimmer.siteconfig import Strict


class DimmerParams(Strict):
    """Every threshold, gain and period, with its default (docs/controller.md explains each)."""

    period_s: float = Field(default=1.0, gt=0)  # nominal control period (the first step's dt)
    # capping
    soft_frac: float = Field(default=0.95, gt=0, lt=1)  # cuts start here (fraction of the rating in force)
    release_frac: float = Field(default=0.93, gt=0, lt=1)  # caps rise freely below this (then to soft)
    emergency_frac: float = Field(default=1.0, gt=0)  # envelope at this fraction of the rating: cut to soft at once
    # ... and where the breaker reports its thermal state: it shows a load over its rating heating it minutes before
    # it trips (I^2 t), so the controller needs no margin under the rating to react in; the margin soft_frac keeps
    # is for a breaker whose only warning is its reading (site-99pct: rows at 99 % as an RMS lost 3 % of goodput)
    reporting_soft_frac: float = Field(default=1.0, gt=0, le=1)
    # breaker thermal state (1 = trip) that triggers the emergency path: 0.9 is a sustained ~1.09 x rating on a
    # k = 1.15 breaker; a steady load at the soft threshold sits near 0.7
    thermal_emergency_frac: float = Field(default=0.9, gt=0, le=1)
    # A domain over its rating by less than this, whose breaker reports its thermal state and is under
    # thermal_emergency_frac, is brought under it at the ramp the utility allows rather than in one step: the
    # long-time (I^2 t) region, where the thermal state is the guard; 1.3 stays clear of the short-time pickups
    # (1.5 x Ir at their lowest setting on IEC 60947-2 trip units), which trip in tenths of a second. 1.0: never.
    pace_max_frac: float = Field(default=1.3, ge=1.0)
    envelope_s: float = Field(default=10.0, gt=0)  # peak-hold window: several iterations of a 0.3-5 s swing
    cap_rise_w_per_s: float = Field(default=20.0, gt=0)  # per GPU: caps rise slowly (GB300: 1.4 % of rated a second)
    # grid shaping
    forecast_tau_s: float = Field(default=20.0, ge=0)
    # the battery follows the campus load's level (filters.SwingLevel over this many seconds of readings): it
    # shapes the level, not the swing (a battery chasing a 0.2-3 Hz swing from 1 s readings arrives out of phase
    # and amplifies it, and a reading in a trough looks like a fall to fill); a change no swing explains is
    # followed within two periods
    bess_level_s: float = Field(default=6.0, gt=0)
    # a job that stopped drawing (a synchronous checkpoint stall, a crash) may come back in one tick: its racks'
    # peak readings are held with this time constant in the load the interconnect must be able to take
    return_hold_s: float = Field(default=120.0, ge=0)
    # ... and held in full for this long after it was last reached, before it decays: a trace's idle lead-in or a
    # dip of 15-20 s, decaying from its start, came back 15 % above the hold and took the campus over its limit
    return_hold_full_s: float = Field(default=60.0, ge=0)
    # how far above its highest 1 s reading a rack's swing may peak: a 40 % swing with a 30 % communication share
    # peaks 14 % above its mean, and a reading that mixes phases sits between them (MODELS.md: 30-40 % swings)
    hidden_peak_frac: float = Field(default=0.15, ge=0, le=1)
    flat_frac: float = Field(default=0.01, ge=0, le=1)  # a window whose readings spread less is no swing
    # a falling limit (a curtailment ramping down) is planned this many periods ahead: a reading, a decision and
    # the GPUs' settling
    limit_lead_periods: float = Field(default=2.0, ge=0)
    # how long a cap write takes to be enforced here, as the operator knows it (caps set through a BMC: tens of
    # seconds; POLCA, ASPLOS 2024: up to ~40 s); 0: as learned from the writes that land (cap_landing.py). Where that
    # is over two periods, a cut not yet landed counts at the cap sent in the caps' plan for the longer of this and
    # the learned delay, and half a period; then it is lost, and its rack counts at the cap it reports
    cap_delay_s: float = Field(default=0.0, ge=0, le=600)
    # ... and before any write has landed since it was sent (every write delayed, none lost), this long at most
    cap_landing_max_s: float = Field(default=60.0, ge=0, le=600)
    # where the site's caps go out of band (SiteModel.cap_path, a BMC), what a write is taken to need until one is
    # seen landing: the first cut of a curtailment is sent before any has, and must lead the falling limit by then
    # (POLCA, ASPLOS 2024: up to ~40 s through the BMC)
    cap_delay_oob_s: float = Field(default=40.0, ge=0, le=600)
    # plan on this share of the utility ramp limit: the rest absorbs what the plan does not command (restart
    # surges, BBU recharge ending, telemetry lag); 0.7 held every library scenario with no violation
    ramp_margin_frac: float = Field(default=0.7, gt=0, le=1)
    pcc_margin_frac: float = Field(default=0.97, gt=0, le=1)  # keep the grid this far under the interconnect limit
    bess_soc_target_frac: float = Field(default=0.6, ge=0, le=1)
    bess_soc_recovery_s: float = Field(default=1800.0, gt=0)  # time constant of the slow SoC recovery
    bess_reserve_frac: float = Field(default=0.15, ge=0, le=1)  # SoC band above the minimum where reliance tapers
    # A capped job may lean on the battery for the room between the release level and the interconnect's, at most
    # what the battery's charge above its floor could give for this long (a lean it can keep, not one that empties
    # it and leaves the caps to come down deeper later)
    bess_lean_horizon_s: float = Field(default=3600.0, gt=0)
    # trough filling
    floor_release_w_per_s: float | None = Field(default=None, gt=0)  # per GPU; default: the ramp limit spread out
    # what one GPU-second of goodput is worth in energy, where the two trade (floors held for a stopped job's return):
    # $2.5 a GPU-hour (H100 on demand, 2026) against $0.08 a kWh (US industrial, EIA 2023) is 31 kJ; 0 pays none
    goodput_worth_j_per_gpu_s: float = Field(default=30e3, ge=0)
    fill_deadband_frac: float = Field(default=0.005, ge=0, le=0.2)  # of the interconnect limit: smaller falls pass
    # rack storage: BBUs are backup units first (dimmer/control/rack_storage.py)
    bbu_cycle_budget_per_day: float = Field(default=1.0, ge=0)  # depth-weighted full cycles a day, each BBU
    bbu_reserve_s: float = Field(default=60.0, ge=0)  # ride-through kept: seconds of the rack's present load
    bbu_recharge_full_tau_s: float = Field(default=300.0, gt=0)  # recharge tapers as the shelf nears full
    # the racks' total recharge grows by at most this share of the utility's ramp step a period
    bbu_recharge_ramp_frac: float = Field(default=0.1, gt=0, le=1)
    # safety
    stale_s: float = Field(default=5.0, gt=0)  # a reading older than this is not trusted
    # PCC meter plausibility: the agreement band between the PCC reading and the rack-based estimate, as a share of
    # the interconnect limit in force. Under the 3 % grid margin (pcc_margin_frac), so an under-reading the check
    # lets through cannot by itself take the import over the limit; over a revenue meter's 0.2-0.5 % and the rack
    # sum's error once its bias is learned (per-rack errors of 1-2 % average out over many racks).
    pcc_check_frac: float = Field(default=0.02, gt=0, le=1)
    pcc_learn_tau_s: float = Field(default=1800.0, gt=0)  # how slowly the unmetered overhead is learned
    pcc_stuck_s: float = Field(default=3.0, gt=0)  # an exactly repeated PCC reading this long, racks moving: stuck
    # the most that on-site generation behind the PCC meter gives: the import is never under the racks' sum by more
    # (0, most campuses: a meter reading under the racks is wrong, a CT ratio say, and the racks stand in)
    behind_meter_generation_w: float = Field(default=0.0, ge=0)
    safe_cap_frac: float = Field(default=0.6, gt=0, le=1)  # of rated: where stale telemetry sends a cap
    # fast frequency response (ffr.py): beyond the deadband, the import moves by a droop of ffr_droop_pct % on the
    # site's rating (its interconnect limit), measured from the deadband's edge, within ffr_max_frac of that rating.
    # 0 droop, the default: no response. Deadband 0.036 Hz: NERC's recommended maximum for primary frequency control
    # (Reliability Guideline "Primary Frequency Control", 2019); ERCOT requires 0.017 Hz (BAL-001-TRE-2).
    ffr_droop_pct: float = Field(default=0.0, ge=0, le=100)
    ffr_deadband_hz: float = Field(default=0.036, ge=0, le=5)
    ffr_max_frac: float = Field(default=0.1, ge=0, le=1)
    # the grid's nominal frequency; None: the nearer of 50 and 60 Hz to the first reading
    ffr_nominal_hz: float | None = Field(default=None, gt=0)
    # voltage ride-through (ride_through.py): below ride_through_dip_pu at the PCC the caps and floors are held and
    # the battery discharges at ride_through_bess_frac of its rating, until the voltage has been at or above
    # ride_through_clear_pu for ride_through_clear_s (or ride_through_max_s has passed); then the support goes at the
    # ramp limit or over ride_through_return_s, the faster. 0.9 pu: where IEC 61000-4-30 starts a dip (as
    # remembered). Outside a dip the battery keeps the energy for ride_through_required_s of that support (3 s: the
    # longest excursion on PRC-024-2's low-voltage curve), and the BBUs' bbu_reserve_s must be at least as long.
    # 0 dip_pu: off. No voltage reading (NaN): nothing changes.
    ride_through_dip_pu: float = Field(default=0.9, ge=0, lt=1.2)
    ride_through_clear_pu: float = Field(default=0.95, gt=0, le=1.2)
    ride_through_clear_s: float = Field(default=2.0, ge=0, le=600)
    ride_through_max_s: float = Field(default=30.0, gt=0, le=3600)
    ride_through_bess_frac: float = Field(default=1.0, ge=0, le=1)
    ride_through_return_s: float = Field(default=5.0, gt=0, le=3600)  # the support withdrawn over this long
    ride_through_required_s: float = Field(default=3.0, ge=0, le=3600)

    @field_validator("ride_through_required_s")
    @classmethod
    def _bbu_reserve_covers(cls, v: float, info: ValidationInfo) -> float:
        reserve = info.data.get("bbu_reserve_s")
        if reserve is not None and v > reserve:
            raise ValueError(f"at most bbu_reserve_s ({reserve:g} s): the BBUs must keep what the ride-through needs")
        return v
