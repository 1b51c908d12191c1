"""Writing what was decided: one write per writable device (rack caps, floors, BBU thresholds with a lease; the
battery setpoint with a revert timeout), each with the reason it is made, run concurrently, each outcome counted and
recorded in the audit log, never raised.

A battery write's result (`write_setpoint`'s return value) may say what went on the wire: when it has `as_audit()`
(the SunSpec model, the scale factor used, each request's address and raw register words, whether it was read
back), its audit entry carries it under `battery_write`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dimmer.daemon.config import SafetySpec
from dimmer.daemon.handles import DeviceHandle, record_failure, record_success
from dimmer.daemon.metrics import DaemonMetrics, rle, write_reasons
from dimmer.observation import Actions
from dimmer.site import SiteModel

log = logging.getLogger("dimmer.daemon")


@dataclass
class Write:
    """One write to one device: what it writes (for the audit log), the call that does it, and its result."""

    handle: DeviceHandle
    what: dict[str, Any]
    run: Callable[[], Any]
    result: Any = None  # what the device's write returned, once it succeeded


def plan_writes(
    handles: Sequence[DeviceHandle], act: Actions, head: str, site: SiteModel, safety: SafetySpec
) -> list[Write]:
    """Every write `act` asks for, each with the reason it is made (`head`: what decided; metrics.write_reasons)."""
    lease = safety.lease_s
    out: list[Write] = []
    for h in handles:
        if h.read_only:
            continue
        if h.kind == "racks":
            sl = h.racks
            cap, floor = act.rack_cap_w[sl], act.rack_floor_w[sl]
            thr, rech = act.rack_bbu_threshold_w[sl], act.rack_bbu_recharge_w[sl]
            dev = h.device
            what = {
                "device": h.name,
                "racks": [sl.start, sl.stop - sl.start],
                "cap_w": rle(cap),
                "floor_w": rle(floor),
                "bbu_threshold_w": [_round(np.min(thr)), _round(np.max(thr))],
                "lease_s": lease,
            }

            def run(dev: Any = dev, cap: Any = cap, floor: Any = floor, thr: Any = thr, rech: Any = rech) -> Any:
                return dev.write(cap, floor, thr, rech, lease)

            out.append(Write(h, what, run))
        elif h.kind == "battery":
            sp, dev = act.bess_setpoint_w, h.device
            what = {"device": h.name, "setpoint_w": round(sp, 1), "revert_s": safety.battery_revert_s}

            def run_b(dev: Any = dev, sp: float = sp) -> Any:
                return dev.write_setpoint(sp, safety.battery_revert_s)

            out.append(Write(h, what, run_b))
    racks = [w.handle.racks if w.handle.kind == "racks" else None for w in out]
    for w, why in zip(out, write_reasons(site, racks, act.reasons, head), strict=True):
        w.what = {"device": w.what["device"], "reason": why, **w.what}
    return out


async def do_write(w: Write, timeout_s: float, speed: float, fail_after: int, metrics: DaemonMetrics) -> str | None:
    """Run one write within `timeout_s` (wall); None if it succeeded (its result kept in `w.result`), else the
    error (counted, flagged when repeated, never raised)."""
    from dimmer.daemon.bus import DeviceError, WriteNotAllowed

    try:
        result = await asyncio.wait_for(w.run(), timeout=timeout_s)
    except TimeoutError:
        err = f"no answer within {timeout_s * speed:g} s"
    except WriteNotAllowed as exc:  # nothing was sent: a bug upstream of the device, not a failing device
        err = f"{type(exc).__name__}: {exc}"
        log.warning("write to %s refused before sending: %s", w.handle.name, exc)
        metrics.writes_refused.labels(device=w.handle.name).inc()
        return err
    except DeviceError as exc:
        err = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a bug in a device's codec must not stop the loop either
        err = f"{type(exc).__name__}: {exc}"
        log.error("write to %s raised %s", w.handle.name, err)
    else:
        w.result = result
        metrics.writes.labels(device=w.handle.name).inc()
        record_success(w.handle, "write", fail_after, metrics)
        return None
    record_failure(w.handle, "write", err, fail_after, metrics)
    return err


def audit_entries(writes: Sequence[Write], results: Sequence[str | None]) -> list[dict[str, Any]]:
    """The audit record's `writes`: each write, what it wrote, `ok` or its `error`; a battery write whose result
    can say what it sent (`as_audit()`) also its raw register words and scale factor, as `battery_write`."""
    out: list[dict[str, Any]] = []
    for w, r in zip(writes, results, strict=True):
        entry: dict[str, Any] = {**w.what, "ok": r is None, **({"error": r} if r else {})}
        if w.handle.kind == "battery" and w.result is not None:
            as_audit = getattr(w.result, "as_audit", None)
            if callable(as_audit):
                try:
                    entry["battery_write"] = as_audit()
                except Exception as exc:  # what a write reports about itself must not stop the loop
                    log.error("battery write to %s: as_audit() raised %s: %s", w.handle.name, type(exc).__name__, exc)
        out.append(entry)
    return out


def _round(x: Any) -> float | str:
    v = float(x)
    return round(v, 1) if math.isfinite(v) else ("inf" if v > 0 else ("-inf" if v < 0 else "nan"))
