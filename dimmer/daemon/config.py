"""The daemon's site config: a TOML file -> a validated `DaemonConfig` -> the site, the controller and the devices.

The power tree, its ratings and the jobs reuse the scenario schema (`dimmer.siteconfig.SiteSpec`,
`JobPlacementSpec`), so a site described for `gridsim` and for `dimmer run` reads the same. On top of it:

    [[devices]]     where every meter, battery, rack cap device and site aggregator answers (Modbus TCP)
    [[limits]]      operating limits below a breaker's rating (never above it)
    [controller]    name and params
    [safety]        safe cap, staleness, debounce, setpoint leases
    [daemon]        period, metrics address, audit log, state file
    [building]      a building daemon's building, under a campus coordinator (docs/daemon.md, "The hierarchy")
    [utility]       the utility's OpenADR VTN this daemon is a VEN of (utility_config.py, docs/utility.md)

Every key is checked once, here, with the file and the key path in the error (exit status 2); cross-checks that need
more than one key run at load too (config_checks.py): racks inside the site and covered exactly once (no two devices
writing the same rack), a safe cap the GPU can hold and at which no breaker is overdrawn with every GPU at it, limits
under the breakers and the interconnect limit, leases and reversion times of at least a period, a controller that
accepts its params. A safe cap that would put the interconnect or a [[limits]] entry over is a warning (`dimmer
check`, and the daemon's log at start and reload). Loading touches no device and no file but the config.

`check_files` (`dimmer check`, and `dimmer run --config` before it starts) asks, creating nothing, whether the audit
log and the state file can be opened where they are, as the daemon will open them: not a directory, not below a
file, in a directory this user can write. It is apart from loading because a config is also loaded where it will
not run (a test, a review), and the example's /var/log/dimmer exists only where systemd made it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationError, field_validator, model_validator

from dimmer.control.building_split import BuildingPart
from dimmer.daemon import config_checks as C
from dimmer.daemon.config_checks import floor3, uniform_cap_bound_w
from dimmer.daemon.registers import RACK_MAX, SITE_MAX_DOMAINS
from dimmer.daemon.utility_config import UtilitySpec, check_utility
from dimmer.errors import from_validation_error
from dimmer.outpath import check_out_file
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import JobPlacementSpec, Name, SiteSpec, Strict
from dimmer.tomlfile import read_toml as read_toml_file

DeviceKind = Literal["meter", "battery", "site", "racks", "building"]

# The register profile each kind speaks (docs/registers.md): SunSpec for meters and batteries, the project's own
# maps for rack cap devices (a power shelf controller, a BMC gateway or `dimmer agent`) and the site aggregator.
PROFILES: dict[str, tuple[str, ...]] = {
    "meter": ("sunspec",),
    "battery": ("sunspec",),
    "racks": ("dimmer-rack-v1",),
    "site": ("dimmer-site-v1",),
    "building": ("dimmer-building-v1",),
}


class DeviceSpec(Strict):
    """One Modbus TCP device: a meter, the campus battery, a block of rack cap devices or the site aggregator."""

    kind: DeviceKind
    name: Name | None = None  # default: "<kind><index>" (metric and log label)
    host: str = Field(min_length=1)
    port: int = Field(default=502, ge=1, le=65535)  # 502 is the IANA Modbus/TCP port
    unit: int = Field(default=1, ge=1, le=247)  # Modbus unit id (0 is broadcast, 248-255 reserved)
    profile: str | None = None  # default: the kind's first profile
    # SunSpec base register; none configured: the "SunS" marker is looked for at 40000, then 0, then 50000
    base: int | None = Field(default=None, ge=0, le=65531)
    domain: str = "campus"  # meter: the domain it meters ("campus" is the interconnect, the PCC)
    first_rack: int | None = Field(default=None, ge=0)  # racks: the first rack (tree order) this device serves
    n_racks: int | None = Field(default=None, ge=1, le=RACK_MAX)  # dimmer-rack-v1 serves up to 64 racks a device
    building: str | None = None  # building: the building (a domain of the site) whose daemon this is
    # site: the site's domains this unit serves (a site of more than one unit's 10,874 is split); default all
    first_domain: int | None = Field(default=None, ge=0)
    n_domains: int | None = Field(default=None, ge=1, le=SITE_MAX_DOMAINS)
    read_only: bool = False  # never written, whatever the controller decides
    timeout_s: float = Field(default=0.5, gt=0, le=30)  # per request
    retries: int = Field(default=2, ge=0, le=10)  # per request, by the bus, before the read counts as failed
    backoff_s: float = Field(default=0.05, ge=0, le=10)  # first reconnect wait; doubles per failure

    @model_validator(mode="after")
    def _kind_fields(self) -> DeviceSpec:
        profile = self.profile or PROFILES[self.kind][0]
        if profile not in PROFILES[self.kind]:
            raise ValueError(f"profile for a {self.kind} device must be one of {', '.join(PROFILES[self.kind])}")
        if self.kind == "racks" and (self.first_rack is None or self.n_racks is None):
            raise ValueError("a racks device needs first_rack and n_racks")
        if self.kind != "racks" and (self.first_rack is not None or self.n_racks is not None):
            raise ValueError("first_rack and n_racks belong to racks devices only")
        if (self.kind == "building") != (self.building is not None):
            raise ValueError("a building device names its building, and only a building device does")
        if self.kind != "site" and (self.first_domain is not None or self.n_domains is not None):
            raise ValueError("first_domain and n_domains belong to site devices only")
        return self

    @property
    def profile_name(self) -> str:
        return self.profile or PROFILES[self.kind][0]


class LimitSpec(Strict):
    """An operating limit for one domain, below its breaker rating (a contract, a margin, a hot aisle)."""

    domain: str
    limit_kw: float | None = Field(default=None, gt=0)
    limit_mw: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one(self) -> LimitSpec:
        if (self.limit_kw is None) == (self.limit_mw is None):
            raise ValueError("give exactly one of limit_kw or limit_mw")
        return self

    def limit_w(self) -> float:
        return self.limit_kw * 1e3 if self.limit_kw is not None else float(self.limit_mw or 0.0) * 1e6


class ControllerConfig(Strict):
    name: str = "dimmer"
    params: dict[str, Any] = {}


class SafetySpec(Strict):
    """What the daemon does when something fails (docs/daemon.md, "Fail-safes")."""

    # Where every fail-safe sends a GPU cap, as a fraction of rated: FAILSAFE mode, SIGTERM, a stale reading, a
    # lapsed lease. 0.6 is the dimmer controller's own default: ~0.82 of full throughput (Perseus curve).
    safe_cap_frac: float = Field(default=0.6, gt=0)
    # A reading older than this is not trusted (the controller's stale_s): 5 control periods.
    stale_s: float = Field(default=5.0, gt=0, le=3600)
    # A device is flagged (logged once, dimmer_device_up 0) after this many consecutive failed reads or writes.
    fail_after: int = Field(default=3, ge=1, le=1000)
    # Rack devices hold the caps and floors written for this long; a device that is not rewritten within it falls
    # back to its safe cap on its own (10 periods: a restart fits, a dead daemon does not hold caps forever).
    lease_s: float = Field(default=10.0, gt=0, le=3600)
    # A meter (no update counter) whose reading has not changed by one count for this long is frozen, and stale,
    # if the racks under it (less the battery, at the campus) moved meanwhile by more than this share of its limit:
    # a battery that holds the import flat repeats a live meter's reading too. With no rack readings to judge it
    # by, a repeat that long is frozen.
    frozen_meter_s: float = Field(default=5.0, gt=0, le=3600)
    frozen_meter_move_frac: float = Field(default=0.02, gt=0, le=1)
    # A rack whose reading is older than this many periods (not stale yet, just late) never has its cap raised.
    hold_after_periods: float = Field(default=1.5, gt=0, le=3600)
    # The campus battery reverts to idle this long after the last setpoint (SunSpec WinTms / RvrtTms).
    battery_revert_s: float = Field(default=10.0, gt=0, le=3600)


class DaemonSpec(Strict):
    period_s: float = Field(default=1.0, gt=0, le=60)  # the control period (the controller's period_s)
    read_timeout_s: float | None = Field(default=None, gt=0)  # a whole device read; default: half the period
    metrics_address: str = "127.0.0.1:9108"  # host:port of the Prometheus endpoint; "" disables it
    metrics_rack_domains: bool = False  # also export rack-level domains (one series per rack and metric)
    # connections the endpoint serves at once (a new one over it closes the longest-silent of the busiest client),
    # and how long one may take to send its request or read the answer: a thread each, so both bounded
    metrics_max_connections: int = Field(default=8, ge=1, le=1000)
    metrics_idle_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    audit_log: str | None = None  # JSON-lines audit log; relative paths are relative to the config file
    state_file: str | None = None  # controller filter state, saved atomically
    state_every: int = Field(default=10, ge=1)  # save the state every this many cycles (and at exit)
    state_max_age_s: float = Field(default=600.0, gt=0)  # an older state file is not restored

    @field_validator("metrics_address")
    @classmethod
    def _address(cls, v: str) -> str:
        if v:
            parse_address(v)
        return v

    @property
    def read_timeout_in_force_s(self) -> float:
        """A whole device read's bound, on the daemon's clock: the configured one, or half the period."""
        return self.read_timeout_s if self.read_timeout_s is not None else 0.5 * self.period_s


class BuildingSpec(Strict):
    """This daemon controls one building of the site, under a campus coordinator (docs/daemon.md, "The
    hierarchy"): its devices are the building's, its interconnect is the budget its parent writes."""

    name: str  # the building: a domain of [site] at the building level
    serve: str = "127.0.0.1:5030"  # host:port where it serves dimmer-building-v1 to its parent
    unit: int = Field(default=1, ge=1, le=247)
    allow: list[str] = []  # networks besides loopback its parent may connect from (CIDR)
    # the share of the interconnect limit in force it holds once a budget's lease lapses; default its share of the
    # campus's most, within the campus's margin (what the coordinator's safe budget is)
    safe_share: float | None = Field(default=None, gt=0, le=1)

    @field_validator("serve")
    @classmethod
    def _address(cls, v: str) -> str:
        parse_address(v)
        return v


class DaemonConfig(Strict):
    site: SiteSpec
    jobs: list[JobPlacementSpec] = []
    devices: list[DeviceSpec] = Field(min_length=1)
    limits: list[LimitSpec] = []
    controller: ControllerConfig = ControllerConfig()
    safety: SafetySpec = SafetySpec()
    daemon: DaemonSpec = DaemonSpec()
    building: BuildingSpec | None = None
    utility: UtilitySpec | None = None


def parse_address(text: str) -> tuple[str, int]:
    """ "127.0.0.1:9108" -> ("127.0.0.1", 9108); "[::1]:9108" for IPv6. ValueError if malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("host:port, e.g. 127.0.0.1:9108")
    return host.strip("[]"), int(port)


def metrics_address_of(loaded: LoadedConfig, given: tuple[str, int] | str | None) -> tuple[str, int] | None:
    """Where a daemon serves its metrics: the config's `daemon.metrics_address` for "config" ("" none), else `given`
    (a host and port, or None: none)."""
    if given == "config":
        text = loaded.config.daemon.metrics_address
        return parse_address(text) if text else None
    return given if isinstance(given, tuple) else None


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config with everything built from it once: the site model, resolved paths, names, limits."""

    config: DaemonConfig
    source: str
    base_dir: Path
    site: SiteModel
    device_names: tuple[str, ...]
    limit_w: np.ndarray  # (n_domains,) operating limit of every domain: min(rating, [[limits]])
    controller_params: Mapping[str, Any]
    campus_site: SiteModel  # the whole site ([site]); `site` is its building's for a building daemon
    part: BuildingPart | None = None  # a building daemon's building

    @property
    def role(self) -> str:
        """ "building" (one building under a coordinator), "coordinator" (over building daemons) or "flat"."""
        if self.part is not None:
            return "building"
        return "coordinator" if any(d.kind == "building" for d in self.config.devices) else "flat"

    @property
    def safe_cap_w(self) -> float:
        gpu = self.site.gpu
        return float(min(max(self.config.safety.safe_cap_frac * gpu.rated_w, gpu.min_cap_w), gpu.rated_w))

    def resolve(self, path: str | None) -> Path | None:
        if path is None:
            return None
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.base_dir / p

    @property
    def audit_path(self) -> Path | None:
        return self.resolve(self.config.daemon.audit_log)

    @property
    def state_path(self) -> Path | None:
        return self.resolve(self.config.daemon.state_file)


def read_toml(path: Path) -> dict[str, Any]:
    return read_toml_file(path, "site config file")


def load_config(path: str | Path) -> LoadedConfig:
    """Read and validate a site config file; InputError (one line: file, key path, expected) if anything is wrong."""
    p = Path(path)
    return validate_config(read_toml(p), str(p), p.resolve().parent)


def validate_config(raw: Mapping[str, Any], source: str, base_dir: Path) -> LoadedConfig:
    try:
        cfg = DaemonConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise from_validation_error(source, exc) from None
    campus = build_site(cfg.site, cfg.jobs, source=source)
    part = C.building_part(cfg, campus, source)
    site = part.site if part is not None else campus
    names = C.check_devices(cfg, site, source, part)
    C.check_site_units(cfg, campus, source)
    limit_w = C.check_limits(cfg, site, source)
    C.check_safety(cfg, site, source)
    params = controller_params(cfg, campus, part)
    C.check_controller(cfg, site, params, source, part)
    loaded = LoadedConfig(cfg, source, base_dir, site, names, limit_w, params, campus, part)
    check_utility(cfg, source, base_dir, loaded.role)
    return loaded


def check_files(loaded: LoadedConfig) -> None:
    """InputError (file, key, what was expected) for an audit log or state file the daemon could not open: the audit
    log is opened for append (its parents made), the state file replaced atomically (a temporary file beside it)."""
    for key, path in (("daemon.audit_log", loaded.audit_path), ("daemon.state_file", loaded.state_path)):
        if path is not None:
            check_out_file(path, loaded.source, key)


def controller_params(
    cfg: DaemonConfig, campus: SiteModel | None = None, part: BuildingPart | None = None
) -> dict[str, Any]:
    """The controller's params, with the daemon's period and (for dimmer) the [safety] staleness and safe cap; a
    building daemon's, with what a building under a coordinator plans on (campus.building_params)."""
    params = dict(cfg.controller.params)
    if cfg.controller.name == "dimmer":
        params.setdefault("period_s", cfg.daemon.period_s)
        params.setdefault("stale_s", cfg.safety.stale_s)
        params.setdefault("safe_cap_frac", cfg.safety.safe_cap_frac)
        if part is not None and campus is not None:
            from dimmer.control.campus import building_params
            from dimmer.control.dimmer import DimmerParams

            with contextlib.suppress(ValidationError):  # (a bad param is reported by check_controller, by key)
                given = DimmerParams.model_validate(params)
                under = building_params(campus, given)
                # (the frequency response off: the coordinator answers for the campus)
                params |= under.model_dump(include={"pcc_margin_frac", "floor_release_w_per_s", "ffr_droop_pct"})
    return params


def safe_cap_load_warnings(loaded: LoadedConfig) -> list[str]:
    """Domains whose load would exceed their operating limit (the interconnect limit for the campus, a [[limits]]
    entry) with every GPU at the safe cap. Worth knowing, not an error: a breaker rating exceeded is refused at load
    (_check_safe_cap_breakers); an operating limit is a contract or a margin, and while failing safe the campus
    battery may still cover the difference."""
    site = loaded.site
    draw_w = site.domain_load_w(site.rack_power_w(np.full(site.n_racks, loaded.safe_cap_w)))
    bound = uniform_cap_bound_w(site, loaded.limit_w)
    over = np.flatnonzero(draw_w > loaded.limit_w * (1 + 1e-12))
    out = []
    for d in over[:10]:
        what = "interconnect limit" if d == 0 else "limit"
        fit = floor3(bound[d] / site.gpu.rated_w)
        hint = f"safe_cap_frac <= {fit:g} would hold it" if bound[d] >= site.gpu.min_cap_w else "no cap holds it"
        out.append(
            f"{site.domain_name[d]}: at the safe cap the racks under it could draw {draw_w[d] / 1e3:.0f} kW, above "
            f"its {loaded.limit_w[d] / 1e3:.0f} kW {what} ({hint})"
        )
    return out


def describe(loaded: LoadedConfig) -> str:
    site, cfg = loaded.site, loaded.config
    kinds = [d.kind for d in cfg.devices]
    parts = ", ".join(
        f"{kinds.count(k)} {k}" for k in ("meter", "battery", "site", "racks", "building") if kinds.count(k)
    )
    ro = sum(d.read_only for d in cfg.devices)
    u = cfg.utility
    utility = f"; OpenADR 2.0b VEN {u.ven_name!r} of {u.vtn_url}" if u is not None and u.enabled else ""
    role = {"building": f"building {loaded.part.name if loaded.part else ''} daemon: ", "coordinator": "coordinator: "}
    return (
        f"{loaded.source}: ok — {role.get(loaded.role, '')}{site.n_gpus} GPUs in {site.n_racks} racks, "
        f"{site.n_domains} domains, "
        f"{site.n_jobs} job{'' if site.n_jobs == 1 else 's'}; devices: {parts}{f' ({ro} read-only)' if ro else ''}; "
        f"controller {cfg.controller.name}, "
        f"period {cfg.daemon.period_s:g} s, safe cap {loaded.safe_cap_w:g} W{utility}"
    )
