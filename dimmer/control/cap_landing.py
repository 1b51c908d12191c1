"""When a cap write lands: the delay from a write to the cap the GPUs report enforcing, learned from the
writes themselves.

A cap sent in band (NVML) is enforced within a period; one sent out of band, through a BMC, up to ~40 s later
(POLCA, ASPLOS 2024), and a command path may slow down or lose writes. Until a cut shows, the racks draw what they
drew, and a controller that counts a rack at the higher of the cap it sent and the cap it reports (right for a
write that is lost: the rack draws to the cap it has) cuts again every period until the first cut shows: with caps
40 s late, oob-curtail with half its battery took both jobs to the lowest cap, and what landed 40 s on was far too
much (19 % of GPU time lost, 196 s over the ramp limit).

So a write whose rack does not yet report it is in flight, and the rack counted at the cap sent (by the caps'
plan only: the battery, which acts now, covers what the rack still draws), for as long as writes take to land here:
the longest landing seen (forgotten over `forget_s`, an hour: a path that sped up is believed after a while) or the
delay the operator states (`cap_delay_s`), whichever is longer, and half a period. A write older than that is lost.
Before any write has landed, a site whose caps go out of band takes them to need `prior_s` (a BMC's ~40 s): the
first cut of a curtailment goes out before anything has been learned, and must lead the falling limit by then.
Until a write anywhere has landed since it was sent, it is in flight for up to `max_s`: a path that delays every
write shows none landing, one that loses some shows the others landing (racks whose firmware ignores their caps
beside racks that obey). A write within a tenth of its step of the reported cap has landed (an in-band lag settling:
what the reported cap says is what the GPUs enforce), and one that an older write's landing only moved toward (out
of band, each period's write lands 40 s on) has not. Where writes land within two periods (in band, a rack device
that reports a cap a couple of seconds after it is enforced), none is in flight: the readings show a cut that soon,
and counting the cap reported until then is the conservative side.
"""

from __future__ import annotations

import math

import numpy as np

from dimmer.site import BoolArray, FloatArray

FAST_PERIODS = 2.0  # a write that lands within this many periods is on the readings' own lag (see in_flight)


class CapLanding:
    """Per rack, the cap last sent, when, and what the rack reported then; site-wide, the delay writes take to land."""

    def __init__(
        self,
        n_racks: int,
        rated_w: float,
        stated_s: float,
        max_s: float,
        forget_s: float = 3600.0,
        prior_s: float = 0.0,
    ) -> None:
        self.sent_w: FloatArray = np.full(n_racks, rated_w)
        self.sent_at_s: FloatArray = np.full(n_racks, -math.inf)
        self.from_w: FloatArray = np.full(n_racks, rated_w)  # the cap each rack reported when its write was sent
        self.pending: BoolArray = np.zeros(n_racks, dtype=bool)
        self.tol_w = 0.01 * rated_w  # (a cap within this of the one sent has landed; a move within it is no write)
        self.stated_s = stated_s
        self.prior_s = prior_s  # (what a write is taken to need before one has been seen landing)
        self.max_s = max(max_s, stated_s)
        self.forget_s = forget_s
        self.learned_s = 0.0  # the longest landing seen, decaying
        self.learned_at_s = -math.inf
        self.landed_at_s = -math.inf  # when a write last landed anywhere
        self.waiting_since_s = -math.inf  # when the first write since then was sent

    def delay_s(self, t_s: float) -> float:
        """How long a write takes to land here, as far as is known at t_s (s)."""
        if self.learned_at_s == -math.inf:
            return max(self.prior_s, self.stated_s)
        learned = self.learned_s * math.exp(-max(t_s - self.learned_at_s, 0.0) / self.forget_s)
        return max(learned, self.stated_s)

    def in_flight(self, t_s: float, period_s: float, reported_w: FloatArray) -> BoolArray:
        """The racks whose last write has not landed and is not yet overdue, given the caps they report now."""
        pending = self.pending
        if not pending.any():
            return pending
        # (a write that reached its cap, or a tenth of its step from it: an in-band lag's tail is what the GPUs
        # enforce; an older write landing on the way to it is not this one. NaN, a cap not reported: not landed.
        # Worked out on the racks with a write pending only: most periods, a job's worth or none)
        idx = np.flatnonzero(pending)
        sent_w = self.sent_w[idx]
        gap_w = np.abs(reported_w[idx] - sent_w)
        landed = (gap_w <= self.tol_w) | (gap_w <= 0.1 * np.abs(sent_w - self.from_w[idx]))
        if landed.any():
            sample = float(np.max(t_s - self.sent_at_s[idx[landed]]))
            # (a longer delay is believed at once, a shorter one as it decays; the first replaces the prior)
            if sample >= self.delay_s(t_s) or self.learned_at_s == -math.inf:
                self.learned_s, self.learned_at_s = sample, t_s
            self.landed_at_s = t_s
            pending = pending.copy()
            pending[idx[landed]] = False
            self.pending = pending
            if not pending.any():
                return pending
        age = t_s - self.sent_at_s
        delay_s = self.delay_s(t_s)
        unlanded = pending & (self.sent_at_s > self.landed_at_s) & (age <= self.max_s)
        # how long the writes since the last landing have waited: since the first of them (a write each period
        # renews each rack's own time)
        waited_s = 0.0
        if unlanded.any() and self.waiting_since_s > self.landed_at_s:
            waited_s = min(t_s - self.waiting_since_s, self.max_s)
        # Where writes are known to land within the readings' own lag (a period or two), a write not landed counts
        # at the cap reported: a cut then made again is a period's, and once landed it is the conservative side (a
        # daemon whose rack devices report a cap 2 s after it is enforced settled its caps 150 W a GPU lower and held
        # its limit when its battery vanished unannounced, where counting the cap sent had it lean on that
        # battery). Where they take longer (a slow path), or the writes sent since the last landing (or since the
        # start) have waited longer than that (a path slower than any seen), a write is in flight.
        fast_s = FAST_PERIODS * period_s
        if delay_s <= fast_s and waited_s < fast_s:
            return np.zeros_like(pending)
        due = age < delay_s + 0.5 * period_s
        out: BoolArray = pending & np.isfinite(reported_w) & (due | unlanded)
        return out

    def sent(self, t_s: float, cap_w: FloatArray, reported_w: FloatArray) -> None:
        """The caps sent at t_s, and the caps the racks reported when they were: a rack whose cap moved by more
        than the tolerance has a new write in flight."""
        moved = np.abs(cap_w - self.sent_w) > self.tol_w
        if moved.any():
            if self.waiting_since_s <= self.landed_at_s:
                self.waiting_since_s = t_s
            self.sent_at_s = np.where(moved, t_s, self.sent_at_s)
            self.from_w = np.where(moved, reported_w, self.from_w)
            self.pending = self.pending | moved
        np.copyto(self.sent_w, cap_w)  # (a move within the tolerance is no new write, but the cap it reaches)
