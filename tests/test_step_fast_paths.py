"""The shortcuts Controller.step takes give what the long way gives, to the last bit: the decisions must not move.

RackMath is the site's rack arithmetic with its constants kept; a Window of whole samples takes its RMS from squares
kept a sample at a time; the BBUs' cycle counter skips a SoC it has already taken; nan_to_num skips finite values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.control.filters import Window, _rms
from dimmer.control.rack_math import RackMath, nan_to_num
from dimmer.control.rack_storage import HalfCycles
from gridsim.scenario import load_scenario
from tests.budget import examples

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
SITES = ("swing-8k.toml", "sites/two-buildings.toml", "sites/staggered-starts.toml", "sites/bare-racks.toml")


@pytest.mark.parametrize("name", SITES)
def test_rack_math_is_the_sites_to_the_bit(name: str) -> None:
    site = load_scenario(SCENARIOS / name, []).site()
    rm = RackMath(site)
    rng = np.random.default_rng(7)
    assert np.array_equal(rm.rack_max_w, site.rack_max_w())
    for _ in range(20):
        x = rng.random(site.n_racks) * 10.0 ** rng.integers(-2, 6)
        x[rng.random(site.n_racks) < 0.05] = np.nan
        x[rng.random(site.n_racks) < 0.02] = np.inf
        for mine, theirs in (
            (rm.rack_power_w, site.rack_power_w),
            (rm.gpu_draw_for_rack_w, site.gpu_draw_for_rack_w),
            (rm.domain_load_w, site.domain_load_w),
        ):
            with np.errstate(invalid="ignore"):  # (inf - inf in the sums, in both)
                assert np.array_equal(mine(x), theirs(x), equal_nan=True)
        finite = np.nan_to_num(x, nan=1.0, posinf=2.0)
        assert np.array_equal(rm.domain_load_w(finite), site.domain_load_w(finite))
        assert np.array_equal(rm.domain_load_w(finite > 1.0), site.domain_load_w(finite > 1.0))


def test_domain_sums_of_a_tree_that_does_not_tile() -> None:
    """Domains that are no tiling of equal spans (a hand-made site) are gathered as the site does."""
    from dataclasses import replace

    site = load_scenario(SCENARIOS / "sites/two-buildings.toml", []).site()
    start = site.domain_rack_start.copy()
    stop = site.domain_rack_stop.copy()
    stop[-1] = start[-1]  # an empty domain at the end
    odd = replace(site, domain_rack_start=start, domain_rack_stop=stop)
    x = np.random.default_rng(1).random(site.n_racks)
    assert np.array_equal(RackMath(odd).domain_load_w(x), odd.domain_load_w(x))


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def test_window_rms_of_whole_samples_is_the_masked_rms() -> None:
    rng = np.random.default_rng(3)
    w = Window(500, 10)
    for step in range(40):
        x = rng.random(500) * 10.0 ** rng.integers(0, 7)
        if step in (3, 4, 25):  # a sample with NaN: the masked path until it has left the window
            x[rng.random(500) < 0.1] = np.nan
        w.update(x)
        assert _bits(w.rms()) == _bits(_rms(w._buf))
        for k in (1, 3, 5, 10):
            idx = (w._i - 1 - np.arange(k)) % 10
            assert _bits(w.rms_recent(k)) == _bits(_rms(w._buf[idx]))


def test_window_written_from_outside_is_taken_as_it_is() -> None:
    """A restored buffer (written past `update`) is never read through squares kept for the old one."""
    w = Window(50, 4)
    for _ in range(6):
        w.update(np.ones(50))
    w.rms()
    fresh = Window(50, 4)  # (the daemon restores into a new window, as here)
    fresh._buf[...] = np.arange(200.0).reshape(4, 50)
    assert _bits(fresh.rms()) == _bits(_rms(fresh._buf))


def _cycles_state(c: HalfCycles) -> tuple[bytes, bytes, bytes]:
    return _bits(c.turn), _bits(c.extreme), _bits(c.direction)


def test_half_cycles_skip_a_soc_they_have_taken() -> None:
    """The same SoC twice: the second update, skipped, leaves what a full one would (and closes nothing)."""
    rng = np.random.default_rng(5)
    fast, full = HalfCycles(300, 0.9), HalfCycles(300, 0.9)
    soc = rng.random(300)
    for step in range(60):
        if step % 3:  # two periods in three the shelves move; one in three they hold
            soc = np.clip(soc + rng.normal(0.0, 0.01, 300) * (rng.random(300) < 0.5), 0.0, 1.0)
            soc[rng.random(300) < 0.02] = np.nan
        closed_fast = fast.update(soc)
        closed_full = full._update(soc)
        assert _bits(closed_fast) == _bits(closed_full)
        assert _cycles_state(fast) == _cycles_state(full)


@pytest.mark.parametrize("share", [0.001, 0.05, 0.3, 0.6])
def test_half_cycles_work_through_only_the_shelves_that_moved(share: float) -> None:
    """Some shelves move, the rest read as last period: working through only those that moved (fewer than half)
    leaves every run, and closes every weight, as the whole update does: turns, starts, NaN among them."""
    rng = np.random.default_rng(int(share * 1000))
    fast, full = HalfCycles(400, 0.9), HalfCycles(400, 0.9)
    soc = rng.random(400)
    for _ in range(80):
        move = rng.random(400) < share
        soc = np.where(move, np.clip(soc + rng.normal(0.0, 0.02, 400), 0.0, 1.0), soc)
        soc[move & (rng.random(400) < 0.05)] = np.nan
        closed_fast = fast.update(soc)
        closed_full = full._update(soc)
        assert _bits(closed_fast) == _bits(closed_full)
        assert _cycles_state(fast) == _cycles_state(full)


def test_nan_to_num_is_numpys() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 1.5, -0.0, 0.0])
    for nan in (0.0, -1.0, 0.3):
        assert _bits(nan_to_num(x, nan=nan)) == _bits(np.nan_to_num(x, nan=nan))
    finite = np.array([1.0, 2.0])
    assert nan_to_num(finite) is finite


def _progressive_cut_long_way(e: np.ndarray, s: np.ndarray, h: np.ndarray) -> np.ndarray:
    """progressive_cut_w as it was before it skipped a vector with nothing over."""
    span = np.maximum(h - s, 1e-9)
    over = np.maximum(e - s, 0.0)
    out = np.where(e > h, e - 0.5 * (h + s), over * over / (2.0 * span))
    return np.nan_to_num(out, nan=0.0)


def test_progressive_cut_with_nothing_over_is_the_formulas() -> None:
    from dimmer.control.filters import progressive_cut_w

    rng = np.random.default_rng(11)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        h = rng.random(n) * 100.0
        s = h * rng.uniform(0.5, 1.0, n)
        e = s * rng.uniform(0.0, 1.2 if rng.random() < 0.5 else 1.0, n)
        for arr in (e, s, h):
            arr[rng.random(n) < 0.05] = rng.choice([np.nan, np.inf, -np.inf])
        with np.errstate(invalid="ignore"):
            assert _bits(progressive_cut_w(e, s, h)) == _bits(_progressive_cut_long_way(e, s, h))


# -- the allocation through JobGpus ----------------------------------------------------------------------------------


def _alloc_site(name: str, shared_priorities: bool):  # type: ignore[no-untyped-def]
    """A library site, with its jobs' priorities as they are or folded to two (groups of several jobs)."""
    from dataclasses import replace

    site = load_scenario(SCENARIOS / name, []).site()
    if shared_priorities:
        site = replace(site, job_priority=np.arange(site.n_jobs) % 2)
    return site


