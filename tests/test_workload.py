"""Training workload: the iteration swing, the job state machine and its power transients, and goodput."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dimmer.errors import InputError
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import JobPlacementSpec, LevelSpec, PccSpec, SiteSpec
from gridsim.plant.workload import (
    ACCOUNTING_KEYS,
    LOSS_KEYS,
    BackgroundSpec,
    CheckpointSpec,
    JobSpec,
    JobState,
    Workload,
)
from tests.budget import examples

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TITANX = DATA / "gpu_titanx_2gpu_ddp_gpt_train_nvsmi100ms_noburn_2025-12-10.csv"

RATED_W = 1400.0  # gb300
IDLE_W = 165.0
GPUS_PER_RACK = 64  # active of 72


def make_site(jobs: list[JobSpec], rows: int = 2, racks_per_row: int = 4, spare: float = 0.0) -> SiteModel:
    spec = SiteSpec(
        gpu="gb300",
        spare_rack_frac=spare,
        pcc=PccSpec(limit_mw=1000),
        levels=[
            LevelSpec(level="row", count=rows, rating_kw=5000),
            LevelSpec(level="rack", count=racks_per_row),
        ],
    )
    placed: list[JobPlacementSpec] = list(jobs)
    return build_site(spec, placed)


def job(name: str = "j", racks: tuple[int, int] = (0, 4), **kw: Any) -> JobSpec:
    """A job whose racks run in lockstep (no rack spread) unless `kw` says otherwise: tests/test_rack_spread.py
    covers the spread; here the exact peak, trough and edges of the swing are what is checked."""
    base: dict[str, Any] = {"jitter_frac": 0.0, "ramp_s": 0.0, "restart_ramp_s": 0.0, "start_s": 0.0}
    if kw.get("kind", "synthetic") == "synthetic":
        base.update(rack_phase_skew_s=0.0, rack_amplitude_spread_frac=0.0)
    base.update(kw)
    return JobSpec(name=name, racks=racks, **base)


def make(jobs: list[JobSpec], seed: int = 0, background: BackgroundSpec | None = None, **site_kw: Any) -> Workload:
    site = make_site(jobs, **site_kw)
    return Workload(site, jobs, background or BackgroundSpec(), np.random.default_rng(seed))


class Runner:
    """Drives a workload with constant (or per-call) inputs and records demand and states."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.speed = np.ones(w.n_jobs)
        self.suspend = np.zeros(w.n_jobs, dtype=bool)
        self.energized = np.ones(w.site.n_racks, dtype=bool)

    def run(self, duration_s: float, dt_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = round(duration_s / dt_s)
        t = np.empty(n)
        demand = np.empty((n, self.w.site.n_racks))
        state = np.empty((n, self.w.n_jobs), dtype=np.int64)
        for k in range(n):
            self.w.advance(dt_s, self.speed, self.suspend, self.energized)
            t[k] = self.w.t_s
            demand[k] = self.w.rack_demand_w()
            state[k] = self.w.job_state
        return t, demand, state


def check_invariant(w: Workload) -> dict[str, np.ndarray]:
    acc = w.accounting()
    assert set(acc) == set(ACCOUNTING_KEYS)
    total = acc["useful"] + sum(acc[k] for k in LOSS_KEYS)
    scale = np.maximum(acc["allocated"], 1.0)
    # exact up to float rounding of the sums (relative 1e-12 over thousands of ticks)
    np.testing.assert_allclose(total / scale, acc["allocated"] / scale, rtol=0, atol=1e-9)
    for k in ("useful", *LOSS_KEYS):
        assert np.all(acc[k] >= -1e-6 * scale), k
    return acc


# ---------------------------------------------------------------------------------------------- the swing
def test_swing_depth_period_and_duty_from_fft() -> None:
    w = make([job(iteration_s=2.0, compute_frac=0.7, swing_frac=0.35, peak_frac=0.9)])
    _, d, _ = Runner(w).run(400.0, 0.05)
    x = d[:, 0]
    peak, trough = 0.9 * RATED_W, 0.9 * RATED_W * 0.65
    assert x.max() == pytest.approx(peak) and x.min() == pytest.approx(trough)
    assert (x.max() - x.min()) / x.max() == pytest.approx(0.35)
    f = np.fft.rfftfreq(x.size, 0.05)
    spectrum = np.abs(np.fft.rfft(x - x.mean()))
    assert f[np.argmax(spectrum)] == pytest.approx(0.5, abs=1.0 / 400)
    assert np.mean(x == peak) == pytest.approx(0.7, abs=0.01)


def test_jittered_period_from_rising_edges() -> None:
    w = make([job(iteration_s=2.0, jitter_frac=0.05)], seed=3)
    t, d, _ = Runner(w).run(600.0, 0.01)
    high = d[:, 0] > 0.8 * RATED_W
    rises = t[1:][high[1:] & ~high[:-1]]
    periods = np.diff(rises)
    assert periods.size > 250
    assert periods.mean() == pytest.approx(2.0, rel=0.01)
    assert periods.std() == pytest.approx(0.05 * 2.0, rel=0.25)  # the per-iteration stretch


def test_a_capped_job_iterates_slower_and_loses_throughput() -> None:
    w = make([job(iteration_s=2.0)])
    r = Runner(w)
    r.speed[:] = 0.5
    _, d, _ = r.run(400.0, 0.05)
    x = d[:, 0]
    f = np.fft.rfftfreq(x.size, 0.05)
    assert f[np.argmax(np.abs(np.fft.rfft(x - x.mean())))] == pytest.approx(0.25, abs=1.0 / 400)
    acc = check_invariant(w)
    gpus = w.site.job_gpus[0]
    assert acc["cap"][0] == pytest.approx(0.5 * 400.0 * gpus, rel=1e-9)
    assert acc["useful"][0] == pytest.approx(0.5 * 400.0 * gpus, rel=1e-9)


def test_all_racks_of_a_job_stay_in_lockstep() -> None:
    jobs = [
        job("a", (0, 5), jitter_frac=0.05, mtbi_gpu_h=3, recovery_s=5, ramp_s=2, restart_ramp_s=1),
        job("b", (5, 8), iteration_s=0.7, checkpoint=CheckpointSpec(mode="sync", interval_s=20, duration_s=3)),
    ]
    w = make(jobs, seed=7, spare=0.25)
    site = w.site
    assert site.rack_is_spare.any()
    _, d, state = Runner(w).run(300.0, 0.1)
    assert (state[:, 0] == JobState.DOWN).any() and (state[:, 1] == JobState.CHECKPOINT).any()
    for j in range(2):
        run = np.flatnonzero((site.rack_job == j) & ~site.rack_is_spare)
        assert run.size >= 2
        assert np.all(d[:, run] == d[:, run[:1]])
    assert np.all(d[:, site.rack_is_spare] == IDLE_W)  # hot-spare racks idle


def test_demand_bounds_and_peak_readout() -> None:
    jobs = [job("a", (0, 4), peak_frac=1.0, swing_frac=1.0), job("b", (4, 6), peak_frac=0.05)]
    w = make(jobs)
    peak = w.rack_peak_w()
    np.testing.assert_allclose(peak, [RATED_W] * 4 + [IDLE_W] * 2 + [RATED_W] * 2)
    _, d, _ = Runner(w).run(20.0, 0.1)
    assert d.max() == RATED_W and d.min() == IDLE_W  # the trough and a tiny peak are floored at idle
    assert np.all(d[:, 6:] == IDLE_W)  # no job, idle background


# ---------------------------------------------------------------------------------------------- ramps
def test_start_ramp_duration_and_startup_cost() -> None:
    w = make([job(start_s=5.0, ramp_s=3.0, swing_frac=0.0, peak_frac=0.9)])
    t, d, state = Runner(w).run(12.0, 0.1)
    peak = 0.9 * RATED_W
    x = d[:, 0]
    assert np.all(x[t < 5.0 - 1e-9] == IDLE_W)
    assert np.all(state[t < 5.0 - 1e-9, 0] == JobState.WAITING)
    starting = t[state[:, 0] == JobState.STARTING]
    assert starting.min() == pytest.approx(5.0) and starting.max() == pytest.approx(7.9)
    mid = np.argmin(np.abs(t - 6.5))
    assert x[mid] == pytest.approx(IDLE_W + 0.5 * (peak - IDLE_W))
    assert np.all(np.diff(x[(t > 5.0) & (t < 8.0)]) > 0)
    assert np.all(x[t > 8.0 - 1e-9] == pytest.approx(peak))
    acc = check_invariant(w)
    gpus = w.site.job_gpus[0]
    assert acc["startup"][0] == pytest.approx(3.0 * gpus)
    assert acc["allocated"][0] == pytest.approx(7.0 * gpus)
    assert acc["useful"][0] == pytest.approx(4.0 * gpus)


def test_stop_ramps_down_and_keeps_uncommitted_work() -> None:
    w = make([job(stop_s=50.0, ramp_s=2.0, swing_frac=0.0, checkpoint=CheckpointSpec(mode="none"))])
    t, d, state = Runner(w).run(60.0, 0.1)
    x = d[:, 0]
    assert np.all(x[(t > 2.0) & (t < 50.0 - 1e-9)] == pytest.approx(0.9 * RATED_W))
    assert x[np.argmin(np.abs(t - 51.0))] == pytest.approx(IDLE_W + 0.5 * (0.9 * RATED_W - IDLE_W))
    assert np.all(x[t > 52.0 - 1e-9] == IDLE_W)
    assert state[-1, 0] == JobState.DONE
    assert w.job_ended()[0] and not w.job_running()[0]  # released: what a scheduler tells the controller
    acc = check_invariant(w)
    gpus = w.site.job_gpus[0]
    assert acc["allocated"][0] == pytest.approx(50.0 * gpus)
    assert acc["useful"][0] == pytest.approx(48.0 * gpus)  # never checkpointed, all of it counts at the end
    w.start(np.array([True]))  # a DONE job resumes from its progress
    assert w.job_state[0] == JobState.STARTING and not w.job_ended()[0]


# ---------------------------------------------------------------------------------------------- checkpoints
def test_sync_checkpoint_dip_and_goodput_cost() -> None:
    ck = CheckpointSpec(mode="sync", interval_s=60.0, duration_s=10.0, dip_frac=0.3)
    w = make([job(swing_frac=0.0, checkpoint=ck)])
    t, d, state = Runner(w).run(300.0, 0.1)
    x = d[:, 0]
    peak = 0.9 * RATED_W
    in_ck = state[:, 0] == JobState.CHECKPOINT
    assert np.all(x[in_ck] == pytest.approx(0.3 * peak))
    assert np.all(x[~in_ck] == pytest.approx(peak))
    starts = t[1:][in_ck[1:] & ~in_ck[:-1]]
    # a stall every 60 s of progress, i.e. every 70 s of wall time: at 60, 130, 200, 270 s
    np.testing.assert_allclose(starts, [60.0, 130.0, 200.0, 270.0], atol=0.11)
    assert in_ck.sum() == pytest.approx(40.0 / 0.1, abs=4)
    assert not w.job_running()[0] or w.job_state[0] == JobState.RUNNING
    acc = check_invariant(w)
    gpus = w.site.job_gpus[0]
    assert acc["checkpoint"][0] == pytest.approx(40.0 * gpus, rel=1e-3)
    assert acc["useful"][0] == pytest.approx(260.0 * gpus, rel=1e-3)
    assert w.job_committed_s[0] == pytest.approx(240.0, abs=0.2)


def test_async_checkpoint_does_not_stall_and_commits_after_the_write() -> None:
    ck = CheckpointSpec(mode="async", interval_s=60.0, duration_s=10.0)
    w = make([job(swing_frac=0.0, checkpoint=ck)])
    r = Runner(w)
    _, d, _ = r.run(65.0, 0.1)
    assert np.all(d[:, 0] == pytest.approx(0.9 * RATED_W))
    assert w.job_state[0] == JobState.CHECKPOINT and w.job_running()[0]
    assert w.job_committed_s[0] == 0.0  # the write has not finished
    r.run(10.0, 0.1)
    assert w.job_state[0] == JobState.RUNNING
    assert w.job_committed_s[0] == pytest.approx(60.0, abs=0.11)
    acc = check_invariant(w)
    assert acc["checkpoint"][0] == 0.0
    assert acc["useful"][0] == pytest.approx(75.0 * w.site.job_gpus[0])


# ---------------------------------------------------------------------------------------------- interruptions
def test_rollback_loss_equals_work_since_last_checkpoint() -> None:
    ck = CheckpointSpec(mode="async", interval_s=100.0, duration_s=0.0)
    w = make([job(checkpoint=ck, recovery_s=30.0, restart_ramp_s=2.0, ramp_s=1.0)])
    r = Runner(w)
    r.run(251.0, 0.1)  # 1 s start ramp, then 250 s of work; commits at 100 and 200
    gpus = w.site.job_gpus[0]
    assert w.job_committed_s[0] == pytest.approx(200.0, abs=0.11)
    before = w.accounting()
    since = w.job_progress_s[0] - w.job_committed_s[0]
    assert since == pytest.approx(50.0, abs=0.11)
    w.interrupt(np.array([True]), "failure")
    assert w.job_state[0] == JobState.DOWN
    assert w.rack_demand_w()[0] == IDLE_W
    after = check_invariant(w)
    assert after["failure"][0] - before["failure"][0] == pytest.approx(since * gpus)
    assert before["useful"][0] - after["useful"][0] == pytest.approx(since * gpus)
    assert w.interruptions()["failure"][0] == 1
    t, _, state = r.run(40.0, 0.1)
    down = t[state[:, 0] == JobState.DOWN]
    restarting = t[state[:, 0] == JobState.RESTARTING]
    assert down.max() == pytest.approx(251.0 + 29.9)
    assert restarting.min() == pytest.approx(281.0) and restarting.max() == pytest.approx(282.9)
    acc = check_invariant(w)
    assert acc["recovery"][0] == pytest.approx(30.0 * gpus)
    assert acc["startup"][0] == pytest.approx(3.0 * gpus)  # the first start and the restart surge


def test_power_loss_interrupts_and_waits_for_power() -> None:
    ck = CheckpointSpec(mode="async", interval_s=100.0, duration_s=0.0)
    w = make([job(checkpoint=ck, recovery_s=20.0, restart_ramp_s=1.0), job("b", (4, 8))])
    r = Runner(w)
    r.run(150.0, 0.1)
    gpus = w.site.job_gpus[0]
    r.energized[2] = False  # one rack of job 0 loses power for 60 s
    t, d, state = r.run(60.0, 0.1)
    assert np.all(state[:, 0] == JobState.DOWN)  # far longer than recovery_s: it waits for power
    assert np.all(state[:, 1] == JobState.RUNNING)
    assert np.all(d[:, :4] == IDLE_W)
    r.energized[2] = True
    t, _, state = r.run(30.0, 0.1)
    restart = t[state[:, 0] == JobState.RESTARTING]
    assert restart.min() == pytest.approx(230.0, abs=0.11)  # recovery counts from the power's return
    acc = check_invariant(w)
    assert w.interruptions()["power"][0] == 1
    # the power's bill: the 50 s of lost work, 80 s down and the 1 s restart surge
    assert acc["trip"][0] == pytest.approx((50.0 + 80.0 + 1.0) * gpus, rel=1e-3)
    assert acc["recovery"][0] == 0.0 and acc["failure"][0] == 0.0
    assert acc["trip"][1] == 0.0


def test_suspend_holds_the_job_without_rollback() -> None:
    w = make([job(restart_ramp_s=2.0, checkpoint=CheckpointSpec(mode="none"))])
    r = Runner(w)
    r.run(100.0, 0.1)
    progress = w.job_progress_s[0]
    r.suspend[0] = True
    _, d, state = r.run(30.0, 0.1)
    assert np.all(state[:, 0] == JobState.SUSPENDED) and np.all(d[:, 0] == IDLE_W)
    assert w.job_progress_s[0] == progress  # no progress, no rollback
    r.suspend[0] = False
    _, _, state = r.run(10.0, 0.1)
    # the resume acts at the start of the first tick; states are read at the ends: 19 reads, 2.0 s
    assert np.sum(state[:, 0] == JobState.RESTARTING) == 19
    assert w.job_progress_s[0] == pytest.approx(progress + 8.0)
    acc = check_invariant(w)
    assert acc["suspend"][0] == pytest.approx(32.0 * w.site.job_gpus[0])


def test_interruption_rate_matches_mtbi() -> None:
    # the worst figure of the seeds: ~1000 interruptions a day per 8k GPUs (MTBI ~192 GPU-hours)
    jb = JobSpec(name="big", racks=(0, 128), mtbi_gpu_h=192.0, recovery_s=0.0, restart_ramp_s=0.0, ramp_s=0.0)
    site = make_site([jb], rows=8, racks_per_row=16)
    assert site.job_gpus[0] == 8192
    w = Workload(site, [jb], BackgroundSpec(), np.random.default_rng(2024))
    r = Runner(w)
    horizon_s = 24 * 3600.0
    live_s = 0.0
    for _ in range(24):
        _, _, state = r.run(3600.0, 1.0)
        live_s += np.isin(state[:, 0], [JobState.RUNNING, JobState.CHECKPOINT]).sum() * 1.0
    n = w.interruptions()["failure"][0]
    expected = 8192 * live_s / (192.0 * 3600.0)
    assert expected == pytest.approx(8192 / 192 * 24, rel=0.05)  # ~1000 a day per 8k GPUs
    assert abs(n - expected) < 4.0 * np.sqrt(expected)
    downs = np.array([e.t_s for e in w.events if e.kind == "down"])
    assert downs.size == n and downs.max() <= horizon_s
    gaps = np.diff(downs)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.15)  # exponential inter-arrival times
    check_invariant(w)


