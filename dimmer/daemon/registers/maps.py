"""The project's own register maps: `dimmer-rack-v1` (a rack power / cap device, up to 64 racks) and
`dimmer-site-v1` (the site device: domain meters, limits in force, grid, jobs). Documented in docs/registers.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

from dimmer.daemon.registers.blocks import (
    ILLEGAL_VALUE,
    Block,
    Field,
    Span,
    merge_spans,
    writable_spans,
    write_error,
)
from dimmer.daemon.registers.words import WordArray, as_words, decode_float32

# -- dimmer-rack-v1 ----------------------------------------------------------------------------------------------

RACK_MAGIC = "DMRK"
RACK_VERSION = 1
RACK_MAX = 64  # racks per device
RACK_CMD_BASE = 16  # command record of rack i at RACK_CMD_BASE + RACK_CMD_STRIDE * i
RACK_CMD_STRIDE = 8
RACK_STATUS_BASE = RACK_CMD_BASE + RACK_CMD_STRIDE * RACK_MAX  # 528
RACK_STATUS_STRIDE = 12
LEASE_NONE, LEASE_HELD, LEASE_EXPIRED = 0, 1, 2
_BIG = 1e9  # declared bound of powers, W

RACK_HEADER = Block(
    "dimmer-rack-v1 header",
    16,
    (
        Field("magic", 0, "string", 2, desc='"DMRK"'),
        Field("version", 2, "uint16", lo=1, hi=1, desc="map version (1)"),
        Field("n_racks", 3, "uint16", lo=1, hi=RACK_MAX, desc="racks this device serves"),
        Field("first_rack", 4, "uint32", desc="site index of its first rack (tree order)"),
        Field("safe_cap_w", 6, "float32", unit="W/GPU", lo=0.0, hi=1e5, desc="cap it falls back to on lease expiry"),
        Field("lease_state", 8, "enum16", lo=0, hi=2, desc="0 never written, 1 lease held, 2 expired: safe cap"),
        Field("update_count", 10, "uint32", desc="bumped at every measurement refresh (stuck = stale)"),
        Field("lease_s", 12, "float32", unit="s", lo=0.0, hi=86400.0, access="RW", desc="lease of the commands"),
        Field("heartbeat", 14, "uint32", access="RW", desc="controller heartbeat, bumped at every write"),
    ),
)
RACK_COMMAND = (
    Field("cap_w", 0, "float32", unit="W/GPU", lo=0.0, hi=1e5, access="RW", desc="per-GPU power cap"),
    Field("floor_w", 2, "float32", unit="W/GPU", lo=0.0, hi=1e5, access="RW", desc="per-GPU power floor, 0 = none"),
    Field(
        "bbu_threshold_w",
        4,
        "float32",
        unit="W",
        lo=0.0,
        hi=math.inf,
        access="RW",
        desc="BBU discharges above this rack draw; +inf = backup only",
    ),
    Field("bbu_recharge_w", 6, "float32", unit="W", lo=0.0, hi=_BIG, access="RW", desc="max BBU recharge power"),
)
RACK_STATUS = (
    Field("power_w", 0, "float32", unit="W", lo=0.0, hi=_BIG, desc="AC input from the supply (window mean)"),
    Field("load_w", 2, "float32", unit="W", lo=0.0, hi=_BIG, desc="IT load before the BBU (power-shelf output)"),
    Field("cap_w", 4, "float32", unit="W/GPU", lo=0.0, hi=1e5, desc="per-GPU cap the GPUs enforce"),
    Field("floor_w", 6, "float32", unit="W/GPU", lo=0.0, hi=1e5, desc="per-GPU floor in force"),
    Field("bbu_soc_frac", 8, "float32", unit="1", lo=0.0, hi=1.0, desc="BBU state of charge"),
    Field("energized", 10, "uint16", unit="bool", lo=0, hi=1, desc="1 powered, 0 under a tripped breaker"),
    # (in the record's last word, which map version 1 left reserved: a device that leaves it at 0 reports no peak)
    Field(
        "load_peak_hw",
        11,
        "uint16",
        unit="100 W",
        lo=1,
        hi=65534,
        desc="highest sample of load_w's window, rounded up; 0 or 0xFFFF: not measured",
    ),
)


def rack_cmd_address(i: int) -> int:
    return RACK_CMD_BASE + RACK_CMD_STRIDE * i


def rack_status_address(i: int) -> int:
    return RACK_STATUS_BASE + RACK_STATUS_STRIDE * i


# -- dimmer-site-v1 ----------------------------------------------------------------------------------------------

SITE_MAGIC = "DMST"
SITE_VERSION = 1
SITE_JOB_BASE = 32  # job j at SITE_JOB_BASE + j
SITE_MAX_JOBS = 256
SITE_DOMAIN_BASE = SITE_JOB_BASE + SITE_MAX_JOBS  # 288: domain d at SITE_DOMAIN_BASE + SITE_DOMAIN_STRIDE * d
SITE_DOMAIN_STRIDE = 6
SITE_MAX_DOMAINS = (0x10000 - SITE_DOMAIN_BASE) // SITE_DOMAIN_STRIDE

SITE_HEADER = Block(
    "dimmer-site-v1 header",
    32,
    (
        Field("magic", 0, "string", 2, desc='"DMST"'),
        Field("version", 2, "uint16", lo=1, hi=1, desc="map version (1)"),
        Field("n_domains", 3, "uint16", lo=1, hi=SITE_MAX_DOMAINS, desc="domains, in SiteModel order"),
        Field("n_jobs", 4, "uint16", lo=0, hi=SITE_MAX_JOBS, desc="jobs, in scenario order"),
        Field("update_count", 6, "uint32", desc="bumped at every measurement refresh (stuck = stale)"),
        Field("pcc_limit_w", 8, "float32", unit="W", lo=0.0, hi=1e12, desc="interconnect limit in force"),
        Field("ramp_limit_w_per_min", 10, "float32", unit="W/min", lo=0.0, hi=1e12, desc="grid ramp limit"),
        Field("grid_freq_hz", 12, "float32", unit="Hz", lo=0.0, hi=100.0, desc="grid frequency"),
        # (in the header's reserved words: a device that leaves them at 0 serves the site from its first domain)
        Field(
            "first_domain", 14, "uint32", desc="site index of its first domain (a site too large for one unit is split)"
        ),
    ),
)
# job state: 0 stopped (a checkpoint stall, a crash: it may come back at any time), 1 drawing training power now,
# 2 ended (the scheduler released it: it does not come back; a job started on its racks later is a start). A writer
# that knows no more than running or not writes 0 and 1, as before 2 was defined.
JOB_STOPPED, JOB_RUNNING, JOB_ENDED = 0, 1, 2
SITE_JOB = (
    Field(
        "state", 0, "uint16", lo=JOB_STOPPED, hi=JOB_ENDED,
        desc="0 stopped (may come back), 1 drawing training power now, 2 ended (released by the scheduler)",
    ),
)  # fmt: skip
SITE_DOMAIN = (
    Field("power_w", 0, "float32", unit="W", lo=-1e12, hi=1e12, desc="domain meter (the campus: net import)"),
    Field("limit_w", 2, "float32", unit="W", lo=0.0, hi=1e12, desc="rating in force (a derate lowers it)"),
    Field("thermal_frac", 4, "float32", unit="1", lo=0.0, hi=1e3, desc="breaker thermal state / trip point"),
)


def site_domain_address(d: int) -> int:
    return SITE_DOMAIN_BASE + SITE_DOMAIN_STRIDE * d


def rack_writable_spans(n_racks: int) -> list[Span]:
    """dimmer-rack-v1: the header's RW registers (lease_s, heartbeat) and the command records of racks 0..n-1."""
    if not 1 <= n_racks <= RACK_MAX:
        raise ValueError(f"n_racks must be in 1..{RACK_MAX} (got {n_racks})")
    return merge_spans([*writable_spans(RACK_HEADER), (RACK_CMD_BASE, rack_cmd_address(n_racks))])


