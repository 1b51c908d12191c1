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
