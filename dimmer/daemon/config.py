"""The daemon's site config: a TOML file -> a validated `DaemonConfig` -> the site, the controller and the devices.

The power tree, its ratings and the jobs reuse the scenario schema (`dimmer.siteconfig.SiteSpec`,
`JobPlacementSpec`), so a site described for `gridsim` and for `dimmer run` reads the same. On top of it:

    [[devices]]     where every meter, battery, rack cap device and site aggregator answers (Modbus TCP)
    [[limits]]      operating limits below a breaker's rating (never above it)
    [controller]    name and params
    [safety]        safe cap, staleness, debounce, setpoint leases
    [daemon]        period, metrics address, audit log, state file

Every key is checked once, here, with the file and the key path in the error (exit status 2); cross-checks that need
more than one key run at load too: racks inside the site and covered exactly once (no two devices writing the same
rack), a safe cap the GPU can hold and at which no breaker is overdrawn with every GPU at it, limits under the
breakers and the interconnect limit, leases and reversion times of at least a period, a controller that accepts its
params. A safe cap that would put the interconnect or a [[limits]] entry over is a warning (`dimmer check`, and
the daemon's log at start and reload). Loading touches no device and no file but the config.

`check_files` (`dimmer check`, and `dimmer run --config` before it starts) asks, creating nothing, whether the audit
log and the state file can be opened where they are, as the daemon will open them: not a directory, not below a
file, in a directory this user can write. It is apart from loading because a config is also loaded where it will
not run (a test, a review), and the example's /var/log/dimmer exists only where systemd made it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, ValidationError, field_validator, model_validator

from dimmer.control.building_split import BuildingPart, building_parts
from dimmer.daemon.registers import RACK_MAX, SITE_MAX_DOMAINS
from dimmer.errors import InputError, from_validation_error
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


def parse_address(text: str) -> tuple[str, int]:
    """ "127.0.0.1:9108" -> ("127.0.0.1", 9108); "[::1]:9108" for IPv6. ValueError if malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("host:port, e.g. 127.0.0.1:9108")
    return host.strip("[]"), int(port)


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
    part = _building_part(cfg, campus, source)
    site = part.site if part is not None else campus
    names = _check_devices(cfg, site, source, part)
    _check_site_units(cfg, campus, source)
    limit_w = _check_limits(cfg, site, source)
    _check_safety(cfg, site, source)
    params = controller_params(cfg, campus, part)
    _check_controller(cfg, site, params, source, part)
    return LoadedConfig(cfg, source, base_dir, site, names, limit_w, params, campus, part)


def _building_part(cfg: DaemonConfig, campus: SiteModel, source: str) -> BuildingPart | None:
    """A building daemon's building (InputError for a name that is no building of the site, an allow entry that is
    no network)."""
    spec = cfg.building
    if spec is None:
        return None
    from dimmer.daemon.agent_server import AllowList

    for i, entry in enumerate(spec.allow):
        try:
            AllowList.parse([entry])
        except ValueError:
            raise InputError(source, f"building.allow[{i}]", f"a network, e.g. 10.20.0.0/24 (got {entry!r})") from None
    parts = [p for p in building_parts(campus) if p.name != "campus"]
    for part in parts:
        if part.name == spec.name:
            return part
    have = ", ".join(p.name for p in parts[:8]) + (", ..." if len(parts) > 8 else "")
    raise InputError(
        source, "building.name", f"a building of the site ({have})" if parts else "a building: the site has none"
    )


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

            with contextlib.suppress(ValidationError):  # (a bad param is reported by _check_controller, by key)
                given = DimmerParams.model_validate(params)
                under = building_params(campus, given)
                params |= under.model_dump(include={"pcc_margin_frac", "floor_release_w_per_s"})
    return params


