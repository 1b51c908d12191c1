"""Training workload: per-GPU power demand (uncapped) of every rack, a job state machine, goodput accounting.

A synchronous training job runs all its GPUs in step: each iteration is a compute phase at the job's peak
power followed by a communication trough. The phase advances with the job's *progress* (work seconds), not
wall time, so a capped (slowed) job's iterations get longer. Its racks keep fixed small phase offsets and swing
gains (gridsim/plant/rack_spread.py; both zero: every rack shows the same demand at the same instant).
Around that swing a state machine adds the transients that move tens of megawatts: start/stop ramps, synchronous
checkpoint stalls, interruptions (random failures, or a rack losing power) with recovery, rollback to the last
checkpoint and a restart surge, and suspension by a hard-stop controller.

Per tick the model does a fixed handful of numpy operations over jobs and one gather to racks; Python code
runs only when a job changes state (an event). docs/models.md gives the equations and their sources.

    WAITING --start--> STARTING --ramp_s--> RUNNING <--duration_s-- CHECKPOINT (sync stall / async write)
                                             |   ^                     ^
                                             |   +---------------------+ every interval_s of progress
           failure / power / crash           v   |
    any live state ----------------------> DOWN --recovery_s, racks energized--> RESTARTING --restart_ramp_s->
    live state --suspend--> SUSPENDED --resume--> RESTARTING
    any state --stop--> STOPPING --ramp_s--> DONE
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator

from dimmer.site import SiteModel
from dimmer.siteconfig import JobPlacementSpec, Strict
from gridsim.plant.rack_spread import RackSpread, rack_levels
from gridsim.plant.trace_map import TraceCache, TraceFields, trace_levels

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

Cause = Literal["failure", "power"]


class CheckpointSpec(Strict):
    """Checkpointing. Synchronous writes stall the GPUs (a power dip of seconds to tens of seconds);
    asynchronous writes do not (MODELS.md, seed articles). Interval and duration defaults are assumptions."""

    mode: Literal["sync", "async", "none"] = "async"
    interval_s: float = Field(default=1800.0, gt=0)  # progress between checkpoints (assumption: 30 min)
    duration_s: float = Field(default=30.0, ge=0)  # sync: stall length; async: write time before it commits
    # per-GPU power in a sync stall, as a fraction of the job's peak (assumption: GPUs wait on storage)
    dip_frac: float = Field(default=0.3, ge=0, le=1)


class JobSpec(JobPlacementSpec, TraceFields):
    """A training job: its placement (name, priority, gpus | racks | building), its power shape and life."""

    kind: Literal["synthetic", "trace"] = "synthetic"
    # compute-phase per-GPU demand, fraction of rated (Meta provisions GB200 at 80 % of rated; assumption 0.9)
    peak_frac: float = Field(default=0.9, gt=0, le=1)
    # trough = peak (1 - swing_frac): 30-40 % at campus level (seeds); 50-90 % per GPU (POLCA, DCD)
    swing_frac: float = Field(default=0.35, ge=0, le=1)
    iteration_s: float = Field(default=2.0, gt=0, le=600)  # 0.3-5 s (Choukse et al. 2025)
    compute_frac: float = Field(default=0.7, gt=0, le=1)  # share of each iteration at peak (assumption)
    # std of the per-iteration period stretch, the whole job in lockstep (assumption); separate jobs drift apart
    jitter_frac: float = Field(default=0.02, ge=0, le=0.3)
    # the racks' fixed phase offsets lie within this of each other (a collective re-aligns them every iteration);
    # measured: two data-parallel GPUs' transitions within 10 ms (docs/models.md, gridsim/plant/rack_spread.py)
    rack_phase_skew_s: float = Field(default=0.01, ge=0)
    # std of a per-rack multiplier on the swing: 0.10 between two measured GPUs, / sqrt(64 GPUs a rack)
    rack_amplitude_spread_frac: float = Field(default=0.013, ge=0, lt=1)
    # None: already running, in step, when the run begins; a time: idle until then, then the start ramp
    start_s: float | None = Field(default=None, ge=0)
    stop_s: float | None = None
    ramp_s: float = Field(default=1.0, ge=0)  # start/stop: tens of MW in about a second (Llama 3 report)
    checkpoint: CheckpointSpec = CheckpointSpec()
    # mean time between interruptions, GPU-hours: 47k-54k now; worst ~192 (1000 a day per 8k GPUs) (seeds)
    mtbi_gpu_h: float | None = Field(default=None, gt=0)
    # isolate node, swap spare, reload checkpoint: minutes (seeds)
    recovery_s: float = Field(default=300.0, ge=0)
    # the restart surge back to full power (assumption: as fast as a start)
    restart_ramp_s: float = Field(default=1.0, ge=0)
    # kind = "trace": the trace_* keys (a measured power log, its format, level and map) are TraceFields'

    @model_validator(mode="after")
    def _workload(self) -> JobSpec:
        if self.kind == "trace" and self.trace_path is None:
            raise ValueError("kind = 'trace' needs trace_path")
        if self.stop_s is not None and self.stop_s <= (self.start_s or 0.0):
            raise ValueError("stop_s must be after start_s")
        if self.kind == "synthetic" and self.rack_phase_skew_s >= 0.5 * self.iteration_s:
            raise ValueError(
                f"rack_phase_skew_s must be below half of iteration_s ({self.rack_phase_skew_s} s"
                f" against {self.iteration_s} s): a collective aligns the racks every iteration"
            )
        if self.kind == "trace":  # a measured trace carries its own shape: the spread is for synthetic jobs
            for key in ("rack_phase_skew_s", "rack_amplitude_spread_frac"):
                if key in self.model_fields_set and getattr(self, key) > 0:
                    raise ValueError(f"{key} applies to kind = 'synthetic' jobs only (a trace replays as measured)")
        return self


class BackgroundSpec(Strict):
    """Non-training load on racks that hold no job: idle GPUs, or inference around a mean with AR(1) noise."""

    kind: Literal["idle", "inference"] = "idle"
    # inference mean per-GPU draw, as a fraction of rated (assumption)
    mean_frac: float = Field(default=0.5, ge=0, le=1)
    noise_frac: float = Field(default=0.1, ge=0, le=1)  # std of the noise, fraction of rated (assumption)
    noise_tau_s: float = Field(default=30.0, gt=0)  # AR(1) time constant (assumption)


class JobState(enum.IntEnum):
    WAITING = 0  # not started yet (racks idle, not allocated)
    STARTING = 1  # start ramp, idle -> peak over ramp_s; no progress
    RUNNING = 2  # training: iterations swing peak <-> trough, progress at job_speed_frac
    CHECKPOINT = 3  # sync: stall at dip power, no progress; async: running while the write completes
    DOWN = 4  # interrupted: idle, waiting for recovery_s (and for its racks to be energized)
    RESTARTING = 5  # restart surge, idle -> peak over restart_ramp_s; no progress
    SUSPENDED = 6  # held by the controller: idle, no progress, state kept (no rollback)
    STOPPING = 7  # stop ramp to idle over ramp_s (no longer allocated)
    DONE = 8  # finished (racks idle)


LOSS_KEYS: tuple[str, ...] = ("cap", "suspend", "trip", "failure", "checkpoint", "recovery", "startup")
ACCOUNTING_KEYS: tuple[str, ...] = ("allocated", "useful", *LOSS_KEYS)

# rows of the per-job time accumulator: two sinks, then one row per loss
_ROW_NONE, _ROW_PROGRESS = 0, 1
_ROW = {k: i + 2 for i, k in enumerate(LOSS_KEYS)}
# why a job is DOWN or RESTARTING; decides which loss its time goes to
_C_START, _C_FAILURE, _C_POWER, _C_SUSPEND = 0, 1, 2, 3
_CAUSE_CODE: dict[str, int] = {"failure": _C_FAILURE, "power": _C_POWER}
_CAUSE_NAME = ("start", "failure", "power", "suspend")
_DOWN_ROW = {_C_FAILURE: _ROW["recovery"], _C_POWER: _ROW["trip"]}
_ROLLBACK_ROW = {_C_FAILURE: _ROW["failure"], _C_POWER: _ROW["trip"]}
_RESTART_ROW = {_C_START: _ROW["startup"], _C_FAILURE: _ROW["startup"], _C_POWER: _ROW["trip"]}
_RESTART_ROW[_C_SUSPEND] = _ROW["suspend"]

_LIVE = (JobState.STARTING, JobState.RUNNING, JobState.CHECKPOINT, JobState.RESTARTING)
_INTERRUPTIBLE = (*_LIVE, JobState.SUSPENDED)
_EPS_S = 1e-9  # timers compare with this slack so that 10 ticks of 0.1 s make 1 s
_MAX_CHAIN = 16  # transitions that may chain within one instant (e.g. zero-length ramps)


class WorkloadEvent(NamedTuple):
    t_s: float
    job: int
    kind: str  # the state entered, lower case ("down", "running", ...), or "committed" for a checkpoint commit
    cause: str  # "start", "failure", "power", "suspend", "checkpoint", "stop", "" where none


class Workload:
    """Per-rack, per-GPU power demand of the jobs placed on `site`, advanced tick by tick.

    Job quantities are `(n_jobs,)`; demand is per rack `(n_racks,)`, in W per active GPU, uncapped (the GPU
    model applies caps, floors and ramp limits). Demand always lies in [idle_w, rated_w].

    Per tick: progress, the iteration phase and the power levels are a few numpy operations over jobs;
    every timed transition (ramp, checkpoint and recovery ends, scheduled start/stop, the next random
    failure) is folded into one scalar next-event time, and accounting is settled lazily at each state
    change, so a tick in which no job changes state runs no Python loop at all.
    """

    def __init__(
        self,
        site: SiteModel,
        jobs: Sequence[JobSpec],
        background: BackgroundSpec,
        rng: np.random.Generator,
        source: str = "scenario",
        rack_rng: np.random.Generator | None = None,
    ) -> None:
        if len(jobs) != site.n_jobs:
            raise ValueError(f"{len(jobs)} job specs for a site with {site.n_jobs} jobs placed")
        if tuple(j.name for j in jobs) != site.job_name:
            raise ValueError("jobs must be the specs the site was built with, in the same order")
        self.site = site
        self.jobs = tuple(jobs)
        self._rng = rng
        n = site.n_jobs
        self.n_jobs = n
        self.idle_w = float(site.gpu.idle_w)
        self.rated_w = float(site.gpu.rated_w)
        idle, rated = self.idle_w, self.rated_w
        self.t_s = 0.0

        def col(values: Sequence[float]) -> FloatArray:
            return np.asarray(values, dtype=np.float64).reshape(n)

        self._gpus = site.job_gpus.astype(np.float64)
        self._jidx = np.arange(n, dtype=np.int64)
        peak = np.clip(col([j.peak_frac for j in jobs]) * rated, idle, rated)
        self._peak_w = peak

        # trace jobs: one flat table of per-GPU demand, indexed per tick by progress
        self._trace_jobs = np.asarray([i for i, j in enumerate(jobs) if j.kind == "trace"], dtype=np.int64)
        cache: TraceCache = {}
        tables: list[FloatArray] = []
        inv_step: list[float] = []
        offset: list[int] = []
        for i in self._trace_jobs.tolist():  # once per trace job, at construction
            spec = jobs[i]
            level, step_s, _ = trace_levels(spec, site, source, f"jobs[{i}].trace_path", cache)
            offset.append(sum(t.size for t in tables))
            tables.append(level)
            inv_step.append(1.0 / (step_s * spec.trace_time_scale))
            peak[i] = float(np.max(level))  # what its throughput is measured against
        self._trace_table = np.concatenate(tables) if tables else np.zeros(0)
        self._trace_offset = np.asarray(offset, dtype=np.int64)
        self._trace_len = np.asarray([t.size for t in tables], dtype=np.int64)
        self._trace_inv_step = np.asarray(inv_step, dtype=np.float64)
        self._has_trace = self._trace_jobs.size > 0

        self._trough_w = np.clip(peak * (1.0 - col([j.swing_frac for j in jobs])), idle, rated)
        self._iter_base_s = col([j.iteration_s for j in jobs])
        self._compute_frac = col([j.compute_frac for j in jobs])
        self._jitter = col([j.jitter_frac for j in jobs])
        self._ramp_s = col([j.ramp_s for j in jobs])
        self._restart_ramp_s = col([j.restart_ramp_s for j in jobs])
        self._recovery_s = col([j.recovery_s for j in jobs])
        self._ck_sync = np.asarray([j.checkpoint.mode == "sync" for j in jobs], dtype=bool).reshape(n)
        # progress between checkpoints, less the timer slack so that 600 ticks of 0.1 s reach 60 s
        intervals = [j.checkpoint.interval_s if j.checkpoint.mode != "none" else math.inf for j in jobs]
        self._ck_interval_s = col(intervals) - _EPS_S
        self._ck_duration_s = col([j.checkpoint.duration_s for j in jobs])
        self._dip_w = np.clip(col([j.checkpoint.dip_frac for j in jobs]) * peak, idle, rated)
        mtbi_s = col([j.mtbi_gpu_h * 3600.0 if j.mtbi_gpu_h is not None else math.inf for j in jobs])
        # live seconds between random interruptions of the whole job: exponential, mean MTBI / GPUs
        self._fail_scale_s = mtbi_s / np.maximum(self._gpus, 1.0)
        self._has_failures = bool(np.isfinite(self._fail_scale_s).any())

        # racks: running racks gather their job's level; spare and job-less racks read the idle slot n
        rj = site.rack_job
        running = (rj >= 0) & ~site.rack_is_spare
        self._rack_slot = np.where(running, rj, n).astype(np.int64)
        self._run_rack = np.flatnonzero(running)
        self._run_job = rj[self._run_rack]
        job_peak = np.append(peak, rated)
        self._rack_peak_w = job_peak[np.where(rj >= 0, rj, n)]
        self._level_w = np.full(n + 1, idle)
        self._job_level_w = self._level_w[:n]  # a view
        # racks of a job out of lockstep: their own generator, so that the job's stream (jitter, failures) is
        # the same whether the spread is on or off; fixed seed where the caller gives none
        spread_rng = (
            rack_rng if rack_rng is not None else np.random.default_rng(np.random.SeedSequence(0, spawn_key=(2,)))
        )
        self._spread = RackSpread.build(site, jobs, spread_rng, self._peak_w, self._trough_w, idle, rated)
        self._last_step = np.zeros(n)  # progress the last tick added, per job: the interval a rack's mean covers

        # background on racks with no job
        self._bg_rack = np.flatnonzero(rj < 0)
        self._bg_on = background.kind == "inference" and self._bg_rack.size > 0
        self._bg_mean_w = background.mean_frac * rated
        self._bg_sigma_w = background.noise_frac * rated
        self._bg_tau_s = background.noise_tau_s
        self._bg_x_w = rng.standard_normal(self._bg_rack.size) * self._bg_sigma_w if self._bg_on else np.zeros(0)
        self._bg_level_w = np.clip(self._bg_mean_w + self._bg_x_w, idle, rated)  # stationary start
        self._bg_dt_s = -1.0
        self._bg_a = 0.0
        self._bg_b = 0.0

        # state
        self.job_state = np.full(n, int(JobState.WAITING), dtype=np.int64)
        self._t0_s = np.zeros(n)  # when the current state was entered
        self._end_at_s = np.full(n, math.inf)  # when the current timed state ends
        self._row = np.full(n, _ROW_NONE, dtype=np.int64)  # where the state's time goes in the accounting
        self._cause = np.zeros(n, dtype=np.int64)
        self._alloc_f = np.zeros(n)
        self._prog_f = np.zeros(n)
        self._running = np.zeros(n, dtype=bool)
        self._live = np.zeros(n, dtype=bool)
        self._susp = np.zeros(n, dtype=bool)
        self._from_w = np.full(n, idle)
        self._delta_w = np.zeros(n)
        self._inv_len = np.zeros(n)
        self._progress_s = np.zeros(n)
        self._committed_s = np.zeros(n)
        self._snapshot_s = np.zeros(n)
        self._ck_due_s = self._ck_interval_s.copy()
        self._iter_phase_s = np.zeros(n)
        self._iter_len_s = self._iter_base_s.copy()
        self._iter_len_s[self._trace_jobs] = math.inf
        self._on_len_s = self._iter_len_s * self._compute_frac
        self._fail_left_s = np.full(n, math.inf)  # live seconds to the next random failure (while not live)
        if self._has_failures:
            draw = rng.exponential(size=n)
            self._fail_left_s = np.where(np.isfinite(self._fail_scale_s), draw * self._fail_scale_s, math.inf)
        self._fail_at_s = np.full(n, math.inf)  # wall time of the next random failure (while live)
        self._start_at_s = col([j.start_s if j.start_s is not None else math.inf for j in jobs])
        self._stop_at_s = col([j.stop_s if j.stop_s is not None else math.inf for j in jobs])
        self._next_event_s = 0.0
        self._dirty = True
        self._any_ramp = False
        self._any_susp = False
        self._suspend_req = np.zeros(n, dtype=bool)
        self._deenerg = np.zeros(n, dtype=bool)
        self._energized_seen: BoolArray | None = None
        self._all_energized = True
        self._any_deenerg = False
        # accounting in seconds per job (times GPUs on the way out), settled up to _settled_s
        self._settled_s = np.zeros(n)
        self._settled_progress_s = np.zeros(n)
        self._alloc_s = np.zeros(n)
        self._acc_s = np.zeros((len(LOSS_KEYS) + 2, n))
        self._interruptions = np.zeros((2, n), dtype=np.int64)  # rows: failure, power
        self.events: list[WorkloadEvent] = []

        self._enter(np.flatnonzero([j.start_s is None for j in jobs]), JobState.RUNNING)
        self._resolve()
        self._update_level()

    # ------------------------------------------------------------------ read-outs
    def job_running(self) -> BoolArray:
        """(n_jobs,) doing training work now: RUNNING, or CHECKPOINT with an asynchronous write."""
        return self._running.copy()

    def job_ended(self) -> BoolArray:
        """(n_jobs,) stopped by the scheduler: STOPPING (its stop ramp) or DONE. The engine reports those no later
        start event brings back as ended (Observation.job_ended); one started again is pending, as a requeued job."""
        ended: BoolArray = (self.job_state == int(JobState.STOPPING)) | (self.job_state == int(JobState.DONE))
        return ended

    def rack_demand_w(self, out: FloatArray | None = None) -> FloatArray:
        """(n_racks,) per-active-GPU demand in W now, uncapped; idle_w (or background) where nothing runs.

        Written into `out` when given (the engine's per-tick buffer), else into a new array."""
        out = np.take(self._level_w, self._rack_slot, out=out)
        sp = self._spread
        if sp is not None:  # racks out of lockstep: each its own tick mean while its job runs
            out[sp.rack] = rack_levels(
                sp,
                self._iter_phase_s,
                self._last_step,
                self._iter_len_s,
                self._on_len_s,
                self._running,
                self._job_level_w,
                self.idle_w,
                self.rated_w,
            )
        if self._bg_on:
            out[self._bg_rack] = self._bg_level_w
        return out

    def rack_peak_w(self) -> FloatArray:
        """(n_racks,) compute-phase per-GPU demand of each rack's job; rated_w where the rack holds no job."""
        return self._rack_peak_w.copy()

    def job_demand_w(self) -> FloatArray:
        """(n_jobs,) per-GPU demand of each job's running racks now."""
        return self._job_level_w.copy()

    @property
    def job_progress_s(self) -> FloatArray:
        """(n_jobs,) work that would survive a stop now (seconds at full speed), committed or not."""
        return self._progress_s.copy()

    @property
    def job_committed_s(self) -> FloatArray:
        """(n_jobs,) work saved by the last committed checkpoint (seconds at full speed)."""
        return self._committed_s.copy()

    def interruptions(self) -> dict[str, IntArray]:
        """Per job, how many times it was interrupted, by cause ("failure", "power")."""
        return {"failure": self._interruptions[0].copy(), "power": self._interruptions[1].copy()}

    def accounting(self) -> dict[str, FloatArray]:
        """Per job, GPU-seconds: "allocated", "useful" and the losses (LOSS_KEYS).

        allocated == useful + sum(losses) at any time, up to float rounding (docs/models.md defines each).
        """
        self._settle(self._jidx)
        g = self._gpus
        out = {"allocated": self._alloc_s * g, "useful": self._progress_s * g}
        for k, row in _ROW.items():
            out[k] = self._acc_s[row] * g
        return out

    # ------------------------------------------------------------------ the tick
    def advance(
        self, dt_s: float, job_speed_frac: FloatArray, job_suspend: BoolArray, rack_energized: BoolArray
    ) -> None:
        """Advance by `dt_s`.

        The inputs hold over the whole tick: power loss and suspension act at its start (the tick's time goes
        to the state they leave a job in); timed states and scheduled events end at its end.
        """
        dt = float(dt_s)
        if not dt >= 0.0:
            raise ValueError(f"dt_s must be >= 0 (got {dt_s})")
        if rack_energized is not self._energized_seen:
            # a read-only mask (the breakers') cannot change under us: reduced once, not every tick
            self._energized_seen = None if rack_energized.flags.writeable else rack_energized
            self._all_energized = bool(np.logical_and.reduce(rack_energized))
        if not self._all_energized:
            self._power_lost(rack_energized)
        elif self._any_deenerg:
            self._deenerg[:] = False
            self._any_deenerg = False
            self._power_back()
        any_suspend = self._any_susp or bool(np.logical_or.reduce(job_suspend))
        if any_suspend and np.where(job_suspend, self._live, self._susp).any():
            self._apply_suspend(job_suspend)
        np.copyto(self._suspend_req, job_suspend)

        step = np.minimum(np.maximum(job_speed_frac, 0.0), 1.0)
        step *= self._prog_f
        step *= dt
        self._last_step = step
        self._progress_s += step
        self._iter_phase_s += step
        wrapped = self._iter_phase_s >= self._iter_len_s
        if np.logical_or.reduce(wrapped):
            self._wrap(np.flatnonzero(wrapped))
        if self._bg_on:
            self._advance_background(dt)
        self.t_s += dt

        self._resolve()
        self._update_level()

    # ------------------------------------------------------------------ timed events
    def interrupt(self, jobs: BoolArray, cause: Cause) -> None:
        """Interrupt `jobs` now (a crash or a power-loss event): roll back to the last checkpoint, go DOWN."""
        if cause not in _CAUSE_CODE:
            raise ValueError(f"cause must be 'failure' or 'power' (got {cause!r})")
        self._interrupt_idx(np.flatnonzero(jobs), _CAUSE_CODE[cause])
        self._resolve()
        self._update_level()

    def start(self, jobs: BoolArray) -> None:
        """Start `jobs` that are WAITING or DONE now (a DONE job continues from its saved progress)."""
        idx = np.flatnonzero(jobs)
        self._start_at_s[idx] = math.inf
        self._dirty = True
        self._do_start(idx)
        self._resolve()
        self._update_level()

    def stop(self, jobs: BoolArray) -> None:
        """Stop `jobs` now: their progress so far counts as useful; they ramp down to idle and are DONE."""
        idx = np.flatnonzero(jobs)
        self._stop_at_s[idx] = math.inf
        self._start_at_s[idx[self.job_state[idx] == JobState.WAITING]] = math.inf
        self._dirty = True
        self._do_stop(idx)
        self._resolve()
        self._update_level()

    # ------------------------------------------------------------------ internals
    def _update_level(self) -> None:
        if self._any_ramp:
            r = np.minimum((self.t_s - self._t0_s) * self._inv_len, 1.0)
            np.copyto(self._job_level_w, self._from_w + self._delta_w * r)
        else:
            np.copyto(self._job_level_w, self._from_w)
        swing = np.where(self._iter_phase_s < self._on_len_s, self._peak_w, self._trough_w)
        if self._has_trace:
            tj = self._trace_jobs
            # + 1e-6 of a sample: progress that sums ticks lands exactly on a sample, not 1e-15 before it
            pos = (self._progress_s[tj] * self._trace_inv_step + 1e-6).astype(np.int64) % self._trace_len
            swing[tj] = self._trace_table[pos + self._trace_offset]
        np.copyto(self._job_level_w, swing, where=self._running)

    def _advance_background(self, dt: float) -> None:
        if dt != self._bg_dt_s:
            self._bg_dt_s = dt
            self._bg_a = math.exp(-dt / self._bg_tau_s)
            self._bg_b = self._bg_sigma_w * math.sqrt(1.0 - self._bg_a**2)
        x = self._bg_x_w
        x *= self._bg_a
        x += self._bg_b * self._rng.standard_normal(x.size)
        lv = self._bg_level_w
        np.add(x, self._bg_mean_w, out=lv)
        np.minimum(lv, self.rated_w, out=lv)
        np.maximum(lv, self.idle_w, out=lv)  # np.clip is several times slower on small arrays

    def _wrap(self, idx: IntArray) -> None:
        """Start the next iteration of jobs whose current one ended; its period is stretched by the jitter."""
        phase = self._iter_phase_s[idx] - self._iter_len_s[idx]
        z = np.minimum(np.maximum(self._rng.standard_normal(idx.size), -3.0), 3.0)
        length = self._iter_base_s[idx] * np.maximum(1.0 + self._jitter[idx] * z, 0.1)
        self._iter_len_s[idx] = length
        self._on_len_s[idx] = length * self._compute_frac[idx]
        self._iter_phase_s[idx] = np.mod(phase, length)

    def _refresh(self) -> None:
        """Recompute what the per-tick path reads after states changed."""
        self._dirty = False
        inf = math.inf
        self._next_event_s = min(
            float(np.min(self._end_at_s, initial=inf)),
            float(np.min(self._fail_at_s, initial=inf)),
            float(np.min(self._start_at_s, initial=inf)),
            float(np.min(self._stop_at_s, initial=inf)),
        )
        self._any_ramp = bool((self._inv_len > 0).any())
        self._any_susp = bool(self._susp.any())

    def _log(self, idx: IntArray, kind: str, cause: str) -> None:
        t = self.t_s
        self.events.extend(WorkloadEvent(t, int(j), kind, cause) for j in idx.tolist())

    def _settle(self, idx: IntArray) -> None:
        """Book the time since jobs `idx` (unique) were last settled to their current state's row."""
        dur = self.t_s - self._settled_s[idx]
        gained = self._progress_s[idx] - self._settled_progress_s[idx]
        self._alloc_s[idx] += dur * self._alloc_f[idx]
        self._acc_s[self._row[idx], idx] += dur
        self._acc_s[_ROW["cap"], idx] += (dur - gained) * self._prog_f[idx]  # time not turned into progress
        self._settled_s[idx] = self.t_s
        self._settled_progress_s[idx] = self._progress_s[idx]

    def _set_ramp(self, idx: IntArray, from_w: FloatArray, to_w: FloatArray, length_s: FloatArray) -> None:
        has = length_s > 0
        self._from_w[idx] = np.where(has, from_w, to_w)
        self._delta_w[idx] = np.where(has, to_w - from_w, 0.0)
        self._inv_len[idx] = np.where(has, 1.0 / np.where(has, length_s, 1.0), 0.0)

    def _enter(self, idx: IntArray, state: JobState, cause: int = _C_START) -> None:
        """Put jobs `idx` (unique) into `state` now: flags, accounting row, end time, ramp, failure clock."""
        if idx.size == 0:
            return
        self._settle(idx)
        t = self.t_s
        level_now = self._level_w[idx].copy()
        idle = np.full(idx.size, self.idle_w)
        zero = np.zeros(idx.size)
        live = state in _LIVE
        if self._has_failures:  # the failure clock runs only while live
            was = self._live[idx]
            leaving = idx[was & (not live)]
            self._fail_left_s[leaving] = self._fail_at_s[leaving] - t
            self._fail_at_s[leaving] = math.inf
            joining = idx[~was & live]
            self._fail_at_s[joining] = t + self._fail_left_s[joining]
        self.job_state[idx] = int(state)
        self._t0_s[idx] = t
        self._cause[idx] = cause
        self._live[idx] = live
        self._susp[idx] = state == JobState.SUSPENDED
        self._alloc_f[idx] = float(state not in (JobState.WAITING, JobState.STOPPING, JobState.DONE))
        running = np.zeros(idx.size, dtype=bool)
        row = np.full(idx.size, _ROW_NONE, dtype=np.int64)
        length = np.full(idx.size, math.inf)
        if state == JobState.STARTING:
            row[:] = _ROW["startup"]
            length = self._ramp_s[idx]
            self._set_ramp(idx, idle, self._peak_w[idx], length)
        elif state == JobState.RESTARTING:
            row[:] = _RESTART_ROW[cause]
            length = self._restart_ramp_s[idx]
            self._set_ramp(idx, idle, self._peak_w[idx], length)
        elif state == JobState.RUNNING:
            running[:] = True
            row[:] = _ROW_PROGRESS
            self._set_ramp(idx, idle, idle, zero)
        elif state == JobState.CHECKPOINT:
            sync = self._ck_sync[idx]
            running = ~sync
            row = np.where(sync, _ROW["checkpoint"], _ROW_PROGRESS)
            length = self._ck_duration_s[idx]
            self._set_ramp(idx, self._dip_w[idx], self._dip_w[idx], zero)
        elif state == JobState.DOWN:
            row[:] = _DOWN_ROW[cause]
            length = np.where(self._deenerg[idx], math.inf, self._recovery_s[idx])  # waits for power
            self._set_ramp(idx, idle, idle, zero)
        elif state == JobState.STOPPING:
            length = self._ramp_s[idx]
            self._set_ramp(idx, level_now, idle, length)
        else:  # WAITING, SUSPENDED, DONE
            if state == JobState.SUSPENDED:
                row[:] = _ROW["suspend"]
            self._set_ramp(idx, idle, idle, zero)
        self._running[idx] = running
        self._prog_f[idx] = running
        self._row[idx] = row
        self._end_at_s[idx] = t + length
        self._dirty = True
        caused = state in (JobState.DOWN, JobState.RESTARTING, JobState.SUSPENDED)
        self._log(idx, state.name.lower(), _CAUSE_NAME[cause] if caused else "")
        self._any_ramp = True  # let _update_level see any ramp just entered; _refresh settles it
        self._update_level()  # so that a STOPPING entered later in this instant starts from the right level

    def _rollback(self, idx: IntArray, cause: int) -> None:
        """Work since the last committed checkpoint is lost to `cause` (call after _settle)."""
        lost = self._progress_s[idx] - self._committed_s[idx]
        self._acc_s[_ROLLBACK_ROW[cause], idx] += lost
        self._progress_s[idx] = self._committed_s[idx]
        self._settled_progress_s[idx] = self._committed_s[idx]
        self._ck_due_s[idx] = self._committed_s[idx] + self._ck_interval_s[idx]
        self._iter_phase_s[idx] = 0.0  # the restart begins a fresh iteration

    def _interrupt_idx(self, idx: IntArray, cause: int) -> None:
        st = self.job_state[idx]
        hit = idx[np.isin(st, _INTERRUPTIBLE)]
        if hit.size:
            self._settle(hit)
            self._rollback(hit, cause)
            self._interruptions[0 if cause == _C_FAILURE else 1, hit] += 1
            self._enter(hit, JobState.DOWN, cause)
        if cause == _C_POWER:  # a job already down now waits for its racks: its downtime is the power's
            down = idx[st == JobState.DOWN]
            if down.size:
                self._settle(down)
                self._cause[down] = _C_POWER
                self._row[down] = _ROW["trip"]
                self._end_at_s[down] = math.inf
                self._dirty = True

    def _power_lost(self, rack_energized: BoolArray) -> None:
        dead_racks = (~rack_energized[self._run_rack]).astype(np.float64)
        self._deenerg = np.bincount(self._run_job, weights=dead_racks, minlength=self.n_jobs) > 0
        self._any_deenerg = bool(self._deenerg.any())
        if self._any_deenerg:
            self._interrupt_idx(np.flatnonzero(self._deenerg), _C_POWER)
        self._power_back()

    def _power_back(self) -> None:
        """DOWN jobs that waited for power and have it again start their recovery now."""
        idx = np.flatnonzero((self.job_state == JobState.DOWN) & np.isinf(self._end_at_s) & ~self._deenerg)
        if idx.size:
            self._t0_s[idx] = self.t_s
            self._end_at_s[idx] = self.t_s + self._recovery_s[idx]
            self._dirty = True

    def _apply_suspend(self, want: BoolArray) -> None:
        go = np.flatnonzero(want & self._live)
        back = np.flatnonzero(~want & self._susp)
        if go.size:
            ck = go[self.job_state[go] == JobState.CHECKPOINT]  # an unfinished checkpoint is abandoned
            self._ck_due_s[ck] = self._committed_s[ck] + self._ck_interval_s[ck]
            self._enter(go, JobState.SUSPENDED, _C_SUSPEND)
        self._enter(back, JobState.RESTARTING, _C_SUSPEND)

    def _do_start(self, idx: IntArray) -> None:
        idx = idx[np.isin(self.job_state[idx], (JobState.WAITING, JobState.DONE))]
        if idx.size == 0:
            return
        self._committed_s[idx] = self._progress_s[idx]
        self._ck_due_s[idx] = self._progress_s[idx] + self._ck_interval_s[idx]
        self._iter_phase_s[idx] = 0.0
        held = self._suspend_req[idx]
        self._enter(idx[~held], JobState.STARTING, _C_START)
        self._enter(idx[held], JobState.SUSPENDED, _C_SUSPEND)

    def _do_stop(self, idx: IntArray) -> None:
        st = self.job_state[idx]
        self._enter(idx[st == JobState.WAITING], JobState.DONE)
        idx = idx[~np.isin(st, (JobState.WAITING, JobState.STOPPING, JobState.DONE))]
        if idx.size == 0:
            return
        self._committed_s[idx] = self._progress_s[idx]  # work not yet checkpointed still counts at the end
        self._ck_due_s[idx] = math.inf
        self._enter(idx, JobState.STOPPING)

    def _schedule(self, t: float) -> None:
        starting = np.flatnonzero(self._start_at_s <= t)
        stopping = np.flatnonzero(self._stop_at_s <= t)
        if starting.size == 0 and stopping.size == 0:
            return
        self._start_at_s[starting] = math.inf
        self._stop_at_s[stopping] = math.inf
        self._dirty = True
        self._do_start(starting)
        self._do_stop(stopping)

    def _finish(self, t: float) -> None:
        """Jobs whose timed state ran out move on."""
        idx = np.flatnonzero(self._end_at_s <= t)
        if idx.size == 0:
            return
        st = self.job_state[idx]
        ck = idx[st == JobState.CHECKPOINT]
        ramped = idx[(st == JobState.STARTING) | (st == JobState.RESTARTING)]
        down = idx[st == JobState.DOWN]
        stopped = idx[st == JobState.STOPPING]
        if ck.size:
            self._committed_s[ck] = self._snapshot_s[ck]
            self._ck_due_s[ck] = self._snapshot_s[ck] + self._ck_interval_s[ck]
            self._log(ck, "committed", "checkpoint")
        self._enter(np.concatenate([ck, ramped]), JobState.RUNNING)
        held = self._suspend_req[down]
        self._enter(down[held], JobState.SUSPENDED, _C_SUSPEND)
        for cause in (_C_FAILURE, _C_POWER):  # two causes, not a loop over jobs
            self._enter(down[~held & (self._cause[down] == cause)], JobState.RESTARTING, cause)
        self._enter(stopped, JobState.DONE)

    def _fail(self, t: float) -> None:
        """Random interruptions whose time has come; each job draws its next one."""
        idx = np.flatnonzero(self._fail_at_s <= t)
        if idx.size == 0:
            return
        self._interrupt_idx(idx, _C_FAILURE)
        self._fail_left_s[idx] = self._rng.exponential(size=idx.size) * self._fail_scale_s[idx]

    def _resolve(self) -> None:
        """Fire every transition due now; chains (zero-length ramps, recovery) resolve in one instant."""
        for _ in range(_MAX_CHAIN):
            if self._dirty:
                self._refresh()
            t = self.t_s + _EPS_S
            fired = False
            if t >= self._next_event_s:
                fired = True
                self._schedule(t)
                self._finish(t)
                if self._has_failures:
                    self._fail(t)
            ck = self._progress_s >= self._ck_due_s
            if np.logical_or.reduce(ck):  # only RUNNING jobs begin one (a resumed job catches up once it runs)
                idx = np.flatnonzero(ck & (self.job_state == JobState.RUNNING))
                if idx.size:
                    self._snapshot_s[idx] = self._progress_s[idx]
                    self._ck_due_s[idx] = math.inf  # the next one is scheduled when this one commits
                    self._enter(idx, JobState.CHECKPOINT)
                    fired = True
            if not fired:
                return
        if self._dirty:
            self._refresh()
