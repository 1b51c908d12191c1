"""Plausibility of the interconnect (PCC) meter: its reading against what the racks report.

The campus import is the racks' supply-side power, plus what the site draws that no rack meter sees (cooling,
offices, distribution losses), less what the campus battery discharges:

    import = g * rack_sum + c - bess          g, c learned: g absorbs load-proportional overhead, c constant overhead

One meter against many: a rack meter that fails moves the sum by one rack, while a PCC meter that drifts, spikes or
sticks moves the controller's whole view of the grid. So the PCC reading is held to the rack-based estimate within a
tolerance, and when it leaves that band the controller runs on the estimate instead (`PccCheck.update`).

The fit (g, c) is an exponentially weighted least-squares line of (PCC + battery) on the rack sum, with a prior that
pulls g toward 1 while the load has not varied enough to tell a slope from an offset. It learns slowly (time
constant `learn_tau_s`, half an hour by default), and each sample's pull is bounded by the tolerance: while the two
agree the fit follows them, while they disagree a sample pulls no harder than one at the tolerance's edge, so a fault
that develops in minutes stays flagged while a real change of the unmetered load is absorbed over hours.

Pure and scalar: no I/O, no clock (dt comes in), a handful of floats of state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dimmer.control.rack_math import clip_float

OK, LOW, HIGH, STUCK, MISSING = "ok", "low", "high", "stuck", "missing"

# What each verdict means, for the controller's reasons (the daemon's metrics label a reason by its first 80
# characters, numbers masked: these stay under that and carry no number).
PHRASES = {
    LOW: "PCC meter implausible (reads low against the racks): rack estimate used",
    HIGH: "PCC meter implausible (reads high against the racks): rack bound used",
    STUCK: "PCC meter stuck while the racks move: rack estimate used",
}


@dataclass(frozen=True)
class PccVerdict:
    """The check's answer for one period: what the controller should take as the grid import, and why."""

    status: str  # ok | low | high | stuck | missing
    used_w: float  # the import to plan on
    estimate_w: float  # the rack-based estimate (racks, learned overhead, battery)
    tolerance_w: float  # the agreement band this period

    @property
    def implausible(self) -> bool:
        return self.status in (LOW, HIGH, STUCK)


