"""The simulator's own exceptions: one more branch of dimmer/errors.py's tree.

DimmerError
 └── PlantError (ValueError)  a run that cannot go on, though its input was valid: exit status 1, one line
      ├── ActionsError        a controller's Actions held a value the plant refuses (NaN, inf where no contract
      │                       gives it a meaning, the wrong shape): named by controller, field, rack and time
      └── ResultError         a result whose series hold non-finite data: no metric is computed over it

The `gridsim` CLI prints any DimmerError other than InputError as one line and exits 1; outputs are staged, so a
refused run writes nothing. Both travel whole across a process pool (a sweep reports them as they were raised).
"""

from __future__ import annotations

from dimmer.errors import DimmerError


class PlantError(DimmerError, ValueError):
    """The plant refused what it was given, or a result is unfit to summarise; str() is one line."""


class ActionsError(PlantError):
    """A controller's `Actions.<field>` broke the plant's contract at simulated time `t_s` (tick `tick`)."""

    def __init__(self, controller: str, field: str, expected: str, t_s: float, tick: int) -> None:
        self.controller = controller
        self.field = field
        self.expected = expected
        self.t_s = t_s
        self.tick = tick
        super().__init__(
            f"controller {controller!r} returned Actions.{field} at t = {t_s:g} s (tick {tick}): expected {expected}"
        )

    def __reduce__(self) -> tuple[type[ActionsError], tuple[str, str, str, float, int]]:
        return (type(self), (self.controller, self.field, self.expected, self.t_s, self.tick))


class ResultError(PlantError):
    """A recorded series held a non-finite value where the metrics need numbers."""

    def __init__(self, scenario: str, controller: str, series: str, what: str) -> None:
        self.scenario = scenario
        self.controller = controller
        self.series = series
        self.what = what
        super().__init__(
            f"{scenario} with controller {controller!r}: series {series!r} {what}; no summary is computed over it"
        )

    def __reduce__(self) -> tuple[type[ResultError], tuple[str, str, str, str]]:
        return (type(self), (self.scenario, self.controller, self.series, self.what))