def test_same_seed_same_series_and_different_seed_differs() -> None:
    jobs = [job("a", (0, 4), jitter_frac=0.05, mtbi_gpu_h=100), job("b", (4, 6), jitter_frac=0.1)]
    bg = BackgroundSpec(kind="inference")

    def series(seed: int) -> np.ndarray:
        return Runner(make(jobs, seed=seed, background=bg)).run(200.0, 0.1)[1]

    a, b, c = series(11), series(11), series(12)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_inference_background_statistics() -> None:
    bg = BackgroundSpec(kind="inference", mean_frac=0.5, noise_frac=0.05, noise_tau_s=2.0)
    w = make([job("a", (0, 1))], background=bg, rows=4, racks_per_row=16)
    _, d, _ = Runner(w).run(400.0, 0.5)
    x = d[:, 1:]
    assert x.mean() == pytest.approx(0.5 * RATED_W, rel=0.02)
    assert x.std() == pytest.approx(0.05 * RATED_W, rel=0.1)
    lag1 = np.mean([np.corrcoef(x[:-1, i], x[1:, i])[0, 1] for i in range(x.shape[1])])
    assert lag1 == pytest.approx(np.exp(-0.5 / 2.0), abs=0.05)
    assert x.min() >= IDLE_W and x.max() <= RATED_W


