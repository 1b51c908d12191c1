"""Racks of one job out of lockstep: a fixed per-rack phase offset within the skew and a per-rack swing gain.

Off (both keys zero) is the lockstep model as it was, to the bit; on, a job's racks stay within the skew of each
other for ever while separate jobs drift apart, each iteration's energy is kept, the same seed gives the same
racks, and the measured defaults are what the shared 2-GPU log gives.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dimmer.errors import InputError
from gridsim.plant.rack_spread import RackSpread, compute_fraction, measure_pair, rack_levels
from gridsim.plant.trace import load_nvsmi_trace
from gridsim.plant.workload import BackgroundSpec, CheckpointSpec, JobSpec, Workload
from gridsim.scenario import validate_scenario
from tests.budget import examples
from tests.conftest import SHARED_DATA
from tests.test_workload import GPUS_PER_RACK, IDLE_W, RATED_W, Runner, job, make, make_site

TITANX = SHARED_DATA / "gpu_titanx_2gpu_ddp_gpt_train_nvsmi100ms_noburn_2025-12-10.csv"
OFF = {"rack_phase_skew_s": 0.0, "rack_amplitude_spread_frac": 0.0}


def _spread_workload(jobs: list[JobSpec], seed: int = 0, rack_seed: int = 1, **site_kw: Any) -> Workload:
    site = make_site(jobs, **site_kw)
    rng = np.random.default_rng(seed)
    return Workload(site, jobs, BackgroundSpec(), rng, rack_rng=np.random.default_rng(rack_seed))


# ------------------------------------------------------------------------------------------------- off
def test_off_is_the_lockstep_workload_to_the_bit() -> None:
    """The digest of this run made by the code before the spread existed (commit e332f30): demand and states of
    two jobs with jitter, random failures, a sync checkpoint, hot spares and inference background, 200 s."""
    jobs = [
        job("a", (0, 5), jitter_frac=0.05, mtbi_gpu_h=3, recovery_s=5, ramp_s=2, restart_ramp_s=1, **OFF),
        job("b", (5, 7), iteration_s=0.7, checkpoint=CheckpointSpec(mode="sync", interval_s=20, duration_s=3), **OFF),
    ]
    w = make(jobs, seed=11, spare=0.25, background=BackgroundSpec(kind="inference"))
    _, d, s = Runner(w).run(200.0, 0.1)
    digest = hashlib.sha256(np.ascontiguousarray(d).tobytes() + s.tobytes()).hexdigest()
    assert digest == "0891552c73c25c716ecf0e9d9cfd10b9252f06a7be15e22946c109317cac9348"
    assert w._spread is None


def test_one_jobs_spread_leaves_the_other_jobs_and_the_job_stream_alone() -> None:
    """The racks' draws come from their own generator: turning a job's spread on moves no other number."""
    a_off = job("a", (0, 4), jitter_frac=0.05, mtbi_gpu_h=5, recovery_s=3, **OFF)
    b = job("b", (4, 8), iteration_s=1.3, jitter_frac=0.03, **OFF)
    a_on = a_off.model_copy(update={"rack_phase_skew_s": 0.05, "rack_amplitude_spread_frac": 0.1})
    w_off, w_on = make([a_off, b], seed=5), make([a_on, b], seed=5)
    _, d_off, s_off = Runner(w_off).run(120.0, 0.1)
    _, d_on, s_on = Runner(w_on).run(120.0, 0.1)
    assert np.array_equal(s_off, s_on)  # the same failures, at the same ticks
    assert np.array_equal(d_off[:, 4:], d_on[:, 4:])  # job b's racks untouched
    assert not np.array_equal(d_off[:, :4], d_on[:, :4])


# ------------------------------------------------------------------------------------- the skew, the drift
def _rising_edges(t: np.ndarray, x: np.ndarray, mid: float) -> np.ndarray:
    """Times a tick-mean series crosses `mid` upwards, interpolated between tick ends (within a tick)."""
    i = np.flatnonzero((x[:-1] <= mid) & (x[1:] > mid))
    return t[i] + (mid - x[i]) / (x[i + 1] - x[i]) * (t[i + 1] - t[i])


def test_a_jobs_racks_stay_within_the_skew_while_separate_jobs_drift_apart() -> None:
    skew, dt = 0.06, 0.005
    a = job("a", (0, 4), iteration_s=1.0, jitter_frac=0.03, rack_phase_skew_s=skew, rack_amplitude_spread_frac=0.0)
    b = job("b", (4, 8), iteration_s=1.0, jitter_frac=0.03, rack_phase_skew_s=skew, rack_amplitude_spread_frac=0.0)
    w = _spread_workload([a, b], seed=3)
    t, d, _ = Runner(w).run(300.0, dt)
    mid = 0.9 * RATED_W * (1 - 0.35 / 2)
    # from 0.5 s: at the start a rack ahead of its job is already in compute and shows no first rising edge
    edges = [x[x > 0.5] for x in (_rising_edges(t, d[:, r], mid) for r in range(8))]
    n = min(e.size for e in edges)
    assert n > 250  # ~300 iterations each, some edges in the last one cut
    e = np.stack([x[:n] for x in edges])  # (racks, iterations): the k-th edge of every rack
    for racks in (slice(0, 4), slice(4, 8)):
        within = e[racks].max(axis=0) - e[racks].min(axis=0)
        assert within.max() <= skew + 2 * dt  # at every iteration, not only on average: no drift
        lag = e[racks] - e[racks][:1]
        assert np.all(lag.std(axis=1) < dt)  # each rack keeps its own offset
        assert within.max() > skew / 4  # and they are not in lockstep
    # jobs a and b start together; their jittered periods are drawn apart, so their k-th edges wander apart
    apart = np.abs(e[0] - e[4])
    assert apart[0] < 0.2
    assert apart.max() > 0.5
    assert np.std(np.diff(e[0])) > 0.02  # the per-iteration jitter that drives the drift


def test_compute_fraction_is_the_share_of_the_interval_in_compute() -> None:
    L, on = np.array(2.0), np.array(1.4)
    # an interval wholly in compute, wholly in the trough, across the falling edge, across the wrap
    phase = np.array([0.5, 1.8, 1.45, 0.05, 0.0, 1.9])
    step = np.array([0.1, 0.1, 0.1, 0.1, 0.0, 0.0])
    got = compute_fraction(phase, step, L, on, np.zeros(6))
    np.testing.assert_allclose(got, [1.0, 0.0, 0.5, 0.5, 1.0, 0.0], atol=1e-12)
    # a rack 30 ms behind sees the rising edge 30 ms later; one ahead, earlier
    late = compute_fraction(np.array(0.05), np.array(0.1), L, on, np.array(0.03))
    early = compute_fraction(np.array(0.05), np.array(0.1), L, on, np.array(-0.03))
    assert late == pytest.approx(0.2) and early == pytest.approx(0.8)


@settings(max_examples=examples(40), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ticks=st.integers(1, 12), skew=st.floats(0.0, 0.3), spread=st.floats(0.0, 0.5))
def test_rack_levels_of_a_block_are_its_ticks_and_the_plain_formula(
    seed: int, ticks: int, skew: float, spread: float
) -> None:
    """Only racks of a job at an edge take the formula; the rest read peak or trough. A block of ticks gives what
    its ticks give one at a time, to the bit, and both are the formula on every rack, to rounding."""
    rng = np.random.default_rng(seed)
    jobs = [
        job(f"j{i}", (2 * i, 2 * i + 2), rack_phase_skew_s=skew, rack_amplitude_spread_frac=spread) for i in range(4)
    ]
    site = make_site(jobs)
    n = len(jobs)
    peak = rng.uniform(600, RATED_W, n)
    trough = peak * rng.uniform(0.3, 1.0, n)
    sp = RackSpread.build(site, jobs, rng, peak, trough, IDLE_W, RATED_W)
    if sp is None:
        assert skew == 0 and spread == 0
        return
    length = rng.uniform(0.7, 3.0, (ticks, n))
    on = length * rng.uniform(0.2, 1.0, (ticks, n))
    phase = length * rng.random((ticks, n))
    phase[rng.random((ticks, n)) < 0.2] = 0.0  # a tick that has just wrapped
    step = np.where(rng.random((ticks, n)) < 0.1, 0.0, rng.uniform(0.0, 0.1, (ticks, n)))
    running = rng.random(n) < 0.8
    held = rng.uniform(IDLE_W, RATED_W, (ticks, n))
    block = rack_levels(sp, phase, step, length, on, running, held, IDLE_W, RATED_W)
    for t in range(ticks):
        one = rack_levels(sp, phase[t], step[t], length[t], on[t], running, held[t], IDLE_W, RATED_W)
        assert np.array_equal(one, block[t])
    j = sp.job
    frac = compute_fraction(phase[:, j], step[:, j], length[:, j], on[:, j], sp.offset_s)
    plain = np.clip(sp.trough_w + sp.swing_w * frac, IDLE_W, RATED_W)
    np.testing.assert_allclose(block, np.where(running[j], plain, held[:, j]), rtol=1e-9)


# ------------------------------------------------------------------------------------------------ energy
def test_each_iterations_energy_is_kept_by_the_skew_and_the_gains() -> None:
    """No jitter: every iteration window, cut mid-trough, holds exactly the job's nominal energy on every rack."""
    a = job("a", (0, 8), iteration_s=2.0, rack_phase_skew_s=0.05, rack_amplitude_spread_frac=0.05)
    w = _spread_workload([a])
    _, d, _ = Runner(w).run(212.0, 0.1)
    peak, trough = 0.9 * RATED_W, 0.9 * RATED_W * 0.65
    nominal = 2.0 * (0.7 * peak + 0.3 * trough)  # J per GPU per iteration
    gains = w._spread.gain if w._spread is not None else np.ones(8)
    assert np.ptp(gains) > 0.05 and np.mean(gains) == pytest.approx(1.0, abs=1e-12)
    k0 = round(11.7 / 0.1)  # mid-trough of the sixth iteration: every rack, early or late, is in its trough
    per_iter = d[k0 : k0 + 100 * 20].reshape(100, 20, 8).sum(axis=1) * 0.1  # (iterations, racks)
    np.testing.assert_allclose(per_iter.mean(axis=1), nominal, rtol=1e-9)  # the job's racks together
    each = trough * 2.0 + gains * (peak - trough) * 1.4  # each rack's own, with its gain
    np.testing.assert_allclose(per_iter, np.broadcast_to(each, per_iter.shape), rtol=1e-9)


