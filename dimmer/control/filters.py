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
        # the samples written by `update` that hold no NaN: a window of those has its RMS in one pass, from each
        # sample's squares worked out once (a buffer written from outside, a restored state, counts as holding NaN
        # until each sample is written anew)
        self._whole = np.zeros(self._buf.shape[0], dtype=bool)
        self._sq: FloatArray | None = None  # each sample's squares, where `_sq_ok` (allocated at the first RMS)
        self._sq_ok = np.zeros(self._buf.shape[0], dtype=bool)
        # the running sums of the squares in buffer order (row j: rows 0..j), the first `_pre_ok` of them as the
        # squares now stand: a sample taken changes only the sums from its row on (`rms`)
        self._pre: FloatArray | None = None
        self._pre_ok = 0

    def update(self, x: FloatArray) -> FloatArray:
        self.push(x)
        return self.peak()

    def push(self, x: FloatArray) -> None:
        """Take a sample (`update` without the peak)."""
        self._buf[self._i] = x
        self._whole[self._i] = not np.isnan(self._buf[self._i]).any()
        self._sq_ok[self._i] = False
        self._i = (self._i + 1) % self._buf.shape[0]

    def peak_of(self, j: int) -> float:
        """`peak()[j]`, without the others."""
        return float(np.fmax.reduce(self._buf[:, j]))

    def _squares(self) -> FloatArray:
        """Every sample squared (the window written by `update` only: see `_whole`)."""
        if self._sq is None:
            self._sq = np.empty_like(self._buf)
        for r in np.flatnonzero(~self._sq_ok):
            np.square(self._buf[r], out=self._sq[r])
            self._pre_ok = min(self._pre_ok, int(r))
        self._sq_ok[:] = True
        return self._sq

    def peak(self) -> FloatArray:
        # (fmax passes over NaN and is NaN only where every sample is: one pass, no masked copies of the window)
        out: FloatArray = np.fmax.reduce(self._buf, axis=0)
        return out

    def trough(self) -> FloatArray:
        """The least sample of the window (NaN where it holds none)."""
        out: FloatArray = np.fmin.reduce(self._buf, axis=0)
        return out

    def rms_recent(self, k: int) -> FloatArray:
        """The root-mean-square over the newest `k` samples only (NaN where they hold none)."""
        k = min(max(k, 1), self._buf.shape[0])
        idx = (self._i - 1 - np.arange(k)) % self._buf.shape[0]
        if self._whole[idx].all():
            return _rms_of_squares(self._squares(), idx)
        return _rms(self._buf[idx])

    def rms(self) -> FloatArray:
        if self._whole.all():
            # (_rms_of_squares over every row in buffer order, its running sums kept: the same additions)
            sq = self._squares()
            if self._pre is None:
                self._pre = np.empty_like(sq)
            pre = self._pre
            if self._pre_ok == 0:
                pre[0] = sq[0]
                self._pre_ok = 1
            for r in range(self._pre_ok, sq.shape[0]):
                np.add(pre[r - 1], sq[r], out=pre[r])
            self._pre_ok = sq.shape[0]
            total = pre[-1] / float(sq.shape[0])
            out: FloatArray = np.sqrt(total, out=total)
            return out
        return _rms(self._buf)


def _rms_of_squares(sq: FloatArray, rows: npt.NDArray[np.intp]) -> FloatArray:
    """`_rms` of `rows` of the samples, where they hold no NaN, from their squares `sq`: the same sums, row after
    row as `sum(axis=0)` adds them, without the masks or a copy of the rows."""
    total = sq[rows[0]].copy()
    for r in rows[1:]:
        total += sq[r]
    total /= float(rows.shape[0])
    out: FloatArray = np.sqrt(total, out=total)
    return out


def _rms(rows: FloatArray) -> FloatArray:
    """Root-mean-square down the first axis, NaN samples left out (NaN where a column holds none)."""
    valid = ~np.isnan(rows)
    count = valid.sum(axis=0)
    sq = np.where(valid, rows, 0.0) ** 2
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
    if not (np.any(envelope_w > soft_w) or np.any(envelope_w > hard_w)):
        # (nothing over its soft threshold, nor its hard one: no cut anywhere, the quadratic's 0)
        return np.zeros(np.broadcast(envelope_w, soft_w, hard_w).shape)
    span = np.maximum(hard_w - soft_w, 1e-9)
    over = np.maximum(envelope_w - soft_w, 0.0)
    quad = over * over / (2.0 * span)
    lin = envelope_w - 0.5 * (hard_w + soft_w)
    out: FloatArray = np.where(envelope_w > hard_w, lin, quad)
    if np.isfinite(out).all():
        return out
    return np.nan_to_num(out, nan=0.0)