def _sparse_vector(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """A domain vector as the step hands one over: mostly zero, or mostly set, with a few non-finite values."""
    x = rng.random(n) * scale * (rng.random(n) < rng.choice([0.001, 0.05, 1.0]))
    if rng.random() < 0.3:
        x[rng.integers(0, n, 3)] = rng.choice([np.nan, np.inf, -np.inf, -1.0, -0.0])
    return x


@settings(max_examples=examples(40), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    name=st.sampled_from((*SITES, "prometheus-campus.toml")),
    shared=st.booleans(),
)
def test_shed_and_grant_through_job_gpus_are_the_bare_matrix(seed: int, name: str, shared: bool) -> None:
    """shed and grant given a JobGpus (each group read only where it has GPUs) give the bare matrix's reductions,
    cuts left, and increases to the bit, over groups of one job and of several."""
    from dimmer.control.allocation import JobGpus, grant, job_gpus_per_domain, priority_groups, shed

    site = _alloc_site(name, shared)
    gpus = job_gpus_per_domain(site)
    fast = JobGpus(gpus)
    groups = priority_groups(site.job_priority)
    rng = np.random.default_rng(seed)
    for _ in range(4):  # (the same JobGpus again: what it kept is read as it was worked out)
        cut = _sparse_vector(rng, site.n_domains, 10.0 ** rng.integers(2, 8))
        room = rng.random(site.n_jobs) * 400.0 * (rng.random(site.n_jobs) < 0.8)
        with np.errstate(invalid="ignore", over="ignore"):  # (inf and MAX in both)
            mine, theirs = (
                shed(cut, fast, room, groups, site.rectifier_eff),
                shed(cut, gpus, room, groups, site.rectifier_eff),
            )
        assert _bits(mine[0]) == _bits(theirs[0]) and _bits(mine[1]) == _bits(theirs[1])
        head = _sparse_vector(rng, site.n_domains, 10.0 ** rng.integers(2, 8))
        if rng.random() < 0.5:
            head = np.where(np.isfinite(head) & (head == 0), rng.random(site.n_domains) * 1e6, head)
        want = rng.random(site.n_jobs) * 50.0 * (rng.random(site.n_jobs) < 0.8)
        if rng.random() < 0.1:
            want[rng.integers(0, site.n_jobs)] = np.inf
        with np.errstate(invalid="ignore", over="ignore"):
            up_mine, up_theirs = (
                grant(head, fast, want, groups, site.rectifier_eff),
                grant(head, gpus, want, groups, site.rectifier_eff),
            )
        assert _bits(up_mine) == _bits(up_theirs)


@settings(max_examples=examples(20), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), name=st.sampled_from((*SITES, "prometheus-campus.toml")))
def test_start_ceiling_through_job_gpus_and_rack_math_is_the_bare_one(seed: int, name: str) -> None:
    """start_ceiling_w with the controller's JobGpus and RackMath lowers the stopped jobs' caps as the bare matrix
    and the site's own sums do, to the bit."""
    from dimmer.control.allocation import JobGpus, job_gpus_per_domain, priority_groups
    from dimmer.control.start_room import start_ceiling_w

    site = _alloc_site(name, False)
    gpu = site.gpu
    rng = np.random.default_rng(seed)
    gpus = job_gpus_per_domain(site)
    groups = priority_groups(site.job_priority)
    running = rng.random(site.n_jobs) < 0.5
    caps = gpu.min_cap_w + rng.random(site.n_jobs) * (gpu.rated_w - gpu.min_cap_w)
    down = (site.rack_job >= 0) & ~running[np.maximum(site.rack_job, 0)]
    planned = site.rack_power_w(rng.random(site.n_racks) * gpu.rated_w)
    bridged = np.where(down, rng.random(site.n_racks) * 2e4, 0.0)
    room = (rng.random(site.n_domains) - 0.3) * site.domain_rating_w
    back = np.where(rng.random(site.n_racks) < 0.5, planned * 1.2, np.inf)
    args = (site, caps, running, down, planned, bridged, room)
    mine = start_ceiling_w(*args, JobGpus(gpus), groups, site.rectifier_eff, back, RackMath(site))
    theirs = start_ceiling_w(*args, gpus, groups, site.rectifier_eff, back)
    assert _bits(mine) == _bits(theirs)


