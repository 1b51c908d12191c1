"""`gridsim sweep`: one scenario run over a grid of overrides, on every local core or on a Dask cluster.

A sweep file names a scenario (relative to the sweep file), fixed overrides, and a grid:

    scenario = "../scenarios/swing-8k.toml"
    set = ["duration_s=900"]
    [grid]
    "site.storage.bess.energy_mwh" = [0.5, 1, 2, 4]
    "site.pcc.ramp_mw_per_min" = [0.5, 1.5, 3]
    controller = ["none", "dimmer"]          # the special key: which controller runs

`plan_sweep` reads and checks the file and builds every grid point (scenario validated, site built, controller
built) before anything runs, so a bad key or value is one InputError naming the sweep file and the key. `run_sweep`
runs the points that have no `runs/<id>/summary.json` yet (a run's id is a hash of its resolved scenario and
controller, so an interrupted sweep resumes and a changed scenario is re-run), writing each summary atomically as it
arrives. `write_sweep` then writes, all or nothing,

    results.csv        one row per run: run_id, the grid values, every summary key
    results.parquet    the same, when pyarrow is importable
    figures/<m>.png    one figure per metric in FIGURE_METRICS: heatmaps over two numeric axes, else lines or bars
    sweep.md           the answer, the table and the figures

matplotlib is imported inside the figure functions only; dask.distributed inside `_dask_client` only.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
import hashlib
import importlib.util
import io
import itertools
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, ValidationError

from dimmer.atomicfile import write_atomic
from dimmer.control import controller_names, make_controller
from dimmer.errors import DimmerError, InputError, from_validation_error, key_path
from dimmer.siteconfig import Strict
from dimmer.tomlfile import read_toml as read_toml_file
from gridsim.compare import KEY_METRICS, csv_cell
from gridsim.metrics import SUMMARY_KEYS
from gridsim.scenario import LoadedScenario, apply_overrides, check_references, parse_override, validate_scenario

CONTROLLER_KEY = "controller"  # the grid key that picks the controller instead of overriding a scenario key
MAX_RUNS = 10_000  # a grid larger than this is almost surely a typo
ZERO = 1e-6  # a metric below this in magnitude is shown as 0 (the accounting's rounding residue is ~1e-11 %)
GOODPUT_OK_PCT = 1.0  # the answer's second question: the smallest size that holds the limits losing less than this

# The metrics drawn, one figure each; the colour scale of each runs from good (light) to bad (dark).
FIGURE_METRICS = (
    "ramp_violation_s",
    "pcc_overlimit_s",
    "breaker_trips",
    "band_rms_mw",
    "goodput_loss_power_pct",
    "energy_overhead_pct",
    "min_bess_soc_frac",
)
LOWER_IS_WORSE = frozenset({"min_bess_soc_frac", "min_bbu_soc_frac", "goodput_pct"})
METRIC_LABEL = dict(KEY_METRICS)

# the table in sweep.md: summary key and column header
TABLE_METRICS: tuple[tuple[str, str], ...] = (
    ("breaker_trips", "trips"),
    ("pcc_overlimit_s", "over limit [s]"),
    ("ramp_violation_s", "over ramp [s]"),
    ("max_ramp_mw_per_min", "max ramp [MW/min]"),
    ("band_rms_mw", "band RMS [MW]"),
    ("goodput_loss_power_pct", "goodput lost [%]"),
    ("energy_overhead_pct", "overhead [%]"),
    ("min_bess_soc_frac", "min BESS SoC"),
)

Scalar = bool | int | float | str
# runs done (reused included), runs in the sweep
SweepProgress = Callable[[int, int], None]


class SweepError(DimmerError):
    """Some runs of a sweep failed; the ones that finished are kept for the next attempt."""


class SweepSpec(Strict):
    """The sweep file. `grid` is checked by hand (its keys are scenario key paths, quoted in the messages)."""

    scenario: str = Field(min_length=1)  # path to the scenario file, relative to the sweep file
    name: str | None = Field(default=None, min_length=1)  # default: the sweep file's stem
    set: list[str] = []  # fixed overrides, KEY=VALUE as for --set
    grid: dict[str, Any]


@dataclass(frozen=True)
class SweepPoint:
    """One run: its grid values (grid order), the controller, the resolved scenario and the run's id."""

    index: int
    values: dict[str, Scalar]
    controller: str
    raw: dict[str, Any]
    run_id: str

    def describe(self) -> str:
        return ", ".join(f"{k} = {_fmt_value(v)}" for k, v in self.values.items())


