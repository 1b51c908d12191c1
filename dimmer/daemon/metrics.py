"""Observability: the Prometheus endpoint and plain logging (the audit log: `dimmer.daemon.audit`).

Every metric is named `dimmer_*` in base units (watts, seconds, ratios). Per-domain series carry a `domain` label
(the tree name, e.g. `b0/h1/r3`); rack-level domains are exported only when `[daemon] metrics_rack_domains` is set,
so a 4,000-rack site does not publish 12,000 series by default. Each daemon has its own registry, so several can
live in one process (the tests do). The endpoint serves no `*_created` series (a counter's creation time is one more
series per counter and says nothing an operator watches).

What an operator watches beyond the loads: each device's state (`dimmer_device_state`: ok / stale / failed /
never-read) and the age of its last good reading, each rack device's lease state, whether the campus battery says
it is on line, the daemon's mode, and what it is built from (`dimmer_build_info`). Device ages are computed when
scraped, from the daemon's clock: a daemon stuck in a cycle shows its readings ageing.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import platform
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily, Metric

import dimmer
from dimmer.daemon.audit import AuditLog, json_safe, reasons_json, rle, write_reasons
from dimmer.daemon.metrics_http import METRICS_IDLE_TIMEOUT_S, METRICS_MAX_CONNECTIONS, serve_metrics
from dimmer.daemon.netguard import ConnectionLimits
from dimmer.observation import Actions, Observation, Reason
from dimmer.site import SiteModel

__all__ = [
    "BESS_STATES",
    "CYCLE_BUCKETS_S",
    "DEVICE_STATES",
    "MODE_STATES",
    "AuditLog",
    "DaemonMetrics",
    "DeviceStatus",
    "RecentDurations",
    "build_info",
    "device_state",
    "is_loopback",
    "json_safe",
    "reason_label",
    "reasons_json",
    "rle",
    "setup_logging",
    "write_reasons",
]

log = logging.getLogger("dimmer.metrics")

MODE_STATES = ["starting", "running", "failsafe", "stopping"]
DEVICE_STATES = ("ok", "stale", "failed", "never-read")
BESS_STATES = ("online", "offline", "unknown")
LEASE_STATES = {0: "never written", 1: "held", 2: "expired"}  # dimmer-rack-v1 header `lease_state`
CYCLE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)

_NUMBER = re.compile(r"[-+]?\d[\d.,]*")


def reason_label(text: str) -> str:
    """A bounded label from a free-text reason: numbers become N, the 'at <domain>' / 'to <value>' tails go."""
    head = re.split(r" at | to ", text, maxsplit=1)[0]
    return _NUMBER.sub("N", head).strip()[:80]


def build_info() -> dict[str, str]:
    """What this daemon is built from: dimmer's version, Python's, pymodbus's (the labels of dimmer_build_info)."""
    try:
        pymodbus = metadata.version("pymodbus")
    except metadata.PackageNotFoundError:
        pymodbus = "unknown"
    return {"version": dimmer.__version__, "python": platform.python_version(), "pymodbus": pymodbus}


