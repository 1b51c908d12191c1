"""Baseline controllers, implemented honestly so that comparisons mean something.

`none`: no control at all. GPUs run uncapped, the campus battery idles, rack BBUs are backup only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dimmer.control import register
from dimmer.errors import InputError
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel


class NoControl:
    name = "none"

    def __init__(self, site: SiteModel) -> None:
        self._actions = Actions.hands_off(site)

    def step(self, obs: Observation) -> Actions:
        return self._actions


@register("none")
def _make_none(site: SiteModel, params: Mapping[str, Any]) -> NoControl:
    if params:
        raise InputError("controller", f"params.{next(iter(params))}", "the none controller takes no parameters")
    return NoControl(site)
