"""The sweep file: its schema, and the checks that every key and value in it makes sense before any point is built.

`read_sweep_file` reads the file, finds and reads its scenario, checks the grid axes and the fixed overrides (`set`),
and applies them, so that a mistake in the file is one InputError naming the sweep file and the key.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from dimmer.control import controller_names, make_controller
from dimmer.errors import InputError, from_validation_error, key_path
from dimmer.siteconfig import PathName, Strict
from dimmer.tomlfile import read_toml as read_toml_file
from gridsim.scenario import LoadedScenario, apply_overrides, check_references, parse_override, validate_scenario
from gridsim.sweep.plan import CONTROLLER_KEY, Scalar

MAX_RUNS = 10_000  # a grid larger than this is almost surely a typo


class SweepSpec(Strict):
    """The sweep file. `grid` is checked by hand (its keys are scenario key paths, quoted in the messages)."""

    scenario: str = Field(min_length=1)  # path to the scenario file, relative to the sweep file
    name: PathName | None = None  # default: the sweep file's stem; names the output directory out/<name>-sweep
    set: list[str] = []  # fixed overrides, KEY=VALUE as for --set
    grid: dict[str, Any]


@dataclass(frozen=True)
class CheckedSweep:
    """The sweep file read and checked, its scenario read and its fixed overrides applied: all but the points."""

    source: str  # the sweep file, as given
    name: str
    scenario_path: Path  # resolved
    scenario_source: str  # the scenario file as the user sees it, for messages
    base_dir: Path  # the scenario's directory: paths inside it are relative to it
    fixed: tuple[str, ...]
    axes: dict[str, list[Scalar]]  # grid key -> values, in grid order
    fixed_raw: dict[str, Any]  # the scenario with the fixed overrides applied


def read_sweep_file(sweep_path: Path) -> CheckedSweep:
    """Read and check the sweep file, its scenario, its grid axes and its fixed overrides; InputError at the first
    problem, naming the sweep file and the key."""
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
    fixed_raw = _apply_fixed(source, spec.set, base_raw, scenario_source, base_dir, axes)
    return CheckedSweep(
        source=source,
        name=spec.name or sweep_path.stem,
        scenario_path=scenario_path,
        scenario_source=scenario_source,
        base_dir=base_dir,
        fixed=tuple(spec.set),
        axes=axes,
        fixed_raw=fixed_raw,
    )


def _apply_fixed(
    source: str,
    fixed: list[str],
    base_raw: dict[str, Any],
    scenario_source: str,
    base_dir: Path,
    axes: dict[str, list[Scalar]],
) -> dict[str, Any]:
    """The scenario with the fixed overrides, alone: an error at one of their keys is the sweep file's."""
    try:
        fixed_raw = apply_overrides(base_raw, list(fixed))
    except InputError as exc:
        i = fixed.index(exc.key) if exc.key in fixed else 0
        raise InputError(source, f"set[{i}]", f"{exc.expected} (got {exc.key!r})") from None
    try:
        _validate(fixed_raw, scenario_source, base_dir, None)
    except InputError as exc:
        for i, text in enumerate(fixed):
            if _related(exc.key, key_path(parse_override(text)[0])):
                raise InputError(source, f"set[{i}]", f"a value the scenario accepts ({exc})") from None
        if not axes.keys() - {CONTROLLER_KEY}:
            raise
        # the grid may be what makes the scenario valid: the points decide
    return fixed_raw


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


def _read_scenario(path: Path, source: str) -> dict[str, Any]:
    from gridsim.scenario import read_toml

    try:
        return read_toml(path)
    except InputError as exc:
        raise InputError(source, exc.key, exc.expected) from None