# ---------------------------------------------------------------------------------------------- traces, specs
def test_trace_job_replays_the_measured_trace(tmp_path: Path) -> None:
    rows = ["timestamp, power.draw [W]"]
    pattern = [100.0, 100.0, 250.0, 250.0]  # 0.4 s period at 0.1 s, rated 250 W
    for i in range(40):
        for g in range(2):
            rows.append(f"2025/12/10 17:40:{10 + i * 0.1:06.3f}, {pattern[i % 4] + g * 0.0:.2f} W")
    path = tmp_path / "tr.csv"
    path.write_text("\n".join(rows) + "\n")
    jb = job("t", (0, 3), kind="trace", trace_path=str(path), trace_gpus=2, trace_rated_w=250.0)
    w = make([jb])
    assert w.rack_peak_w()[0] == pytest.approx(RATED_W)
    _, d, _ = Runner(w).run(4.0, 0.1)
    assert np.all(d[:, :3] == d[:, :1])
    # idle -> idle, peak -> peak: the trace's 100 W (its idle) is the preset's idle, its 250 W (= its rating) rated
    lvl = {100: IDLE_W, 250: RATED_W}
    np.testing.assert_allclose(d[:8, 0], [lvl[x] for x in (100, 250, 250, 100, 100, 250, 250, 100)])
    # played twice as slow: at t = 0.1 .. 0.8 s it reads samples 0, 1, 1, 2, 2, 3, 3, 4
    slow = make([jb.model_copy(update={"trace_time_scale": 2.0})])
    _, d2, _ = Runner(slow).run(4.0, 0.1)
    np.testing.assert_allclose(d2[:8, 0], [lvl[x] for x in (100, 100, 100, 250, 250, 250, 250, 100)])


