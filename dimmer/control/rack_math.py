"""The site's rack arithmetic with its constants worked out once: what `Controller.step` calls a dozen times a period.

`SiteModel.rack_power_w`, `gpu_draw_for_rack_w` and `domain_load_w` rebuild their per-rack constants on every call;
at 14,080 racks each rebuild is a few full-length passes. These give the same numbers, operation for operation and in
the same order (so to the last bit: tests/test_step_fast_paths.py holds them to it), from constants kept here; so do
the shortcuts beside them (a rack's figure worked out at some racks only, a sum over the racks that are set, the least
share above each rack a level at a time) and numpy's results without their wrappers (nan_to_num, clip_float).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from dimmer.site import SiteModel

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

_MAX = float(np.finfo(np.float64).max)


class RackMath:
    def __init__(self, site: SiteModel) -> None:
        self.site = site
        gpu = site.gpu
        idle_gpus = site.gpus_per_rack - site.rack_active_gpus
        self._active = site.rack_active_gpus.astype(np.float64)
        self._idle_w = idle_gpus * gpu.idle_w
        self._host_w = site.gpus_per_rack * gpu.host_overhead_w
        self._fixed_w = idle_gpus * gpu.idle_w + site.gpus_per_rack * gpu.host_overhead_w
        self._per_gpu = np.maximum(site.rack_active_gpus, 1).astype(np.float64)
        self._eff = site.rectifier_eff
        self.rack_max_w = site.rack_max_w()
        self._csum = np.zeros(site.n_racks + 1)
        runs = _level_runs(site.domain_rack_start, site.domain_rack_stop)
        # (a tree of a few levels is a few runs; anything else is gathered, as the site does it)
        self._levels = runs if len(runs) <= 64 else None
        # rack -> the domains above it (CSR rows, ascending), for the least of a value over them
        self.rack_domains = sp.csr_array(site.incidence.T)
        self.rack_domains.sort_indices()
        # ... which the level runs give a level at a time where they are the incidence, every rack under a domain
        self._runs_are_incidence = self._levels is not None and _runs_are(self.rack_domains, site)

    def ancestor_min(self, share: FloatArray, limiting: npt.NDArray[np.bool_]) -> FloatArray:
        """Per rack, the least `share` of the domains above it: `np.minimum.reduceat` over the incidence's rows, to
        the bit (a minimum is exact, and NaN wins either way). `share` must be 1 wherever `limiting` is False and at
        most 1 elsewhere: a level with nothing limiting leaves the racks as they are."""
        rd = self.rack_domains
        # (a -0.0 beside a 0.0 under one rack: which of the two a minimum keeps is the reduction's order, which only
        # the reduceat has)
        negative_zero = bool(np.any((share == 0.0) & np.signbit(share)))
        if not self._runs_are_incidence or self._levels is None or negative_zero:
            out: FloatArray = np.minimum.reduceat(share[rd.indices], rd.indptr[:-1])
            return out
        acc = np.ones(self.site.n_racks)
        for first, stop, rack0, span in self._levels:
            if span == 0 or not limiting[first:stop].any():
                continue
            k = stop - first
            part = acc[rack0 : rack0 + span * k]
            if k == 1:
                np.minimum(part, share[first], out=part)
            elif span == 1:
                np.minimum(part, share[first:stop], out=part)
            else:
                np.minimum(part, np.repeat(share[first:stop], span), out=part)
        return acc

    def rack_power_w(self, gpu_draw_w: FloatArray) -> FloatArray:
        """`site.rack_power_w` for a `(n_racks,)` vector."""
        out: FloatArray = self._active * gpu_draw_w
        out += self._idle_w
        out += self._host_w
        out /= self._eff
        return out

    def rack_power_at_w(self, gpu_draw_w: FloatArray, at: npt.NDArray[np.intp]) -> FloatArray:
        """`rack_power_w` of the racks `at` only (`gpu_draw_w` theirs, in that order): each rack's own figure."""
        out: FloatArray = _at(self._active, at) * gpu_draw_w
        out += _at(self._idle_w, at)
        out += _at(self._host_w, at)
        out /= self._eff
        return out

    def gpu_draw_for_rack_w(self, rack_w: FloatArray) -> FloatArray:
        """`site.gpu_draw_for_rack_w` for a `(n_racks,)` vector."""
        out: FloatArray = rack_w * self._eff
        out -= self._fixed_w
        out /= self._per_gpu
        return out

    def campus_load_w(self, rack_w: FloatArray) -> float:
        """`domain_load_w(rack_w)[0]` (the campus's), without the other domains' differences."""
        if rack_w.dtype != np.float64 or rack_w.ndim != 1:
            return float(self.site.domain_load_w(rack_w)[0])
        csum = self._csum
        np.cumsum(rack_w, out=csum[1:])
        return float(csum[self.site.domain_rack_stop[0]] - csum[self.site.domain_rack_start[0]])

    def domain_load_w(self, rack_w: FloatArray, only_at: npt.NDArray[np.intp] | None = None) -> FloatArray:
        """`site.domain_load_w` for a `(n_racks,)` float vector: the same cumulative sum, differenced level by level
        over strided views rather than gathered. `only_at` (ascending): the racks outside it hold +0.0, so the sum
        is run only from the first of them to the last (before it every partial sum is +0.0, after it each is the
        last one plus +0.0: the same bits)."""
        if rack_w.dtype != np.float64 or rack_w.ndim != 1:
            return self.site.domain_load_w(rack_w)
        csum = self._csum
        if only_at is None:
            np.cumsum(rack_w, out=csum[1:])
        elif only_at.size == 0:
            csum[:] = 0.0
        else:
            # (from the +0.0 before the first, where there is one: the sum then adds the first to +0.0, as the
            # whole sum does, rather than starting from it)
            a, b = max(int(only_at[0]) - 1, 0), int(only_at[-1]) + 1
            csum[: a + 1] = 0.0
            np.cumsum(rack_w[a:b], out=csum[a + 1 : b + 1])
            csum[b + 1 :] = csum[b] + 0.0
        if self._levels is None:
            gathered: FloatArray = csum[self.site.domain_rack_stop] - csum[self.site.domain_rack_start]
            return gathered
        out = np.empty(self.site.n_domains)
        for first, stop, rack0, span in self._levels:
            k = stop - first
            if k == 1:
                out[first] = csum[rack0 + span] - csum[rack0]
            else:
                np.subtract(csum[rack0 + span : rack0 + span * k + 1 : span],
                            csum[rack0 : rack0 + span * (k - 1) + 1 : span], out=out[first:stop])  # fmt: skip
        return out


