"""Storage at three levels: capacitor trays and BBUs in every rack, and the campus battery (BESS).

Sign and energy conventions (see docs/models.md):
- Every `step` returns the power on the grid side of the store (W): the rack's draw from upstream, or for the
  BESS the power it delivers to the campus bus (+ discharge, - charge).
- `energy_in_j` is grid-side energy taken in while charging, `energy_out_j` grid-side energy delivered while
  discharging (both totals over all racks, J). A store with round-trip efficiency eta charges and discharges
  through sqrt(eta) each way, so stored_now - stored_0 = energy_in * sqrt(eta) - energy_out / sqrt(eta) and
  loss_j = energy_in - energy_out - (stored_now - stored_0) >= 0.
- Capacitor trays are lossless (assumption: supercapacitor / bulk-capacitor round trip is > 95 % and their
  energy is tiny next to the rack's; no public figure).
"""

from __future__ import annotations

import math

import numpy as np

from dimmer.site import BoolArray, FloatArray, SiteModel


def _decay(dt_s: float, tau_s: float) -> float:
    """exp(-dt/tau): the fraction of a first-order lag's error left after dt (0 for tau = 0)."""
    return math.exp(-dt_s / tau_s) if tau_s > 0.0 else 0.0


class CapacitorTrays:
    """Capacitor trays in each rack's power shelves: sub-second ripple smoothing (GB300: ~65 J per GPU).

    The upstream target is a first-order low-pass of the rack's load (time constant `smoothing_tau_s`) plus
    a slow pull toward half charge, (E_half - E) / recenter_tau_s, so the tray never drifts onto a rail. The
    tray supplies (or absorbs) the difference within its power limit, its energy [0, E_max] and never more
    than the rack's own load (a tray never back-feeds the grid). Lossless (assumption).
    """

    def __init__(self, site: SiteModel, smoothing_tau_s: float = 0.2, recenter_tau_s: float | None = None) -> None:
        """`recenter_tau_s` None: the site's trays' refill time (`RackStorageRatings.tray_refill_s`), which the
        controller counts the refill on."""
        rs = site.rack_storage
        if recenter_tau_s is None:
            recenter_tau_s = rs.tray_refill_s
        if not (smoothing_tau_s >= 0.0 and recenter_tau_s > 0.0):
            raise ValueError("smoothing_tau_s must be >= 0 and recenter_tau_s > 0")
        self.smoothing_tau_s = float(smoothing_tau_s)
        self.recenter_tau_s = float(recenter_tau_s)
        self.energy_max_j: FloatArray = rs.tray_energy_j.astype(np.float64, copy=True)
        self.power_max_w: FloatArray = rs.tray_power_w.astype(np.float64, copy=True)
        self._neg_power_w: FloatArray = -self.power_max_w
        self._half_j: FloatArray = 0.5 * self.energy_max_j
        self.energy_j: FloatArray = self._half_j.copy()  # starts at half charge
        self.energy_0_j = float(self.energy_j.sum())
        self.energy_in_j = 0.0  # absorbed from the rack's supply while charging (total, J)
        self.energy_out_j = 0.0  # supplied to the rack while discharging (total, J)
        self.power_w: FloatArray = np.zeros_like(self.energy_j)  # + supplying the rack, - absorbing
        self.upstream_w: FloatArray = np.zeros_like(self.energy_j)
        self._lp_w: FloatArray = np.zeros_like(self.energy_j)
        self._primed = False  # the low-pass starts at the first load it sees (the plant starts settled)
        self._dt_s = math.nan
        self._decay = 0.0
        self._tmp: FloatArray = np.zeros_like(self.energy_j)

    def set_power_max_w(self, power_w: FloatArray) -> None:
        """Change each tray's power limit (0 disables a tray: a fault)."""
        self.power_max_w[:] = power_w
        np.negative(self.power_max_w, out=self._neg_power_w)

    def step(self, dt_s: float, rack_w: FloatArray, energized: BoolArray | None = None) -> FloatArray:
        """Advance by dt_s with the rack loads `rack_w` (W); return each rack's draw from upstream (W).

        Where `energized` is False (a tripped breaker above the rack) the tray holds its charge, the rack
        draws 0 from upstream and the low-pass restarts from 0 (the rack comes back from an outage).
        """
        self.step_ticks(dt_s, rack_w[np.newaxis], energized)
        return self.upstream_w

    def step_ticks(self, dt_s: float, rack_w: FloatArray, energized: BoolArray | None = None) -> FloatArray:
        """`step` over ticks of dt_s with the loads `rack_w` (n_ticks, n_racks); returns each tick's upstream draw
        (n_ticks, n_racks), a new array.

        Tick by tick, what carries over (the low-pass, the charge) takes the same operations as a step at a time;
        what does not (the energy totals, the upstream draw) is computed for all the ticks at once, row by row with
        the same operations, so n ticks here and n calls of `step` leave the same numbers to the bit.
        """
        if dt_s != self._dt_s:
            self._dt_s = dt_s
            self._decay = _decay(dt_s, self.smoothing_tau_s)
        lp = self._lp_w
        tmp = self._tmp
        e = self.energy_j
        inv_dt = 1.0 / dt_s
        lp_gain = 1.0 - self._decay
        recenter = 1.0 / self.recenter_tau_s
        power = np.empty_like(rack_w)
        # discharge never exceeds the tray's power or the rack's own load (no back-feed): min(power, max(rack, 0)),
        # for every tick at once (a minimum of three is the same number whichever two are taken first)
        discharge_max = np.maximum(rack_w, 0.0)
        np.minimum(discharge_max, self.power_max_w, out=discharge_max)
        for i in range(rack_w.shape[0]):
            rack = rack_w[i]
            if self._primed:  # exact step of the low-pass for a load held over dt
                np.subtract(rack, lp, out=tmp)
                tmp *= lp_gain
                lp += tmp
            else:
                np.copyto(lp, rack)
                self._primed = True
            if energized is not None:
                lp *= energized
            # what the tray must supply for the upstream to see lp + (E_half - E) / tau_r
            p = power[i]
            np.subtract(e, self._half_j, out=tmp)
            tmp *= recenter
            np.add(tmp, rack, out=p)
            p -= lp
            # discharge: within power, the energy held and the rack's own load (no back-feed)
            np.multiply(e, inv_dt, out=tmp)
            np.minimum(tmp, discharge_max[i], out=tmp)
            np.minimum(p, tmp, out=p)
            # charge: within power and the room left
            np.subtract(e, self.energy_max_j, out=tmp)
            tmp *= inv_dt
            np.maximum(tmp, self._neg_power_w, out=tmp)
            np.maximum(p, tmp, out=p)
            if energized is not None:
                p *= energized
            np.multiply(p, dt_s, out=tmp)
            e -= tmp
            np.maximum(e, 0.0, out=e)  # rounding only
            np.minimum(e, self.energy_max_j, out=e)
        # the energy totals in the ticks' order, each tick's sum over racks as np.add.reduce sums the tick's row
        moved_j = power * dt_s
        sum_j = np.add.reduce(moved_j, axis=1).tolist()
        np.maximum(moved_j, 0.0, out=moved_j)
        out_j = np.add.reduce(moved_j, axis=1).tolist()
        for s_j, o_j in zip(sum_j, out_j, strict=True):
            self.energy_out_j += o_j
            self.energy_in_j += o_j - s_j
        up = np.subtract(rack_w, power, out=moved_j)
        if energized is not None:
            up *= energized
        np.copyto(self.power_w, power[-1])
        np.copyto(self.upstream_w, up[-1])
        return up


