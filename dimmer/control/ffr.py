"""Fast frequency response: the campus answers a frequency deviation as a droop resource (docs/controller.md).

Beyond a deadband, the import moves in proportion to the deviation measured from the deadband's edge (a "non-step"
response: NERC Reliability Guideline *Primary Frequency Control*, 2019; ERCOT BAL-001-TRE-2), on the site's rating:

    Δf_b = sign(Δf) · max(|Δf| − deadband, 0)                    Δf = f − f_nom
    ΔP   = clip( (−Δf_b / f_nom) / (droop_pct / 100) · P_ref,  −max_frac · P_ref,  max_frac · P_ref )

ΔP > 0 asks for less import (under-frequency), ΔP < 0 for more (over-frequency). The order is taken on in the period
that sees the deviation and given back at most one ramp step a period as the frequency recovers. The battery answers
first, within its power and state-of-charge window (and, charging, under the interconnect's ceiling); what it cannot
give of a reduction is a cut at the campus (GPU caps, lowest priority first, through the controller's own machinery,
under every limit it keeps); what it cannot take of an increase is left (no floors: see split). Pure: no clock, no
I/O; the frequency comes in the Observation.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from dimmer.control.dimmer_params import DimmerParams
from dimmer.observation import Reason
from dimmer.site import SiteModel

FloatArray = npt.NDArray[np.float64]

NOMINALS_HZ = (50.0, 60.0)
HOLD_W = 1e-3  # a campus cut of a milliwatt: the caps' share holds them where it cut them (see split)


def beyond_deadband_hz(dev_hz: float | FloatArray, deadband_hz: float) -> FloatArray:
    """The deviation measured from the deadband's edge, signed: 0 inside it (NaN stays NaN)."""
    d = np.asarray(dev_hz, dtype=np.float64)
    out: FloatArray = np.sign(d) * np.maximum(np.abs(d) - deadband_hz, 0.0)
    return out


def droop_response_w(
    freq_hz: float | FloatArray,
    nominal_hz: float,
    deadband_hz: float,
    droop_pct: float,
    p_ref_w: float,
    max_frac: float,
) -> FloatArray:
    """ΔP (W, + less import) a droop of `droop_pct` % on `p_ref_w` asks for at `freq_hz`, within ±max_frac · p_ref_w.

    0 where droop_pct is 0 (off) or the frequency is unknown (NaN)."""
    f = np.asarray(freq_hz, dtype=np.float64)
    if droop_pct <= 0:
        return np.zeros_like(f)
    beyond = beyond_deadband_hz(f - nominal_hz, deadband_hz)
    bound = max_frac * p_ref_w
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # (a vanishing droop: an unbounded gain)
        raw = -beyond / nominal_hz * (100.0 / droop_pct) * p_ref_w
    out: FloatArray = np.nan_to_num(np.clip(np.where(beyond == 0, 0.0, raw), -bound, bound))
    return out


def nominal_for(freq_hz: float) -> float:
    """The nominal (50 or 60 Hz) a reading belongs to: the nearer one (no grid runs 5 Hz off)."""
    return min(NOMINALS_HZ, key=lambda n: abs(freq_hz - n))


def released_w(order_w: float, target_w: float, release_w: float) -> float:
    """The order this period: the droop's target where it asks for as much or more in the order's direction (taken on
    at once), else the order moved toward it by at most `release_w` (given back at the ramp limit). A target on the
    other side of nominal waits until the order in force is given back."""
    if target_w * order_w < 0:
        target_w = 0.0
    if abs(target_w) >= abs(order_w):
        return target_w
    return order_w - math.copysign(min(release_w, abs(order_w - target_w)), order_w)