def same_bits(a: FloatArray, b: FloatArray | None) -> bool:
    """`a` holds exactly the values (to the bit) of the float64 array `b` (False where either is not C-contiguous
    float64: then not known to)."""
    if b is None or a.dtype != np.float64 or a.shape != b.shape or not a.flags.c_contiguous:
        return False
    if b.dtype != np.float64 or not b.flags.c_contiguous:
        return False
    return bool(np.array_equal(a.view(np.int64), b.view(np.int64)))


def clip_float(x: float, lo: float, hi: float) -> float:
    """`float(np.clip(x, lo, hi))` for three floats, without its wrappers (tens of microseconds a call): the larger
    of x and lo, then the smaller of that and hi, each keeping the first of two equals (0.0 against -0.0) and a NaN
    from either side, as numpy's clip does."""
    m = x if x != x else (lo if (lo != lo or x < lo) else x)
    return float(m if m != m else (hi if (hi != hi or hi < m) else m))


def _at(x: npt.NDArray[np.floating[Any]] | float, at: npt.NDArray[np.intp]) -> npt.NDArray[np.floating[Any]] | float:
    """A per-rack constant at the racks `at` (one for every rack: itself)."""
    return x[at] if isinstance(x, np.ndarray) and x.ndim else x


def nan_to_num(x: FloatArray, nan: float = 0.0) -> FloatArray:
    """`np.nan_to_num(x, nan=nan)`, without its four passes where every value is finite (then `x` itself: the
    caller must not write to it)."""
    if np.isfinite(x).all():
        return x
    # (np.nan_to_num's three replacements, without its wrappers)
    out: FloatArray = np.array(x, dtype=np.float64)
    np.copyto(out, nan, where=np.isnan(out))
    np.copyto(out, _MAX, where=out == np.inf)
    np.copyto(out, -_MAX, where=out == -np.inf)
    return out


def _runs_are(rack_domains: sp.csr_array, site: SiteModel) -> bool:
    """The domains' rack spans are the incidence's rows (its transpose `rack_domains`), and every rack is under one."""
    if np.any(np.diff(rack_domains.indptr) == 0):
        return False
    start, stop = site.domain_rack_start, site.domain_rack_stop
    spans = [np.arange(int(a), int(b)) for a, b in zip(start, stop, strict=True)]
    cols = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
    rows = np.repeat(np.arange(start.shape[0]), stop - start)
    ranges = sp.csr_array((np.ones(rows.shape[0]), (cols, rows)), shape=rack_domains.shape)
    ranges.sort_indices()
    return bool(
        np.array_equal(ranges.indptr, rack_domains.indptr) and np.array_equal(ranges.indices, rack_domains.indices)
    )


def _level_runs(start: IntArray, stop: IntArray) -> list[tuple[int, int, int, int]]:
    """(first domain, stop domain, first rack, racks each) of every run of domains that tile consecutive equal
    spans of racks: each run's sums are two strided views of the cumulative sum. A lone domain (or an empty one) is
    a run of one."""
    runs: list[tuple[int, int, int, int]] = []
    n = int(start.shape[0])
    i = 0
    while i < n:
        span = int(stop[i] - start[i])
        j = i + 1
        while span > 0 and j < n and int(start[j]) == int(stop[j - 1]) and int(stop[j] - start[j]) == span:
            j += 1
        runs.append((i, j, int(start[i]), span))
        i = j
    return runs
