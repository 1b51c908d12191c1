"""Controllers behind one protocol, looked up by name.

A controller is pure: `step(observation) -> actions`, no I/O, no clock. It is built once for a site with its
parameters (a mapping, validated by the controller) and then stepped every control period.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from dimmer.errors import InputError
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel


@runtime_checkable
class Controller(Protocol):
    name: str

    def step(self, obs: Observation) -> Actions: ...


ControllerFactory = Callable[[SiteModel, Mapping[str, Any]], Controller]

_REGISTRY: dict[str, ControllerFactory] = {}


def register(name: str) -> Callable[[ControllerFactory], ControllerFactory]:
    def deco(factory: ControllerFactory) -> ControllerFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def controller_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def make_controller(
    name: str, site: SiteModel, params: Mapping[str, Any] | None = None, source: str = "controller"
) -> Controller:
    """Build the controller called `name`; InputError if the name or a parameter is wrong."""
    _load_builtin()
    if name not in _REGISTRY:
        raise InputError(source, "controller", f"one of {', '.join(sorted(_REGISTRY))} (got {name!r})")
    return _REGISTRY[name](site, params or {})


def _load_builtin() -> None:
    # Importing the modules registers their controllers.
    from dimmer.control import baselines, campus, dimmer  # noqa: F401


__all__ = ["Actions", "Controller", "Observation", "controller_names", "make_controller", "register"]