def test_with_jitter_the_skew_moves_no_energy() -> None:
    """The same jittered iterations (the job's stream), with and without the skew: the same energy per job."""
    common = {"iteration_s": 1.5, "jitter_frac": 0.05, "rack_amplitude_spread_frac": 0.02}
    skewed = _spread_workload([job("a", (0, 8), rack_phase_skew_s=0.08, **common)], seed=9)
    aligned = _spread_workload([job("a", (0, 8), rack_phase_skew_s=0.0, **common)], seed=9)
    _, d1, _ = Runner(skewed).run(600.0, 0.1)
    _, d0, _ = Runner(aligned).run(600.0, 0.1)
    e1, e0 = d1.sum() * 0.1, d0.sum() * 0.1
    sp = skewed._spread
    assert sp is not None
    # only the racks' first and last edges differ: at most each rack's offset of swing at either end
    swing_w = 0.35 * 0.9 * RATED_W * float(sp.gain.max())
    assert abs(e1 - e0) <= 2 * float(np.abs(sp.offset_s).sum()) * swing_w
    assert abs(e1 - e0) < 1e-4 * d0.sum() * 0.1
    assert not np.array_equal(d1, d0)
    # the aggregate edge is smoothed: the largest tick-to-tick step of the job's total falls
    assert np.abs(np.diff(d1.sum(axis=1))).max() < np.abs(np.diff(d0.sum(axis=1))).max()