class RackBbus:
    """ORv3 rack BBU shelves: shave each rack's draw to a threshold, recharge below it (OCP ORv3; MICRO 2020).

    discharge = clip(rack - threshold, 0, power), limited by the energy above soc_min;
    recharge (only when rack < threshold) = min(recharge_w, the shelf's rated recharge, threshold - rack, power, room
    below soc_max).
    threshold = inf makes the BBU backup only: it never discharges and recharges at recharge_w whenever below
    soc_max (uncoordinated recharge). Charge and discharge efficiency are both sqrt(round_trip_eff).
    """

    def __init__(self, site: SiteModel) -> None:
        rs = site.rack_storage
        self.power_max_w: FloatArray = rs.bbu_power_w.astype(np.float64, copy=True)
        # the shelf's charger rating: a controller may ask for less, never for more
        self.recharge_max_w: FloatArray = np.minimum(rs.bbu_recharge_w, rs.bbu_power_w).astype(np.float64)
        self.capacity_j: FloatArray = rs.bbu_energy_j.astype(np.float64, copy=True)
        self.round_trip_eff = float(rs.bbu_round_trip_eff)
        self.soc_min_frac = float(rs.bbu_soc_min_frac)
        self.soc_max_frac = float(rs.bbu_soc_max_frac)
        self._eff = math.sqrt(self.round_trip_eff)
        self._min_j: FloatArray = self.soc_min_frac * self.capacity_j
        self._max_j: FloatArray = self.soc_max_frac * self.capacity_j
        self._has_capacity: BoolArray = self.capacity_j > 0.0
        self.stored_j: FloatArray = self._max_j.copy()  # starts full (soc_max)
        self.stored_0_j = float(self.stored_j.sum())
        self.discharge_w: FloatArray = np.zeros_like(self.capacity_j)  # delivered to the rack (grid side)
        self.recharge_w: FloatArray = np.zeros_like(self.capacity_j)  # taken from the supply (grid side)
        self.upstream_w: FloatArray = np.zeros_like(self.capacity_j)
        self.energy_in_j = 0.0
        self.energy_out_j = 0.0
        self._tmp: FloatArray = np.zeros_like(self.capacity_j)
        self._eq: BoolArray = np.zeros(self.capacity_j.shape, dtype=bool)
        # True when the last step found every BBU full with no threshold set (backup only): nothing moved, so
        # stored_j, discharge_w and recharge_w are as they were (the latter two all 0)
        self.idle = False

    @property
    def soc_frac(self) -> FloatArray:
        """(n_racks,) state of charge; a BBU with no capacity reports soc_max (it is absent, not empty)."""
        soc = np.full_like(self.capacity_j, self.soc_max_frac)
        np.divide(self.stored_j, self.capacity_j, out=soc, where=self._has_capacity)
        out: FloatArray = np.clip(soc, self.soc_min_frac, self.soc_max_frac)  # rounding only
        return out

    @property
    def loss_j(self) -> float:
        return self.energy_in_j - self.energy_out_j - (float(self.stored_j.sum()) - self.stored_0_j)

    def _all_idle(self, rack_w: FloatArray, threshold_w: FloatArray, recharge_w: FloatArray) -> bool:
        """Every BBU backup only (threshold +inf), full (stored at soc_max), with finite loads and recharge limits:
        a step that moves nothing. Four reductions, against some twenty operations for a step."""
        if float(np.minimum.reduce(threshold_w, initial=math.inf)) != math.inf:
            return False
        if math.isnan(float(np.minimum.reduce(recharge_w, initial=math.inf))):
            return False
        if not math.isfinite(float(np.add.reduce(rack_w))):
            return False
        np.equal(self.stored_j, self._max_j, out=self._eq)
        return bool(np.logical_and.reduce(self._eq))

    def step(
        self,
        dt_s: float,
        rack_w: FloatArray,
        threshold_w: FloatArray,
        recharge_w: FloatArray,
        energized: BoolArray,
    ) -> FloatArray:
        """Advance by dt_s; return each rack's draw from the grid side (W): rack - discharge + recharge,
        0 where not energized (the BBU neither charges nor discharges there)."""
        if self._all_idle(rack_w, threshold_w, recharge_w):
            # Backup only and full: the steps below would discharge 0 (rack - inf < 0), recharge 0 (no room) and
            # leave stored_j as it is; the upstream is rack + 0 (which turns a -0.0 into 0.0, as they do).
            if not self.idle:
                self.discharge_w.fill(0.0)
                self.recharge_w.fill(0.0)
                self.idle = True
            up = self.upstream_w
            np.add(rack_w, 0.0, out=up)
            up *= energized
            return up
        self.idle = False
        eff = self._eff
        dis = self.discharge_w
        rec = self.recharge_w
        tmp = self._tmp
        st = self.stored_j
        # discharge = rack - max(threshold, 0) (never more than the rack's own load), within power and the
        # energy above soc_min (grid-side watts over this dt)
        np.maximum(threshold_w, 0.0, out=dis)
        np.subtract(rack_w, dis, out=dis)
        np.minimum(dis, self.power_max_w, out=dis)
        np.subtract(st, self._min_j, out=tmp)
        tmp *= eff / dt_s
        np.minimum(dis, tmp, out=dis)
        np.maximum(dis, 0.0, out=dis)
        dis *= energized
        # recharge = threshold - rack, within recharge_w, power and the room below soc_max
        np.subtract(threshold_w, rack_w, out=rec)
        np.minimum(rec, recharge_w, out=rec)
        np.minimum(rec, self.recharge_max_w, out=rec)
        np.subtract(self._max_j, st, out=tmp)
        tmp *= 1.0 / (eff * dt_s)
        np.minimum(rec, tmp, out=rec)
        np.maximum(rec, 0.0, out=rec)
        rec *= energized
        # stored energy: + recharge * eff - discharge / eff, kept in its window (the clip absorbs rounding)
        np.multiply(rec, eff * dt_s, out=tmp)
        st += tmp
        np.multiply(dis, dt_s / eff, out=tmp)
        st -= tmp
        np.maximum(st, self._min_j, out=st)
        np.minimum(st, self._max_j, out=st)
        self.energy_in_j += float(np.add.reduce(rec)) * dt_s
        self.energy_out_j += float(np.add.reduce(dis)) * dt_s
        up = self.upstream_w
        np.subtract(rack_w, dis, out=up)
        up += rec
        up *= energized
        return up