# -- the least share above each rack, and the BBUs' figures where they are asked for ----------------------------------


@settings(max_examples=examples(30), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), name=st.sampled_from((*SITES, "prometheus-campus.toml")))
def test_ancestor_min_is_the_reduceat_over_the_incidence(seed: int, name: str) -> None:
    """RackMath.ancestor_min, a level at a time, is np.minimum.reduceat over each rack's domains to the bit (NaN and
    signed zeros included), for shares of 1 where nothing limits and at most 1 where something does."""
    site = load_scenario(SCENARIOS / name, []).site()
    rm = RackMath(site)
    rd = rm.rack_domains
    rng = np.random.default_rng(seed)
    for _ in range(5):
        limiting = rng.random(site.n_domains) < rng.choice([0.0, 0.001, 0.05, 0.5, 1.0])
        share = np.where(limiting, rng.random(site.n_domains) * rng.choice([1.0, 1e-12]), 1.0)
        odd = limiting & (rng.random(site.n_domains) < 0.05)
        share[odd] = rng.choice([np.nan, -0.0, 0.0, 1.0, -np.inf], size=int(odd.sum()))
        theirs = np.minimum.reduceat(share[rd.indices], rd.indptr[:-1])
        assert _bits(rm.ancestor_min(share, limiting)) == _bits(theirs)


