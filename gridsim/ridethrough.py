"""The PCC voltage tick by tick, the site's partial UPS transfer, and the ride-through it is judged against.

`VoltagePlant` is what the engine holds (docs/models.md, "Voltage at the PCC and ride-through"). Each tick, after
the grid import is known: the PCC voltage from the Thevenin source (gridsim.plant.voltage), the UPS's tolerance clock
and the requirement's clock. When the voltage leaves the UPS tolerance, the share of each building's load behind
it leaves the grid and runs on its racks' BBUs from the next tick (`bbu_commands` lowers their thresholds to carry
it); it comes back, at once, once the voltage has been at or above `return_pu` for `return_delay_s`. A transfer
while the voltage is still inside the ride-through curve is a violation: the site dropped load it had to keep.

A site with no source impedance, no dip and no UPS share builds an inactive plant: the engine does nothing per tick
and the summary reports the source voltage (an infinite bus), so existing scenarios run exactly as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dimmer.site import SiteModel
from dimmer.siteconfig import LEVEL_ORDER
from gridsim.plant.voltage import (
    CurveClock,
    RideThroughSpec,
    SourceSpec,
    UpsSpec,
    VoltageDipEvent,
    impedance_pu,
    source_schedule,
)

FloatArray = npt.NDArray[np.float64]


@dataclass
class Transfer:
    """One UPS transfer: when, the load that left the grid (W), and whether the requirement allowed it."""

    t_s: float
    load_w: float
    inside_curve: bool  # the voltage was still inside the ride-through curve: a violation
    return_s: float = math.nan


@dataclass
class VoltageRecord:
    """What the run leaves for the metrics: the PCC voltage at every tick (None: an infinite bus at v_const_pu)."""

    v_pu: FloatArray | None
    v_const_pu: float
    band_pu: tuple[float, float]
    transfers: list[Transfer] = field(default_factory=list)
    required_s: float = 0.0  # the longest excursion the ride-through curve asks the site to ride through


def unit_racks(site: SiteModel) -> tuple[npt.NDArray[np.int64], int]:
    """Each rack's building (index among the buildings), and how many there are; the whole site is one building
    when the tree has no building level."""
    b = np.flatnonzero(site.domain_level == LEVEL_ORDER.index("building"))
    rack_unit = np.zeros(site.n_racks, dtype=np.int64)
    for i, d in enumerate(b):
        rack_unit[site.domain_rack_start[d] : site.domain_rack_stop[d]] = i
    return rack_unit, max(int(b.size), 1)


class VoltagePlant:
    def __init__(
        self,
        site: SiteModel,
        source: SourceSpec,
        ride: RideThroughSpec,
        ups: UpsSpec,
        dips: list[VoltageDipEvent],
        n_ticks: int,
        dt_s: float,
    ) -> None:
        rack_unit, n_units = unit_racks(site)
        shares = ups.share_frac if isinstance(ups.share_frac, list) else [ups.share_frac] * n_units
        if len(shares) != n_units:
            raise ValueError(f"ups.share_frac: {n_units} shares, one per building (got {len(shares)})")
        self.rack_share: FloatArray = np.asarray(shares, dtype=np.float64)[rack_unit]
        self.behind_ups = self.rack_share > 0
        self.has_ups = bool(self.behind_ups.any())
        sc_mva = math.inf if source.sc_mva is None else source.sc_mva
        self.active = math.isfinite(sc_mva) or bool(dips) or self.has_ups or source.v_source_pu != 1.0
        self.source, self.ups = source, ups
        self.r_pu, self.x_pu = impedance_pu(source.x_over_r)
        self.tan_phi = math.tan(math.acos(source.power_factor))
        self.s_base_w = sc_mva * 1e6
        self.ups_clock = CurveClock(ups.tolerance)
        self.ride_clock = CurveClock(ride.curve)
        self.v_s = source_schedule(source.v_source_pu, dips, n_ticks, dt_s) if self.active else None
        self.v = np.full(n_ticks, source.v_source_pu) if self.active else None
        self.on_backup = False
        self._above_s = 0.0
        self.transfers: list[Transfer] = []

    def bbu_commands(self, threshold_w: FloatArray, recharge_w: FloatArray, rack_w: FloatArray) -> tuple[
        FloatArray, FloatArray]:  # fmt: skip
        """The BBU thresholds and recharge limits as the racks' power shelves apply them: on backup, the share
        behind the UPS is carried by the BBU (threshold at most (1 - share) of the rack) and nothing recharges."""
        if not self.on_backup:
            return threshold_w, recharge_w
        m = self.behind_ups
        carried = np.minimum(threshold_w, (1.0 - self.rack_share) * rack_w)
        return np.where(m, carried, threshold_w), np.where(m, 0.0, recharge_w)

    def voltage_pu(self, k: int, grid_w: float, campus_w: float) -> float:
        """The PCC voltage at tick k for this import (the rectifiers' reactive power from the load on the grid)."""
        assert self.v_s is not None
        vs = float(self.v_s[k])
        if not math.isfinite(self.s_base_w):
            return vs
        p = grid_w / self.s_base_w
        q = self.tan_phi * campus_w / self.s_base_w if grid_w != 0.0 else 0.0  # a scripted island draws nothing
        a = self.r_pu * p + self.x_pu * q
        b = self.x_pu * p - self.r_pu * q
        c = vs * vs - 2.0 * a
        disc = max(c * c - 4.0 * (a * a + b * b), 0.0)
        return math.sqrt(max(0.5 * (c + math.sqrt(disc)), 0.0))

    def step(self, k: int, t_s: float, dt_s: float, grid_w: float, campus_w: float, rack_w: FloatArray) -> None:
        """After the tick's import: the PCC voltage, the requirement's clock, the UPS's decision for the next tick."""
        assert self.v is not None
        v = self.voltage_pu(k, grid_w, campus_w)
        self.v[k] = v
        outside_curve = self.ride_clock.step(v, dt_s)
        if not self.has_ups:
            return
        if not self.on_backup:
            if self.ups_clock.step(v, dt_s):
                self.on_backup = True
                self._above_s = 0.0
                lost = float(np.add.reduce(self.rack_share * rack_w))
                self.transfers.append(Transfer(t_s, lost, inside_curve=not outside_curve))
            return
        self._above_s = self._above_s + dt_s if v >= self.ups.return_pu else 0.0
        if self._above_s >= self.ups.return_delay_s - 1e-9:
            self.on_backup = False
            self.ups_clock.below_s[:] = 0.0
            self.transfers[-1].return_s = t_s

    def observed(self, k: int) -> float:
        """The PCC voltage a meter reads at tick k (NaN where the voltage is not modelled)."""
        return float(self.v[k]) if self.v is not None and k >= 0 else math.nan

    def record(self) -> VoltageRecord:
        s = self.source
        return VoltageRecord(
            self.v, s.v_source_pu, (s.band_lo_pu, s.band_hi_pu), self.transfers, self.ride_clock.required_s()
        )


def voltage_summary(rec: VoltageRecord | None, dt_s: float, n_ticks: int) -> dict[str, float | int]:
    """The summary's voltage keys (docs/models.md, "Metrics"): the lowest PCC voltage, the seconds outside the band,
    the largest load one transfer took off the grid, and the transfers the ride-through curve did not allow."""
    if rec is None:
        return {"min_voltage_pu": 1.0, "voltage_violation_s": 0.0, "load_lost_mw": 0.0, "ride_through_violations": 0}
    lo, hi = rec.band_pu
    if rec.v_pu is None:
        v_min = rec.v_const_pu
        outside_s = n_ticks * dt_s if not (lo <= v_min <= hi) else 0.0
    else:
        v_min = float(rec.v_pu.min()) if rec.v_pu.size else rec.v_const_pu
        outside_s = float(np.count_nonzero((rec.v_pu < lo) | (rec.v_pu > hi))) * dt_s
    return {
        "min_voltage_pu": v_min,
        "voltage_violation_s": outside_s,
        "load_lost_mw": max((tr.load_w for tr in rec.transfers), default=0.0) / 1e6,
        "ride_through_violations": sum(1 for tr in rec.transfers if tr.inside_curve),
    }