class CampusBess:
    """The campus battery: first-order response to a setpoint (+ discharge into the campus, - charge).

    p <- p + (sp - p)(1 - exp(-dt/response_tau_s)) with sp clipped to +-power, then p clipped to what the SoC
    window [soc_min, soc_max] allows within dt. Charge and discharge efficiency are both sqrt(round_trip_eff).
    """

    def __init__(self, site: SiteModel) -> None:
        b = site.bess
        self.power_max_w = float(b.power_w)
        self.capacity_j = float(b.energy_j)
        self.round_trip_eff = float(b.round_trip_eff)
        self.soc_min_frac = float(b.soc_min_frac)
        self.soc_max_frac = float(b.soc_max_frac)
        self.response_tau_s = float(b.response_tau_s)
        self._eff = math.sqrt(self.round_trip_eff)
        self._min_j = self.soc_min_frac * self.capacity_j
        self._max_j = self.soc_max_frac * self.capacity_j
        self.stored_j = float(b.soc_init_frac) * self.capacity_j
        self.stored_0_j = self.stored_j
        self._soc_init_frac = float(b.soc_init_frac)
        self.power_w = 0.0
        self.online = True
        self.energy_in_j = 0.0
        self.energy_out_j = 0.0
        self._dt_s = math.nan
        self._decay = 0.0

    @property
    def soc_frac(self) -> float:
        if self.capacity_j <= 0.0:
            return self._soc_init_frac
        return min(max(self.stored_j / self.capacity_j, self.soc_min_frac), self.soc_max_frac)  # rounding only

    @property
    def loss_j(self) -> float:
        return self.energy_in_j - self.energy_out_j - (self.stored_j - self.stored_0_j)

    def equivalent_cycles(self) -> float:
        """Energy discharged from the store divided by the usable capacity (soc_max - soc_min) * energy."""
        usable_j = self._max_j - self._min_j
        return self.energy_out_j / self._eff / usable_j if usable_j > 0.0 else 0.0

    def step(self, dt_s: float, setpoint_w: float) -> float:
        """Advance by dt_s toward `setpoint_w`; return the power delivered to the campus (W, + discharge)."""
        if not self.online:
            self.power_w = 0.0
            return 0.0
        if dt_s != self._dt_s:
            self._dt_s = dt_s
            self._decay = _decay(dt_s, self.response_tau_s)
        pmax = self.power_max_w
        sp = min(max(setpoint_w, -pmax), pmax) if setpoint_w == setpoint_w else 0.0  # NaN: hold idle
        p = sp + (self.power_w - sp) * self._decay
        eff = self._eff
        s = self.stored_j
        if p > 0.0:
            p = min(p, (s - self._min_j) * eff / dt_s)
            p = max(p, 0.0)
            s -= p * dt_s / eff
            self.energy_out_j += p * dt_s
        elif p < 0.0:
            p = max(p, -(self._max_j - s) / (eff * dt_s))
            p = min(p, 0.0)
            s -= p * dt_s * eff
            self.energy_in_j -= p * dt_s
        self.stored_j = min(max(s, self._min_j), self._max_j)
        self.power_w = p
        return p
