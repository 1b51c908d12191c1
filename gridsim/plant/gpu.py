"""GPU power caps, floors and ramp limits, one value per rack.

All active GPUs of a rack run the same job in lockstep, so the bank keeps one cap, one floor and one draw per
rack (per GPU, W); the rack's AC power is `SiteModel.rack_power_w(draw_w)`.

Actuation (see docs/models.md):
- in-band (NVML / driver): the cap and floor in force approach the commanded values as a first-order lag
  with time constant `tau_s` (assumption 0.1-0.5 s, MODELS.md), stepped exactly:
  x += (target - x)(1 - exp(-dt/tau)).
- out-of-band (BMC): a pure delay; a command takes effect `oob_delay_s` after it was sent (POLCA, ASPLOS 2024:
  up to ~40 s).

Time convention: `step(t_s, dt_s, ...)` advances the bank over [t_s, t_s + dt_s] and leaves every attribute
(`cap_w`, `floor_w`, `draw_w`) at its value at t_s + dt_s.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

import numpy as np
from pydantic import Field

from dimmer.site import BoolArray, FloatArray, SiteModel
from dimmer.siteconfig import Strict

# A settling lag whose remaining fraction falls below this is snapped to its target (exactly equal after).
_SETTLED_FRAC = 1e-12


class GpuActuationSpec(Strict):
    """How cap/floor commands reach the GPUs."""

    # in-band (NVML/driver) first-order settling vs out-of-band (BMC) pure delay
    path: Literal["inband", "oob"] = "inband"
    # in-band cap settling time constant (MODELS.md: assumption 0.1-0.5 s)
    tau_s: float = Field(default=0.3, ge=0.0)
    # out-of-band: the command takes effect after this delay (POLCA ASPLOS 2024: up to ~40 s)
    oob_delay_s: float = Field(default=40.0, ge=0.0)


class GpuBank:
    """Caps, floors and draw of every rack's GPUs (per GPU, W), vectorised over racks."""

    def __init__(self, site: SiteModel, spec: GpuActuationSpec) -> None:
        n = site.n_racks
        self.site = site
        self.spec = spec
        self._min_cap_w = float(site.gpu.min_cap_w)
        self._rated_w = float(site.gpu.rated_w)
        self._floor_max_w = float(site.gpu.floor_max_frac * site.gpu.rated_w)
        # in force now (after the actuation lag)
        self.cap_w: FloatArray = np.full(n, self._rated_w)
        self.floor_w: FloatArray = np.zeros(n)
        self.draw_w: FloatArray = np.zeros(n)
        # the latest command, merged over NaN ("no change") entries; in-band values settle toward these
        self.cap_target_w: FloatArray = self.cap_w.copy()
        self.floor_target_w: FloatArray = self.floor_w.copy()
        # firmware power-smoothing profile (site-wide), in force from the command on
        self.ramp_up_w_per_s = math.inf
        self.ramp_down_w_per_s = math.inf
        self._oob = spec.path == "oob"
        self._pending: deque[tuple[float, FloatArray, FloatArray]] = deque()
        self._settling = False
        self._remaining_frac = 0.0
        self._decay_dt_s = math.nan
        self._decay = 0.0
        self._primed = False  # the first step has no previous draw to ramp from (the plant starts settled)
        self._buf: FloatArray = np.zeros(n)
        self._tmp: FloatArray = np.zeros(n)
        # bumped whenever cap_w or floor_w may have changed: what is computed from them can be kept until it moves
        self.version = 0

    # ---- commands (once per control period) ----------------------------------------------------------------

    def command(
        self,
        t_s: float,
        cap_w: FloatArray,
        floor_w: FloatArray,
        ramp_up_w_per_s: float = math.inf,
        ramp_down_w_per_s: float = math.inf,
    ) -> None:
        """Send per-GPU caps and floors for every rack (NaN = no change) and the ramp-limit profile.

        Caps are clamped to [min_cap_w, rated_w], floors to [0, floor_max_frac * rated_w] and to at most the
        cap.
        """
        if not (ramp_up_w_per_s >= 0.0 and ramp_down_w_per_s >= 0.0):
            raise ValueError("ramp limits must be >= 0 W/s (inf = no limit)")
        self.ramp_up_w_per_s = float(ramp_up_w_per_s)
        self.ramp_down_w_per_s = float(ramp_down_w_per_s)
        n = self.cap_w.shape[0]
        cap = np.asarray(cap_w, dtype=np.float64)
        floor = np.asarray(floor_w, dtype=np.float64)
        if cap.shape != (n,):
            cap = np.broadcast_to(cap, (n,))
        if floor.shape != (n,):
            floor = np.broadcast_to(floor, (n,))
        # np.clip's values (NaN stays NaN) without its Python-level wrapper, a control period's fixed cost
        cap = np.minimum(np.maximum(cap, self._min_cap_w), self._rated_w)
        floor = np.minimum(np.maximum(floor, 0.0), self._floor_max_w)
        if self._oob:
            self._pending.append((t_s + self.spec.oob_delay_s, cap, floor))
            self._merge(self.cap_target_w, self.floor_target_w, cap, floor)
            return
        self._merge(self.cap_target_w, self.floor_target_w, cap, floor)
        if self.spec.tau_s <= 0.0:
            np.copyto(self.cap_w, self.cap_target_w)
            np.copyto(self.floor_w, self.floor_target_w)
            self._settling = False
            self.version += 1
        elif bool((self.cap_target_w == self.cap_w).all()) and bool((self.floor_target_w == self.floor_w).all()):
            # already there: the lag would add (target - x)(1 - exp(-dt/tau)) = 0 to every value each tick
            self._settling = False
        else:
            self._settling = True
            self._remaining_frac = 1.0

    @staticmethod
    def _merge(cap_into: FloatArray, floor_into: FloatArray, cap: FloatArray, floor: FloatArray) -> None:
        np.copyto(cap_into, cap, where=~np.isnan(cap))
        np.copyto(floor_into, floor, where=~np.isnan(floor))
        np.minimum(floor_into, cap_into, out=floor_into)

    # ---- the tick ------------------------------------------------------------------------------------------

    def _actuate(self, t_end_s: float, dt_s: float) -> None:
        if self._oob:
            pending = self._pending
            due = t_end_s + 1e-9 * max(1.0, abs(t_end_s))  # tolerate t accumulated as k * dt
            while pending and pending[0][0] <= due:
                _, cap, floor = pending.popleft()
                self._merge(self.cap_w, self.floor_w, cap, floor)
                self.version += 1
            return
        if not self._settling:
            return
        if dt_s != self._decay_dt_s:
            self._decay_dt_s = dt_s
            self._decay = math.exp(-dt_s / self.spec.tau_s)
        self._remaining_frac *= self._decay
        self.version += 1
        if self._remaining_frac < _SETTLED_FRAC:
            np.copyto(self.cap_w, self.cap_target_w)
            np.copyto(self.floor_w, self.floor_target_w)
            self._settling = False
            return
        gain = 1.0 - self._decay
        tmp = self._tmp
        for x, target in ((self.cap_w, self.cap_target_w), (self.floor_w, self.floor_target_w)):
            np.subtract(target, x, out=tmp)
            tmp *= gain
            x += tmp

    def step(self, t_s: float, dt_s: float, demand_w: FloatArray, energized: BoolArray) -> FloatArray:
        """Advance over [t_s, t_s + dt_s]; return the per-GPU draw of every rack at its end (W).

        draw = clip(demand, floor, cap), then moved at most ramp_up * dt up and ramp_down * dt down from the
        last draw; the cap always wins (a falling cap pulls the draw down at once: it is the hard limit), the
        ramp-up limit wins over a rising floor. 0 where not energized; a re-energized rack ramps up from 0.
        The returned array is the bank's own `draw_w`, overwritten by the next step: copy it to keep it.
        """
        self._actuate(t_s + dt_s, dt_s)
        d = self._buf
        np.maximum(demand_w, self.floor_w, out=d)
        np.minimum(d, self.cap_w, out=d)
        if self._primed and (self.ramp_up_w_per_s < math.inf or self.ramp_down_w_per_s < math.inf):
            last = self.draw_w
            np.minimum(d, last + self.ramp_up_w_per_s * dt_s, out=d)
            np.maximum(d, last - self.ramp_down_w_per_s * dt_s, out=d)
            np.minimum(d, self.cap_w, out=d)
        np.multiply(d, energized, out=self.draw_w)
        self._primed = True
        return self.draw_w

    def power_limit_w(self, demand_w: FloatArray) -> FloatArray:
        """The power each rack's GPUs are held to now: the cap, or the draw where a ramp limit holds it below demand.

        A GPU that cannot draw what its work asks for, because the firmware ramp limit has not let it rise yet, runs
        slower exactly as if capped at its draw.
        """
        ramp_held = self.draw_w < demand_w * (1.0 - 1e-9)
        out: FloatArray = np.where(ramp_held, np.minimum(self.draw_w, self.cap_w), self.cap_w)
        return out

    def rack_speed_frac(self, peak_w: FloatArray, limit_w: FloatArray | None = None) -> FloatArray:
        """Throughput of each rack's GPUs relative to uncapped, when uncapped they peak at `peak_w` per GPU.

        The rack's job's throughput curve (SiteModel.rack_throughput_frac) at min(limit, peak_w) / peak_w, with
        `limit_w` the power the GPUs are held to (default the cap; power_limit_w adds the ramp limit); 1 where
        peak_w <= 0 (nothing to slow down). Floors do not slow GPUs.
        """
        peak = np.asarray(peak_w, dtype=np.float64)
        limit = self.cap_w if limit_w is None else limit_w
        frac = np.divide(np.minimum(limit, peak), peak, out=np.ones_like(self.cap_w), where=peak > 0.0)
        return self.site.rack_throughput_frac(frac)