@cache
def rack_block(n_racks: int) -> Block:
    """dimmer-rack-v1 as one block up to the end of its command records: the header, then "rack i: cap_w",
    "rack i: floor_w", ... of racks 0..n-1 at their addresses (what `rack_write_error` vets a write against)."""
    if not 1 <= n_racks <= RACK_MAX:
        raise ValueError(f"n_racks must be in 1..{RACK_MAX} (got {n_racks})")
    records = tuple(
        Field(f"rack {i}: {f.name}", rack_cmd_address(i) + f.offset, f.kind, f.size, f.unit, f.sf, f.lo, f.hi, f.access)
        for i in range(n_racks)
        for f in RACK_COMMAND
    )
    return Block("dimmer-rack-v1", rack_cmd_address(n_racks), (*RACK_HEADER.fields, *records))


def rack_write_error(cand: Sequence[int] | WordArray, address: int, count: int, n_racks: int) -> tuple[int, str] | None:
    """Why a write of `count` registers at `address` to a dimmer-rack-v1 device of `n_racks` racks, leaving its
    registers `cand` (from 0), may not be stored: (Modbus exception code, why), or None. What `dimmer agent` and the
    served plant's rack devices both answer: `write_error` on the map (every value written whole, within its
    declared range, no NaN, +inf only for the BBU threshold), and a `lease_s` that is more than 0 s (a lease of 0
    would lapse as it is written)."""
    block = rack_block(n_racks)
    w = as_words(cand)[: block.length]
    return write_error(block, address, count, w) or lease_error(RACK_HEADER.field("lease_s"), w, address, count)


def lease_error(lease: Field, w: WordArray, address: int, count: int) -> tuple[int, str] | None:
    """A write touching `lease` (a float32 of seconds) that leaves it at 0 or less: a lease that lapses as it is
    written (ILLEGAL_VALUE, why); None otherwise."""
    touched = address < lease.offset + lease.n and lease.offset < address + count
    if touched and not float(decode_float32(w[lease.offset : lease.offset + lease.n])[0]) > 0:
        return ILLEGAL_VALUE, f"lease_s: a positive number of seconds up to {lease.hi:g}"
    return None