def _check_devices(cfg: DaemonConfig, site: SiteModel, source: str, part: BuildingPart | None) -> tuple[str, ...]:
    names: list[str] = []
    covered = np.zeros(site.n_racks, dtype=np.int64)
    metered: dict[str, int] = {}
    endpoints: dict[tuple[str, int, int, str, int], int] = {}
    kinds: dict[str, int] = {}
    coordinator = any(d.kind == "building" for d in cfg.devices)
    buildings = {p.name: -1 for p in building_parts(site) if p.name != "campus"} if coordinator else {}
    for i, dev in enumerate(cfg.devices):
        key = f"devices[{i}]"
        name = dev.name or f"{dev.kind}{i}"
        if name in names:
            raise InputError(source, f"{key}.name", f"a name no other device has ({name!r} repeats)")
        names.append(name)
        _check_role(dev, key, source, part, coordinator)
        if dev.kind == "building":
            if buildings.get(str(dev.building), -2) == -2:
                raise InputError(source, f"{key}.building", f"a building of the site (not {dev.building!r})")
            if buildings[str(dev.building)] >= 0:
                raise InputError(
                    source, f"{key}.building", f"one device per building (devices[{buildings[str(dev.building)]}])"
                )
            buildings[str(dev.building)] = i
        if dev.kind == "site":
            kinds["site"] = i
        elif dev.kind == "battery":
            if dev.kind in kinds:
                raise InputError(source, f"{key}.kind", f"at most one {dev.kind} device (devices[{kinds[dev.kind]}])")
            kinds[dev.kind] = i
        if dev.kind == "meter":
            if dev.domain not in site.domain_name:
                raise InputError(source, f"{key}.domain", f"a domain of the site (not {dev.domain!r})")
            if dev.domain in metered:
                raise InputError(source, f"{key}.domain", f"one meter per domain (devices[{metered[dev.domain]}])")
            metered[dev.domain] = i
        if dev.kind == "racks":
            first, n = int(dev.first_rack or 0), int(dev.n_racks or 0)
            if first + n > site.n_racks:
                raise InputError(
                    source,
                    f"{key}.n_racks",
                    f"racks within the site's 0..{site.n_racks - 1} (got {first}..{first + n - 1})",
                )
            if covered[first : first + n].any():
                dup = first + int(np.argmax(covered[first : first + n] > 0))
                raise InputError(source, f"{key}.first_rack", f"racks no other device serves (rack {dup} repeats)")
            covered[first : first + n] += 1
        # a rack device may share an endpoint and unit with others (blocks of one rack controller); SunSpec devices
        # at the same endpoint, unit and base would read the same registers
        base = -1 if dev.base is None else dev.base  # none: discovered (40000, 0, 50000)
        ep = (dev.host, dev.port, dev.unit, dev.kind, base if dev.kind != "racks" else -2 - i)
        if ep in endpoints:
            raise InputError(
                source,
                f"{key}.unit",
                f"a unit no other {dev.kind} device at {dev.host}:{dev.port} uses (devices[{endpoints[ep]}])",
            )
        endpoints[ep] = i
    pcc = site.domain_name[1] if part is not None else "campus"
    if pcc not in metered and "feed" not in metered and "site" not in kinds:
        what = "its building's import" if part is not None else "the interconnect"
        raise InputError(source, "devices", f"a meter with domain = {pcc!r} or a site device: {what} must be measured")
    if coordinator:
        unserved = [b for b, i in buildings.items() if i < 0]
        if unserved:
            raise InputError(source, "devices", f"a building device for every building (none for {unserved[0]})")
        return tuple(names)
    missing = np.flatnonzero(covered == 0)
    if missing.size:
        raise InputError(
            source,
            "devices",
            f"racks devices covering every rack exactly once "
            f"(racks {_ranges(missing)} of 0..{site.n_racks - 1} have none)",
        )
    return tuple(names)


def _check_site_units(cfg: DaemonConfig, campus: SiteModel, source: str) -> None:
    """Site devices serve runs of the site's domains that do not overlap (a large site is split over units)."""
    owner = np.full(campus.n_domains, -1)
    for i, dev in enumerate(cfg.devices):
        if dev.kind != "site":
            continue
        first = dev.first_domain or 0
        n = dev.n_domains if dev.n_domains is not None else campus.n_domains - first
        if first + n > campus.n_domains or n < 1:
            what = f"domains within the site's 0..{campus.n_domains - 1} (got {first}..{first + n - 1})"
            raise InputError(source, f"devices[{i}].{'n_domains' if dev.n_domains else 'first_domain'}", what)
        if n > SITE_MAX_DOMAINS:
            what = f"at most {SITE_MAX_DOMAINS} domains a unit: the site's {campus.n_domains} are split over units"
            raise InputError(source, f"devices[{i}].n_domains", what)
        taken = owner[first : first + n]
        if np.any(taken >= 0):
            other = int(taken[np.argmax(taken >= 0)])
            raise InputError(source, f"devices[{i}].first_domain", f"domains no other site device serves ({other})")
        owner[first : first + n] = i


