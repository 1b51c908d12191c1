"""A building daemon as its campus coordinator sees it: a `dimmer-building-v1` device (registers/building.py).

Read: the building's report (what it draws, the most it may draw at its caps, per priority group what its jobs
hold, their floor and their uncapped demand) and the budget it holds. Written: a budget, with its lease and the
coordinator's heartbeat, in one request. A device that reports another building's size (its `max_w` more than
0.1 % from the site config's) is refused as a misread, not planned on: a coordinator pointed at the wrong port
would otherwise budget one building by another's numbers.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dimmer.daemon import registers as R
from dimmer.daemon.bus import RegisterBus
from dimmer.daemon.device_base import BusDevice, Clock, FloatArray
from dimmer.daemon.device_base import as_float as _f

MAX_W_TOLERANCE = 1e-3
HEADER = R.NumericDecoder(R.BUILDING_HEADER)
GROUPS = R.RecordDecoder(R.BUILDING_GROUP, R.BUILDING_GROUP_STRIDE)
# the budget write as the map lays it out (float32 lease_s, uint32 heartbeat, float32 ceiling_w and floor_w), packed
# by struct, not by four numpy encoders: a coordinator writes one to each of its 44 buildings a second
BUDGET_STRUCT = struct.Struct(">fIff")
BUDGET_WORDS = struct.Struct(f">{R.BUDGET_LEN}H")
SCALARS = (*R.REPORT_SCALARS, "measured", "update_count", "budget_state", "ceiling_in_force_w", "safe_budget_w",
           "bbu_soc_frac", "bbu_energy_j")  # fmt: skip


@dataclass(frozen=True)
class BudgetWrite:
    """What one budget write put on the wire (for the audit log)."""

    ceiling_w: float
    floor_w: float
    lease_s: float
    heartbeat: int

    def as_audit(self) -> dict[str, Any]:
        return {"ceiling_w": round(self.ceiling_w, 1), "floor_w": round(self.floor_w, 1), "heartbeat": self.heartbeat}


class BuildingDevice(BusDevice):
    """One building daemon's `dimmer-building-v1` registers.

    Values: scalars "import_w", "bound_w", "prior_w", "return_w", "return_gpus", "base_w", "back_w", "fill_w",
    "measured", "update_count", "budget_state", "ceiling_in_force_w", "safe_budget_w", "bbu_soc_frac" (its racks'
    BBUs' mean state of charge), "bbu_energy_j" (their energy above their floor); arrays "group_w",
    "floor_w", "demand_w" (n_groups,).
    """

    kind = "building"

    def __init__(
        self,
        bus: RegisterBus,
        unit: int,
        n_groups: int,
        max_w: float,
        *,
        name: str | None = None,
        read_only: bool = False,
        clock: Clock = time.monotonic,
    ) -> None:
        if not 1 <= n_groups <= R.BUILDING_MAX_GROUPS:
            raise ValueError(f"n_groups must be in 1..{R.BUILDING_MAX_GROUPS}")
        super().__init__(bus, unit, name, read_only, clock)
        self.n_groups = int(n_groups)
        self.max_w = float(max_w)
        self.heartbeat = 0

    def nan_values(self) -> dict[str, float | FloatArray]:
        out: dict[str, float | FloatArray] = dict.fromkeys(SCALARS, math.nan)
        return out | {k: np.full(self.n_groups, np.nan) for k in ("group_w", "floor_w", "demand_w")}

    def writable_spans(self) -> list[R.Span]:
        return R.building_writable_spans()

    async def _read(self) -> dict[str, float | FloatArray]:
        words = await self._get(0, R.building_group_address(self.n_groups))
        hdr = HEADER.decode(words[: R.BUILDING_HEADER.length])
        if hdr["magic"] != R.BUILDING_MAGIC:
            raise R.DecodeError(f"not a {R.BUILDING_MAGIC} device (magic {hdr['magic']!r})")
        if hdr["version"] != R.BUILDING_VERSION:
            raise R.DecodeError(f"building map version {hdr['version']} (this daemon speaks {R.BUILDING_VERSION})")
        if hdr["n_groups"] != self.n_groups:
            raise R.DecodeError(f"device reports {_f(hdr['n_groups']):.0f} priority groups, configured {self.n_groups}")
        max_w = _f(hdr["max_w"])
        if not abs(max_w - self.max_w) <= MAX_W_TOLERANCE * self.max_w:
            raise R.DecodeError(
                f"device reports a building of {max_w / 1e6:.3f} MW at most, the site config's is "
                f"{self.max_w / 1e6:.3f} MW: another building's daemon?"
            )
        groups = GROUPS.decode(words[R.BUILDING_GROUP_BASE :], self.n_groups)
        out: dict[str, float | FloatArray] = {k: _f(hdr[k]) for k in SCALARS}
        return out | {k: groups[k] for k in ("group_w", "floor_w", "demand_w")}

    async def write_budget(self, ceiling_w: float, floor_w: float, lease_s: float) -> BudgetWrite:
        """The budget, its lease and the next heartbeat in one request. A floor of NaN is none (0 on the wire)."""
        floor = floor_w if math.isfinite(floor_w) and floor_w > 0 else 0.0
        most = R.BUILDING_HEADER.field("ceiling_w").hi
        for name, v in (("ceiling_w", ceiling_w), ("floor_w", floor)):
            if not (math.isfinite(v) and 0 <= v <= most):
                raise self._refuse(f"{name} {v!r}: a number of watts in 0..{most:g}", R.BUDGET_AT)
        if not (math.isfinite(lease_s) and 0 < lease_s <= R.BUILDING_HEADER.field("lease_s").hi):
            raise self._refuse(f"lease_s {lease_s!r}: a positive number of seconds up to 86400", R.BUDGET_AT)
        self.heartbeat = (self.heartbeat + 1) % 0xFFFFFFFF
        # (the map's order: lease_s, heartbeat, ceiling_w, floor_w; each within its declared range, checked above)
        words = list(BUDGET_WORDS.unpack(BUDGET_STRUCT.pack(lease_s, self.heartbeat, ceiling_w, floor)))
        await self._put(R.BUDGET_AT, words)
        return BudgetWrite(ceiling_w, floor, lease_s, self.heartbeat)
