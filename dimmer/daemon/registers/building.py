"""`dimmer-building-v1`: a building as one controllable load, served by its building daemon, read and written by
the campus coordinator (docs/registers.md; the hierarchy in docs/controller.md and docs/daemon.md).

The building reports, every period, what its parent plans on (the coordinator's `BuildingReports`: its import, the
most its racks may draw at the caps in force, and per priority group what its running jobs hold of that, their
floor and their uncapped demand), and the budget it holds now; the coordinator writes a budget (a ceiling on that
bound, a floor under its import) with a lease and a heartbeat, in one request. A budget not renewed within its
lease falls to the building's safe budget (`budget_state` 2), which it keeps under its own breakers in any case.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dimmer.daemon.registers.blocks import Block, Field, Span, merge_spans, writable_spans, write_error
from dimmer.daemon.registers.maps import LEASE_EXPIRED, LEASE_HELD, LEASE_NONE, lease_error
from dimmer.daemon.registers.words import WordArray, as_words

BUILDING_MAGIC = "DMBD"
BUILDING_VERSION = 1
BUILDING_MAX_GROUPS = 16  # priority groups a building reports (jobs of one priority are one group)
BUILDING_GROUP_BASE = 48  # group g at BUILDING_GROUP_BASE + BUILDING_GROUP_STRIDE * g
BUILDING_GROUP_STRIDE = 6
BUILDING_IMAGE_SIZE = BUILDING_GROUP_BASE + BUILDING_GROUP_STRIDE * BUILDING_MAX_GROUPS  # 144
BUDGET_NONE, BUDGET_HELD, BUDGET_SAFE = LEASE_NONE, LEASE_HELD, LEASE_EXPIRED
_W = 1e12  # declared bound of powers, W (a gigawatt campus with room)


def _w(name: str, offset: int, desc: str, access: str = "R") -> Field:
    return Field(name, offset, "float32", unit="W", lo=0.0, hi=_W, access=access, desc=desc)


BUILDING_HEADER = Block(
    "dimmer-building-v1",
    BUILDING_GROUP_BASE,
    (
        Field("magic", 0, "string", 2, desc='"DMBD"'),
        Field("version", 2, "uint16", lo=1, hi=1, desc="map version (1)"),
        Field("n_groups", 3, "uint16", lo=1, hi=BUILDING_MAX_GROUPS, desc="priority groups, lowest first"),
        Field("update_count", 4, "uint32", desc="bumped at every report (stuck = stale)"),
        Field("budget_state", 6, "enum16", lo=0, hi=2, desc="0 never written, 1 lease held, 2 expired: safe budget"),
        Field("measured", 7, "uint16", unit="bool", lo=0, hi=1, desc="1: every running rack's peak is measured"),
        _w("max_w", 8, "the most its racks can draw (every GPU at rated): its worst case"),
        _w("safe_budget_w", 10, "the ceiling it falls to when a budget's lease lapses"),
        _w("ceiling_in_force_w", 12, "the ceiling it plans on now (the budget's, or the safe one)"),
        Field("import_w", 14, "float32", unit="W", lo=-_W, hi=_W, desc="its meter; not implemented: none"),
        _w("bound_w", 16, "the most its racks may draw at the caps in force, with its overhead"),
        _w("prior_w", 18, "the share of the bound that is a prior (a peak no reading measured)"),
        _w("return_w", 20, "what its stopped jobs would add back when they run again"),
        Field("return_gpus", 22, "float32", unit="GPU", lo=0.0, hi=1e9, desc="on this many GPUs"),
        _w("base_w", 24, "what no cap moves: racks without a running job, overhead"),
        _w("back_w", 26, "what its stopped jobs' returns would add to the bound"),
        _w("fill_w", 28, "what floors on its uncapped racks could add"),
        Field("bbu_soc_frac", 30, "float32", unit="1", lo=0.0, hi=1.0, desc="its racks' BBUs: mean state of charge"),
        Field("lease_s", 32, "float32", unit="s", lo=0.0, hi=86400.0, access="RW", desc="lease of the budget"),
        Field("heartbeat", 34, "uint32", access="RW", desc="coordinator heartbeat, bumped at every write"),
        _w("ceiling_w", 36, "budget: the most its bound may reach", access="RW"),
        _w("floor_w", 38, "budget: the least import asked of it, 0 = none", access="RW"),
        Field("bbu_energy_j", 40, "float32", unit="J", lo=0.0, hi=1e15, desc="its BBUs' energy above their floor"),
    ),
)
BUILDING_GROUP = (
    _w("group_w", 0, "its running jobs' share of the bound"),
    _w("floor_w", 2, "... at their lowest caps"),
    _w("demand_w", 4, "... as they would draw uncapped"),
)
BUDGET_AT = BUILDING_HEADER.offset("lease_s")  # one write: lease_s, heartbeat, ceiling_w, floor_w
BUDGET_LEN = BUILDING_HEADER.stop("floor_w") - BUDGET_AT
REPORT_SCALARS = ("import_w", "bound_w", "prior_w", "return_w", "return_gpus", "base_w", "back_w", "fill_w")


def building_group_address(g: int) -> int:
    return BUILDING_GROUP_BASE + BUILDING_GROUP_STRIDE * g


def building_writable_spans() -> list[Span]:
    return merge_spans(writable_spans(BUILDING_HEADER))


def building_write_error(cand: Sequence[int] | WordArray, address: int, count: int) -> tuple[int, str] | None:
    """Why a write to a dimmer-building-v1 device, leaving its registers `cand`, may not be stored (Modbus
    exception code, why), or None: every value whole and within its declared range, a lease of more than 0 s."""
    w = as_words(cand)[:BUILDING_IMAGE_SIZE]
    lease = BUILDING_HEADER.field("lease_s")
    return write_error(BUILDING_HEADER, address, count, w) or lease_error(lease, w, address, count)


def floor_or_none(floor_w: float) -> float:
    """A budget's floor as the controller takes it: NaN (none) for 0 or not a number."""
    return floor_w if math.isfinite(floor_w) and floor_w > 0 else math.nan