def test_trace_job_on_the_measured_titanx_log() -> None:
    if not TITANX.is_file():
        pytest.skip(f"measured trace {TITANX} is absent")
    jb = job("t", (0, 2), kind="trace", trace_path=str(TITANX), trace_gpus=2)
    w = make([jb])
    _, d, _ = Runner(w).run(340.0, 0.1)
    x = d[:, 0] / w.rack_peak_w()[0]
    late = x[300:]  # past the idle warm-up of the log
    assert late.max() == pytest.approx(1.0)
    assert 0.25 < late.min() < 0.45  # evaluation dips to ~140/430 of the peak
    training = late[late > 0.5]
    assert 0.8 < float(np.median(training)) < 0.95
    assert 0.4 < training.size / late.size < 0.75  # ~22 s of training per ~36 s


def test_bad_trace_file_names_source_and_key(tmp_path: Path) -> None:
    good = job("a", (0, 2))
    bad = job("b", (2, 4), kind="trace", trace_path=str(tmp_path / "missing.csv"))
    site = make_site([good, bad])
    with pytest.raises(InputError) as info:
        Workload(site, [good, bad], BackgroundSpec(), np.random.default_rng(0), source="run.toml")
    assert str(info.value).startswith("run.toml: jobs[1].trace_path: ")
    assert "missing.csv" in str(info.value)