# -------------------------------------------------------------------------------------------- properties
@settings(max_examples=examples(30), deadline=None)
@given(
    skew_frac=st.floats(0.0, 0.49),
    spread=st.floats(0.0, 0.99),
    iteration_s=st.floats(0.3, 4.0),
    compute_frac=st.floats(0.05, 1.0),
    peak_frac=st.floats(0.3, 1.0),
    jitter=st.floats(0.0, 0.3),
    seed=st.integers(0, 2**32 - 1),
)
def test_same_seed_same_racks_and_every_level_within_its_bounds(
    skew_frac: float, spread: float, iteration_s: float, compute_frac: float, peak_frac: float, jitter: float, seed: int
) -> None:
    skew = skew_frac * iteration_s
    spec = job(
        "a",
        (0, 6),
        iteration_s=iteration_s,
        compute_frac=compute_frac,
        peak_frac=peak_frac,
        jitter_frac=jitter,
        rack_phase_skew_s=skew,
        rack_amplitude_spread_frac=spread,
    )
    runs = []
    for _ in range(2):
        w = _spread_workload([spec], seed=seed, rack_seed=seed + 1)
        runs.append((w, Runner(w).run(12.0, 0.1)[1]))
    (w, d), (_, d2) = runs
    assert np.array_equal(d, d2)
    sp = w._spread
    if skew == 0 and spread == 0:
        assert sp is None
        return
    assert sp is not None
    assert np.all(np.abs(sp.offset_s) <= skew / 2) and np.ptp(sp.offset_s) <= skew
    assert np.mean(sp.gain) == pytest.approx(1.0, abs=1e-12)
    bound = 6 * spread  # z clipped to +-3, less its job mean: a gain within 1 +- 6 spread
    assert np.all(np.abs(sp.gain - 1.0) <= bound + 1e-12)
    peak, trough = w._peak_w[0], w._trough_w[0]
    run = d[:, :6]
    hi = min(RATED_W, trough + (peak - trough) * (1 + bound)) + 1e-9
    lo = max(IDLE_W, min(trough, trough + (peak - trough) * (1 - bound))) - 1e-9
    assert np.all(run <= hi) and np.all(run >= lo)
    assert np.all(d >= IDLE_W) and np.all(d <= RATED_W)


