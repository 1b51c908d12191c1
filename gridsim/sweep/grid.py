"""The grid expanded: every combination of the axes as a point, its resolved scenario checked and its run id.

`plan_sweep` is the door: the checked sweep file in, a `SweepPlan` out, or an InputError naming the grid key (or the
point) that makes a scenario the simulator would refuse.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path
from typing import Any

from dimmer.errors import InputError, key_path
from gridsim.scenario import apply_overrides, parse_override
from gridsim.sweep.plan import CONTROLLER_KEY, Scalar, SweepPlan, SweepPoint, _fmt_value
from gridsim.sweep.spec import CheckedSweep, _grid_key, _related, _validate, read_sweep_file


def _toml_literal(v: Scalar) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "inf" if v == math.inf else "-inf" if v == -math.inf else "nan" if v != v else repr(v)
    if isinstance(v, int):
        return str(v)
    return json.dumps(v)  # a TOML basic string


def run_id(raw: dict[str, Any], controller: str) -> str:
    """The id of a run: a hash of everything it depends on that the sweep controls (the resolved scenario, the
    controller). Trace files and the simulator's code are not in it: delete `runs/` after changing either."""
    text = json.dumps({"scenario": raw, "controller": controller}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def plan_sweep(path: str | Path) -> SweepPlan:
    """Read and check the sweep file and every one of its grid points; raise InputError at the first problem."""
    sweep = read_sweep_file(Path(path))
    points = expand_grid(sweep)
    first = points[0]
    return SweepPlan(
        source=sweep.source,
        name=sweep.name,
        scenario_path=sweep.scenario_path,
        scenario_name=str(first.raw.get("name", sweep.scenario_path.stem)),
        base_dir=sweep.base_dir,
        fixed=sweep.fixed,
        axes=sweep.axes,
        points=points,
    )


def expand_grid(sweep: CheckedSweep) -> list[SweepPoint]:
    """Every combination of the axes, in grid order, as a point whose resolved scenario (and controller) is checked;
    InputError naming the grid key, or the point, that the scenario refuses, or two points that are one run."""
    source, axes, fixed_raw = sweep.source, sweep.axes, sweep.fixed_raw
    scenario_source, base_dir = sweep.scenario_source, sweep.base_dir
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
    return points