def test_ancestor_min_of_a_tree_that_does_not_tile_is_the_reduceat() -> None:
    """A hand-made site whose spans are not the incidence takes the reduceat itself."""
    from dataclasses import replace

    site = load_scenario(SCENARIOS / "sites/two-buildings.toml", []).site()
    stop = site.domain_rack_stop.copy()
    stop[-1] = site.domain_rack_start[-1]
    rm = RackMath(replace(site, domain_rack_stop=stop))
    share = np.random.default_rng(2).random(site.n_domains)
    rd = rm.rack_domains
    assert _bits(rm.ancestor_min(share, share < 1.0)) == _bits(np.minimum.reduceat(share[rd.indices], rd.indptr[:-1]))


def test_bbu_figures_worked_out_where_asked_are_the_whole_fleets() -> None:
    """BbuPolicy.affordable_w, reserve_soc and can_hold at some racks are the whole fleet's at those racks, to the
    bit, through the SoC runs a fleet goes through (rising, falling, turning, unknown) and any allowance."""
    from dimmer.control.rack_storage import BbuPolicy

    for name in ("swing-8k.toml", "sites/two-buildings.toml", "sites/bare-racks.toml"):  # (bare: racks without BBUs)
        site = load_scenario(SCENARIOS / name, []).site()
        bbus = BbuPolicy(site, 1.0, 90.0, 600.0)
        rng = np.random.default_rng(9)
        soc = rng.random(site.n_racks)
        for _ in range(30):
            soc = np.clip(soc + rng.normal(0.0, 0.02, site.n_racks), 0.0, 1.0)
            soc[rng.random(site.n_racks) < 0.03] = np.nan
            bbus.cycles.update(soc)
            bbus.allowance = rng.random(site.n_racks) * rng.choice([0.01, 1.0, 2.0])
            bbus.given_w = rng.random(site.n_racks) * 1e4 * (rng.random(site.n_racks) < 0.3)
            at = np.flatnonzero(rng.random(site.n_racks) < 0.3)
            for dt in (0.5, 1.0):
                assert _bits(bbus.affordable_w(dt, at)) == _bits(bbus.affordable_w(dt)[at])
            bound = rng.random(site.n_racks) * 2e5
            bound[rng.random(site.n_racks) < 0.03] = np.nan
            assert _bits(bbus.reserve_soc(bound[at], at)) == _bits(bbus.reserve_soc(bound)[at])
            assert np.array_equal(bbus.can_hold(soc, bound, at), bbus.can_hold(soc, bound)[at])


