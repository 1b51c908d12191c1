"""Running the points of a plan, locally or on Dask, and resuming: a run whose summary is on disk is not run again.

Each run's summary is written atomically as it arrives; a run that raises is recorded and the others go on.
dask.distributed is imported inside `_dask_client` and `_run_dask` only.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dimmer.atomicfile import write_atomic
from dimmer.errors import InputError
from dimmer.outpath import writing
from gridsim.metrics import SUMMARY_KEYS
from gridsim.scenario import LoadedScenario, validate_scenario
from gridsim.sweep.plan import SweepOutcome, SweepPlan, SweepPoint, SweepProgress


def run_task(raw: dict[str, Any], source: str, base_dir: str, controller: str) -> dict[str, Any]:
    """One run, in a worker process (or a Dask worker): the resolved scenario in, the summary dict out."""
    from gridsim.engine import run
    from gridsim.metrics import summarize

    loaded = LoadedScenario(validate_scenario(raw, source), source, Path(base_dir))
    return summarize(run(loaded, controller=controller))


def _load_summary(path: Path) -> dict[str, Any] | None:
    """A finished run's summary, or None when it is absent or not a whole summary (then the run is redone)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or tuple(summary) != SUMMARY_KEYS:
        return None
    return summary


def _save(plan: SweepPlan, point: SweepPoint, summary: dict[str, Any], out_dir: Path) -> None:
    run_dir = out_dir / "runs" / point.run_id
    meta = {
        "run_id": point.run_id,
        "sweep": plan.source,
        "scenario": str(plan.scenario_path),
        "set": list(plan.fixed),
        "grid": point.values,
        "controller": point.controller,
    }
    with writing(run_dir):  # a full disk ends the sweep with one line; the runs saved so far are kept for a resume
        write_atomic(run_dir / "point.json", json.dumps(meta, indent=2) + "\n")
        write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")  # last: it marks the run done


def _dask_client(address: str, timeout_s: float = 10.0) -> Any:
    try:
        from distributed import Client
    except ImportError:
        raise InputError("--dask", address, "dask.distributed installed (pip install 'dimmer[dask]')") from None
    try:
        return Client(address, timeout=timeout_s, set_as_default=False)
    except (OSError, TimeoutError, ValueError, TypeError) as exc:
        raise InputError("--dask", address, f"the address of a running dask.distributed scheduler ({exc})") from None


def connect(dask_address: str | None, timeout_s: float = 10.0) -> Any:
    """A Dask client for `dask_address` (None: none); InputError when it cannot connect within `timeout_s`.
    Connect before running anything so that a wrong address fails with nothing written."""
    return None if dask_address is None else _dask_client(dask_address, timeout_s)


# one run: the resolved scenario, the scenario file, its directory and the controller in; the summary out
Task = Callable[[dict[str, Any], str, str, str], dict[str, Any]]
Finished = Callable[[SweepPoint, dict[str, Any] | None, BaseException | None], None]


def _resume(plan: SweepPlan, out_dir: Path) -> tuple[dict[str, dict[str, Any]], list[SweepPoint]]:
    """The summaries already in `out_dir/runs/` (run id -> summary) and the points still to run, in grid order."""
    summaries: dict[str, dict[str, Any]] = {}
    todo: list[SweepPoint] = []
    for p in plan.points:
        done = _load_summary(out_dir / "runs" / p.run_id / "summary.json")
        if done is not None:
            summaries[p.run_id] = done
        else:
            todo.append(p)
    return summaries, todo


def run_points(
    plan: SweepPlan,
    out_dir: Path,
    task: Task,
    workers: int | None = None,
    client: Any = None,
    progress: SweepProgress | None = None,
) -> SweepOutcome:
    """`gridsim.sweep.run_sweep`, with the function every run calls passed in as `task` (`run_task` in a sweep)."""
    out_dir = Path(out_dir)
    total = len(plan.points)
    summaries, todo = _resume(plan, out_dir)
    outcome = SweepOutcome(summaries=summaries, reused=list(summaries))
    n_workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    if not todo:
        outcome.where = "no worker (every run was done)"
    elif client is not None:
        outcome.where = f"the Dask cluster at {client.scheduler.address}"
    else:
        outcome.where = f"{min(n_workers, len(todo))} local worker process(es)"
    if progress is not None:
        progress(len(summaries), total)

    def finished(point: SweepPoint, summary: dict[str, Any] | None, error: BaseException | None) -> None:
        if summary is not None:
            _save(plan, point, summary, out_dir)
            summaries[point.run_id] = summary
            outcome.ran.append(point.run_id)
        else:
            outcome.failed.append((point.run_id, f"{point.describe()}: {type(error).__name__}: {error}"))
        if progress is not None:
            progress(len(summaries) + len(outcome.failed), total)

    source = str(plan.scenario_path)
    args = [(p.raw, source, str(plan.base_dir), p.controller) for p in todo]
    wall0 = time.perf_counter()
    if not todo:
        pass
    elif client is not None:
        _run_dask(task, client, todo, args, finished)
    elif n_workers == 1 or len(todo) == 1:
        for p, a in zip(todo, args, strict=True):
            try:
                summary = task(*a)
            except Exception as exc:
                finished(p, None, exc)
            else:
                finished(p, summary, None)
    else:
        _run_pool(task, min(n_workers, len(todo)), todo, args, finished)
    outcome.wall_s = time.perf_counter() - wall0
    return outcome


def _run_pool(task: Task, n: int, todo: list[SweepPoint], args: list[tuple[Any, ...]], finished: Finished) -> None:
    pool = cf.ProcessPoolExecutor(max_workers=n)
    try:
        futures = {pool.submit(task, *a): p for p, a in zip(todo, args, strict=True)}
        for fut in cf.as_completed(futures):
            exc = fut.exception()
            finished(futures[fut], None if exc else fut.result(), exc)
    except BaseException:
        # interrupted: drop the queued runs and stop the running ones (their summaries are not written)
        processes = list((getattr(pool, "_processes", None) or {}).values())  # taken before shutdown clears it
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            if proc.is_alive():
                proc.terminate()
        raise
    pool.shutdown(wait=True)


def _run_dask(task: Task, client: Any, todo: list[SweepPoint], args: list[tuple[Any, ...]], finished: Finished) -> None:
    from distributed import as_completed

    futures = {client.submit(task, *a, pure=False): p for p, a in zip(todo, args, strict=True)}
    try:
        with client.as_current():  # as_completed finds its client as the current one
            for fut in as_completed(list(futures)):
                point = futures[fut]
                try:
                    summary = fut.result()
                except Exception as exc:
                    finished(point, None, exc)
                else:
                    finished(point, summary, None)
    except BaseException:
        client.cancel(list(futures))
        raise