def _check_role(dev: DeviceSpec, key: str, source: str, part: BuildingPart | None, coordinator: bool) -> None:
    """A building daemon has its building's devices (no campus battery, no other building); a coordinator has the
    interconnect's, the campus battery and its buildings (no racks: those are the buildings')."""
    if part is not None and dev.kind in ("battery", "building"):
        what = "meter, site or racks in a building daemon: the campus's are its parent's"
        raise InputError(source, f"{key}.kind", what)
    if coordinator and dev.kind == "racks":
        what = "meter, site, battery or building in a coordinator: racks are its buildings'"
        raise InputError(source, f"{key}.kind", what)


def _ranges(idx: np.ndarray) -> str:
    """[0 1 2 5] -> "0-2, 5" (at most four runs, then "...")."""
    runs: list[str] = []
    start = prev = int(idx[0])
    for x in [*idx[1:].tolist(), None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        runs.append(f"{start}-{prev}" if prev > start else f"{start}")
        if x is not None:
            start = prev = x
    return ", ".join(runs[:4]) + (", ..." if len(runs) > 4 else "")


def _check_limits(cfg: DaemonConfig, site: SiteModel, source: str) -> np.ndarray:
    limit = site.domain_rating_w.copy()
    seen: set[str] = set()
    for i, lim in enumerate(cfg.limits):
        key = f"limits[{i}]"
        if lim.domain not in site.domain_name:
            raise InputError(source, f"{key}.domain", f"a domain of the site (not {lim.domain!r})")
        if lim.domain in seen:
            raise InputError(source, f"{key}.domain", f"one limit per domain ({lim.domain!r} repeats)")
        seen.add(lim.domain)
        d = site.domain_index(lim.domain)
        rating = float(site.domain_rating_w[d])
        if lim.limit_w() > rating + 1e-6:
            what = "interconnect limit (site.pcc.limit_mw)" if d == 0 else "breaker rating"
            raise InputError(
                source,
                f"{key}.{'limit_kw' if lim.limit_kw is not None else 'limit_mw'}",
                f"at most the {what} of {lim.domain}, {rating / 1e3:g} kW (got {lim.limit_w() / 1e3:g} kW)",
            )
        limit[d] = lim.limit_w()
    return limit


def _check_safety(cfg: DaemonConfig, site: SiteModel, source: str) -> None:
    gpu = site.gpu
    cap_w = cfg.safety.safe_cap_frac * gpu.rated_w
    lo = gpu.min_cap_w / gpu.rated_w
    if cap_w > gpu.rated_w + 1e-9:
        raise InputError(
            source,
            "safety.safe_cap_frac",
            f"at most 1 (a safe cap above the {gpu.name} rating of {gpu.rated_w:g} W is no cap; "
            f"got {cfg.safety.safe_cap_frac:g})",
        )
    if cap_w < gpu.min_cap_w - 1e-9:
        raise InputError(
            source,
            "safety.safe_cap_frac",
            f"at least {lo:.3g}: the {gpu.name} power limit is settable from {gpu.min_cap_w:g} W (got {cap_w:g} W)",
        )
    _check_safe_cap_breakers(cfg, site, source, cap_w)
    if cfg.safety.lease_s < cfg.daemon.period_s:
        raise InputError(source, "safety.lease_s", f"at least the period ({cfg.daemon.period_s:g} s)")
    if cfg.safety.battery_revert_s < cfg.daemon.period_s:
        raise InputError(source, "safety.battery_revert_s", f"at least the period ({cfg.daemon.period_s:g} s)")
    if cfg.daemon.read_timeout_s is not None and cfg.daemon.read_timeout_s >= cfg.daemon.period_s:
        raise InputError(source, "daemon.read_timeout_s", f"below the period ({cfg.daemon.period_s:g} s)")


def uniform_cap_bound_w(site: SiteModel, limit_w: np.ndarray, extra_w: np.ndarray | None = None) -> np.ndarray:
    """(n_domains,) the highest per-GPU cap at which the racks under each domain, every active GPU drawing that cap,
    draw at most `limit_w` of it (rack power is affine in the per-GPU draw); +inf where a domain has no active GPU.
    `extra_w` (n_racks,) is load on top of every rack's (a recharging BBU)."""
    zero = site.rack_power_w(np.zeros(site.n_racks))
    gain = site.domain_load_w(site.rack_power_w(np.ones(site.n_racks)) - zero)
    fixed = site.domain_load_w(zero if extra_w is None else zero + extra_w)
    with np.errstate(divide="ignore", invalid="ignore"):
        bound: np.ndarray = np.where(gain > 0, (limit_w - fixed) / np.where(gain > 0, gain, 1.0), np.inf)
    return bound


def _check_safe_cap_breakers(cfg: DaemonConfig, site: SiteModel, source: str, cap_w: float) -> None:
    """Refuse a safe cap at which the racks under a breaker, every GPU drawing it, would overdraw the breaker.

    Every fail-safe (stale telemetry, FAILSAFE, stop) sends every cap to the safe cap, and on stale telemetry the
    daemon no longer knows the load: a safe cap that can trip a breaker is no fail-safe, and the trip drops the racks
    under it at once (the job crashes, the grid sees the step). The fix costs only throughput while failing safe: a
    lower safe_cap_frac. The interconnect and the [[limits]] (contracts, margins) only warn: safe_cap_load_warnings.
    """
    gpu = site.gpu
    bound = uniform_cap_bound_w(site, site.domain_rating_w)
    bound[0] = np.inf  # the campus "rating" is the interconnect limit: a warning
    d = int(np.argmin(bound))
    if cap_w <= bound[d] + 1e-9:
        return
    draw_w = float(site.domain_load_w(site.rack_power_w(np.full(site.n_racks, cap_w)))[d])
    what = (
        f"at most {_floor3(bound[d] / gpu.rated_w):g}"
        if bound[d] >= gpu.min_cap_w
        else f"a cap the {gpu.name} can hold ({gpu.min_cap_w:g} W is the lowest, and still too much)"
    )
    raise InputError(
        source,
        "safety.safe_cap_frac",
        f"{what}: with every GPU at the safe cap of {cap_w:g} W the racks under {site.domain_name[d]} would draw "
        f"{draw_w / 1e3:.0f} kW, above its {site.domain_rating_w[d] / 1e3:.0f} kW breaker rating",
    )


def _floor3(x: float) -> float:
    """Rounded down to three decimals: a fraction suggested as an upper bound must not round past it."""
    return math.floor(x * 1000.0) / 1000.0


def _check_controller(
    cfg: DaemonConfig, site: SiteModel, params: Mapping[str, Any], source: str, part: BuildingPart | None
) -> None:
    from dimmer.control import make_controller

    coordinator = any(d.kind == "building" for d in cfg.devices)
    if part is not None and cfg.controller.name != "dimmer":
        what = "dimmer: a building daemon runs the flat controller on its building"
        raise InputError(source, "controller.name", what)
    if coordinator:
        from dimmer.control.campus import campus_params

        if cfg.controller.name != "dimmer-campus":
            raise InputError(source, "controller.name", "dimmer-campus: a coordinator over building daemons runs it")
        try:
            campus_params(params)
        except InputError as exc:
            raise InputError(source, f"controller.{exc.key}", exc.expected) from None
        return
    try:
        make_controller(cfg.controller.name, site, params, source=source)
    except InputError as exc:
        if exc.source == source:  # an unknown controller name
            raise InputError(source, "controller.name", exc.expected) from None
        raise InputError(source, f"controller.{exc.key}", exc.expected) from None


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
        fit = _floor3(bound[d] / site.gpu.rated_w)
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
    role = {"building": f"building {loaded.part.name if loaded.part else ''} daemon: ", "coordinator": "coordinator: "}
    return (
        f"{loaded.source}: ok — {role.get(loaded.role, '')}{site.n_gpus} GPUs in {site.n_racks} racks, "
        f"{site.n_domains} domains, "
        f"{site.n_jobs} job{'' if site.n_jobs == 1 else 's'}; devices: {parts}{f' ({ro} read-only)' if ro else ''}; "
        f"controller {cfg.controller.name}, "
        f"period {cfg.daemon.period_s:g} s, safe cap {loaded.safe_cap_w:g} W"
    )
