"""The daemon's modes and the state machine that moves between them (docs/daemon.md, "Modes")."""

from __future__ import annotations

import enum
from collections.abc import Callable


class Mode(enum.Enum):
    STARTING = "starting"  # waiting for every device's first reading (at most stale_s): nothing written yet
    RUNNING = "running"  # every period: read, decide, write what the controller decided (within the safety net)
    FAILSAFE = "failsafe"  # the controller failed this period: safe caps written, reads go on, retried next period
    STOPPING = "stopping"  # shutting down: safe caps written once, state saved, devices closed; no way back


ALLOWED: dict[Mode, frozenset[Mode]] = {
    Mode.STARTING: frozenset({Mode.RUNNING, Mode.FAILSAFE, Mode.STOPPING}),
    Mode.RUNNING: frozenset({Mode.FAILSAFE, Mode.STOPPING}),
    Mode.FAILSAFE: frozenset({Mode.RUNNING, Mode.STOPPING}),
    Mode.STOPPING: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A mode change the state machine does not allow (a bug, never a runtime condition)."""


class ModeMachine:
    def __init__(self, on_change: Callable[[Mode, Mode], None] | None = None) -> None:
        self.mode = Mode.STARTING
        self._on_change = on_change

    def to(self, new: Mode) -> None:
        """Move to `new`; staying in the same mode is a no-op; a transition not in ALLOWED raises."""
        if new is self.mode:
            return
        if new not in ALLOWED[self.mode]:
            raise IllegalTransition(f"{self.mode.value} -> {new.value}")
        old, self.mode = self.mode, new
        if self._on_change is not None:
            self._on_change(old, new)
