"""A building daemon's face to its parent: its `dimmer-building-v1` registers served over Modbus TCP, and the
budget the campus coordinator writes there, with its lease.

The budget is what the building's controller plans on in place of an interconnect limit: its ceiling is the most
the building's bound may reach, its floor the least import asked of it. A budget holds for its lease (plant
seconds, from when the write arrived here); past it, or before any budget has arrived, the building holds its safe
budget: its share of the interconnect limit in force (by its most, as the coordinator's `safe_ceiling_w`), never
more than the last budget it was given, and no floor; it comes down to it from the last budget at its share of the
campus's ramp rule (`lapsed_ceiling_w`, as in the simulator), not in one step. Its own breakers are held in any
case (they are its own site's domains). Every write is vetted as the map declares (`building_write_error`) and
recorded with its client (`RegisterServer`); a write from anyone but loopback and the configured networks never
reaches the registers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from dimmer.control.coordinator import BuildingReports, lapsed_ceiling_w
from dimmer.daemon import registers as R
from dimmer.daemon.agent_server import AllowList, RegisterServer, WriteRefused
from dimmer.daemon.netguard import ConnectionLimits

log = logging.getLogger("dimmer.daemon")
HEADER = R.NumericDecoder(R.BUILDING_HEADER)


class BuildingServer:
    def __init__(
        self,
        name: str,
        max_w: float,
        safe_share: float,
        n_groups: int,
        *,
        unit: int = 1,
        clock: Callable[[], float] = time.monotonic,
        speed: float = 1.0,
        fall_w_per_s: float = math.inf,
        allow: AllowList | None = None,
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.name = name
        self.max_w = float(max_w)
        self.safe_share = float(safe_share)
        self.n_groups = int(n_groups)
        self.unit = int(unit)
        self.clock = clock
        self.speed = float(speed)
        self.fall_w_per_s = float(fall_w_per_s)  # how fast a lapsed budget comes down to the safe one
        self.image = np.zeros(R.BUILDING_IMAGE_SIZE, dtype=np.uint16)
        header: dict[str, float | str | int | None] = {
            "magic": R.BUILDING_MAGIC,
            "version": R.BUILDING_VERSION,
            "n_groups": n_groups,
            "update_count": 0,
            "budget_state": R.BUDGET_NONE,
            "max_w": max_w,
        }
        self.image[: R.BUILDING_HEADER.length] = R.encode_block(R.BUILDING_HEADER, header)
        self.image[R.BUILDING_GROUP_BASE :] = R.encode_records(
            R.BUILDING_GROUP, {}, R.BUILDING_MAX_GROUPS, R.BUILDING_GROUP_STRIDE
        )
        self.update_count = 0
        self.ceiling_w = math.nan  # the last budget written, and when it arrived (monotonic), its lease
        self.floor_w = math.nan
        self.lease_s = math.nan
        self.budget_t = math.nan
        self.n_budgets = 0
        self.lease_expiries = 0
        self.state = R.BUDGET_NONE
        self.server = RegisterServer(
            {self.unit: self.image},
            {self.unit: R.building_writable_spans()},
            self._on_write,
            allow=allow,
            limits=limits,
        )

    # -- the budget ------------------------------------------------------------------------------------------------

    def _on_write(self, unit: int, address: int, values: list[int], cand: npt.NDArray[np.uint16]) -> str:
        refused = R.building_write_error(cand, address, len(values))
        if refused is not None:
            raise WriteRefused(*refused)
        vals = HEADER.decode(cand[: R.BUILDING_HEADER.length])
        at = R.BUILDING_HEADER.field("ceiling_w").offset
        if address <= at < address + len(values):  # a budget (a heartbeat alone renews nothing)
            self.ceiling_w = float(vals["ceiling_w"] or 0.0)
            self.floor_w = R.floor_or_none(float(vals["floor_w"] or 0.0))
            self.lease_s = float(vals["lease_s"] or 0.0)
            self.budget_t = self.clock()
            self.n_budgets += 1
            return f"budget {self.ceiling_w / 1e6:.3f} MW, floor {self.floor_w / 1e6:.3f} MW, lease {self.lease_s:g} s"
        return "heartbeat"

    def safe_budget_w(self, pcc_limit_w: float) -> float:
        """Its share of the interconnect limit in force (its most, if that is not known)."""
        return self.safe_share * pcc_limit_w if math.isfinite(pcc_limit_w) else self.max_w

    def budget(self, pcc_limit_w: float) -> tuple[float, float]:
        """(ceiling, floor) to plan on now: the budget within its lease, else the safe budget and no floor."""
        safe = self.safe_budget_w(pcc_limit_w)
        age_s = (self.clock() - self.budget_t) * self.speed if math.isfinite(self.budget_t) else math.inf
        if age_s <= self.lease_s:
            state, ceiling, floor = R.BUDGET_HELD, self.ceiling_w, self.floor_w
        else:
            # down to the safe budget at its share of the ramp rule, from the last one (at once if none came)
            state, floor = R.BUDGET_SAFE if self.n_budgets else R.BUDGET_NONE, math.nan
            last = np.array([self.ceiling_w if self.n_budgets else math.nan])
            lapsed = np.array([age_s - self.lease_s])
            ceiling = float(lapsed_ceiling_w(last, np.array([safe]), lapsed, np.array([self.fall_w_per_s]))[0])
        if state == R.BUDGET_SAFE and self.state == R.BUDGET_HELD:
            self.lease_expiries += 1
            log.warning(
                "building %s: no budget from the coordinator for %.1f s (lease %g s): the safe budget, %.3f MW",
                self.name,
                (self.clock() - self.budget_t) * self.speed,
                self.lease_s,
                ceiling / 1e6,
            )
        elif state == R.BUDGET_HELD and self.state == R.BUDGET_SAFE:
            log.info("building %s: budgets from the coordinator again", self.name)
        self.state = state
        self._set({"budget_state": state, "safe_budget_w": safe, "ceiling_in_force_w": ceiling})
        return ceiling, floor

    # -- the report ------------------------------------------------------------------------------------------------

    def publish(self, rep: BuildingReports, bbu_soc_frac: float = math.nan, bbu_energy_j: float = math.nan) -> None:
        """This period's report (row 0 of `rep`) and its storage state, with the update counter moved."""
        self.update_count = (self.update_count + 1) % 0xFFFFFFFF
        scalars: dict[str, float | str | int | None] = {k: float(getattr(rep, k)[0]) for k in R.REPORT_SCALARS}
        scalars |= {"bbu_soc_frac": bbu_soc_frac, "bbu_energy_j": bbu_energy_j}
        self._set(scalars | {"measured": int(bool(rep.measured[0])), "update_count": self.update_count})
        g = min(rep.group_w.shape[1], R.BUILDING_MAX_GROUPS)
        groups = {k: getattr(rep, k)[0, :g] for k in ("group_w", "floor_w", "demand_w")}
        words = R.encode_records(R.BUILDING_GROUP, groups, g, R.BUILDING_GROUP_STRIDE)
        self.image[R.BUILDING_GROUP_BASE : R.BUILDING_GROUP_BASE + len(words)] = words

    def _set(self, values: dict[str, float | str | int | None]) -> None:
        for key, v in values.items():
            f = R.BUILDING_HEADER.field(key)
            self.image[f.offset : f.offset + f.n] = R.encode_value(R.BUILDING_HEADER, f, v)

    # -- life ------------------------------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        return await self.server.start(host, port)

    async def stop(self) -> None:
        await self.server.stop()
