"""Storage wear: depth-weighted rainflow cycles of every rack BBU's state of charge, and its ride-through.

A cycle's wear depends on its depth: Xu et al., "Modeling of Lithium-Ion Battery Degradation for Cell Life
Assessment", IEEE Trans. Smart Grid 9(2), 2018, give the cycle-depth stress of a cycle of depth d (a fraction of
the usable window) as

    Phi(d) = (k1 * d**k2 + k3) ** -1,   k1 = 1.40e5, k2 = -0.501, k3 = -1.23e5   (their LMO cell fit),

so one cycle of depth d weighs Phi(d) / Phi(1) full cycles: a 1 % cycle 0.013, a 10 % cycle 0.053, a 50 % cycle
0.23 of a full one (a shallow cycle costs more than its depth, a deep one less). Cycles are counted with
rainflow counting (ASTM E1049-85, the `rainflow` package), half cycles at half weight.

The counting needs each BBU's SoC turning points only, so the engine keeps those (`SocTurningPoints`, vectorised
over racks, one comparison a period) instead of every rack's SoC series: reversals smaller than `hysteresis_frac`
of the window are not kept (a 0.01 % cycle weighs 0.0012 of a full one).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import rainflow

from dimmer.wear import DAY_S, SOC_TURN_HYSTERESIS, XU_K1, XU_K2, XU_K3, depth_weight

FloatArray = npt.NDArray[np.float64]

__all__ = ["DAY_S", "XU_K1", "XU_K2", "XU_K3", "SocTurningPoints", "depth_weight", "equivalent_cycles"]


def equivalent_cycles(soc_frac: npt.ArrayLike, window_frac: float = 1.0) -> float:
    """Depth-weighted rainflow cycles of one SoC series; depths as a share of a window of `window_frac` SoC."""
    x = np.asarray(soc_frac, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size < 2 or window_frac <= 0:
        return 0.0
    if x.size == 2:  # one run with no turn: half a cycle (rainflow counts nothing for two points)
        return 0.5 * float(depth_weight(abs(x[1] - x[0]) / window_frac))
    # Counted at a resolution of 1e-12 of charge: rainflow finds turns from products of successive differences, and
    # a denormal step (1e-311) underflows them to 0, which lost a whole 0.3-deep cycle as two turns at one value.
    x = np.round(x, 12)
    cycles = list(rainflow.count_cycles(x))  # (range, count), count 0.5 for a half cycle
    if not cycles:
        return 0.0
    rng, count = np.asarray(cycles, dtype=np.float64).T
    return float(np.sum(count * depth_weight(rng / window_frac)))


class SocTurningPoints:
    """The turning points of every rack's SoC, kept as they occur (vectorised over racks)."""

    def __init__(self, soc0: FloatArray, hysteresis_frac: float = SOC_TURN_HYSTERESIS) -> None:
        n = soc0.shape[0]
        self.first = soc0.astype(np.float64, copy=True)
        self.extreme = self.first.copy()  # the current candidate turning point
        self.direction = np.zeros(n, dtype=np.int8)  # +1 rising, -1 falling, 0 not yet moved
        self.h = hysteresis_frac
        self._buf = np.zeros((n, 16), dtype=np.float32)
        self.count = np.zeros(n, dtype=np.int64)

    def update(self, soc: FloatArray) -> None:
        d, ext, h = self.direction, self.extreme, self.h
        rising, falling = d > 0, d < 0
        turned = (rising & (soc <= ext - h)) | (falling & (soc >= ext + h))
        if turned.any():
            self._keep(np.flatnonzero(turned), ext[turned])
            d[turned] = -d[turned]
            ext[turned] = soc[turned]
        start = (d == 0) & (np.abs(soc - ext) >= h)
        if start.any():
            d[start] = np.where(soc[start] > ext[start], 1, -1)
        # extend the current run: a rising run keeps its highest value, a falling one its lowest
        np.copyto(ext, np.maximum(ext, soc), where=(d > 0) & ~turned)
        np.copyto(ext, np.minimum(ext, soc), where=(d < 0) & ~turned)

    def _keep(self, idx: npt.NDArray[np.int64], values: FloatArray) -> None:
        need = int(self.count[idx].max()) + 1
        if need > self._buf.shape[1]:
            grown = np.zeros((self._buf.shape[0], max(need, 2 * self._buf.shape[1])), dtype=np.float32)
            grown[:, : self._buf.shape[1]] = self._buf
            self._buf = grown
        self._buf[idx, self.count[idx]] = values
        self.count[idx] += 1

    def series(self, k: int) -> FloatArray:
        """Rack k's SoC as its turning points: the first value, every reversal, the value now."""
        kept = self._buf[k, : self.count[k]].astype(np.float64)
        return np.concatenate([[self.first[k]], kept, [self.extreme[k]]])

    def cycles_per_rack(self, window_frac: float) -> FloatArray:
        """Depth-weighted cycles of every rack (racks with the same turning points are counted once)."""
        out = np.zeros(self.first.shape[0])
        seen: dict[bytes, float] = {}
        moved = (self.count > 0) | (self.direction != 0)  # a single fall with no turn is a half cycle too
        for k in np.flatnonzero(moved):  # at the end of a run, not in a per-tick path
            s = self.series(int(k))
            key = s.tobytes()
            if key not in seen:
                seen[key] = equivalent_cycles(s, window_frac)
            out[k] = seen[key]
        return out
