"""The racks' peak readings: the highest sample of each window, where the racks report it (docs/controller.md).

A window mean hides a swing's peak, so the controller counts a job rack `hidden_peak_frac` above its highest mean.
A rack that reports the highest sample of its window (`Observation.rack_load_peak_w`: NVML's power samples on the
host agent, a power shelf's peak-demand register) shows the peak itself, once a reading holds both of the swing's
phases: its peak above its own mean, or above the window's least mean (a swing slower than the window), by more
than `flat_frac`; and for `hold_full_s` after, as the controller's peak hold keeps it, while its readings come.
Until then (a first reading, a slow swing seen only in its trough, a flat rack) only the prior is known. A peak
reading under its own window's mean is none (a device that leaves the register at 0).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class PeakReadings:
    """Per rack: this period's peak reading (`now_w`, NaN where none), the peaks held as the means are (`held_w`),
    and which racks' readings show their swing's peak (`update`'s result)."""

    def __init__(self, n_racks: int, flat_frac: float, hold_full_s: float) -> None:
        self.flat_frac = flat_frac
        self.hold_full_s = hold_full_s
        self.swing_seen_s = np.full(n_racks, -math.inf)  # when a peak reading last showed each rack's swing
        self.now_w = np.full(n_racks, np.nan)
        self.held_w = np.full(n_racks, np.nan)

    def update(
        self, peak_in_w: FloatArray | None, t_s: float, load_ok: BoolArray, load_w: FloatArray, trough_w: FloatArray
    ) -> BoolArray:
        """Take this period's peak readings (None: the racks report none); which racks' readings show their swing.

        `load_w` is this period's mean reading (NaN where not trusted, with `load_ok`), `trough_w` the least mean of
        the window the controller holds."""
        if peak_in_w is None:
            self.now_w = np.full(self.now_w.shape, np.nan)
            return np.zeros(self.now_w.shape, dtype=bool)
        with np.errstate(invalid="ignore"):
            ok = load_ok & np.isfinite(peak_in_w) & (peak_in_w >= load_w * (1.0 - self.flat_frac))
        self.now_w = np.where(ok, np.fmax(peak_in_w, load_w), np.nan)
        showed = ok & (self.now_w > (1.0 + self.flat_frac) * np.fmin(load_w, trough_w))
        self.swing_seen_s = np.where(showed, t_s, self.swing_seen_s)
        # (and only while the readings come: a rack whose agent is down shows nothing of what it draws now)
        seen: BoolArray = ok & (t_s - self.swing_seen_s <= self.hold_full_s)
        return seen

    def hold(self, decay: float | FloatArray) -> None:
        """Hold the peaks as the controller holds its means: decayed by `decay` a period, raised by a new reading."""
        self.held_w = np.fmax(self.now_w, self.held_w * decay)