def is_loopback(host: str) -> bool:
    """`host` (an address as a socket reports it, or "localhost") is a loopback address."""
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


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
    """The daemon's Prometheus metrics, on a registry of its own (`registry`: what the endpoint serves).

    `clock` (monotonic seconds, the clock the devices stamp their readings with) and `speed` (the daemon's clock
    speed) turn a device's last reading time into its age when scraped."""

    def __init__(
        self,
        site: SiteModel,
        device_names: Sequence[str],
        rack_domains: bool = False,
        *,
        clock: Callable[[], float] = time.monotonic,
        speed: float = 1.0,
    ) -> None:
        # the metrics live on `_inner`; the registry served reads them through a filter that drops *_created
        self._inner = CollectorRegistry()
        r = self._inner
        self.domains, self.domain_names = _exported_domains(site, rack_domains)
        self.site = site

        # per-domain series: arrays updated each cycle, turned into samples only when scraped
        self._domains = _DomainCollector(self.domain_names)
        r.register(self._domains)
        self._devices = _DeviceCollector(clock, speed)
        r.register(self._devices)
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
        self.build = Info("dimmer_build", "What the daemon is built from", registry=r)
        # a campus coordinator's: what it grants each building and what each says it may draw (building_role.py)
        self.budget = Gauge(
            "dimmer_building_budget_watts", "Ceiling granted to each building", ["building"], registry=r
        )
        self.building_bound = Gauge(
            "dimmer_building_bound_watts", "The most each building says its racks may draw", ["building"], registry=r
        )
        self.build.info(build_info())
        for name in device_names:
            self.device_up.labels(device=name).set(1)
            self.writes_refused.labels(device=name)
            for op in ("read", "write"):
                self.comm_errors.labels(device=name, op=op)
        self.registry = CollectorRegistry()
        self.registry.register(_WithoutCreated(self._inner))  # last: it names every family registered above
        self._server: Any = None

    def rebind(self, site: SiteModel, device_names: Sequence[str], rack_domains: bool = False) -> None:
        """Follow a reloaded config: the domains exported and the devices known (old series stay until restart,
        but for the per-device state and ages, which follow `set_devices`)."""
        self.site = site
        self.domains, self.domain_names = _exported_domains(site, rack_domains)
        self._domains.rebind(self.domain_names)
        for name in device_names:
            self.device_up.labels(device=name).set(1)

    def serve(self, address: tuple[str, int], limits: ConnectionLimits | None = None) -> int:
        """Start the HTTP endpoint on `address`; returns the bound port (0 picks a free one). ListenError (one line:
        host:port and why) if it cannot listen. `limits`: connections at once and their idle timeout (default 8,
        10 s: `metrics_http`). A warning when the address is not a loopback one: the endpoint tells the site's
        loads to whoever can reach it."""
        if limits is None:
            limits = ConnectionLimits(METRICS_MAX_CONNECTIONS, METRICS_IDLE_TIMEOUT_S)
        server, _thread = serve_metrics(address, self.registry, limits)
        self._server = server
        host, port = self.bound_address or address
        if not is_loopback(host):
            log.warning(
                "metrics endpoint on %s:%d, not a loopback address: anyone who can reach it reads the site's loads "
                "(docs/daemon.md, Trust model: keep it on 127.0.0.1 and scrape from the host)",
                host,
                port,
            )
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

    def set_devices(self, devices: Sequence[DeviceStatus], stale_s: float) -> None:
        """The state of every configured device, as of now (replacing the last set whole: a scrape sees one)."""
        self._devices.set(tuple(devices), stale_s)

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

    def publish(self, obs: Observation, act: Actions, cycle_s: float, step_s: float) -> None:
        """One cycle's worth: its durations, what was observed and what was decided."""
        site = self.site
        self.cycles.inc()
        self.cycle.observe(cycle_s)
        self.step.observe(step_s)
        reported = np.where(np.isfinite(obs.rack_cap_w), obs.rack_cap_w, act.rack_cap_w)
        enforced = site.domain_load_w(site.rack_power_w(reported))
        self.observe_domains(obs.domain_power_w, act.planned_domain_w, enforced, obs.domain_limit_w)
        self.pcc.set(obs.pcc_power_w)
        self.pcc_limit.set(obs.pcc_limit_w)
        self.bess_soc.set(obs.bess_soc_frac)
        self.bess_power.set(obs.bess_power_w)
        self.bess_setpoint.set(act.bess_setpoint_w)
        self.cap_min.set(float(np.min(act.rack_cap_w)) if site.n_racks else math.nan)
        self.cap_mean.set(float(np.mean(act.rack_cap_w)) if site.n_racks else math.nan)
        self.count_reasons(act.reasons)

    def publish_coordinator(
        self, obs: Observation, setpoint_w: float, names: Sequence[str], ceiling_w: npt.NDArray[np.float64],
        bound_w: npt.NDArray[np.float64], cycle_s: float, step_s: float,
    ) -> None:  # fmt: skip
        """A coordinator's cycle: the interconnect, the battery, and each building's budget and bound."""
        self.cycles.inc()
        self.cycle.observe(cycle_s)
        self.step.observe(step_s)
        self.pcc.set(obs.pcc_power_w)
        self.pcc_limit.set(obs.pcc_limit_w)
        self.bess_soc.set(obs.bess_soc_frac)
        self.bess_power.set(obs.bess_power_w)
        self.bess_setpoint.set(setpoint_w)
        for name, ceiling, bound in zip(names, ceiling_w.tolist(), bound_w.tolist(), strict=True):
            self.budget.labels(building=name).set(ceiling)
            self.building_bound.labels(building=name).set(bound)