@pytest.mark.parametrize("name", (*SITES, "prometheus-campus.toml"))
def test_rack_sums_worked_out_where_racks_are_set_are_the_whole_ones(name: str) -> None:
    """RackMath.domain_load_w over only the racks that are set (+0.0 elsewhere) and rack_power_at_w at some racks
    are the whole vector's, to the bit: runs at either end, in the middle, empty, with NaN, inf and -0.0 set."""
    site = load_scenario(SCENARIOS / name, []).site()
    rm = RackMath(site)
    n = site.n_racks
    rng = np.random.default_rng(13)
    picks = [
        np.arange(0, 0),
        np.arange(0, min(5, n)),
        np.arange(n - 3, n),
        np.arange(n // 3, n // 2),
        np.array([0, n - 1]),
    ]
    picks += [np.flatnonzero(rng.random(n) < f) for f in (0.001, 0.1, 0.9)]
    for at in picks:
        for odd in (False, True):
            x = np.zeros(n)
            x[at] = rng.random(at.size) * 10.0 ** rng.integers(0, 7)
            if odd and at.size:
                x[at[rng.integers(0, at.size, 3)]] = rng.choice([np.nan, np.inf, -0.0, 0.0], 3)
            with np.errstate(invalid="ignore"):
                assert _bits(rm.domain_load_w(x, only_at=at)) == _bits(rm.domain_load_w(x))
            g = rng.random(at.size) * 1400.0
            full = np.zeros(n)
            full[at] = g
            assert _bits(rm.rack_power_at_w(g, at)) == _bits(rm.rack_power_w(full)[at])


def test_caps_in_force_kept_only_while_neither_moves() -> None:
    """The racks' caps and their draw at the caps in force, kept from one period to the next, are what a fresh
    working-out gives after every kind of change: the controller's caps assigned or written in place, the reported
    caps written in place (the same array) or replaced, NaN and -0.0 among them."""
    from dimmer.control import make_controller

    site = load_scenario(SCENARIOS / "sites/two-buildings.toml", []).site()
    ctrl = make_controller("dimmer", site, {})
    fresh = make_controller("dimmer", site, {})
    rng = np.random.default_rng(17)
    reported = np.full(site.n_racks, site.gpu.rated_w)
    for step in range(40):
        what = step % 5
        if what == 1:
            ctrl.cap_w = site.gpu.min_cap_w + rng.random(site.n_jobs) * 300.0  # type: ignore[attr-defined]
        elif what == 2:
            ctrl.cap_w[rng.integers(0, site.n_jobs)] -= 1.0  # type: ignore[attr-defined]
        elif what == 3:
            reported[rng.integers(0, site.n_racks, 5)] = rng.choice([np.nan, -0.0, 900.0, 1e9], 5)
        elif what == 4:
            reported = np.where(rng.random(site.n_racks) < 0.5, reported, site.gpu.rated_w)
        fresh.cap_w = ctrl.cap_w.copy()  # type: ignore[attr-defined]
        fresh._caps_kept = None  # type: ignore[attr-defined]
        mine = ctrl._caps_in_force(reported)  # type: ignore[attr-defined]
        theirs = fresh._caps_in_force(reported.copy())  # type: ignore[attr-defined]
        assert _bits(mine[0]) == _bits(theirs[0]) and _bits(mine[1]) == _bits(theirs[1])


def _find_period_long_way(level) -> int:  # type: ignore[no-untyped-def]
    """SwingLevel.find_period's rule written out lag by lag: of the lags 2..max_length whose correlation is a local
    peak of at least PERIOD_MIN_CORR, the least within PERIOD_NEAR_BEST of the highest such peak."""
    h = level._hist[~np.isnan(level._hist)]
    d = np.diff(h)
    n = d.size
    max_lag = min(level.max_length, n // 2)
    if max_lag < 2:
        return 0
    d = d - d.mean()
    var = float(d @ d)
    if var <= n * max(level.tol_abs, 1e-6 * float(np.abs(h).mean())) ** 2:
        return 0
    # (each lag's dot product as the filter takes it: the rule, not the rounding of a sum, is what is compared)
    corr = {k: float(d[: n - k] @ d[k:]) * n / (n - k) / var for k in range(1, max_lag + 2) if k < n}
    peaks = [
        k
        for k in range(2, max_lag + 1)
        if k + 1 in corr and corr[k] >= level.PERIOD_MIN_CORR and corr[k] >= corr[k - 1] and corr[k] >= corr[k + 1]
    ]
    if not peaks:
        return 0
    best = max(corr[k] for k in peaks)
    return min(k for k in peaks if corr[k] >= best - level.PERIOD_NEAR_BEST)


@settings(max_examples=examples(40), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    period=st.integers(1, 20),
    length=st.integers(2, 8),
    max_length=st.integers(2, 20),
    noise=st.sampled_from([0.0, 0.01, 0.3, 3.0]),
)
def test_find_period_is_its_rule_lag_by_lag(seed: int, period: int, length: int, max_length: int, noise: float) -> None:
    """The readings' period, its lags' correlations worked out as one array, is the rule worked out lag by lag, reading
    after reading (steps, swings of any period, noise, NaN)."""
    from dimmer.control.filters import SwingLevel

    rng = np.random.default_rng(seed)
    level = SwingLevel(length, tol_abs=0.05, max_length=max_length)
    for i in range(80):
        x = 10.0 + np.sin(2 * np.pi * i / period) + noise * rng.normal() + (5.0 if i > 40 else 0.0)
        level.update(float(np.nan) if rng.random() < 0.05 else x)
        assert level.find_period() == _find_period_long_way(level)


def test_clip_float_is_numpys() -> None:
    """clip_float is float(np.clip(x, lo, hi)) to the bit over NaN, infinities, signed zeros and crossed bounds."""
    from dimmer.control.rack_math import clip_float

    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-300, -1e300]
    rng = np.random.default_rng(3)
    values = special + list(rng.normal(0.0, 2.0, 12))
    for x in values:
        for lo in values:
            for hi in values:
                mine = clip_float(x, lo, hi)
                with np.errstate(invalid="ignore"):
                    theirs = float(np.clip(x, lo, hi))
                assert type(mine) is float
                assert _bits(np.array(mine)) == _bits(np.array(theirs)), (x, lo, hi, mine, theirs)
