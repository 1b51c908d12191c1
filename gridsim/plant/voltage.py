"""Voltage at the point of connection: a Thevenin source, voltage dips, and the site's UPS transfer (docs/models.md).

The grid behind the PCC is a source V_s (per unit, dipping during a `voltage_dip` event) behind an impedance
Z = R + jX. On the base S_sc (the short-circuit power at the PCC) |Z| = 1 pu, so R = 1/sqrt(1 + (X/R)^2) and
X = (X/R)·R. The campus draws P + jQ (Q = P_load·tan φ at the rectifiers' power factor); with the PCC voltage V as
the angle reference, V_s = V + Z·(P − jQ)/V, and |V_s|² V² = (V² + a)² + b² with a = RP + XQ, b = XP − RQ:

    V² = ( V_s² − 2a + sqrt((V_s² − 2a)² − 4(a² + b²)) ) / 2            (the high-voltage root)

Past the nose of the P–V curve (negative discriminant) the voltage has collapsed; the model reports the nose
voltage sqrt((V_s² − 2a)/2) there (the load cannot draw more: a bound, not a dynamic). An infinite bus (sc_mva left
out) gives V = V_s.

Tolerance and requirement curves share one form: a list of (voltage_pu, duration_s) points, read as "the voltage may
stay below voltage_pu for at most duration_s in one excursion". `CurveClock` keeps, per point, how long the voltage
has been below it, and says when the curve is left.
"""

from __future__ import annotations

import itertools
import math
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from dimmer.siteconfig import Strict

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

# NERC PRC-024-2, Attachment 2 (voltage ride-through time duration curve, low-voltage side), as remembered, not
# re-read from the standard: a generator must not trip for V below 0.45 pu for up to 0.15 s, below 0.65 for 0.30 s,
# below 0.75 for 2 s, below 0.90 for 3 s. ERCOT's ride-through for large electronic loads (NOGRR 282) is summarised as
# PRC-024-style (MODELS.md, secondary summaries); its own numbers are not in this repository: give them as a curve.
PRC_024_LOW_VOLTAGE = ((0.45, 0.15), (0.65, 0.30), (0.75, 2.0), (0.90, 3.0))
# The ITIC (CBEMA) curve, ITI 2000, lower side, as remembered: IT equipment tolerates 0 V for 20 ms, 70 % for
# 0.5 s, 80 % for 10 s, 90 % indefinitely.
ITIC_LOW_VOLTAGE = ((0.70, 0.02), (0.80, 0.5), (0.90, 10.0))

Curve = list[tuple[float, float]]


def _check_curve(curve: Curve) -> None:
    v = [p[0] for p in curve]
    d = [p[1] for p in curve]
    if not curve:
        raise ValueError("at least one [voltage_pu, duration_s] point")
    if any(not (0.0 < x <= 1.0) for x in v):
        raise ValueError("voltages in (0, 1] pu (the points of a low-voltage curve)")
    if any(not (0.0 <= x <= 3600.0) for x in d):
        raise ValueError("durations in [0, 3600] s")
    if any(b <= a for a, b in itertools.pairwise(v)) or any(b < a for a, b in itertools.pairwise(d)):
        raise ValueError("points in rising voltage, durations not falling (a shallower dip is tolerated longer)")


class SourceSpec(Strict):
    """`[grid.source]`: the Thevenin equivalent of the grid at the PCC, and the band the voltage should stay in."""

    sc_mva: float | None = Field(default=None, gt=0)  # short-circuit power at the PCC; left out: an infinite bus
    x_over_r: float = Field(default=10.0, ge=0, le=100)
    power_factor: float = Field(default=0.99, gt=0, le=1)  # the rectifiers' (PFC), lagging
    v_source_pu: float = Field(default=1.0, ge=0.8, le=1.2)  # before any dip (a tap changer's setting)
    band_lo_pu: float = Field(default=0.95, gt=0, le=1)
    band_hi_pu: float = Field(default=1.05, ge=1, le=2)


class RideThroughSpec(Strict):
    """`[grid.ride_through]`: what the site must ride through without dropping load (default: PRC-024-2's table)."""

    curve: list[tuple[float, float]] = Field(default_factory=lambda: [*PRC_024_LOW_VOLTAGE])

    @model_validator(mode="after")
    def _curve(self) -> RideThroughSpec:
        _check_curve(self.curve)
        return self


