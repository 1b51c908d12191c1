"""Voltage ride-through: what dimmer does when the PCC voltage dips (docs/controller.md, "Voltage ride-through").

Behind a source impedance the PCC voltage falls with the import (gridsim/plant/voltage.py: V ≈ V_s − (R·P + X·Q)),
so the site holds its voltage up by drawing less. When the voltage reading falls below `ride_through_dip_pu`:

- the caps in force are held (no cap rises; cuts the controller makes for its limits still pass) and so are the
  floors: nothing raises the import into the dip;
- the campus battery discharges at `ride_through_bess_frac` of its rating (never past the campus load: no export),
  which lowers the import by as much and lifts the PCC voltage by about R·ΔP (on a resistive connection a few
  hundredths of a pu for a few MW; on a stiff, inductive one little: the lever is the connection's R);

until the voltage has been at or above `ride_through_clear_pu` (the source has recovered: the support alone lifts it
by less) or `ride_through_max_s` has passed. Then the support is withdrawn in even steps over `ride_through_return_s`
(or at the ramp the utility allows, if that is faster), so the import comes back as a ramp, not a step, and soon: the
utility's ramp rule reads the import's mean over its window (60 s), which a support of 2 MW held for some 8 s moves
by a quarter of a MW, while withdrawing it at the rule's own rate kept it for two minutes and moved that mean by the
whole 2 MW (scenarios/voltage-dip.toml: 32.8 s over the ramp limit). Outside a dip the battery keeps, above its
SoC floor, the energy to give that support for `ride_through_required_s` (the longest excursion of the ride-through
curve: 3 s on PRC-024-2), and the BBUs keep `bbu_reserve_s` (validated to be at least as long).

A reading of NaN (no voltage measured) leaves the actions as they are. The voltage arrives once a control period, so
a dip shorter than a period is over before the controller sees it: what the site rides through in the first period
is the UPS's and the power shelves' own doing.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from dimmer.control.dimmer_params import DimmerParams
from dimmer.observation import Actions, Observation, Reason
from dimmer.site import SiteModel

FloatArray = npt.NDArray[np.float64]


class RideThrough:
    def __init__(self, site: SiteModel, params: DimmerParams) -> None:
        self.p = params
        self.bess_power_w = site.bess.power_w
        self.bess_energy_j = site.bess.energy_j
        self.bess_soc_min_frac = site.bess.soc_min_frac
        self.ramp_w_per_s = site.ramp_limit_w_per_min / 60.0
        self.in_dip = False
        self.dip_s = 0.0
        self.clear_s = 0.0
        self.support_w = 0.0  # the discharge laid over the plan (withdrawn over ride_through_return_s after the dip)
        self.support_end_w = 0.0  # ... as it stood when the dip cleared
        self.held_cap_w: FloatArray | None = None
        self.held_floor_w: FloatArray | None = None

    @classmethod
    def for_site(cls, site: SiteModel, params: DimmerParams) -> RideThrough | None:
        """None where ride-through support is off (ride_through_dip_pu = 0)."""
        return cls(site, params) if params.ride_through_dip_pu > 0 else None

    def reserve_j(self) -> float:
        """The battery energy above its SoC floor kept for one ride-through at full support."""
        return self.p.ride_through_bess_frac * self.bess_power_w * self.p.ride_through_required_s

    def apply(self, obs: Observation, act: Actions, dt_s: float) -> Actions:
        v = obs.pcc_voltage_pu
        if math.isnan(v) and not self.in_dip and self.support_w == 0.0:
            return act
        p = self.p
        if not self.in_dip and v < p.ride_through_dip_pu:
            self.in_dip, self.dip_s, self.clear_s = True, 0.0, 0.0
            self.held_cap_w = obs.rack_cap_w.copy()
            self.held_floor_w = obs.rack_floor_w.copy()
        elif self.in_dip:
            self.dip_s += dt_s
            self.clear_s = self.clear_s + dt_s if v >= p.ride_through_clear_pu else 0.0
            if self.clear_s >= p.ride_through_clear_s - 1e-9 or self.dip_s >= p.ride_through_max_s:
                self.in_dip = False
                self.support_end_w = self.support_w
        plan_w = act.bess_setpoint_w if math.isfinite(act.bess_setpoint_w) else 0.0
        if self.in_dip:
            return self._hold(obs, act, plan_w)
        if self.support_w > 0.0:  # after the dip: the support withdrawn at the ramp the utility allows
            step_w = max(self.ramp_w_per_s * p.ramp_margin_frac, self.support_end_w / p.ride_through_return_s) * dt_s
            self.support_w = max(self.support_w - step_w, 0.0)
            why = Reason("grid", "ride-through support withdrawn", domain=0, value_w=self.support_w)
            return replace(act, bess_setpoint_w=plan_w + self.support_w, reasons=(*act.reasons, why))
        return self._keep_reserve(obs, act, plan_w)

    def _hold(self, obs: Observation, act: Actions, plan_w: float) -> Actions:
        assert self.held_cap_w is not None and self.held_floor_w is not None
        target_w = self.p.ride_through_bess_frac * self.bess_power_w if obs.bess_online else 0.0
        campus_w = obs.pcc_power_w + obs.bess_power_w  # what the campus draws: the battery exports none of it
        if math.isfinite(campus_w):
            target_w = min(target_w, max(campus_w, 0.0))
        setpoint_w = max(plan_w, target_w)
        self.support_w = setpoint_w - plan_w
        caps = np.fmin(act.rack_cap_w, self.held_cap_w)
        why = Reason("grid", f"voltage dip ({obs.pcc_voltage_pu:.3f} pu): caps and floors held, battery supports",
                     domain=0, value_w=self.support_w)  # fmt: skip
        return replace(
            act,
            rack_cap_w=caps,
            rack_floor_w=self.held_floor_w,
            bess_setpoint_w=setpoint_w,
            reasons=(*act.reasons, why),
        )

    def _keep_reserve(self, obs: Observation, act: Actions, plan_w: float) -> Actions:
        """No discharge that would leave less than one ride-through's energy above the battery's SoC floor."""
        if plan_w <= 0.0 or not math.isfinite(obs.bess_soc_frac) or self.bess_energy_j <= 0.0:
            return act
        above_j = (obs.bess_soc_frac - self.bess_soc_min_frac) * self.bess_energy_j
        if above_j > self.reserve_j():
            return act
        why = Reason("grid", "battery discharge held: its charge is the ride-through reserve", domain=0, value_w=plan_w)
        return replace(act, bess_setpoint_w=0.0, reasons=(*act.reasons, why))
