"""The cycle-depth stress of Li-ion cells: what one charge-discharge cycle of a given depth costs a battery.

Xu et al., "Modeling of Lithium-Ion Battery Degradation for Cell Life Assessment", IEEE Trans. Smart Grid 9(2),
2018, fit the stress of a cycle of depth d (a fraction of the usable window) as

    Phi(d) = (k1 * d**k2 + k3) ** -1,   k1 = 1.40e5, k2 = -0.501, k3 = -1.23e5   (their LMO cell fit),

so one cycle of depth d weighs Phi(d) / Phi(1) full cycles: a 1 % cycle 0.013, a 10 % cycle 0.053, a 50 % cycle
0.23 (a shallow cycle costs more than its depth). The controller budgets its BBUs' cycles with it, and gridsim
counts the wear it caused with it (gridsim/wear.py): one curve for both.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

XU_K1, XU_K2, XU_K3 = 1.40e5, -0.501, -1.23e5
DAY_S = 86400.0
# SoC reversals smaller than this (a share of the whole charge) are not counted, by gridsim's wear metric nor by
# the controller's budget: one threshold, so the budget never misses a cycle the metric counts (a 0.01 % cycle
# weighs 0.0012 of a full one; at 2e-4 the controller had missed interruption-storm's 1-2e-4 reversals, 1.27
# depth-weighted cycles a day counted on a budget of 1)
SOC_TURN_HYSTERESIS = 1e-4


def depth_weight(depth_frac: FloatArray | float) -> FloatArray:
    """Full-cycle equivalents of one cycle of each depth (a fraction of the usable window, clipped to [0, 1])."""
    d = np.clip(np.asarray(depth_frac, dtype=np.float64), 0.0, 1.0)
    out: FloatArray = np.zeros(d.shape)
    cycled = d > 0  # (most shelves most periods: the power is worked out only where a cycle is)
    stress = XU_K1 * np.power(d[cycled], XU_K2) + XU_K3  # 1 / Phi(d)
    out[cycled] = (XU_K1 + XU_K3) / stress
    return out


def depth_for_weight(weight: FloatArray | float) -> FloatArray:
    """The deepest cycle (a fraction of the window, in [0, 1]) that weighs at most `weight` full cycles: the
    inverse of depth_weight, so a wear allowance can be spent as a depth before the cycle is made."""
    w = np.asarray(weight, dtype=np.float64)
    out: FloatArray = np.where(w >= 1.0, 1.0, 0.0)
    part = (w > 0) & (w < 1.0)  # (worked out only there: most shelves have nothing left or nothing spent)
    base = ((XU_K1 + XU_K3) / w[part] - XU_K3) / XU_K1  # = d ** XU_K2
    out[part] = np.power(base, 1.0 / XU_K2)
    return np.clip(out, 0.0, 1.0)
