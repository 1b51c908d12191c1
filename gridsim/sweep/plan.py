"""What a sweep is once its file is checked: the plan (its grid axes and every point), and the outcome of running it.

Every other part of the sweep speaks in these types; none of them reads a file or runs anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dimmer.errors import DimmerError

CONTROLLER_KEY = "controller"  # the grid key that picks the controller instead of overriding a scenario key

Scalar = bool | int | float | str
# runs done (reused included), runs in the sweep
SweepProgress = Callable[[int, int], None]


class SweepError(DimmerError):
    """Some runs of a sweep failed; the ones that finished are kept for the next attempt."""


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


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)
