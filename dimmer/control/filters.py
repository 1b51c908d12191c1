"""Stateful, vectorised signal filters for the controller: one instance filters a whole vector at once."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


class Window:
    """The last `length` samples of a vector, with NaN samples ignored; `update` returns the peak.

    The envelope of a swinging load: it follows the peaks of recent iterations, not the instantaneous value, so a
    controller reading it does not chase the swing. `rms()` gives the root-mean-square over the same samples: what a
    thermal breaker's heating (I^2 t) responds to.
    """

    def __init__(self, n: int, length: int) -> None:
        self._buf = np.full((max(length, 1), n), np.nan)
        self._i = 0

    def update(self, x: FloatArray) -> FloatArray:
        self._buf[self._i] = x
        self._i = (self._i + 1) % self._buf.shape[0]
        return self.peak()

    def peak(self) -> FloatArray:
        valid = ~np.isnan(self._buf)
        out: FloatArray = np.where(valid.any(axis=0), np.max(np.where(valid, self._buf, -np.inf), axis=0), np.nan)
        return out

    def trough(self) -> FloatArray:
        """The least sample of the window (NaN where it holds none)."""
        valid = ~np.isnan(self._buf)
        out: FloatArray = np.where(valid.any(axis=0), np.min(np.where(valid, self._buf, np.inf), axis=0), np.nan)
        return out

    def rms(self) -> FloatArray:
        valid = ~np.isnan(self._buf)
        count = valid.sum(axis=0)
        sq = np.where(valid, self._buf, 0.0) ** 2
        out: FloatArray = np.where(count > 0, np.sqrt(sq.sum(axis=0) / np.maximum(count, 1)), np.nan)
        return out


class LowPass:
    """First-order low-pass with time constant `tau_s`; the first sample initialises it; NaN holds the last value."""

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self.value: FloatArray | None = None

    def update(self, x: FloatArray, dt_s: float) -> FloatArray:
        x = np.asarray(x, dtype=np.float64)
        if self.value is None:
            self.value = np.where(np.isnan(x), 0.0, x)
            return self.value
        a = 1.0 - math.exp(-dt_s / self.tau_s) if self.tau_s > 0 else 1.0
        self.value = np.where(np.isnan(x), self.value, self.value + a * (x - self.value))
        return self.value


def slew(
    previous: FloatArray, target: FloatArray, max_up: float | FloatArray, max_down: float | FloatArray
) -> FloatArray:
    """Move from `previous` toward `target` by at most `max_up` up and `max_down` down (both >= 0)."""
    out: FloatArray = np.clip(target, previous - max_down, previous + max_up)
    return out


def progressive_cut_w(envelope_w: FloatArray, soft_w: FloatArray, hard_w: FloatArray) -> FloatArray:
    """The dimmer's required reduction: zero below `soft_w`, growing smoothly to the hard limit, linear beyond.

    cut = (e - s)^2 / (2 (h - s))        for s < e <= h   (a gentle cut just past the soft threshold)
    cut = e - (h + s) / 2                for e > h         (the same slope as the quadratic at h: no kink)
    so the planned load e - cut never exceeds (h + s) / 2 < h, and the cut is continuous with a continuous slope.
    """
    span = np.maximum(hard_w - soft_w, 1e-9)
    over = np.maximum(envelope_w - soft_w, 0.0)
    quad = over * over / (2.0 * span)
    lin = envelope_w - 0.5 * (hard_w + soft_w)
    out: FloatArray = np.where(envelope_w > hard_w, lin, quad)
    return np.nan_to_num(out, nan=0.0)


class SwingLevel:
    """The level of a swinging load from its period readings: the mean of the last `length` readings, restarted
    from two readings in a row that no swing explains.

    A 0.3-5 s training swing read as 1 s means aliases into a wobble of the readings (a 2 s swing alternates
    full-peak and mixed windows), which a low-pass passes on, out of phase, to whatever follows it. The window mean
    rejects it. A reading beyond the band the window spans (by `tol_frac` of its span, and at least `tol_abs`) is
    held aside: if the next one lies beyond it on the same side, the level has changed — a start, a crash, a stall —
    and the window restarts from the two (a step is followed within two periods); otherwise it was the swing, and
    both join the window. `span` is the swing's span, remembered over `memory` readings. NaN holds its value.
    """

    def __init__(self, length: int, tol_frac: float = 0.25, tol_abs: float = 0.0, memory: int = 300) -> None:
        self._buf = np.full(max(length, 2), np.nan)
        self._i = 0
        self._seen = 0
        self.tol_frac, self.tol_abs = tol_frac, tol_abs
        self._decay = math.exp(-1.0 / max(memory, 1))
        self.span = 0.0
        self._pending: tuple[float, int] | None = None  # a reading held aside, and its side (+1 above, -1 below)
        self.stepped = False  # the last reading restarted the window

    def _push(self, x: float) -> None:
        self._buf[self._i] = x
        self._i = (self._i + 1) % self._buf.shape[0]
        self._seen += 1

    def update(self, x: float) -> float:
        self.stepped = False
        if math.isnan(x):
            return self.level()
        valid = self._buf[~np.isnan(self._buf)]
        side = 0
        if valid.size and not self.warming:
            lo, hi = float(valid.min()), float(valid.max())
            tol = max(self.tol_frac * (hi - lo), self.tol_abs)
            side = 1 if x > hi + tol else (-1 if x < lo - tol else 0)
        pending, self._pending = self._pending, None
        if side and pending is not None and pending[1] == side:
            self._buf[:] = np.nan
            self._push(pending[0])
            self.stepped = True
        elif side:
            self._pending = (x, side)
            if pending is not None:
                self._push(pending[0])
            return self.level()
        elif pending is not None:
            self._push(pending[0])
        self._push(x)
        valid = self._buf[~np.isnan(self._buf)]
        self.span = max(self.span * self._decay, float(valid.max() - valid.min()))
        return self.level()

    def restart(self) -> None:
        """Forget every reading: the level is learned afresh (the span is kept)."""
        self._buf[:] = np.nan
        self._i, self._seen, self._pending = 0, 0, None

    @property
    def warming(self) -> bool:
        """Fewer readings than the window holds: the level is still being learned."""
        return self._seen < self._buf.shape[0]

    @property
    def count(self) -> int:
        """How many readings the level is the mean of (fewer than the window while warming or after a restart)."""
        return int(np.count_nonzero(~np.isnan(self._buf)))

    def level(self) -> float:
        valid = self._buf[~np.isnan(self._buf)]
        return float(valid.mean()) if valid.size else math.nan