def test_spec_validation() -> None:
    with pytest.raises(ValidationError):
        JobSpec(name="x", gpus=64, kind="trace")
    with pytest.raises(ValidationError):
        JobSpec(name="x", gpus=64, start_s=10.0, stop_s=5.0)
    with pytest.raises(ValidationError):
        JobSpec(name="x", gpus=64, peak_frac=1.2)
    with pytest.raises(ValidationError):
        JobSpec(name="x", gpus=64, mtbi_gpu_h=0.0)
    with pytest.raises(ValidationError):
        JobSpec(name="x", gpus=64, checkpoint={"interval_s": 0.0})
    with pytest.raises(ValidationError):
        JobSpec.model_validate({"name": "x", "gpus": 64, "iteration_s": 2.0, "unknown_key": 1})
    with pytest.raises(ValidationError):
        JobSpec(name="x")  # the placement validator still runs
    site = make_site([job("a")])
    with pytest.raises(ValueError, match="specs"):
        Workload(site, [job("other")], BackgroundSpec(), np.random.default_rng(0))


# ---------------------------------------------------------------------------------------------- properties
job_params = st.fixed_dictionaries(
    {
        "peak_frac": st.floats(0.05, 1.0),
        "swing_frac": st.floats(0.0, 1.0),
        "iteration_s": st.floats(0.3, 5.0),
        "compute_frac": st.floats(0.05, 1.0),
        "jitter_frac": st.floats(0.0, 0.3),
        "start_s": st.sampled_from([0.0, 0.0, 3.0, 17.3]),
        "ramp_s": st.sampled_from([0.0, 0.05, 1.0, 4.0]),
        "restart_ramp_s": st.sampled_from([0.0, 1.0, 3.3]),
        "recovery_s": st.sampled_from([0.0, 0.1, 5.0, 30.0]),
        "mtbi_gpu_h": st.sampled_from([None, 2.0, 20.0]),
        "checkpoint": st.builds(
            CheckpointSpec,
            mode=st.sampled_from(["sync", "async", "none"]),
            interval_s=st.sampled_from([0.5, 7.0, 30.0]),
            duration_s=st.sampled_from([0.0, 0.3, 4.0, 12.0]),
            dip_frac=st.floats(0.0, 1.0),
        ),
    }
)