class UpsSpec(Strict):
    """`[ups]`: the share of each building's load behind UPS / rack BBUs that leaves the grid when the PCC voltage
    leaves its tolerance, and how it comes back. share_frac 0 (the default): no transfer is modelled."""

    share_frac: float | list[float] = 0.0  # one share for every building, or one per building
    tolerance: list[tuple[float, float]] = Field(default_factory=lambda: [*ITIC_LOW_VOLTAGE])
    return_pu: float = Field(default=0.9, gt=0, le=1.2)  # back on the grid once V has been at or above this ...
    return_delay_s: float = Field(default=5.0, ge=0, le=3600)  # ... for this long (*assumption*: retransfer delay)

    @model_validator(mode="after")
    def _check(self) -> UpsSpec:
        _check_curve(self.tolerance)
        shares = self.share_frac if isinstance(self.share_frac, list) else [self.share_frac]
        if not shares or any(not (0.0 <= s <= 1.0) for s in shares):
            raise ValueError("share_frac: a fraction in [0, 1], or a list of them, one per building")
        return self


class VoltageDipEvent(Strict):
    """A fault elsewhere replayed at the source: V_s falls by `depth_pu` (or to `voltage_pu`) for `duration_s`."""

    kind: Literal["voltage_dip"]
    at_s: float = Field(ge=0)
    duration_s: float = Field(gt=0, le=3600)
    depth_pu: float | None = Field(default=None, gt=0, le=1)
    voltage_pu: float | None = Field(default=None, ge=0, lt=1.2)

    @model_validator(mode="after")
    def _one(self) -> VoltageDipEvent:
        if (self.depth_pu is None) == (self.voltage_pu is None):
            raise ValueError("give depth_pu or voltage_pu, one of them")
        return self


def impedance_pu(x_over_r: float) -> tuple[float, float]:
    """(R, X) on the short-circuit base, |Z| = 1."""
    r = 1.0 / math.sqrt(1.0 + x_over_r * x_over_r)
    return r, x_over_r * r


def pcc_voltage_pu(
    p_pu: float | FloatArray, q_pu: float | FloatArray, v_s_pu: float | FloatArray, r_pu: float, x_pu: float
) -> FloatArray:
    """The PCC voltage magnitude (pu) for a load P + jQ (pu on S_sc) behind R + jX from a source V_s: the
    high-voltage root of V⁴ + (2a − V_s²)V² + a² + b² = 0; at the nose where the root does not exist."""
    p = np.asarray(p_pu, dtype=np.float64)
    q = np.asarray(q_pu, dtype=np.float64)
    vs2 = np.square(np.asarray(v_s_pu, dtype=np.float64))
    a = r_pu * p + x_pu * q
    b = x_pu * p - r_pu * q
    c = vs2 - 2.0 * a
    disc = np.maximum(c * c - 4.0 * (a * a + b * b), 0.0)
    out: FloatArray = np.sqrt(np.maximum(0.5 * (c + np.sqrt(disc)), 0.0))
    return out


def curve_arrays(curve: Curve) -> tuple[FloatArray, FloatArray]:
    return np.array([p[0] for p in curve]), np.array([p[1] for p in curve])


class CurveClock:
    """How long the voltage has stayed below each point of a curve; `outside` once it stayed longer than allowed."""

    def __init__(self, curve: Curve) -> None:
        self.v_pu, self.limit_s = curve_arrays(curve)
        self.below_s = np.zeros(self.v_pu.size)

    def step(self, v_pu: float, dt_s: float) -> bool:
        below = v_pu < self.v_pu
        self.below_s = np.where(below, self.below_s + dt_s, 0.0)
        return bool(np.any(self.below_s > self.limit_s + 1e-9))

    def required_s(self) -> float:
        """The longest excursion the curve allows (s): what a ride-through must be sized for."""
        return float(self.limit_s.max())


def source_schedule(v_source_pu: float, dips: list[VoltageDipEvent], n_ticks: int, dt_s: float) -> FloatArray:
    """V_s at every tick: each dip lowers it (by its depth, or to its voltage) over [at_s, at_s + duration_s)."""
    t = np.arange(n_ticks, dtype=np.float64) * dt_s
    vs = np.full(n_ticks, v_source_pu)
    for ev in dips:
        on = (t >= ev.at_s - 1e-9) & (t < ev.at_s + ev.duration_s - 1e-9)
        level = v_source_pu - ev.depth_pu if ev.depth_pu is not None else float(ev.voltage_pu or 0.0)
        vs[on] = np.minimum(vs[on], max(level, 0.0))
    return vs
