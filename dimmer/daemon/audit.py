"""The JSON-lines audit log: one object per line and per cycle (the time, the mode, every reason the controller
gave, every write: device, reason, what, ok or the error) and per event (starting, reload, stop).

Arrays of caps are run-length encoded: one cap per job compresses to a few pairs. NaN and infinity are written as
strings, numpy types as plain JSON.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from dimmer.observation import Actions, Reason
from dimmer.site import SiteModel

log = logging.getLogger("dimmer.metrics")


def rle(values: np.ndarray, digits: int = 1) -> list[list[float | int | str]]:
    """Run-length encode `values` rounded to `digits`: [[value, count], ...]; inf and NaN as strings."""
    if values.size == 0:
        return []
    v = np.round(np.asarray(values, dtype=np.float64), digits)
    change = np.flatnonzero(~((v[1:] == v[:-1]) | (np.isnan(v[1:]) & np.isnan(v[:-1])))) + 1
    starts = np.concatenate([[0], change])
    counts = np.diff(np.concatenate([starts, [v.size]]))
    return [[_json_float(float(v[s])), int(c)] for s, c in zip(starts, counts, strict=True)]


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def json_safe(x: Any) -> Any:
    """Make `x` JSON-encodable without NaN/inf (strings instead) and without numpy types."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    if isinstance(x, np.ndarray):
        return [json_safe(v) for v in x.tolist()]
    if isinstance(x, np.generic):
        return json_safe(x.item())
    if isinstance(x, float):
        return _json_float(x)
    return x


class AuditLog:
    """One JSON object per line; opened for append, line-buffered; `reopen()` after a log rotation (SIGHUP)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._f: TextIO | None = None
        self.reopen()

    def reopen(self) -> None:
        self.close()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self.path.open("a", encoding="utf-8", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None:
            return
        record = {"time_unix_s": round(time.time(), 3), **record}
        try:
            self._f.write(json.dumps(json_safe(record), separators=(",", ":"), allow_nan=False) + "\n")
        except OSError as exc:  # a full disk must not stop the loop
            log.warning("audit log %s: %s", self.path, exc)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def decided_json(act: Actions) -> dict[str, Any]:
    """What a cycle decided, for its audit record: caps and floors run-length encoded, the battery setpoint."""
    return {
        "cap_w": rle(act.rack_cap_w),
        "floor_w": rle(act.rack_floor_w),
        "bess_setpoint_w": round(act.bess_setpoint_w, 1),
    }


def reasons_json(reasons: Sequence[Reason]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in reasons:
        d: dict[str, Any] = {"layer": r.layer, "reason": r.reason}
        if r.domain >= 0:
            d["domain"] = r.domain
        if r.job >= 0:
            d["job"] = r.job
        if math.isfinite(r.value_w):
            d["value_w"] = round(r.value_w, 1)
        out.append(d)
    return out


def write_reasons(
    site: SiteModel, racks: Sequence[slice | None], reasons: Sequence[Reason], head: str, most: int = 4
) -> list[str]:
    """One line per write: why it was made. `racks` holds each write's racks (None: the campus battery); `head`
    says what decided (the controller, the fail-safe, a stop). A write's reasons are those of `reasons` that concern
    it: a domain over some of its racks (the battery: the campus), a job on some of its racks (not the battery), or
    the whole site (no domain, no job). A write no reason concerns carries what the controller's filters decided
    (caps held or rising, a battery setpoint) and renews the device's lease or reversion timer."""
    n = len(racks)
    is_rack = np.array([r is not None for r in racks], dtype=bool)
    start = np.array([r.start if r is not None else 0 for r in racks], dtype=np.int64)
    stop = np.array([r.stop if r is not None else 0 for r in racks], dtype=np.int64)
    concerns = np.ones((len(reasons), n), dtype=bool)
    for i, r in enumerate(reasons):  # a few reasons a cycle; each a vector over the writes
        if r.domain >= 0:
            d = r.domain
            over = (start < site.domain_rack_stop[d]) & (stop > site.domain_rack_start[d])
            concerns[i] = np.where(is_rack, over, d == 0)
        elif r.job >= 0:
            job_racks = np.flatnonzero(site.rack_job == r.job)
            concerns[i] = is_rack & (np.searchsorted(job_racks, start) < np.searchsorted(job_racks, stop))
    out: list[str] = []
    for k in range(n):
        mine = [f"{reasons[i].layer}: {reasons[i].reason}" for i in np.flatnonzero(concerns[:, k]).tolist()]
        if not mine:
            renewed = "caps and floors as decided, lease renewed" if is_rack[k] else "setpoint as decided"
            out.append(f"{head}: no cut here this period: {renewed}")
            continue
        more = f"; +{len(mine) - most} more" if len(mine) > most else ""
        out.append(f"{head}: " + "; ".join(mine[:most]) + more)
    return out