@settings(max_examples=examples(40), deadline=None)
@given(
    params=st.lists(job_params, min_size=1, max_size=3),
    stop=st.lists(st.sampled_from([None, 25.0, 60.0]), min_size=3, max_size=3),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_accounting_invariant_and_bounds(
    params: list[dict[str, Any]], stop: list[float | None], seed: int, data: st.DataObject
) -> None:
    jobs = [
        JobSpec(
            name=f"j{i}",
            racks=(2 * i, 2 * i + 2),
            stop_s=stop[i] if stop[i] is None else p["start_s"] + stop[i],
            **p,
        )
        for i, p in enumerate(params)
    ]
    w = make(jobs, seed=seed, background=BackgroundSpec(kind="inference", noise_frac=0.5))
    n, n_racks = w.n_jobs, w.site.n_racks
    rng = np.random.default_rng(seed)
    dt = data.draw(st.sampled_from([0.05, 0.1, 0.5, 1.0]))
    speed, suspend, energized = np.ones(n), np.zeros(n, dtype=bool), np.ones(n_racks, dtype=bool)
    for k in range(data.draw(st.integers(20, 150))):
        u = rng.random()
        if u < 0.15:
            speed = rng.uniform(-0.2, 1.2, n)  # out-of-range speeds are clamped to [0, 1]
        elif u < 0.22:
            suspend = rng.random(n) < 0.5
        elif u < 0.3:
            energized = rng.random(n_racks) < 0.8
        elif u < 0.33:
            w.interrupt(rng.random(n) < 0.5, "failure" if rng.random() < 0.5 else "power")
        elif u < 0.35:
            w.stop(rng.random(n) < 0.5)
        elif u < 0.38:
            w.start(rng.random(n) < 0.5)
        w.advance(dt, speed, suspend, energized)
        demand = w.rack_demand_w()
        assert np.all(demand >= IDLE_W) and np.all(demand <= RATED_W)
        assert np.all(np.isin(w.job_state, list(JobState)))
        running, state = w.job_running(), w.job_state
        assert np.all(running[state == JobState.RUNNING])
        assert not np.any(running[~np.isin(state, [JobState.RUNNING, JobState.CHECKPOINT])])
        if k % 10 == 0:
            check_invariant(w)
    acc = check_invariant(w)
    assert np.all(acc["allocated"] <= w.site.job_gpus * w.t_s * (1 + 1e-12))
    assert np.all(w.job_committed_s <= w.job_progress_s + 1e-9)


def test_a_site_with_no_jobs_draws_background_only() -> None:
    site = make_site([])
    w = Workload(site, [], BackgroundSpec(kind="inference"), np.random.default_rng(5))
    r = Runner(w)
    r.energized[3] = False  # a dead rack with no job interrupts nothing
    _, d, _ = r.run(10.0, 0.1)
    assert d.shape == (100, 8) and np.all((d >= IDLE_W) & (d <= RATED_W)) and d.std() > 0
    np.testing.assert_array_equal(w.rack_peak_w(), RATED_W)
    assert all(v.shape == (0,) for v in w.accounting().values())


def test_job_without_start_time_is_running_at_the_outset() -> None:
    w = make([JobSpec(name="j", racks=(0, 4), jitter_frac=0.0, swing_frac=0.0)])
    assert w.job_state[0] == JobState.RUNNING
    assert np.all(w.rack_demand_w()[:4] == pytest.approx(0.9 * w.site.gpu.rated_w))
    w.advance(0.1, np.ones(1), np.zeros(1, dtype=bool), np.ones(w.site.n_racks, dtype=bool))
    acc = w.accounting()
    assert acc["startup"][0] == 0.0 and acc["useful"][0] == pytest.approx(acc["allocated"][0])