@dataclass(frozen=True)
class SweepPlan:
    source: str  # the sweep file, as given
    name: str
    scenario_path: Path
    scenario_name: str
    base_dir: Path  # the scenario's directory: paths inside it are relative to it
    fixed: tuple[str, ...]
    axes: dict[str, list[Scalar]]  # grid key -> values, in grid order
    points: list[SweepPoint]

    @property
    def numeric_axes(self) -> list[str]:
        return [k for k, vs in self.axes.items() if k != CONTROLLER_KEY and all(_is_number(v) for v in vs)]


@dataclass
class SweepOutcome:
    summaries: dict[str, dict[str, Any]]  # run_id -> summary, every point that has one
    ran: list[str] = field(default_factory=list)  # run ids run this time
    reused: list[str] = field(default_factory=list)  # run ids whose summary was already there
    failed: list[tuple[str, str]] = field(default_factory=list)  # (run id, error)
    wall_s: float = 0.0
    where: str = ""  # "4 local workers" or "dask tcp://..."


# -- reading and checking ------------------------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _read_sweep_toml(path: Path) -> dict[str, Any]:
    return read_toml_file(path, "sweep file")


def _grid_key(key: str) -> str:
    return f'grid."{key}"' if not key.isidentifier() else f"grid.{key}"


def _check_axes(source: str, grid: dict[str, Any], fixed: Sequence[str]) -> dict[str, list[Scalar]]:
    if not grid:
        raise InputError(source, "grid", "at least one key with a list of values")
    fixed_paths = {key_path(parse_override(text)[0]) for text in fixed}
    known = controller_names()
    axes: dict[str, list[Scalar]] = {}
    for key, values in grid.items():
        where = _grid_key(key)
        if key != CONTROLLER_KEY:
            try:
                path, _ = parse_override(f"{key}=0", source)
            except InputError:
                raise InputError(
                    source, where, "a dotted scenario key such as engine.tick_s or jobs[0].gpus, or controller"
                ) from None
            if key_path(path) in fixed_paths:
                raise InputError(source, where, "a key that `set` does not also fix")
        if not isinstance(values, list):
            raise InputError(source, where, f"a list of values, e.g. [0.5, 1, 2] (got {values!r})")
        if not values:
            raise InputError(source, where, "a non-empty list of values")
        for v in values:
            if not isinstance(v, bool | int | float | str):
                raise InputError(source, where, f"a list of numbers, strings or booleans (got {v!r})")
        if len({json.dumps(v) for v in values}) != len(values):
            raise InputError(source, where, "each value once")
        if key == CONTROLLER_KEY:
            for v in values:
                if v not in known:
                    raise InputError(source, where, f"controller names, each one of {', '.join(known)} (got {v!r})")
        axes[key] = list(values)
    n_runs = math.prod(len(vs) for vs in axes.values())
    if n_runs > MAX_RUNS:
        raise InputError(source, "grid", f"at most {MAX_RUNS:,} runs (this grid has {n_runs:,})")
    return axes


def _toml_literal(v: Scalar) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "inf" if v == math.inf else "-inf" if v == -math.inf else "nan" if v != v else repr(v)
    if isinstance(v, int):
        return str(v)
    return json.dumps(v)  # a TOML basic string


