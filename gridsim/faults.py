"""Fault injection: timed scenario events that make telemetry lie, commands vanish, storage fail or the site leave
the grid. The engine calls one hook per path; each is a no-op (one comparison) while no fault is active.

What each fault does is written in its event's docstring in gridsim/scenario.py and in docs/reliability.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from dimmer.observation import Actions
from dimmer.site import SiteModel
from gridsim.plant.storage import CampusBess, CapacitorTrays, RackBbus
from gridsim.scenario import ActuationFault, BackupTransferEvent, Event, StorageFault, TelemetryFault

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


@dataclass
class _Active:
    event: TelemetryFault | ActuationFault | StorageFault | BackupTransferEvent
    domain: int
    racks: BoolArray
    start_s: float
    end_s: float
    frozen: dict[str, object] = field(default_factory=dict)  # values held by stale/stuck telemetry

    def on(self, t_s: float) -> bool:
        return self.start_s <= t_s < self.end_s


@dataclass
class Telemetry:
    """The readings the controller is about to see; the fault hook edits them in place."""

    rack_w: FloatArray
    load_w: FloatArray
    rack_age_s: FloatArray
    domain_w: FloatArray
    domain_age_s: FloatArray
    pcc_w: float
    pcc_age_s: float
    load_peak_w: FloatArray | None = None


class Faults:
    def __init__(self, site: SiteModel, events: list[Event]) -> None:
        self.site = site
        self.faults: list[_Active] = []
        for ev in events:
            if isinstance(ev, TelemetryFault | ActuationFault | StorageFault):
                d = site.domain_index(ev.domain)
                racks = np.zeros(site.n_racks, dtype=bool)
                racks[site.domain_rack_start[d] : site.domain_rack_stop[d]] = True
                self.faults.append(_Active(ev, d, racks, ev.at_s, ev.at_s + ev.duration_s))
            elif isinstance(ev, BackupTransferEvent):
                self.faults.append(_Active(ev, 0, np.ones(site.n_racks, dtype=bool), ev.at_s, ev.at_s + ev.duration_s))
        # the BBU settings last delivered, which a lost write leaves in force
        self._threshold_w = np.full(site.n_racks, np.inf)
        self._recharge_w = site.rack_storage.bbu_recharge_w.copy()
        self.drained_j = 0.0  # BBU energy removed by bbu_empty faults (kept out of the storage's own bookkeeping)
        self._storage_state: dict[int, bool] = {}
        self._next_change_s = min([f.start_s for f in self.faults] + [math.inf])

    def _active(self, t_s: float, kind: type) -> list[_Active]:
        return [f for f in self.faults if isinstance(f.event, kind) and f.on(t_s)]

    # -- telemetry -------------------------------------------------------------------------------------------------

    def telemetry(self, t_s: float, tel: Telemetry) -> None:
        for f in self._active(t_s, TelemetryFault):
            ev = f.event
            assert isinstance(ev, TelemetryFault)
            elapsed = t_s - f.start_s
            if ev.target == "pcc":
                value, f.frozen = _fault_scalar(ev, tel.pcc_w, elapsed, f.frozen)
                tel.pcc_w = value
                if ev.mode == "stale":
                    tel.pcc_age_s += elapsed
            elif ev.target == "meter":
                d = f.domain
                value, f.frozen = _fault_scalar(ev, float(tel.domain_w[d]), elapsed, f.frozen)
                tel.domain_w[d] = value
                if ev.mode == "stale":
                    tel.domain_age_s[d] += elapsed
            else:
                m = f.racks
                for name in ("rack_w", "load_w", "load_peak_w"):
                    arr: FloatArray | None = getattr(tel, name)
                    if arr is not None:
                        arr[m] = _fault_array(ev, arr[m], elapsed, f.frozen, name)
                if ev.mode == "stale":
                    tel.rack_age_s[m] += elapsed

    def racks_dark(self, t_s: float) -> BoolArray | None:
        """Racks whose readings vanish because their host agents are down."""
        down = [f for f in self._active(t_s, ActuationFault) if getattr(f.event, "mode", "") == "agent_down"]
        dark = [f.racks for f in down]
        return np.logical_or.reduce(dark) if dark else None

    # -- actuation -------------------------------------------------------------------------------------------------

    def actuation(self, t_s: float, act: Actions) -> tuple[Actions, float]:
        """The actions as they reach the plant, and any extra delay before they do."""
        delay = 0.0
        for f in self._active(t_s, ActuationFault):
            ev = f.event
            assert isinstance(ev, ActuationFault)
            m = f.racks
            if ev.mode == "delayed":
                delay = max(delay, ev.delay_s)
                continue
            cap = act.rack_cap_w.copy()
            floor = act.rack_floor_w.copy()
            cap[m] = np.nan  # NaN: no change at the GPUs
            floor[m] = np.nan
            changes: dict[str, object] = {"rack_cap_w": cap, "rack_floor_w": floor}
            if ev.mode in ("lost", "agent_down"):
                threshold = np.where(m, self._threshold_w, act.rack_bbu_threshold_w)
                recharge = np.where(m, self._recharge_w, act.rack_bbu_recharge_w)
                changes |= {"rack_bbu_threshold_w": threshold, "rack_bbu_recharge_w": recharge}
            act = replace(act, **changes)  # type: ignore[arg-type]
        self._threshold_w = act.rack_bbu_threshold_w
        self._recharge_w = act.rack_bbu_recharge_w
        return act, delay

    # -- storage and the grid connection ---------------------------------------------------------------------------

    def storage(self, t_s: float, trays: CapacitorTrays, bbus: RackBbus, bess: CampusBess) -> None:
        """Apply storage faults as they begin and end (cheap: one comparison per tick while nothing changes)."""
        if t_s < self._next_change_s:
            return
        upcoming = []
        for i, f in enumerate(self.faults):
            if isinstance(f.event, StorageFault):
                on = f.on(t_s)
                if self._storage_state.get(i, False) != on:
                    self._switch(f, on, trays, bbus, bess)
                    self._storage_state[i] = on
            upcoming += [x for x in (f.start_s, f.end_s) if x > t_s]
        self._next_change_s = min([*upcoming, math.inf])

    def _switch(self, f: _Active, on: bool, trays: CapacitorTrays, bbus: RackBbus, bess: CampusBess) -> None:
        ev = f.event
        assert isinstance(ev, StorageFault)
        m = f.racks
        rs = self.site.rack_storage
        if ev.mode == "bess_offline":
            bess.online = not on
        elif ev.mode == "bbu_failed":
            bbus.power_max_w[m] = 0.0 if on else rs.bbu_power_w[m]
        elif ev.mode == "trays_disabled":
            trays.set_power_max_w(np.where(m, 0.0 if on else rs.tray_power_w, trays.power_max_w))
        elif ev.mode == "bbu_empty" and on:
            floor_j = bbus.soc_min_frac * bbus.capacity_j[m]
            self.drained_j += float(np.sum(np.maximum(bbus.stored_j[m] - floor_j, 0.0)))
            bbus.stored_j[m] = np.minimum(bbus.stored_j[m], floor_j)

    def islanded(self, t_s: float) -> bool:
        return bool(self._active(t_s, BackupTransferEvent))


def _fault_scalar(
    ev: TelemetryFault, true: float, elapsed: float, frozen: dict[str, object]
) -> tuple[float, dict[str, object]]:
    if ev.mode in ("stale", "stuck"):
        frozen.setdefault("pcc", true)
        return float(frozen["pcc"]), frozen  # type: ignore[arg-type]
    if ev.mode == "nan":
        return math.nan, frozen
    if ev.mode == "spike":
        return true * ev.factor, frozen
    return true * (1.0 + ev.factor * elapsed / 3600.0), frozen


def _fault_array(
    ev: TelemetryFault, true: FloatArray, elapsed: float, frozen: dict[str, object], name: str
) -> FloatArray:
    if ev.mode in ("stale", "stuck"):
        frozen.setdefault(name, true.copy())
        held: FloatArray = frozen[name]  # type: ignore[assignment]
        return held
    if ev.mode == "nan":
        return np.full_like(true, np.nan)
    if ev.mode == "spike":
        return true * ev.factor
    return true * (1.0 + ev.factor * elapsed / 3600.0)