# ----------------------------------------------------------------------------------------- measured defaults
def test_the_defaults_are_the_measured_two_gpu_log() -> None:
    if not TITANX.is_file():
        pytest.skip(f"measured trace {TITANX} is absent")
    t_s, power_w = load_nvsmi_trace(TITANX, 2, "test", "trace")
    total = power_w.sum(axis=1)
    training = (t_s > 24.0) & (total > 230.0)  # past the idle warm-up, out of the evaluation dips (test_trace.py)
    m = measure_pair(t_s, power_w, training)
    assert m.edges > 700
    # the two GPUs' transitions: best correlated at lag 0 of 100 ms samples, median edge lag a few ms
    assert m.xcorr_peak_lag == 0
    assert abs(m.edge_lag_s) < 0.01 and max(abs(x) for x in m.edge_lag_ci_s) < 0.01
    default = JobSpec(name="x", gpus=64)
    assert default.rack_phase_skew_s == 0.01  # the bound the log gives: within 10 ms
    # amplitude: GPU 1 swings 0.87 of GPU 0 (compute phase 0.94, trough 0.96 of its power)
    assert m.swing_ratio == pytest.approx(0.867, abs=0.005)
    assert m.compute_ratio == pytest.approx(0.942, abs=0.005)
    assert m.trough_ratio == pytest.approx(0.964, abs=0.005)
    assert m.gpu_spread_frac == pytest.approx(0.10, abs=0.005)
    # a rack averages its 64 GPUs' independent spreads: 0.10 / 8
    assert default.rack_amplitude_spread_frac == pytest.approx(m.gpu_spread_frac / np.sqrt(GPUS_PER_RACK), abs=5e-4)


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("rack_phase_skew_s", -0.01, "greater than or equal to 0"),
        ("rack_amplitude_spread_frac", 1.0, "less than 1"),
        ("rack_amplitude_spread_frac", -0.1, "greater than or equal to 0"),
        ("rack_phase_skew_s", 1.0, "below half of iteration_s"),
    ],
)
def test_bad_values_name_the_key(key: str, value: float, says: str) -> None:
    with pytest.raises(ValidationError) as info:
        JobSpec(name="x", gpus=64, iteration_s=2.0, **{key: value})
    assert key in str(info.value) and says in str(info.value)
    raw = {
        "name": "t",
        "duration_s": 10,
        "site": {
            "pcc": {"limit_mw": 2.0},
            "levels": [{"level": "row", "count": 2, "rating_kw": 600}, {"level": "rack", "count": 4}],
        },
        "jobs": [{"name": "j", "gpus": 256, key: value}],
    }
    with pytest.raises(InputError) as err:
        validate_scenario(raw, "sc.toml")
    line = str(err.value)
    assert line.startswith("sc.toml: jobs[0]") and "\n" not in line
    assert key in line


def test_a_trace_job_refuses_a_spread_it_was_given() -> None:
    with pytest.raises(ValidationError, match="rack_phase_skew_s applies to kind = 'synthetic'"):
        JobSpec(name="x", gpus=64, kind="trace", trace_path="t.csv", rack_phase_skew_s=0.02)
    # the defaults are not applied to it, nor checked against an iteration_s a trace does not use
    spec = JobSpec(name="x", gpus=64, kind="trace", trace_path="t.csv", iteration_s=0.01)
    assert spec.rack_phase_skew_s > 0
