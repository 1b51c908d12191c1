"""Devices on a register bus: SunSpec meters and batteries, the project's rack cap devices and site device.

Each device has a `name`, a `read_only` flag, `async read() -> Reading` that never raises (a failure comes back
as `ok=False` with every value NaN and the reason in `error`), and write methods that raise `DeviceError`
(`DeviceReadOnly` when the device is configured read-only, without sending anything).

Writes are checked here, the lowest layer that knows the device, before anything is sent (`WriteNotAllowed`
otherwise): every request must lie in a register block the device's map declares writable (`writable_spans()`:
the rack map's lease, heartbeat and command records of its own racks; a battery's 704 setpoint block and 802
controller heartbeat), and every value must lie in its field's declared range and within the ratings the device
was built with (`RackLimits`: caps in the GPU's settable range, floors at most the caps, BBU recharge within the
BBU's rating, the lease; a battery's `max_power_w`).

Every value is a float or a numpy array of floats: NaN where the device did not report it, reported "not
implemented", or reported something out of its declared range. Flags (online, energized, job running) are
1.0 / 0.0 / NaN. `Reading.t_s` is the monotonic time at which the read began, so an age computed from it is never
underestimated.

Reads are batched: a SunSpec meter is one request, a battery three (701, 802, the 704 timer), a rack device of 64
racks eight, the site device one plus 6·n_domains/124. SunSpec devices find their models once (the "SunS" marker
at `base`, or at 40000, 0 and 50000 when `base` is None, then the model chain) and check the model id on every
read, so a device that was replaced or reconfigured is found again rather than misread.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dimmer.daemon import registers as R
from dimmer.daemon.bus import DeviceError, DeviceReadOnly, RegisterBus
from dimmer.daemon.device_base import BusDevice as _Device
from dimmer.daemon.device_base import Clock, FloatArray, Reading, Value
from dimmer.daemon.device_base import as_float as _f
from dimmer.daemon.sunspec_devices import BatteryWrite, SunSpecBattery, SunSpecMeter

__all__ = ["BatteryWrite", "Clock", "RackDevice", "RackLimits", "Reading", "SiteDevice", "SunSpecBattery",
           "SunSpecMeter", "Value"]  # fmt: skip


# (decoded in one pass a value type: the daemon reads every rack device's header each period)
RACK_HEADER = R.NumericDecoder(R.RACK_HEADER)
SITE_HEADER = R.NumericDecoder(R.SITE_HEADER)


# -- dimmer-rack-v1 ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RackLimits:
    """What a rack device may be told beyond its map's declared ranges: the ratings of the site config.

    Caps in [cap_min_w, cap_max_w] (the GPU's settable range), each rack's BBU recharge at most `recharge_max_w`
    (its BBU rating; a scalar or one value per rack of the device), leases in (0, lease_max_s]. Floors at most the
    caps, BBU thresholds >= 0 (+inf: backup only) and no NaN hold for every rack device, with or without limits.
    """

    cap_min_w: float
    cap_max_w: float
    recharge_max_w: float | FloatArray = math.inf
    lease_max_s: float = 86400.0  # the map's declared range of lease_s


class RackDevice(_Device):
    """A rack power / cap device (`dimmer-rack-v1`) serving racks first_rack .. first_rack + n_racks - 1.

    Values: arrays (n_racks,) "power_w", "load_w", "cap_w", "floor_w", "bbu_soc_frac", "energized"; scalars
    "lease_state" (0 never written, 1 held, 2 expired), "update_count", "safe_cap_w".
    """

    kind = "rack"

    def __init__(
        self,
        bus: RegisterBus,
        unit: int,
        first_rack: int,
        n_racks: int,
        *,
        name: str | None = None,
        read_only: bool = False,
        limits: RackLimits | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if not 1 <= n_racks <= R.RACK_MAX:
            raise ValueError(f"n_racks must be in 1..{R.RACK_MAX} (got {n_racks})")
        if first_rack < 0:
            raise ValueError("first_rack must be >= 0")
        super().__init__(bus, unit, name, read_only, clock)
        self.first_rack = int(first_rack)
        self.n_racks = int(n_racks)
        self.limits = limits
        self.heartbeat = 0

    def writable_spans(self) -> list[R.Span]:
        return R.rack_writable_spans(self.n_racks)

    def refusal(self, cols: dict[str, FloatArray], lease_s: float) -> str | None:
        """Why these commands (per-rack arrays of the RACK_COMMAND fields) and lease may not be sent, or None."""
        if not (math.isfinite(lease_s) and lease_s > 0):
            return f"lease_s must be positive (got {lease_s!r})"
        why = R.out_of_range(R.RACK_COMMAND, cols)
        if why is not None:
            return why
        cap, floor = cols["cap_w"], cols["floor_w"]
        if np.any(floor > cap):
            i = int(np.argmax(floor > cap))
            return f"floor {floor[i]:.6g} W above the cap {cap[i]:.6g} W at rack {self.first_rack + i}"
        lim = self.limits
        if lim is None:
            return None
        if lease_s > lim.lease_max_s:
            return f"lease_s {lease_s:g} s above {lim.lease_max_s:g} s"
        out = (cap < lim.cap_min_w) | (cap > lim.cap_max_w)
        if np.any(out):
            i = int(np.argmax(out))
            return (
                f"cap {cap[i]:.6g} W at rack {self.first_rack + i} outside the GPU's settable range "
                f"{lim.cap_min_w:g}..{lim.cap_max_w:g} W"
            )
        over = cols["bbu_recharge_w"] > np.asarray(lim.recharge_max_w, dtype=np.float64)
        if np.any(over):
            i = int(np.argmax(over))
            return f"BBU recharge {cols['bbu_recharge_w'][i]:.6g} W at rack {self.first_rack + i} beyond its rating"
        return None

    @property
    def racks(self) -> slice:
        """The site's racks this device serves."""
        return slice(self.first_rack, self.first_rack + self.n_racks)

    def nan_values(self) -> dict[str, float | FloatArray]:
        out: dict[str, float | FloatArray] = {f.name: np.full(self.n_racks, np.nan) for f in R.RACK_STATUS}
        out |= {"lease_state": math.nan, "update_count": math.nan, "safe_cap_w": math.nan}
        return out

    def check_header(self, hdr: dict[str, float | str | None]) -> None:
        if hdr["magic"] != R.RACK_MAGIC:
            raise R.DecodeError(f"not a {R.RACK_MAGIC} device (magic {hdr['magic']!r})")
        if hdr["version"] != R.RACK_VERSION:
            raise R.DecodeError(f"rack map version {hdr['version']} (this daemon speaks {R.RACK_VERSION})")
        if hdr["n_racks"] != self.n_racks or hdr["first_rack"] != self.first_rack:
            raise R.DecodeError(
                f"device serves {_f(hdr['n_racks']):.0f} racks from {_f(hdr['first_rack']):.0f}, "
                f"configured {self.n_racks} from {self.first_rack}"
            )

    async def _read(self) -> dict[str, float | FloatArray]:
        hdr = RACK_HEADER.decode(await self._get(0, R.RACK_HEADER.length))
        self.check_header(hdr)
        words = await self._get(R.RACK_STATUS_BASE, R.RACK_STATUS_STRIDE * self.n_racks)
        out: dict[str, float | FloatArray] = dict(
            R.decode_records(R.RACK_STATUS, words, self.n_racks, R.RACK_STATUS_STRIDE)
        )
        out |= {k: _f(hdr[k]) for k in ("lease_state", "update_count", "safe_cap_w")}
        return out

    async def write(
        self,
        cap_w: npt.ArrayLike,
        floor_w: npt.ArrayLike,
        bbu_threshold_w: npt.ArrayLike,
        bbu_recharge_w: npt.ArrayLike,
        lease_s: float,
    ) -> None:
        """Write every rack's command record and renew the lease (lease_s, heartbeat + 1) in one span.

        Arrays are (n_racks,) or scalars; bbu_threshold_w may be +inf (backup only). Values outside what the
        device may be told (`refusal`) raise WriteNotAllowed and nothing is sent. The device refuses values out of
        its own range (DeviceRefused, code 3) and applies nothing of a refused request.
        """
        if self.read_only:
            raise DeviceReadOnly("configured read-only: caps not written", unit=self.unit)
        n = self.n_racks
        cols = {}
        for key, v in (
            ("cap_w", cap_w),
            ("floor_w", floor_w),
            ("bbu_threshold_w", bbu_threshold_w),
            ("bbu_recharge_w", bbu_recharge_w),
        ):
            cols[key] = np.broadcast_to(np.asarray(v, dtype=np.float64), (n,))
        why = self.refusal(cols, lease_s)
        if why is not None:
            raise self._refuse(why)
        self.heartbeat = (self.heartbeat + 1) & 0xFFFFFFFF
        try:
            words = R.encode_float32(lease_s) + R.encode_uint32(self.heartbeat)
            words += R.encode_records(R.RACK_COMMAND, cols, n, R.RACK_CMD_STRIDE)
        except R.EncodeError as exc:
            raise DeviceError(f"commands do not fit the rack map: {exc}", unit=self.unit) from None
        await self._put(R.RACK_HEADER.field("lease_s").offset, words)


# -- dimmer-site-v1 ------------------------------------------------------------------------------------------------


class SiteDevice(_Device):
    """The site device (`dimmer-site-v1`), read only.

    Values: arrays "domain_power_w", "domain_limit_w", "domain_thermal_frac" (n_domains,), "job_running" and
    "job_ended" (n_jobs; 1.0 or 0.0 from the job's state, NaN where it is not implemented or out of range); scalars
    "pcc_limit_w", "ramp_limit_w_per_min", "grid_freq_hz", "update_count".
    """

    kind = "site"

    def __init__(
        self,
        bus: RegisterBus,
        unit: int,
        n_domains: int,
        n_jobs: int,
        *,
        name: str | None = None,
        clock: Clock = time.monotonic,
        first_domain: int = 0,
        read: npt.ArrayLike | None = None,
        slots: npt.ArrayLike | None = None,
        width: int | None = None,
    ) -> None:
        if not 1 <= n_domains <= R.SITE_MAX_DOMAINS:
            raise ValueError(f"n_domains must be in 1..{R.SITE_MAX_DOMAINS}")
        if not 0 <= n_jobs <= R.SITE_MAX_JOBS:
            raise ValueError(f"n_jobs must be in 0..{R.SITE_MAX_JOBS}")
        super().__init__(bus, unit, name, True, clock)
        self.n_domains = int(n_domains)  # on this unit: the site's first_domain .. first_domain + n_domains - 1
        self.n_jobs = int(n_jobs)
        self.first_domain = int(first_domain)
        # which of its domains are read (a building daemon reads its own, a coordinator the campus's record, not the
        # thousands of a large site), as runs of consecutive domains, a span each; and where each lands in the
        # arrays returned (`slots` of `width`; by default the domains read, in their order)
        picked = np.arange(self.n_domains) if read is None else np.asarray(read, dtype=np.int64).reshape(-1)
        if picked.size and (picked.min() < 0 or picked.max() >= self.n_domains):
            raise ValueError(f"domains read must be indices in 0..{self.n_domains - 1}")
        self.read_domains = picked
        self.width = picked.size if width is None else int(width)
        self._slots = np.arange(picked.size) if slots is None else np.asarray(slots, dtype=np.int64).reshape(-1)
        if self._slots.shape != picked.shape or (picked.size and self._slots.max() >= self.width):
            raise ValueError("slots: one position in 0..width - 1 for each domain read")
        lo = np.unique(picked)
        breaks = np.flatnonzero(np.diff(lo) != 1) + 1
        self._runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(lo, breaks)] if lo.size else []
        self._order = np.searchsorted(lo, picked)

    def nan_values(self) -> dict[str, float | FloatArray]:
        d = self.width
        out: dict[str, float | FloatArray] = {
            "domain_power_w": np.full(d, np.nan),
            "domain_limit_w": np.full(d, np.nan),
            "domain_thermal_frac": np.full(d, np.nan),
            "job_running": np.full(self.n_jobs, np.nan),
            "job_ended": np.full(self.n_jobs, np.nan),
        }
        return out | dict.fromkeys(("pcc_limit_w", "ramp_limit_w_per_min", "grid_freq_hz", "update_count"), math.nan)

    async def _read(self) -> dict[str, float | FloatArray]:
        words = await self._get(0, R.SITE_JOB_BASE + self.n_jobs)
        hdr = SITE_HEADER.decode(words[: R.SITE_HEADER.length])
        if hdr["magic"] != R.SITE_MAGIC:
            raise R.DecodeError(f"not a {R.SITE_MAGIC} device (magic {hdr['magic']!r})")
        if hdr["version"] != R.SITE_VERSION:
            raise R.DecodeError(f"site map version {hdr['version']} (this daemon speaks {R.SITE_VERSION})")
        first = _f(hdr["first_domain"])
        first = 0.0 if math.isnan(first) else first  # (a device that predates the field serves from domain 0)
        if hdr["n_domains"] != self.n_domains or hdr["n_jobs"] != self.n_jobs or first != self.first_domain:
            raise R.DecodeError(
                f"device has {_f(hdr['n_domains']):.0f} domains from {first:.0f} and {_f(hdr['n_jobs']):.0f} jobs, "
                f"configured {self.n_domains} from {self.first_domain} and {self.n_jobs}"
            )
        state = R.decode_records(R.SITE_JOB, words[R.SITE_JOB_BASE :], self.n_jobs, 1)["state"]
        known = np.isfinite(state)
        words_d: list[int] = []
        for a, b in self._runs:
            words_d += await self._get(R.site_domain_address(a), R.SITE_DOMAIN_STRIDE * (b - a))
        dom = {k: np.full(self.width, np.nan) for k in ("power_w", "limit_w", "thermal_frac")}
        if words_d:
            n = len(words_d) // R.SITE_DOMAIN_STRIDE
            for k, v in R.decode_records(R.SITE_DOMAIN, words_d, n, R.SITE_DOMAIN_STRIDE).items():
                dom[k][self._slots] = v[self._order]
        out: dict[str, float | FloatArray] = {
            "domain_power_w": dom["power_w"],
            "domain_limit_w": dom["limit_w"],
            "domain_thermal_frac": dom["thermal_frac"],
            "job_running": np.where(known, state == R.JOB_RUNNING, np.nan),
            "job_ended": np.where(known, state == R.JOB_ENDED, np.nan),
        }
        out |= {k: _f(hdr[k]) for k in ("pcc_limit_w", "ramp_limit_w_per_min", "grid_freq_hz", "update_count")}
        return out


Device = SunSpecMeter | SunSpecBattery | RackDevice | SiteDevice