class SwingLevel:
    """The level of a swinging load from its period readings: the mean of the last readings over a window that
    spans whole periods of the swing, restarted from two readings in a row that no swing explains.

    A 0.3-5 s training swing read as 1 s means aliases into a wobble of the readings (a 2 s swing alternates
    full-peak and mixed windows), which a low-pass passes on, out of phase, to whatever follows it. The window mean
    rejects it, as long as the window spans whole periods of the wobble: a mean over 6 readings of an 8 s RL
    iteration (3.6 s of training, 4.4 s of rollouts) swings with it, and a battery following that level charged on
    every training phase (slow-rl: the grid's in-band RMS 1.57 MW against demand's 1.31 MW). So the
    window is `length` readings, or the least whole number of the readings' period at or above it where the readings
    show one (`period`, at most `max_length`).

    A reading beyond the band the window spans (by `tol_frac` of its span, and at least `tol_abs`) is held aside: if
    the next one lies beyond it on the same side, the level has changed — a start, a crash, a stall — and the window
    restarts from the two (a step is followed within two periods); otherwise it was the swing, and both join the
    window. `span` is the swing's span, remembered over `memory` readings. NaN holds its value.
    """

    # a period is a lag whose autocorrelation of the readings' changes is a local peak at least this high
    PERIOD_MIN_CORR = 0.5
    # (a shorter period within this of the best peak's correlation is the same swing's: its multiples peak as high)
    PERIOD_NEAR_BEST = 0.1

    def __init__(
        self, length: int, tol_frac: float = 0.25, tol_abs: float = 0.0, memory: int = 300, max_length: int = 0
    ) -> None:
        self.length = max(length, 2)
        self.max_length = max(max_length, self.length)
        self._buf = np.full(self.max_length, np.nan)
        self._i = 0
        self._seen = 0
        # the latest readings, oldest first, for the period: two periods of the longest window and one reading more
        self._hist = np.full(2 * self.max_length + 2, np.nan)
        self.period = 0  # the readings' period in readings (0: none found)
        self.window = self.length  # readings the level is the mean of, once that many are in
        self.tol_frac, self.tol_abs = tol_frac, tol_abs
        self._decay = math.exp(-1.0 / max(memory, 1))
        self.span = 0.0
        self._pending: tuple[float, int] | None = None  # a reading held aside, and its side (+1 above, -1 below)
        self.stepped = False  # the last reading restarted the window

    def _push(self, x: float) -> None:
        self._buf[self._i] = x
        self._i = (self._i + 1) % self._buf.shape[0]
        self._seen += 1

    def _last(self) -> FloatArray:
        """The readings of the window, newest first (NaN where it holds fewer)."""
        idx = (self._i - 1 - np.arange(self.window)) % self._buf.shape[0]
        out: FloatArray = self._buf[idx]
        return out

    def find_period(self) -> int:
        """The readings' period (in readings, 2 to max_length), or 0 where they show none. Read from the
        autocorrelation of the changes between readings, not of the readings: a step or a ramp is one change or a
        steady one, not a period, and leaves the swing's period visible while it is in the history. Of the lags whose
        correlation is a local peak at least PERIOD_MIN_CORR, the least within PERIOD_NEAR_BEST of the highest: two
        jobs' swings together (a 2.5 s pretraining alias, every 5 readings, beside a 15 s RL iteration) repeat only at
        the longer period, where both line up, and a mean over the shorter one swings with the slower job."""
        h = self._hist[~np.isnan(self._hist)]
        d = np.diff(h)
        n = d.size
        max_lag = min(self.max_length, n // 2)
        if max_lag < 2:
            return 0
        d = d - d.mean()
        var = float(d @ d)
        # (changes no larger than the tolerance, or than float rounding of the readings, are no swing to follow)
        if var <= n * max(self.tol_abs, 1e-6 * float(np.abs(h).mean())) ** 2:
            return 0
        # (each lag's sum over the pairs it has, scaled to the whole series: an unbiased estimate; lags 1 to
        # max_lag + 1, where the series has them)
        lags = np.arange(1, min(max_lag + 1, n - 1) + 1)
        corr = np.array([float(d[:-k] @ d[k:]) for k in lags]) * n / (n - lags) / var
        k = lags[1:-1]
        c = corr[1:-1]
        peak = (c >= self.PERIOD_MIN_CORR) & (c >= corr[:-2]) & (c >= corr[2:])
        if not peak.any():
            return 0
        best = float(c[peak].max())
        return int(k[peak & (c >= best - self.PERIOD_NEAR_BEST)][0])

    def _set_window(self) -> None:
        p = self.find_period()
        self.period = p
        whole = p * -(-self.length // p) if p else self.length
        self.window = whole if whole <= self.max_length else self.length

    def update(self, x: float) -> float:
        self.stepped = False
        if math.isnan(x):
            return self.level()
        self._hist[:-1] = self._hist[1:]  # (shifted in place: np.roll's copy, without the new array)
        self._hist[-1] = x
        period_before = self.period  # (a step just read may hide the period from the history until it is rebased)
        self._set_window()
        valid = self._last()
        valid = valid[~np.isnan(valid)]
        side = 0
        if valid.size and not self.warming:
            lo, hi = float(valid.min()), float(valid.max())
            tol = max(self.tol_frac * (hi - lo), self.tol_abs)
            side = 1 if x > hi + tol else (-1 if x < lo - tol else 0)
            # A swing whose phases outlast the window (a 15 s RL iteration: 6 readings of training, 9 of rollouts) has
            # readings beyond the window's band at every change of phase, and each restart narrowed the band to two
            # readings, so the level followed the swing for good. Where the readings show a period, a reading within
            # what they read one period ago (a reading either side, for jitter) is the swing.
            ago = self._period_ago()
            if side and ago is not None:
                tol = self._swing_tol
                side = side if (x > ago[1] + tol if side > 0 else x < ago[0] - tol) else 0
        pending, self._pending = self._pending, None
        if side and pending is not None and pending[1] == side:
            self._rebase_history(side, self.period or period_before)
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
        valid = self._last()
        valid = valid[~np.isnan(valid)]
        self.span = max(self.span * self._decay, float(valid.max() - valid.min()))
        return float(valid.mean())  # (the level: these readings hold x at least)

    @property
    def _swing_tol(self) -> float:
        """How far a reading may lie off its phase one period before and still be the swing: a share of the swing's
        remembered span (the window's may be two readings since a restart), at least the absolute tolerance."""
        return max(self.tol_frac * self.span, self.tol_abs)

    def _period_ago(self) -> tuple[float, float] | None:
        """The band the newest reading's phase read one period ago (the readings either side of it too), or None
        where no period is known or the history lacks those readings."""
        p = self.period
        if not p:
            return None
        ago = self._hist[-p - 2 : -p + 1]  # (p >= 2: find_period's least)
        ago = ago[~np.isnan(ago)]
        return (float(ago.min()), float(ago.max())) if ago.size else None

    def _rebase_history(self, side: int, p: int) -> None:
        """A step in a load that goes on swinging: the history the period and the band one period ago are read
        from is moved by the step, so the swing's next phase, at the new level, is read as the swing and not as
        another step. The step is what the readings since it lie off their phase one period before (on `side`, by
        more than the tolerance); a step within the swing's band shows only at a later phase, so the readings it
        moved may be more than the two that showed it. `p`: the period (0: none known, nothing to move)."""
        if not p:
            return
        off = self._hist[-p:] - self._hist[-2 * p : -p]
        moved = (np.sign(off) == side) & (np.abs(off) > self._swing_tol)  # (NaN: neither)
        k = p if moved.all() else p - 1 - int(np.flatnonzero(~moved)[-1])
        if k < 2:
            return
        self._hist[:-k] += float(np.median(off[-k:]))

    def restart(self) -> None:
        """Forget the window's readings: the level is learned afresh (the span and the period's history are kept:
        the same jobs swing the same way after a blackout)."""
        self._buf[:] = np.nan
        self._i, self._seen, self._pending = 0, 0, None

    @property
    def warming(self) -> bool:
        """Fewer readings than the least window: the level is still being learned."""
        return self._seen < self.length

    @property
    def count(self) -> int:
        """How many readings the level is the mean of (fewer than the window while warming or after a restart)."""
        return int(np.count_nonzero(~np.isnan(self._last())))

    def level(self) -> float:
        last = self._last()
        valid = last[~np.isnan(last)]
        return float(valid.mean()) if valid.size else math.nan
