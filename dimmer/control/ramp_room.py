"""What the utility's ramp rule leaves the grid import, read from the import's own history.

The rule (docs/models.md) bounds |m(t) - m(t - W)|, where m is the trailing mean of the import over the window W:
the change of the window-average level. A level held from now on moves each coming window's mean by how far it lies
from the readings that window drops, so the last 2 W of readings give, in closed form, the least and the most the
import may be held at with every difference the rule will measure over the next window within a budget. Held there,
the next period's bounds still contain it (holding is the same plan one period on), so a controller that keeps the
import inside the bounds every period keeps the rule, and may use all of the budget: a limit on the rate of the
level is enough but spends half of it, and it cannot tell a fall the window means will show from an iteration's
trough they will not.
"""

from __future__ import annotations

import math

import numpy as np

from dimmer.site import FloatArray


class RampRoom:
    """The import's last two ramp windows of period readings, and the room they leave a level held from now on."""

    def __init__(self, window_s: float, period_s: float, seed_s: float = 10.0) -> None:
        self.n = max(1, round(window_s / period_s))
        self.n_seed = max(1, min(self.n, round(seed_s / period_s)))
        self.history_w: FloatArray = np.full(2 * self.n, np.nan)  # oldest first; NaN before the first reading
        self._tau = np.arange(1, self.n + 1, dtype=np.float64)  # periods ahead
        self._k = np.arange(1, self.n + 1)
        self._c = np.zeros(2 * self.n + 1)  # c[k] = sum of the history's first k readings

    @property
    def seen(self) -> int:
        """Readings pushed, up to 2 n (the NaN ahead of them is the history not yet known)."""
        return int(np.count_nonzero(np.isfinite(self.history_w)))

    @property
    def known(self) -> bool:
        return bool(np.isfinite(self.history_w[-1]))

    def push(self, import_w: float) -> None:
        """A period's reading of the import; NaN (no trusted reading) holds the last one."""
        if not math.isfinite(import_w):
            if not self.known:
                return
            import_w = float(self.history_w[-1])
        self.history_w[:-1] = self.history_w[1:]
        self.history_w[-1] = import_w

    def _history(self) -> FloatArray:
        """The last 2 n readings; before that many are seen, the plant before them is taken as settled at the mean
        of the first seed_s of them (as the simulator's rule takes its pre-run). Seeded from the first reading alone,
        a run that starts in an iteration's peak read its first trough as a fall of the whole swing; from the mean of
        every reading seen, a fall in the first minute lowered the past with it, and the import fell past the rule."""
        seen = self.seen
        if seen >= self.history_w.shape[0]:
            return self.history_w
        h = self.history_w.copy()
        k = h.shape[0] - seen
        h[:k] = float(np.mean(h[k : k + min(seen, self.n_seed)]))
        return h

    def bounds(self, budget_w: float) -> tuple[float, float]:
        """(least, most) import to hold from now on with every window-mean change over the next window within
        `budget_w`. With no history, or no ramp rule, anything goes; where no level keeps it (the history already
        breaks the budget: a fall the limit forced, commands that landed late) both are the midpoint of the two."""
        if not self.known or not math.isfinite(budget_w):
            return -math.inf, math.inf
        n, h = self.n, self._history()
        tau = self._tau  # periods ahead
        c = self._c  # c[k] = sum of h[:k]
        np.cumsum(h, out=c[1:])
        k = self._k
        kept = c[2 * n] - c[n + k]  # the readings the window ending tau periods ahead still holds
        before = c[n + k] - c[k]  # the window the rule compares it with
        base = (before - kept) / tau  # the level that leaves that window's mean unchanged
        slack = budget_w * n / tau
        lo, hi = float(np.max(base - slack)), float(np.min(base + slack))
        if lo > hi:
            # (and within what the import drew over the two windows: the level that would pay a window already
            # broken back can be far outside anything the site draws, and chasing it breaks the next windows. A job
            # start under caps 20 s late, whose step and the cut it drew both landed whole, asked for -38 MW of a
            # campus that had drawn 4.7-10.4 MW, and held every job at the lowest cap for minutes)
            lo = hi = min(max(0.5 * (lo + hi), float(np.min(h))), float(np.max(h)))
        return lo, hi

    def straddle_w(self) -> float:
        """How far the rule, which measures its windows at every instant, may see a window mean off the mean of whole
        periods of readings: a window that starts or ends inside a period holds only part of it, so a change from
        one period to the next moves what it measures by up to that change times the share of a period in a
        window, at each of its two ends."""
        h = self.history_w[np.isfinite(self.history_w)]
        if h.shape[0] < 2:
            return 0.0
        return 2.0 * float(np.max(np.abs(np.diff(h)))) / self.n


class ReturnHold:
    """The import held within one ramp budget of what stopped jobs would draw on their return, while that is the
    cheaper bet.

    A job that stops may run again (a crash is recovered in minutes, MODELS.md), and its return is a rise the rule
    lets the import take one budget a window: an import that has fallen with the job climbs back under caps. Held
    within one budget of the return, it takes the return at once, but the hold burns floors. Which costs more is the
    exchange rate's to say (`worth_j_per_gpu_s`, what one GPU-second of goodput is worth in energy), and not knowing
    whether or when the job returns, the hold lasts until what it has burned equals what a release would then cost
    the return (the ski-rental rule: at a fixed price never more than twice the cheaper choice, whenever the job
    returns or if it never does; here the price grows as the rule's room falls). Released, it stays released until
    the stopped jobs run again.
    """

    def __init__(self, worth_j_per_gpu_s: float) -> None:
        self.worth_j_per_gpu_s = worth_j_per_gpu_s
        self.spent_j = 0.0  # the energy this hold has kept the import up by, since the jobs stopped
        self.released = False

    def level_w(
        self,
        return_w: float,
        return_gpus: float,
        with_return_w: float,
        free_lo_w: float,
        budget_w: float,
        rate_w_per_s: float,
        dt_s: float,
    ) -> float:
        """The least import to hold this period (-inf: none). `return_w` is what the stopped jobs' racks would add
        on their `return_gpus` GPUs, `with_return_w` the import they would bring, `free_lo_w` the least the ramp rule
        alone asks for, `rate_w_per_s` the rate it lets the import climb at."""
        if return_w <= 0 or return_gpus <= 0:
            self.spent_j, self.released = 0.0, False
            return -math.inf
        if self.released or self.worth_j_per_gpu_s <= 0 or not math.isfinite(budget_w) or rate_w_per_s <= 0:
            return -math.inf
        hold_w = with_return_w - budget_w
        extra_w = hold_w - free_lo_w
        if extra_w <= 0:
            return -math.inf
        # released, a return would climb extra_w at the rate, the capped share falling from extra_w to 0
        lost_gpu_s = 0.5 * extra_w / rate_w_per_s * extra_w / (return_w / return_gpus)
        if self.spent_j >= self.worth_j_per_gpu_s * lost_gpu_s:
            self.released = True
            return -math.inf
        self.spent_j += extra_w * dt_s
        return hold_w