def _related(a: str, b: str) -> bool:
    """Does the error at key path `a` concern the override at `b` (the same key, or one inside the other)?"""
    return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))


def _validate(raw: dict[str, Any], scenario_source: str, base_dir: Path, controller: str | None) -> LoadedScenario:
    """Scenario, site, placements, references and the controller: everything a run will build."""
    loaded = LoadedScenario(validate_scenario(raw, scenario_source), scenario_source, base_dir)
    check_references(loaded)
    name = controller or loaded.scenario.controller.name
    make_controller(name, loaded.site(), loaded.scenario.controllers.get(name, {}), source=scenario_source)
    return loaded


def run_id(raw: dict[str, Any], controller: str) -> str:
    """The id of a run: a hash of everything it depends on that the sweep controls (the resolved scenario, the
    controller). Trace files and the simulator's code are not in it: delete `runs/` after changing either."""
    text = json.dumps({"scenario": raw, "controller": controller}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def plan_sweep(path: str | Path) -> SweepPlan:
    """Read and check the sweep file and every one of its grid points; raise InputError at the first problem."""
    sweep_path = Path(path)
    source = str(sweep_path)
    doc = _read_sweep_toml(sweep_path)
    try:
        spec = SweepSpec.model_validate(doc)
    except ValidationError as exc:
        raise from_validation_error(source, exc) from None

    scenario_path = (sweep_path.parent / Path(spec.scenario).expanduser()).resolve()
    if not scenario_path.is_file():
        raise InputError(source, "scenario", f"an existing scenario file ({scenario_path})")
    scenario_source = os.path.normpath(sweep_path.parent / Path(spec.scenario).expanduser())  # as the user sees it
    base_raw = _read_scenario(scenario_path, scenario_source)
    base_dir = scenario_path.parent

    for i, text in enumerate(spec.set):
        try:
            parse_override(text)
        except InputError as exc:
            raise InputError(source, f"set[{i}]", f"{exc.expected} (got {text!r})") from None
    axes = _check_axes(source, spec.grid, spec.set)

    # the fixed overrides, alone: an error at one of their keys is the sweep file's
    try:
        fixed_raw = apply_overrides(base_raw, list(spec.set))
    except InputError as exc:
        i = spec.set.index(exc.key) if exc.key in spec.set else 0
        raise InputError(source, f"set[{i}]", f"{exc.expected} (got {exc.key!r})") from None
    try:
        _validate(fixed_raw, scenario_source, base_dir, None)
    except InputError as exc:
        for i, text in enumerate(spec.set):
            if _related(exc.key, key_path(parse_override(text)[0])):
                raise InputError(source, f"set[{i}]", f"a value the scenario accepts ({exc})") from None
        if not axes.keys() - {CONTROLLER_KEY}:
            raise
        # the grid may be what makes the scenario valid: the points decide

    keys = list(axes)
    override_keys = [k for k in keys if k != CONTROLLER_KEY]
    points: list[SweepPoint] = []
    for index, combo in enumerate(itertools.product(*(axes[k] for k in keys))):
        values = dict(zip(keys, combo, strict=True))
        controller = str(values[CONTROLLER_KEY]) if CONTROLLER_KEY in values else None
        overrides = [f"{k}={_toml_literal(values[k])}" for k in override_keys]
        try:
            raw = apply_overrides(fixed_raw, overrides)
        except InputError as exc:
            key = next((k for k in override_keys if exc.key.startswith(f"{k}=")), None)
            raise InputError(source, _grid_key(key) if key else "grid", exc.expected) from None
        try:
            loaded = _validate(raw, scenario_source, base_dir, controller)
        except InputError as exc:
            point = ", ".join(f"{k} = {_fmt_value(v)}" for k, v in values.items())
            culprit = next((k for k in override_keys if _related(exc.key, key_path(parse_override(f"{k}=0")[0]))), None)
            if culprit is not None:
                raise InputError(
                    source, _grid_key(culprit), f"a key and value the scenario accepts (at {point}: {exc})"
                ) from None
            raise InputError(source, "grid", f"every point a valid scenario (at {point}: {exc})") from None
        name = controller or loaded.scenario.controller.name
        points.append(SweepPoint(index, values, name, raw, run_id(raw, name)))
    seen: dict[str, SweepPoint] = {}
    for p in points:
        if p.run_id in seen:
            raise InputError(
                source, "grid", f"points that differ ({seen[p.run_id].describe()} and {p.describe()} are one run)"
            )
        seen[p.run_id] = p

    first = points[0]
    return SweepPlan(
        source=source,
        name=spec.name or sweep_path.stem,
        scenario_path=scenario_path,
        scenario_name=str(first.raw.get("name", scenario_path.stem)),
        base_dir=base_dir,
        fixed=tuple(spec.set),
        axes=axes,
        points=points,
    )


def _read_scenario(path: Path, source: str) -> dict[str, Any]:
    from gridsim.scenario import read_toml

    try:
        return read_toml(path)
    except InputError as exc:
        raise InputError(source, exc.key, exc.expected) from None


# -- running -------------------------------------------------------------------------------------------------


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


def run_sweep(
    plan: SweepPlan,
    out_dir: Path,
    workers: int | None = None,
    client: Any = None,
    progress: SweepProgress | None = None,
) -> SweepOutcome:
    """Run every point of `plan` that has no summary in `out_dir/runs/<id>/` yet: on `client` (a dask.distributed
    Client) when given, else on `workers` local processes (default: every core; 1 runs in this process).

    Each summary is written atomically as its run finishes. A run that raises does not stop the others; it is
    listed in `failed` and has no summary (the next attempt runs it again).
    """
    out_dir = Path(out_dir)
    total = len(plan.points)
    summaries: dict[str, dict[str, Any]] = {}
    todo: list[SweepPoint] = []
    for p in plan.points:
        done = _load_summary(out_dir / "runs" / p.run_id / "summary.json")
        if done is not None:
            summaries[p.run_id] = done
        else:
            todo.append(p)
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
        _run_dask(client, todo, args, finished)
    elif n_workers == 1 or len(todo) == 1:
        for p, a in zip(todo, args, strict=True):
            try:
                summary = run_task(*a)
            except Exception as exc:
                finished(p, None, exc)
            else:
                finished(p, summary, None)
    else:
        _run_pool(min(n_workers, len(todo)), todo, args, finished)
    outcome.wall_s = time.perf_counter() - wall0
    return outcome


Finished = Callable[[SweepPoint, dict[str, Any] | None, BaseException | None], None]


def _run_pool(n: int, todo: list[SweepPoint], args: list[tuple[Any, ...]], finished: Finished) -> None:
    pool = cf.ProcessPoolExecutor(max_workers=n)
    try:
        futures = {pool.submit(run_task, *a): p for p, a in zip(todo, args, strict=True)}
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


def _run_dask(client: Any, todo: list[SweepPoint], args: list[tuple[Any, ...]], finished: Finished) -> None:
    from distributed import as_completed

    futures = {client.submit(run_task, *a, pure=False): p for p, a in zip(todo, args, strict=True)}
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


# -- results -------------------------------------------------------------------------------------------------


def result_columns(plan: SweepPlan) -> list[str]:
    """run_id, the grid keys, then every summary key not already a grid key (controller, seed, duration_s)."""
    grid = list(plan.axes)
    return ["run_id", *grid, *(k for k in SUMMARY_KEYS if k not in grid)]


def result_rows(plan: SweepPlan, summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point, in grid order: its grid values (as asked) and its summary."""
    rows = []
    for p in plan.points:
        s = summaries[p.run_id]
        rows.append({"run_id": p.run_id, **p.values, **{k: v for k, v in s.items() if k not in p.values}})
    return rows


def results_csv(plan: SweepPlan, rows: Sequence[dict[str, Any]]) -> str:
    cols = result_columns(plan)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(cols)
    for row in rows:
        writer.writerow([csv_cell(row[c]) for c in cols])
    return buf.getvalue()


def parquet_available() -> bool:
    return importlib.util.find_spec("pyarrow") is not None


def results_parquet(plan: SweepPlan, rows: Sequence[dict[str, Any]], path: Path) -> None:
    import pandas as pd

    pd.DataFrame(list(rows), columns=result_columns(plan)).to_parquet(path, index=False, engine="pyarrow")


def holds_limits(s: dict[str, Any]) -> bool:
    """No breaker trip, never over the interconnect limit, never over the ramp limit."""
    return not (s["breaker_trips"] or s["pcc_overlimit_s"] > 0 or s["ramp_violation_s"] > 0)


def short_key(key: str) -> str:
    """`site.storage.bess.energy_mwh` -> `bess energy_mwh`: the last two parts of a key, for labels and answers."""
    parts = key.split(".")
    return " ".join(parts[-2:])


def _where(values: dict[str, Scalar]) -> str:
    ctrl = values.get(CONTROLLER_KEY)
    rest = ", ".join(f"{short_key(k)} = {_fmt_value(v)}" for k, v in values.items() if k != CONTROLLER_KEY)
    if ctrl is not None:
        return f"with {ctrl}" + (f" at {rest}" if rest else "")
    return f"at {rest}" if rest else "in this sweep"


def _violations(s: dict[str, Any]) -> str:
    out = []
    if s["breaker_trips"]:
        out.append(f"{s['breaker_trips']} trip(s)")
    if s["pcc_overlimit_s"] > 0:
        out.append(f"{s['pcc_overlimit_s']:.1f} s over the interconnect limit")
    if s["ramp_violation_s"] > 0:
        out.append(f"{s['ramp_violation_s']:.1f} s over the ramp limit")
    return ", ".join(out)


def answers(plan: SweepPlan, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Plain answers. With a numeric axis (the first one is the size), for every combination of the other axes:
    the smallest size that holds the limits, and the smallest that also loses under GOODPUT_OK_PCT % goodput.
    With none: which controllers hold the limits and which of those loses the least goodput."""
    by_point = {p.run_id: (p, r) for p, r in zip(plan.points, rows, strict=True)}
    numeric = plan.numeric_axes
    if not numeric:
        held = [r for r in rows if holds_limits(r)]
        if not held:
            return ["no run of the grid holds the limits"]
        best = min(held, key=lambda r: r["goodput_loss_power_pct"])
        names = [_where({k: r[k] for k in plan.axes}) for r in held]
        return [
            f"{len(held)} of {len(rows)} runs hold the limits ({'; '.join(names)}); the one that loses the least "
            f"goodput is {_where({k: best[k] for k in plan.axes}).removeprefix('with ')} "
            f"({best['goodput_loss_power_pct']:.2f} %)"
        ]
    size = numeric[0]
    others = sorted((k for k in plan.axes if k != size), key=lambda k: k != CONTROLLER_KEY)
    label = short_key(size)
    lines = []
    for combo in itertools.product(*(plan.axes[k] for k in others)):
        fixed = dict(zip(others, combo, strict=True))
        runs = sorted(
            (
                (float(p.values[size]), r)
                for p, r in by_point.values()
                if all(p.values[k] == v for k, v in fixed.items())
            ),
            key=lambda vr: vr[0],
        )
        ok = [(v, r) for v, r in runs if holds_limits(r)]
        where = _where(fixed)
        if not ok:
            v_max, r_max = runs[-1]
            lines.append(
                f"{where}: no {label} in the grid (up to {v_max:g}) holds the limits "
                f"(at {v_max:g}: {_violations(r_max)})"
            )
            continue
        v0, r0 = ok[0]
        smallest = ", the smallest in the grid" if v0 == runs[0][0] else ""
        text = (
            f"{where}: the smallest {label} that holds the limits is {v0:g}{smallest} "
            f"(goodput lost {r0['goodput_loss_power_pct']:.2f} %)"
        )
        worse = [v for v, r in runs if v > v0 and not holds_limits(r)]
        if worse:
            text += f", though not at {', '.join(f'{v:g}' for v in worse)}"
        cheap = [(v, r) for v, r in ok if r["goodput_loss_power_pct"] < GOODPUT_OK_PCT]
        if cheap and cheap[0][0] != v0:
            v1, r1 = cheap[0]
            text += (
                f"; the smallest that also loses under {GOODPUT_OK_PCT:g} % of goodput is {v1:g} "
                f"({r1['goodput_loss_power_pct']:.2f} %)"
            )
        elif not cheap:
            text += f"; none in the grid holds them losing under {GOODPUT_OK_PCT:g} % of goodput"
        lines.append(text)
    return lines


# -- figures -------------------------------------------------------------------------------------------------


def _metric(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan


def _cell_text(v: float) -> str:
    if math.isnan(v):
        return "–"
    return "0" if abs(v) < ZERO else f"{v:.3g}"


def sweep_figure(plan: SweepPlan, rows: Sequence[dict[str, Any]], metric: str, path: Path) -> str:
    """Draw `metric` over the grid into `path`; return the kind drawn: "heatmap", "lines" or "bars".

    Two numeric axes or more: a heatmap of the first two (columns, rows), one panel per combination of the
    others (e.g. per controller), one colour scale; cells outlined in green held every limit. One numeric axis:
    a line per combination of the others against it, hollow markers where a limit was broken. None: bars.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    numeric = plan.numeric_axes
    title = f"{METRIC_LABEL.get(metric, metric)} — sweep {plan.name} on {plan.scenario_name}, {len(rows)} runs"
    lookup = {tuple(p.values.values()): r for p, r in zip(plan.points, rows, strict=True)}
    keys = list(plan.axes)

    def row_at(values: dict[str, Scalar]) -> dict[str, Any]:
        return lookup[tuple(values[k] for k in keys)]

    cmap = "YlOrRd_r" if metric in LOWER_IS_WORSE else "YlOrRd"
    finite = [v for r in rows if not math.isnan(v := _metric(r, metric))]
    vmin, vmax = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if vmax <= vmin:
        vmin, vmax = vmin - 0.5, vmax + 0.5

    if len(numeric) >= 2:
        xk, yk = numeric[0], numeric[1]
        panel_keys = [k for k in keys if k not in (xk, yk)]
        panels = list(itertools.product(*(plan.axes[k] for k in panel_keys)))
        xs, ys = plan.axes[xk], plan.axes[yk]
        ncols = min(len(panels), 3)
        nrows = math.ceil(len(panels) / ncols)
        w_panel, h_panel = 1.0 + 0.9 * len(xs), 1.3 + 0.55 * len(ys)
        fig = Figure(figsize=(ncols * w_panel + 1.6, nrows * h_panel + 1.0), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, ncols, squeeze=False)
        image = None

        for i, combo in enumerate(panels):
            ax = axes[i // ncols][i % ncols]
            fixed = dict(zip(panel_keys, combo, strict=True))
            grid = np.full((len(ys), len(xs)), np.nan)
            held = np.zeros((len(ys), len(xs)), dtype=bool)
            for yi, yv in enumerate(ys):
                for xi, xv in enumerate(xs):
                    r = row_at({**fixed, xk: xv, yk: yv})
                    grid[yi, xi] = _metric(r, metric)
                    held[yi, xi] = holds_limits(r)
            image = ax.imshow(
                np.ma.masked_invalid(grid), cmap=cmap, vmin=vmin, vmax=vmax, origin="lower", aspect="auto"
            )
            ax.set_facecolor("0.85")
            for yi in range(len(ys)):
                for xi in range(len(xs)):
                    v = grid[yi, xi]
                    frac = 0.0 if math.isnan(v) else (v - vmin) / (vmax - vmin)
                    dark = (1 - frac) if metric in LOWER_IS_WORSE else frac
                    ax.text(xi, yi, _cell_text(v), ha="center", va="center", fontsize=8,
                            color="white" if dark > 0.6 else "black")  # fmt: skip
                    if held[yi, xi]:
                        ax.add_patch(Rectangle((xi - 0.47, yi - 0.47), 0.94, 0.94, fill=False, ec="green", lw=2))
            ax.set_xticks(range(len(xs)), [_fmt_value(v) for v in xs])
            ax.set_yticks(range(len(ys)), [_fmt_value(v) for v in ys])
            ax.set_xlabel(xk, fontsize=8)
            ax.set_ylabel(yk, fontsize=8)
            if fixed:
                ax.set_title(", ".join(f"{short_key(k)} = {_fmt_value(v)}" for k, v in fixed.items()), fontsize=10)
        for j in range(len(panels), nrows * ncols):
            axes[j // ncols][j % ncols].set_visible(False)
        if image is not None:
            fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.9, label=METRIC_LABEL.get(metric, metric))
        fig.suptitle(title + " (green outline: every limit held)", fontsize=10)
        kind = "heatmap"
    elif len(numeric) == 1:
        xk = numeric[0]
        others = [k for k in keys if k != xk]
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for i, combo in enumerate(itertools.product(*(plan.axes[k] for k in others))):
            fixed = dict(zip(others, combo, strict=True))
            xs = [float(v) for v in plan.axes[xk]]
            rs = [row_at({**fixed, xk: v}) for v in plan.axes[xk]]
            ys = [_metric(r, metric) for r in rs]
            colour = f"C{i % 10}"
            label = ", ".join(f"{short_key(k)} = {_fmt_value(v)}" for k, v in fixed.items()) or metric
            ax.plot(xs, ys, color=colour, lw=1.2, label=label)
            for x, y, r in zip(xs, ys, rs, strict=True):
                ax.plot([x], [y], "o", color=colour, mfc=colour if holds_limits(r) else "white", ms=7)
        ax.set_xlabel(xk)
        ax.set_ylabel(METRIC_LABEL.get(metric, metric))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="filled: every limit held", title_fontsize=8)
        ax.set_title(title, fontsize=10)
        kind = "lines"
    else:
        fig = Figure(figsize=(max(6.0, 0.8 * len(rows) + 2), 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        labels = [", ".join(_fmt_value(v) for v in p.values.values()) for p in plan.points]
        vals = [_metric(r, metric) for r in rows]
        colours = ["C2" if holds_limits(r) else "C3" for r in rows]
        ax.bar(range(len(rows)), [0.0 if math.isnan(v) else v for v in vals], color=colours)
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(METRIC_LABEL.get(metric, metric))
        ax.grid(alpha=0.3, axis="y")
        ax.set_title(title + " (green: every limit held)", fontsize=10)
        kind = "bars"
    fig.savefig(path, dpi=90)
    return kind


# -- the report ----------------------------------------------------------------------------------------------


def _md_cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "0" if abs(v) < ZERO else f"{v:.4g}"
    return str(v)


def sim_wall_s(rows: Sequence[dict[str, Any]]) -> float:
    """Wall time the simulations took, summed over runs: duration_s / sim_speed_x_realtime of each."""
    return sum(r["duration_s"] / r["sim_speed_x_realtime"] for r in rows if r.get("sim_speed_x_realtime"))


def sweep_md(plan: SweepPlan, rows: Sequence[dict[str, Any]], outcome: SweepOutcome, figures: Sequence[str]) -> str:
    grid = "".join(f"- `{k}`: {', '.join(_fmt_value(v) for v in vs)}\n" for k, vs in plan.axes.items())
    fixed = ", ".join(f"`{t}`" for t in plan.fixed) or "none"
    n = len(rows)
    head = "| run | " + " | ".join(f"`{k}`" for k in plan.axes) + " | " + " | ".join(h for _, h in TABLE_METRICS)
    aligns = ["---:|" if all(_is_number(v) for v in vs) else "---|" for vs in plan.axes.values()]
    head += " | limits |\n|---|" + "".join(aligns) + "---:|" * len(TABLE_METRICS) + "---|\n"
    body = "".join(
        f"| `{r['run_id']}` | "
        + " | ".join(_fmt_value(r[k]) for k in plan.axes)
        + " | "
        + " | ".join(_md_cell(r[k]) for k, _ in TABLE_METRICS)
        + f" | {'held' if holds_limits(r) else '**broken**'} |\n"
        for r in rows
    )
    figs = "".join(
        f"### {METRIC_LABEL.get(m, m)}\n\n![{m}]({f})\n\n" for m, f in zip(FIGURE_METRICS, figures, strict=True)
    )
    answer = "".join(f"- {line}\n" for line in answers(plan, rows))
    return (
        f"# Sweep `{plan.name}`: {n} runs of `{plan.scenario_name}`\n\n"
        f"Sweep file `{plan.source}`; scenario `{plan.scenario_path.name}`; fixed overrides: {fixed}. Grid:\n\n"
        f"{grid}\n"
        f"This attempt ran {len(outcome.ran)} run(s) in {outcome.wall_s:.1f} s wall time on {outcome.where} and "
        f"reused {len(outcome.reused)} from an earlier attempt; the simulations of all {n} took "
        f"{sim_wall_s(rows):.1f} s between them (simulated time over speed, summed).\n\n"
        f"## Answer\n\n"
        f'"Holds the limits": no breaker trip, never over the interconnect limit, never over the ramp limit.\n\n'
        f"{answer}\n"
        f"## Runs\n\n{head}{body}\n"
        f"Every summary key of every run is in `results.csv` (and `results.parquet` when pyarrow is installed); "
        f"each run's `summary.json` is in `runs/<run>/`.\n\n"
        f"## Figures\n\n{figs}"
    )


def write_sweep(plan: SweepPlan, outcome: SweepOutcome, out_dir: Path) -> list[Path]:
    """results.csv, results.parquet (when pyarrow is importable), figures/*.png and sweep.md, all or nothing:
    staged in a temporary directory inside `out_dir` and moved into place at the end."""
    missing = [p.run_id for p in plan.points if p.run_id not in outcome.summaries]
    if missing:
        raise ValueError(f"{len(missing)} runs have no summary")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = result_rows(plan, outcome.summaries)
    figures = [f"figures/{m}.png" for m in FIGURE_METRICS]
    names = ["results.csv", *(["results.parquet"] if parquet_available() else []), *figures, "sweep.md"]
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".stage.") as tmp:
        stage = Path(tmp)
        (stage / "figures").mkdir()
        (stage / "results.csv").write_text(results_csv(plan, rows))
        if parquet_available():
            results_parquet(plan, rows, stage / "results.parquet")
        for m, f in zip(FIGURE_METRICS, figures, strict=True):
            sweep_figure(plan, rows, m, stage / f)
        (stage / "sweep.md").write_text(sweep_md(plan, rows, outcome, figures))
        (out_dir / "figures").mkdir(exist_ok=True)
        written = []
        for name in names:
            target = out_dir / name
            os.replace(stage / name, target)
            written.append(target)
    return written


__all__ = [
    "CONTROLLER_KEY",
    "FIGURE_METRICS",
    "SweepOutcome",
    "SweepPlan",
    "SweepPoint",
    "answers",
    "connect",
    "plan_sweep",
    "run_sweep",
    "write_sweep",
]