class _WithoutCreated:
    """Everything `inner` collects but the *_created samples of counters, histograms and summaries (per registry,
    unlike prometheus_client.disable_created_metrics(), which switches them off for the whole process)."""

    def __init__(self, inner: CollectorRegistry) -> None:
        self._inner = inner

    def describe(self) -> Iterator[Metric]:
        """The families served (a scrape of some of them, `?name[]=...`, finds them by name)."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        for fam in self._inner.collect():
            created = fam.name + "_created"
            if any(s.name == created for s in fam.samples):
                out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                out.samples = [s for s in fam.samples if s.name != created]
                fam = out
            yield fam


# -- devices -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceStatus:
    """What the endpoint says about one device: times on the daemon's monotonic clock (NaN: never read)."""

    name: str
    kind: str  # meter, battery, racks, site
    read_t_s: float  # its last good reading
    fresh_t_s: float  # when its values last changed (an update counter that does not move ages them)
    flagged: bool  # failed fail_after reads or writes in a row
    lease_state: float = math.nan  # racks: 0 never written, 1 held, 2 expired (NaN: unknown)
    online: float = math.nan  # battery: 1 on line, 0 off line (NaN: it does not say)


def device_state(s: DeviceStatus, data_age_s: float, stale_s: float) -> str:
    """never-read (no good reading yet), failed (flagged), stale (its values older than stale_s), or ok."""
    if not math.isfinite(s.read_t_s):
        return "never-read"
    if s.flagged:
        return "failed"
    return "stale" if not data_age_s <= stale_s else "ok"


class _DeviceCollector:
    """dimmer_device_{reading_age_seconds,data_age_seconds,state}{device,kind}, dimmer_rack_lease_state{device},
    dimmer_bess_online_state{state}: from the last `DeviceStatus` set, the ages as of the scrape."""

    def __init__(self, clock: Callable[[], float], speed: float) -> None:
        self.clock = clock
        self.speed = speed
        self.data: tuple[tuple[DeviceStatus, ...], float] = ((), math.inf)

    def set(self, devices: tuple[DeviceStatus, ...], stale_s: float) -> None:
        self.data = (devices, stale_s)  # one assignment: a scrape sees the old set or the new one, whole

    def _age(self, now: float, t: float) -> float:
        return max(now - t, 0.0) * self.speed if math.isfinite(t) else math.inf

    def collect(self) -> Iterator[GaugeMetricFamily]:
        devices, stale_s = self.data
        now = self.clock()
        labels = ["device", "kind"]
        reading = GaugeMetricFamily(
            "dimmer_device_reading_age_seconds", "Time since the device's last good reading (+Inf: none)", labels=labels
        )
        data = GaugeMetricFamily(
            "dimmer_device_data_age_seconds",
            "Age of the device's values as the controller counts it: from when they last changed (+Inf: never read)",
            labels=labels,
        )
        state = GaugeMetricFamily(
            "dimmer_device_state", "1 for the device's state: ok, stale, failed, never-read", labels=[*labels, "state"]
        )
        lease = GaugeMetricFamily(
            "dimmer_rack_lease_state",
            "A rack device's lease as it reports it: 0 never written, 1 held, 2 expired (absent: unknown)",
            labels=["device"],
        )
        bess = GaugeMetricFamily(
            "dimmer_bess_online_state",
            "1 for what the campus battery says: online, offline, unknown (it does not say, or its reading is stale)",
            labels=["state"],
        )
        have_bess = False
        for s in devices:
            data_age = self._age(now, s.fresh_t_s)
            reading.add_metric([s.name, s.kind], self._age(now, s.read_t_s))
            data.add_metric([s.name, s.kind], data_age)
            current = device_state(s, data_age, stale_s)
            for st in DEVICE_STATES:
                state.add_metric([s.name, s.kind, st], 1.0 if st == current else 0.0)
            if s.kind == "racks" and math.isfinite(s.lease_state):
                lease.add_metric([s.name], s.lease_state)
            if s.kind == "battery" and not have_bess:  # a config has at most one
                have_bess = True
                says = "unknown"
                if math.isfinite(s.online) and data_age <= stale_s:
                    says = "online" if s.online > 0.5 else "offline"
                for st in BESS_STATES:
                    bess.add_metric([st], 1.0 if st == says else 0.0)
        yield from (reading, data, state, lease, bess)


# -- domains -----------------------------------------------------------------------------------------------------------


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


def setup_logging(level: str = "INFO") -> None:
    """Plain logs on stderr: time, level, logger, message (journald adds its own timestamp; keep ours for files)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # pymodbus logs every dropped reply with a dump of the last frames; our bus reports failures itself
    logging.getLogger("pymodbus").setLevel(logging.ERROR if level != "DEBUG" else logging.DEBUG)
