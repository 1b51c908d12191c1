"""The cross-checks of a daemon config that need more than one key (config.py loads and validates the schema):
devices against the site and each other (racks covered once, meters, site units, what each role may have), limits
under the ratings, the safe cap against the breakers, the controller's params, a building daemon's building.

Each raises InputError naming the file, the key and what was expected (exit status 2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dimmer.control.building_split import BuildingPart, building_parts
from dimmer.daemon.registers import SITE_MAX_DOMAINS
from dimmer.errors import InputError
from dimmer.site import SiteModel

if TYPE_CHECKING:
    from dimmer.daemon.config import DaemonConfig, DeviceSpec


def building_part(cfg: DaemonConfig, campus: SiteModel, source: str) -> BuildingPart | None:
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


def check_devices(cfg: DaemonConfig, site: SiteModel, source: str, part: BuildingPart | None) -> tuple[str, ...]:
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


def check_site_units(cfg: DaemonConfig, campus: SiteModel, source: str) -> None:
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


def check_limits(cfg: DaemonConfig, site: SiteModel, source: str) -> np.ndarray:
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


def check_safety(cfg: DaemonConfig, site: SiteModel, source: str) -> None:
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
        f"at most {floor3(bound[d] / gpu.rated_w):g}"
        if bound[d] >= gpu.min_cap_w
        else f"a cap the {gpu.name} can hold ({gpu.min_cap_w:g} W is the lowest, and still too much)"
    )
    raise InputError(
        source,
        "safety.safe_cap_frac",
        f"{what}: with every GPU at the safe cap of {cap_w:g} W the racks under {site.domain_name[d]} would draw "
        f"{draw_w / 1e3:.0f} kW, above its {site.domain_rating_w[d] / 1e3:.0f} kW breaker rating",
    )


def floor3(x: float) -> float:
    """Rounded down to three decimals: a fraction suggested as an upper bound must not round past it."""
    return math.floor(x * 1000.0) / 1000.0


def check_controller(
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
