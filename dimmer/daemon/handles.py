"""The daemon's devices: one `DeviceHandle` per configured device (the device, its last good reading, its
failures and flags), building them from a config, and the bookkeeping of every read and write's outcome.

A read or write that fails counts against its device; after `fail_after` failures in a row (by operation) the
device is flagged (one warning, `dimmer_device_up` 0) and unflagged when it answers again. A device that answers
with old values (an update counter that does not move, a meter whose reading is frozen) is `stuck`: its values age
from their last change, so it goes stale like one that does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from dimmer.daemon.config import LoadedConfig, SafetySpec
from dimmer.daemon.metrics import DaemonMetrics, DeviceStatus
from dimmer.site import SiteModel

log = logging.getLogger("dimmer.daemon")

FloatArray = npt.NDArray[np.float64]


class ReadingLike(Protocol):
    values: Mapping[str, Any]
    t_s: float
    ok: bool
    error: str | None


@dataclass
class DeviceHandle:
    """One configured device with its bookkeeping: the last good reading, consecutive failures, the flag."""

    name: str
    kind: str
    device: Any  # SunSpecMeter | SunSpecBattery | RackDevice | SiteDevice
    read_only: bool
    domain: int = -1  # meters: the domain metered
    racks: slice = field(default_factory=lambda: slice(0, 0))  # racks devices: the racks served
    last: ReadingLike | None = None  # the last good reading
    fresh_t_s: float = math.nan  # when its values were last known new (update_count moved), monotonic
    last_count: float = math.nan  # the device's update_count at the last good read (NaN: it has none)
    stuck: bool = False  # answering, but its update_count has not moved for too long (a meter: judge_meters)
    value_w: float = math.nan  # meters: the last power read, and when it last changed (monotonic)
    value_t_s: float = math.nan
    expect_lo_w: float = math.nan  # meters: the range of what the racks under it say it should read, since then
    expect_hi_w: float = math.nan
    failures: dict[str, int] = field(default_factory=lambda: {"read": 0, "write": 0})  # in a row, by operation
    flagged: bool = False
    offline: bool = False  # a battery answering, but reporting itself off line (as of its last good reading)


BusFactory = Callable[[Any], Any]  # DeviceSpec -> RegisterBus


def tcp_bus_factory() -> BusFactory:
    """One ModbusTcpBus per (host, port): every device at an endpoint shares its connection."""
    from dimmer.daemon.bus import ModbusTcpBus

    buses: dict[tuple[str, int], Any] = {}

    def make(spec: Any) -> Any:
        key = (spec.host, spec.port)
        if key not in buses:
            buses[key] = ModbusTcpBus(
                spec.host, spec.port, timeout_s=spec.timeout_s, retries=spec.retries, backoff_s=spec.backoff_s
            )
        return buses[key]

    return make


def build_devices(
    loaded: LoadedConfig, bus_factory: BusFactory, clock: Callable[[], float] = time.monotonic
) -> list[DeviceHandle]:
    from dimmer.control.building_report import n_priority_groups
    from dimmer.control.building_split import building_parts
    from dimmer.daemon.building_device import BuildingDevice
    from dimmer.daemon.devices import RackDevice, RackLimits, SunSpecBattery, SunSpecMeter

    site = loaded.site
    gpu = site.gpu
    out: list[DeviceHandle] = []
    for name, spec in zip(loaded.device_names, loaded.config.devices, strict=True):
        bus = bus_factory(spec)
        dev: Any
        handle = DeviceHandle(name=name, kind=spec.kind, device=None, read_only=spec.read_only)
        if spec.kind == "meter":
            dev = SunSpecMeter(bus, spec.unit, base=spec.base, name=name, clock=clock)
            handle.domain = site.domain_index(spec.domain)
        elif spec.kind == "battery":
            dev = SunSpecBattery(
                bus,
                spec.unit,
                base=spec.base,
                name=name,
                read_only=spec.read_only,
                max_power_w=site.bess.power_w,
                clock=clock,
            )
        elif spec.kind == "racks":
            first, n = int(spec.first_rack or 0), int(spec.n_racks or 0)
            recharge_max_w = site.rack_storage.bbu_power_w[first : first + n].copy()
            limits = RackLimits(gpu.min_cap_w, gpu.rated_w, recharge_max_w, loaded.config.safety.lease_s)
            # (a building daemon counts racks from its building's first; the device, from the site's)
            at = first + (loaded.part.rack_start if loaded.part is not None else 0)
            dev = RackDevice(bus, spec.unit, at, n, name=name, read_only=spec.read_only, limits=limits, clock=clock)
            handle.racks = slice(first, first + n)
        elif spec.kind == "building":
            max_w = next(p.max_w for p in building_parts(site) if p.name == spec.building)
            dev = BuildingDevice(
                bus, spec.unit, n_priority_groups(site), max_w, name=name, read_only=spec.read_only, clock=clock
            )
        else:
            # a building daemon reads its own domains of the site device: the building first, as its feed
            dev = _site_device(loaded, spec, bus, name, clock)
        handle.read_only = spec.read_only or spec.kind in ("meter", "site")  # meters and the site device: read only
        handle.device = dev
        out.append(handle)
    return out


def _site_device(loaded: LoadedConfig, spec: Any, bus: Any, name: str, clock: Callable[[], float]) -> Any:
    """One unit of the site device: the domains it serves (`first_domain` on), of which a flat daemon reads all
    (into the site's layout), a building daemon its building's (the building first, as its feed: into its own
    site's order), a coordinator the campus's record only."""
    from dimmer.daemon.devices import SiteDevice

    campus, mine = loaded.campus_site, loaded.part
    first = int(spec.first_domain or 0)
    n = int(spec.n_domains) if spec.n_domains is not None else campus.n_domains - first
    if mine is not None:
        wanted = np.concatenate(([mine.domain], mine.domains))
        width = wanted.size
    elif loaded.role == "coordinator":
        wanted, width = np.zeros(1, dtype=np.int64), campus.n_domains
    else:
        wanted, width = np.arange(campus.n_domains), campus.n_domains
    here = np.flatnonzero((wanted >= first) & (wanted < first + n))
    slots = here if mine is not None else wanted[here]
    return SiteDevice(
        bus, spec.unit, n, campus.n_jobs, name=name, clock=clock, first_domain=first, read=wanted[here] - first,
        slots=slots, width=width,
    )  # fmt: skip


async def close_buses(handles: list[DeviceHandle]) -> None:
    """Close every bus the devices use, once each (a shared connection once); errors are not raised."""
    seen: set[int] = set()
    for h in handles:
        bus = getattr(h.device, "bus", None)
        if bus is None or id(bus) in seen:
            continue
        seen.add(id(bus))
        with contextlib.suppress(Exception):
            await bus.close()


# -- reading values ----------------------------------------------------------------------------------------------------


def value_array(values: Mapping[str, Any], key: str, n: int) -> FloatArray:
    """`values[key]` as `(n,)` floats; all NaN when absent or of another length."""
    v = values.get(key)
    if v is None:
        return np.full(n, np.nan)
    a = np.asarray(v, dtype=np.float64).reshape(-1)
    return a if a.size == n else np.full(n, np.nan)


def value_num(values: Mapping[str, Any], key: str) -> float:
    """`values[key]` as a float; NaN when absent or not a number."""
    v = values.get(key)
    try:
        return float(v) if v is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


def has_data(h: DeviceHandle) -> bool:
    """The device has answered with published values (a dimmer update counter still at 0 has published nothing;
    a battery's 802 Hb is 0 at every one of its periodic resets, so there 0 is a value like any other)."""
    if h.last is None:
        return False
    if h.kind == "battery":
        return True
    count = value_num(h.last.values, "update_count")
    return not math.isfinite(count) or count > 0


# -- outcomes ----------------------------------------------------------------------------------------------------------


def record_failure(h: DeviceHandle, op: str, error: str, fail_after: int, metrics: DaemonMetrics) -> None:
    h.failures[op] += 1
    metrics.comm_errors.labels(device=h.name, op=op).inc()
    if h.failures[op] >= fail_after and not h.flagged:
        h.flagged = True
        metrics.device_up.labels(device=h.name).set(0)
        log.warning("device %s flagged: %d failed %ss in a row (last: %s)", h.name, h.failures[op], op, error)
    else:
        log.debug("device %s: %s failed: %s", h.name, op, error)


def record_success(h: DeviceHandle, op: str, fail_after: int, metrics: DaemonMetrics) -> None:
    h.failures[op] = 0
    if h.flagged and max(h.failures.values()) < fail_after:
        log.info("device %s answers again", h.name)
        metrics.device_up.labels(device=h.name).set(1)
        h.flagged = False


async def read_device(
    h: DeviceHandle, timeout_s: float, speed: float, fail_after: int, metrics: DaemonMetrics
) -> ReadingLike | None:
    """Read `h` within `timeout_s` (wall); the reading if good, else None (the failure counted, never raised)."""
    try:
        r: ReadingLike = await asyncio.wait_for(h.device.read(), timeout=timeout_s)
    except TimeoutError:
        record_failure(h, "read", f"no answer within {timeout_s * speed:g} s", fail_after, metrics)
        return None
    except Exception as exc:  # read() should never raise; a bug in a device must not stop the loop
        record_failure(h, "read", f"{type(exc).__name__}: {exc}", fail_after, metrics)
        return None
    if not r.ok:
        record_failure(h, "read", r.error or "read failed", fail_after, metrics)
        return None
    record_success(h, "read", fail_after, metrics)
    return r


# -- freshness ---------------------------------------------------------------------------------------------------------


def note_reading(h: DeviceHandle, r: ReadingLike, safety: SafetySpec, speed: float) -> None:
    """Keep `r` as the device's last good reading. A device with an update counter (dimmer-rack-v1,
    dimmer-site-v1) whose counter has not moved is answering with old values: they age from the last move."""
    h.last = r
    if h.kind == "meter":
        _note_meter(h, r)
        return
    if h.kind == "battery":
        _note_battery(h, r)
    count = value_num(r.values, "update_count")
    if not math.isfinite(count) or count != h.last_count or not math.isfinite(h.fresh_t_s):
        h.fresh_t_s = r.t_s
        if h.stuck:
            log.info("device %s: updating again", h.name)
        h.stuck = False
    elif not h.stuck and (r.t_s - h.fresh_t_s) * speed > safety.stale_s:
        h.stuck = True
        log.warning("device %s: update_count stuck at %.0f: its readings are stale", h.name, count)
    h.last_count = count


def _note_meter(h: DeviceHandle, r: ReadingLike) -> None:
    """A SunSpec meter has no update counter: keep when its reading last changed (judge_meters decides whether a
    repeat is a frozen meter)."""
    value = value_num(r.values, "power_w")
    if not math.isfinite(h.value_t_s) or value != h.value_w:
        h.value_w, h.value_t_s = value, r.t_s
        h.expect_lo_w = h.expect_hi_w = math.nan


def judge_meters(handles: list[DeviceHandle], site: SiteModel, limit_w: FloatArray, safety: SafetySpec,
                 speed: float) -> None:  # fmt: skip
    """After a cycle's reads: a meter whose reading has repeated for longer than frozen_meter_s is frozen (stale, its
    value aging from its last change) if what the racks under it say it should read (less the battery's discharge,
    at the campus) moved meanwhile by more than frozen_meter_move_frac of its limit. A live meter on a load held flat
    (a battery flattening the import, a 10 kW register resolution) repeats too, and is not frozen: the racks and the
    battery show why. With no complete rack readings to judge it by, a repeat that long is frozen."""
    rack_w = np.full(site.n_racks, np.nan)
    bess_w = 0.0
    for h in handles:
        if h.last is None:
            continue
        if h.kind == "racks" and not (h.stuck or h.flagged):  # (a stale rack is no evidence either way)
            rack_w[h.racks] = value_array(h.last.values, "power_w", h.racks.stop - h.racks.start)
        elif h.kind == "battery":
            b = value_num(h.last.values, "power_w")
            bess_w = b if math.isfinite(b) and not (h.stuck or h.flagged) else math.nan
    for h in handles:
        if h.kind != "meter" or h.last is None:
            continue
        d = h.domain
        under = rack_w[site.domain_rack_start[d] : site.domain_rack_stop[d]]
        expect = float(np.sum(under)) - (bess_w if d == 0 else 0.0) if under.size else math.nan
        if math.isfinite(expect):
            h.expect_lo_w = float(np.fmin(h.expect_lo_w, expect))
            h.expect_hi_w = float(np.fmax(h.expect_hi_w, expect))
        moved_w = h.expect_hi_w - h.expect_lo_w
        evidence = math.isfinite(expect) and math.isfinite(moved_w)
        still = not evidence or moved_w > safety.frozen_meter_move_frac * float(limit_w[d])
        frozen_s = (h.last.t_s - h.value_t_s) * speed
        if frozen_s > safety.frozen_meter_s and still:
            if not h.stuck:
                log.warning("device %s: reading frozen at %.0f W for %.1f s: treated as stale", h.name, h.value_w,
                            frozen_s)  # fmt: skip
            h.stuck = True
            h.fresh_t_s = h.value_t_s
        else:
            if h.stuck:
                log.info("device %s: updating again", h.name)
            h.stuck = False
            h.fresh_t_s = h.last.t_s


def _note_battery(h: DeviceHandle, r: ReadingLike) -> None:
    """A battery that answers but reports itself off line (802 State, 701 ConnSt) is not planned on: say so
    when it goes, and when it comes back."""
    on = value_num(r.values, "online")
    if math.isnan(on):
        return
    offline = on < 0.5
    if offline and not h.offline:
        log.warning("device %s: reports itself off line: the controller no longer plans on it", h.name)
    elif h.offline and not offline:
        log.info("device %s: on line again: planned on again", h.name)
    h.offline = offline


def device_status(h: DeviceHandle) -> DeviceStatus:
    """What the metrics endpoint says about `h`, as of its last good reading."""
    last = h.last
    if last is None:
        return DeviceStatus(h.name, h.kind, math.nan, math.nan, h.flagged)
    return DeviceStatus(
        h.name,
        h.kind,
        last.t_s,
        h.fresh_t_s,
        h.flagged,
        lease_state=value_num(last.values, "lease_state") if h.kind == "racks" else math.nan,
        online=value_num(last.values, "online") if h.kind == "battery" else math.nan,
    )


def freeze_startup_heap() -> None:
    """Take what start-up built (the site model, the register maps, the controller's arrays and the imported
    libraries: millions of objects at 1M GPUs) out of the cyclic collector's sight before the first cycle: each full
    collection walked them all, 46-95 ms of a 1M-GPU coordinator's cycle (measured: its p99 CPU 100 -> 78 ms).
    What the cycles allocate afterwards is collected as before."""
    gc.collect()
    gc.freeze()
