"""Observability: the Prometheus endpoint, the JSON-lines audit log and plain logging.

Every metric is named `dimmer_*` in base units (watts, seconds, ratios). Per-domain series carry a `domain` label
(the tree name, e.g. `b0/h1/r3`); rack-level domains are exported only when `[daemon] metrics_rack_domains` is set,
so a 4,000-rack site does not publish 12,000 series by default. Each daemon has its own registry, so several can
live in one process (the tests do).

The audit log has one JSON object per line and per cycle: the time, the mode, every reason the controller gave, and
every write (device, what, ok or the error). Arrays of caps are run-length encoded: one cap per job compresses to a
few pairs.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from dimmer.observation import Reason
from dimmer.site import SiteModel

log = logging.getLogger("dimmer.metrics")

MODE_STATES = ["starting", "running", "failsafe", "stopping"]
CYCLE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)

_NUMBER = re.compile(r"[-+]?\d[\d.,]*")


def reason_label(text: str) -> str:
    """A bounded label from a free-text reason: numbers become N, the 'at <domain>' / 'to <value>' tails go."""
    head = re.split(r" at | to ", text, maxsplit=1)[0]
    return _NUMBER.sub("N", head).strip()[:80]


class RecentDurations:
    """The latest `size` durations (s) in a ring allocated once: a daemon that runs for months keeps a fixed
    footprint (a deque of floats grows by ~32 bytes a cycle until it is full: 3 MB, hours after the start)."""

    def __init__(self, size: int = 100_000) -> None:
        self._buf = np.full(size, np.nan)
        self._n = 0

    def append(self, seconds: float) -> None:
        self._buf[self._n % self._buf.size] = seconds
        self._n += 1

    def values(self) -> npt.NDArray[np.float64]:
        """The durations kept, in no particular order (what percentiles need)."""
        return self._buf[: min(self._n, self._buf.size)].copy()

    def __len__(self) -> int:
        return min(self._n, self._buf.size)


class DaemonMetrics:
    """The daemon's Prometheus metrics, on a registry of its own."""

    def __init__(self, site: SiteModel, device_names: Sequence[str], rack_domains: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.domains, self.domain_names = _exported_domains(site, rack_domains)
        self.site = site

        # per-domain series: arrays updated each cycle, turned into samples only when scraped
        self._domains = _DomainCollector(self.domain_names)
        r.register(self._domains)
        self.pcc = Gauge("dimmer_pcc_watts", "Grid import at the interconnect", registry=r)
        self.pcc_limit = Gauge("dimmer_pcc_limit_watts", "Interconnect limit in force", registry=r)
        self.bess_soc = Gauge("dimmer_bess_soc_ratio", "Campus battery state of charge (0-1)", registry=r)
        self.bess_power = Gauge("dimmer_bess_watts", "Campus battery power, positive discharging", registry=r)
        self.bess_setpoint = Gauge("dimmer_bess_setpoint_watts", "Campus battery setpoint decided", registry=r)
        self.cap_min = Gauge("dimmer_gpu_cap_min_watts", "Lowest per-GPU cap decided", registry=r)
        self.cap_mean = Gauge("dimmer_gpu_cap_mean_watts", "Mean per-GPU cap decided", registry=r)
        self.cycle = Histogram("dimmer_cycle_seconds", "Duration of one cycle", buckets=CYCLE_BUCKETS_S, registry=r)
        self.step = Histogram(
            "dimmer_controller_step_seconds", "Duration of Controller.step", buckets=CYCLE_BUCKETS_S, registry=r
        )
        self.overruns = Counter("dimmer_cycle_overruns", "Cycles that took longer than the period", registry=r)
        self.cycles = Counter("dimmer_cycles", "Cycles run", registry=r)
        self.comm_errors = Counter("dimmer_comm_errors", "Failed reads and writes", ["device", "op"], registry=r)
        self.device_up = Gauge(
            "dimmer_device_up", "1 unless the device failed fail_after times in a row", ["device"], registry=r
        )
        self.writes = Counter("dimmer_writes", "Setpoint writes that succeeded", ["device"], registry=r)
        self.writes_refused = Counter(
            "dimmer_writes_refused",
            "Writes refused before sending: outside the device's writable registers or its ratings",
            ["device"],
            registry=r,
        )
        self.actions = Counter("dimmer_actions", "Actions taken, by layer and reason", ["layer", "reason"], registry=r)
        self.failsafe = Counter("dimmer_failsafe_entries", "Times the daemon entered FAILSAFE mode", registry=r)
        self.mode = Enum("dimmer_mode", "Daemon mode", states=MODE_STATES, registry=r)
        for name in device_names:
            self.device_up.labels(device=name).set(1)
            self.writes_refused.labels(device=name)
            for op in ("read", "write"):
                self.comm_errors.labels(device=name, op=op)
        self._server: Any = None

    def rebind(self, site: SiteModel, device_names: Sequence[str], rack_domains: bool = False) -> None:
        """Follow a reloaded config: the domains exported and the devices known (old series stay until restart)."""
        self.site = site
        self.domains, self.domain_names = _exported_domains(site, rack_domains)
        self._domains.rebind(self.domain_names)
        for name in device_names:
            self.device_up.labels(device=name).set(1)

    def serve(self, address: tuple[str, int]) -> int:
        """Start the HTTP endpoint on `address`; returns the bound port (0 picks a free one)."""
        server, _thread = start_http_server(address[1], addr=address[0], registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    @property
    def bound_address(self) -> tuple[str, int] | None:
        """(host, port) the endpoint listens on, as the socket reports it; None when not serving."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def set_mode(self, mode: str) -> None:
        self.mode.state(mode)

    def observe_domains(
        self, measured_w: np.ndarray, planned_w: np.ndarray | None, enforced_w: np.ndarray, limit_w: np.ndarray
    ) -> None:
        """Latest per-domain watts (full `(n_domains,)` arrays); copied, so the caller may reuse its buffers."""
        idx = self.domains
        planned = planned_w[idx] if planned_w is not None else np.full(idx.size, np.nan)
        self._domains.set(
            (measured_w[idx].copy(), np.asarray(planned, dtype=np.float64), enforced_w[idx].copy(), limit_w[idx].copy())
        )

    def count_reasons(self, reasons: Sequence[Reason]) -> None:
        for r in reasons:
            self.actions.labels(layer=r.layer, reason=reason_label(r.reason)).inc()


def _exported_domains(site: SiteModel, rack_domains: bool) -> tuple[np.ndarray, list[str]]:
    rack_level = int(site.domain_level.max()) if site.n_domains else 0
    keep = np.ones(site.n_domains, dtype=bool) if rack_domains else site.domain_level < rack_level
    keep[0] = True
    idx = np.flatnonzero(keep)
    return idx, [site.domain_name[d] for d in idx]


class _DomainCollector:
    """dimmer_domain_{measured,planned,enforced,limit}_watts{domain}, built from arrays at scrape time."""

    FAMILIES = (
        ("dimmer_domain_measured_watts", "Measured load of a domain"),
        ("dimmer_domain_planned_watts", "The controller's planned load of a domain"),
        ("dimmer_domain_enforced_watts", "Most a domain can draw under the caps in force (every GPU at its cap)"),
        ("dimmer_domain_limit_watts", "Limit in force of a domain"),
    )

    def __init__(self, names: list[str]) -> None:
        self.rebind(names)

    def rebind(self, names: list[str]) -> None:
        empty = np.full(len(names), np.nan)
        self.data: tuple[list[str], tuple[np.ndarray, ...]] = (names, (empty, empty, empty, empty))

    def set(self, values: tuple[np.ndarray, ...]) -> None:
        self.data = (self.data[0], values)  # one assignment: a scrape sees the old set or the new one, whole

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names, values = self.data
        for (name, doc), arr in zip(self.FAMILIES, values, strict=True):
            fam = GaugeMetricFamily(name, doc, labels=["domain"])
            for domain, v in zip(names, arr.tolist(), strict=True):
                fam.add_metric([domain], v)
            yield fam


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


def setup_logging(level: str = "INFO") -> None:
    """Plain logs on stderr: time, level, logger, message (journald adds its own timestamp; keep ours for files)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # pymodbus logs every dropped reply with a dump of the last frames; our bus reports failures itself
    logging.getLogger("pymodbus").setLevel(logging.ERROR if level != "DEBUG" else logging.DEBUG)