class PccCheck:
    """Cross-check of the PCC meter against the rack sum; one instance per site, stepped every control period.

    `scale_w` (the nominal interconnect limit) normalises the fit; `tol_frac` is the agreement band as a share of
    the limit in force; `stuck_s` how long an exactly repeated reading must last, while the racks move, to be stuck;
    `generation_w` the most that on-site generation behind the meter gives (the import may be that far under the
    racks' sum: 0 for a site with none).
    """

    def __init__(
        self,
        scale_w: float,
        tol_frac: float,
        learn_tau_s: float,
        stuck_s: float,
        prior_frac: float = 0.2,
        start_weight_s: float | None = None,
        generation_w: float = 0.0,
    ) -> None:
        self.scale_w = scale_w if math.isfinite(scale_w) and scale_w > 0 else 1.0
        self.generation_w = generation_w  # the most on-site generation behind the meter gives (W)
        self.tol_frac = tol_frac
        self.learn_tau_s = learn_tau_s
        self.stuck_s = stuck_s
        self.start_weight_s = learn_tau_s / 10.0 if start_weight_s is None else start_weight_s
        self.prior = prior_frac**2  # variance of the normalised rack sum at which the data and the prior weigh equally
        self.sums = np.zeros(5)  # weight, x, y, xx, xy: exponentially weighted, in units of scale_w
        self.flagged = ""  # low | high while a disagreement lasts (hysteresis)
        self.last_pcc_w = math.nan
        self.last_rack_w = math.nan
        self.last_bess_w = math.nan
        self.repeat_s = 0.0  # how long the PCC reading has repeated exactly
        self.run_lo_w = math.nan  # the estimate's range while it has
        self.run_hi_w = math.nan

    def fit(self) -> tuple[float, float]:
        """(gain, offset W): the PCC plus the battery as a line in the rack sum; (1, 0) before any sample."""
        w, sx, sy, sxx, sxy = self.sums
        if w <= 0:
            return 1.0, 0.0
        mx, my = sx / w, sy / w
        var = max(sxx / w - mx * mx, 0.0)
        cov = sxy / w - mx * my
        gain = clip_float((cov + self.prior) / (var + self.prior), 0.5, 2.0)
        return gain, (my - gain * mx) * self.scale_w

    def update(
        self,
        pcc_w: float,
        pcc_fresh: bool,
        rack_sum_w: float,
        bess_w: float,
        unknown_w: float,
        limit_w: float,
        dt_s: float,
    ) -> PccVerdict:
        """One period: the meter (`pcc_fresh` False when it is NaN or stale), the racks' supply-side sum (stale racks
        at their last value), the battery's discharge, the most the stale racks may be off by (`unknown_w`), the
        interconnect limit in force. Returns what to plan on."""
        base_tol = self.tol_frac * (limit_w if math.isfinite(limit_w) and limit_w > 0 else self.scale_w)
        learnable = unknown_w <= 0.5 * base_tol  # the racks' picture is near complete
        # The import carries every rack and what no rack meter sees, less the battery and any generation behind the
        # meter: it is never less than the racks' sum less that generation (within the tolerance). A meter under that
        # is no fit to learn, even at its first reading: one that read half from its start (a wrong CT ratio) was
        # taken as healthy, its -50 % "overhead" learned, and a curtailment to half the racks' draw then found
        # nothing to cut (the stateful property at its long profile).
        racks_floor_w = rack_sum_w - self.generation_w - base_tol
        plausible = pcc_fresh and math.isfinite(pcc_w) and pcc_w + bess_w >= racks_floor_w
        if self.sums[0] <= 0 and learnable and plausible and math.isfinite(rack_sum_w):
            self._learn(pcc_w + bess_w, rack_sum_w, pcc_w + bess_w, 0.0, dt_s)  # taken as healthy at start
        gain, offset_w = self.fit()
        estimate = max(gain * rack_sum_w + offset_w, racks_floor_w) - bess_w
        # Readings taken over slightly different windows disagree by up to one period's movement of what they measure.
        moved = abs(rack_sum_w - self.last_rack_w) + abs(bess_w - self.last_bess_w)
        tol = base_tol + (moved if math.isfinite(moved) else 0.0) + unknown_w
        self.last_rack_w, self.last_bess_w = rack_sum_w, bess_w
        if not (pcc_fresh and math.isfinite(pcc_w)):
            self.flagged = ""
            self.repeat_s = 0.0
            return PccVerdict(MISSING, estimate, estimate, tol)

        stuck = self._stuck(pcc_w, estimate, dt_s, base_tol)
        diff = pcc_w - estimate
        if abs(diff) > (0.5 * tol if self.flagged else tol):
            self.flagged = LOW if diff < 0 else HIGH
        else:
            self.flagged = ""
        if not stuck and learnable and (self.sums[0] > 0 or plausible):  # (no start from an implausible reading)
            self._learn(pcc_w + bess_w, rack_sum_w, gain * rack_sum_w + offset_w, 0.5 * base_tol, dt_s)
        if stuck:
            return PccVerdict(STUCK, estimate, estimate, tol)
        if self.flagged == LOW:
            return PccVerdict(LOW, estimate, estimate, tol)  # the larger of the two: the safe side
        if self.flagged == HIGH:
            # (the band's top without the period's movement: that keeps a live meter from being flagged, and read as
            # load, up to ~1 MW on a 2 s swing read at 1 s, a spike cut spike-tight's fine-tuning job to 283 W)
            return PccVerdict(HIGH, min(pcc_w, estimate + base_tol + unknown_w), estimate, tol)
        return PccVerdict(OK, pcc_w, estimate, tol)

    def _stuck(self, pcc_w: float, estimate_w: float, dt_s: float, base_tol_w: float) -> bool:
        """A reading repeated exactly for `stuck_s` while the estimate moved by more than half the base tolerance.

        A live meter on a campus whose racks move does not repeat to the bit; a frozen register does. Tracking the
        estimate (racks less battery), not the rack sum, keeps a battery that cancels a rack move from looking stuck.
        """
        if pcc_w == self.last_pcc_w:
            self.repeat_s += dt_s
            self.run_lo_w = min(self.run_lo_w, estimate_w)
            self.run_hi_w = max(self.run_hi_w, estimate_w)
        else:
            self.repeat_s = 0.0
            self.run_lo_w = self.run_hi_w = estimate_w
        self.last_pcc_w = pcc_w
        return self.repeat_s >= self.stuck_s and self.run_hi_w - self.run_lo_w > 0.5 * base_tol_w

    def _learn(self, y_w: float, x_w: float, predicted_w: float, pull_w: float, dt_s: float) -> None:
        """Fold one sample into the fit, its distance from the line bounded by `pull_w`.

        The first sample counts as `start_weight_s` of them: the fit starts from the residual it finds (the meter is
        taken as healthy at start) and from then on moves slowly, rather than averaging the first few minutes
        equally with whatever a fault beginning in them does.
        """
        if self.sums[0] > 0:
            y_w = predicted_w + clip_float(y_w - predicted_w, -pull_w, pull_w)
        x, y = x_w / self.scale_w, y_w / self.scale_w
        sample = np.array([1.0, x, y, x * x, x * y])
        if self.sums[0] <= 0:
            self.sums = sample * self.start_weight_s
            return
        sample *= dt_s
        keep = math.exp(-dt_s / self.learn_tau_s)
        self.sums = self.sums * keep + sample