class FastFrequencyResponse:
    """The droop order in force and its split between the battery and the caps or floors, one control period a call.

    `order_w` is the response ordered last period (+ less import): the import the plan sees is lower by it, and the
    plan's history of the import (the ramp rule's room) adds it back, so the plan neither fights nor repeats it."""

    def __init__(self, deadband_hz: float, droop_pct: float, max_frac: float, p_ref_w: float,
                 nominal_hz: float | None = None) -> None:  # fmt: skip
        self.deadband_hz = float(deadband_hz)
        self.droop_pct = float(droop_pct)
        self.max_frac = float(max_frac)
        self.p_ref_w = float(p_ref_w)
        self.nominal_hz = nominal_hz
        self.order_w = 0.0
        self.target_w = 0.0  # the droop's own ask this period (before the release limit)
        self.bess_w = 0.0  # the battery's share of the order
        self.cut_w = 0.0  # the cut asked of the caps this period (under-frequency)
        self.caps_w = 0.0  # what the caps give of the order, as cut so far and not given back
        self.unmet_w = 0.0  # what no resource took of an increase (over-frequency, the battery full or at its power)

    @classmethod
    def for_site(cls, site: SiteModel, p: DimmerParams, rack_max_w: FloatArray) -> FastFrequencyResponse | None:
        """The response a site's parameters ask for, on its rating: the interconnect limit (the rating the utility
        holds it to), or where none is set the most its racks may draw; None where the droop is 0 (off)."""
        if p.ffr_droop_pct <= 0:
            return None
        p_ref = site.pcc_limit_w if math.isfinite(site.pcc_limit_w) else float(np.sum(rack_max_w))
        return cls(p.ffr_deadband_hz, p.ffr_droop_pct, p.ffr_max_frac, p_ref, p.ffr_nominal_hz)

    def order(self, freq_hz: float, release_w: float) -> float:
        """This period's order (W, + less import) from the frequency read, given back at most `release_w`."""
        if self.nominal_hz is None and math.isfinite(freq_hz):
            self.nominal_hz = nominal_for(freq_hz)
        if self.nominal_hz is None or not math.isfinite(freq_hz):
            target = 0.0  # no frequency known: no new order, the old one given back at the ramp
        else:
            target = float(droop_response_w(freq_hz, self.nominal_hz, self.deadband_hz, self.droop_pct,
                                            self.p_ref_w, self.max_frac))  # fmt: skip
        self.target_w = target
        self.order_w = released_w(self.order_w, target, release_w if math.isfinite(release_w) else math.inf)
        return self.order_w

    def split(self, order_w: float, bess_w: float, discharge_w: float, charge_w: float) -> tuple[float, float]:
        """(battery setpoint, cut) with the order laid on the plan's setpoint `bess_w`: the battery first, within
        `discharge_w` and `-charge_w` (its power, SoC window and the interconnect's ceiling); the rest of a reduction a
        cut at the campus (GPU caps). The rest of an increase is left (`unmet_w`): a GPU floor burns what it adds, and
        the trough machinery lifts floors from each period's readings, so an order laid on it would ratchet them up.
        A plan already past a bound is left where it is.

        The campus's cut is what the caps' share adds to what they already give (`caps_w`): the readings show a cut
        made, and a cut asked again each period would be made again. While they give any, the cut is at least
        HOLD_W, so the campus counts as cut and no cap rises into the room the order holds; the caps come back, at the
        controller's own pace, once the order needs them no more."""
        share = self.unmet_w = 0.0  # (the caps' share of a reduction; what is left of an increase)
        if order_w > 0:
            room = max(discharge_w - bess_w, 0.0)
            new, share = (bess_w + order_w, 0.0) if order_w <= room else (bess_w + room, order_w - room)
        elif order_w < 0:
            room = max(bess_w + charge_w, 0.0)
            new, self.unmet_w = (bess_w + order_w, 0.0) if -order_w <= room else (bess_w - room, order_w + room)
        else:
            new = bess_w
        self.bess_w = new - bess_w
        if share > 0:
            self.cut_w = max(share - self.caps_w, HOLD_W)
            self.caps_w = max(self.caps_w, share)
        else:
            self.cut_w = self.caps_w = 0.0
        return new, self.cut_w

    def reason(self) -> Reason:
        """Why the import moved this period: the order, and what the battery, the caps and the floors took of it."""
        what = (
            f"fast frequency response: {self.order_w / 1e6:+.3f} MW of import asked (battery {self.bess_w / 1e6:+.3f}, "
            f"caps {self.caps_w / 1e6:.3f}, not met {self.unmet_w / 1e6:+.3f})"
        )
        return Reason("grid", what, domain=0, value_w=self.order_w)
