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
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dimmer.daemon import registers as R
from dimmer.daemon.bus import DeviceError, DeviceReadOnly, RegisterBus, WriteNotAllowed

FloatArray = npt.NDArray[np.float64]
Value = float | FloatArray
Clock = Callable[[], float]


@dataclass(frozen=True)
class Reading:
    """One read of one device: `values` (NaN where unknown), the monotonic time `t_s` the read began, `ok`, and
    `error` (None when ok). A failed read has every value NaN."""

    values: dict[str, float | FloatArray]
    t_s: float
    ok: bool
    error: str | None = None
    requests: int = field(default=0, compare=False)

    def array(self, key: str) -> FloatArray:
        """A per-rack / per-domain / per-job value as a float array."""
        return np.asarray(self.values[key], dtype=np.float64)

    def scalar(self, key: str) -> float:
        """A single value as a float (NaN when unknown)."""
        v = self.values[key]
        if isinstance(v, np.ndarray):
            raise TypeError(f"{key} is an array; use Reading.array")
        return float(v)


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, DeviceError | R.RegisterError) else f"{type(exc).__name__}: {exc}"


class _Device:
    kind = "device"

    def __init__(self, bus: RegisterBus, unit: int, name: str | None, read_only: bool, clock: Clock) -> None:
        if not 0 <= unit <= 255:
            raise ValueError(f"unit {unit} outside 0..255")
        self.bus = bus
        self.unit = int(unit)
        self.name = name or f"{self.kind}@{unit}"
        self.read_only = bool(read_only)
        self.clock = clock
        self._requests = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, unit={self.unit})"

    def nan_values(self) -> dict[str, float | FloatArray]:
        """The value keys this device returns, all NaN (what a failed read carries)."""
        raise NotImplementedError

    async def _read(self) -> dict[str, float | FloatArray]:
        raise NotImplementedError

    async def _get(self, address: int, count: int) -> list[int]:
        self._requests += -(-count // 124)
        return await self.bus.read(self.unit, address, count)

    def writable_spans(self) -> list[R.Span]:
        """The [start, stop) register spans this device may be written in (none unless a subclass says so)."""
        return []

    def _refuse(self, why: str, address: int | None = None) -> WriteNotAllowed:
        return WriteNotAllowed(why, endpoint=getattr(self.bus, "endpoint", ""), unit=self.unit, address=address)

    async def _put(self, address: int, words: list[int]) -> None:
        """Every write goes through here: nothing outside the device's writable blocks reaches the wire."""
        if self.read_only:
            raise DeviceReadOnly("configured read-only: not written", unit=self.unit, address=address)
        if not R.span_allowed(self.writable_spans(), address, len(words)):
            raise self._refuse(f"{len(words)} registers outside the writable blocks of its map", address)
        await self.bus.write(self.unit, address, words)

    async def read(self) -> Reading:
        """Read the device; never raises (failures come back as ok=False with NaN values)."""
        t = self.clock()
        self._requests = 0
        try:
            values = await self._read()
        except Exception as exc:  # the contract: a read never raises; the reason travels in `error`
            self._forget()
            return Reading(self.nan_values(), t, False, _describe(exc), self._requests)
        return Reading(values, t, True, None, self._requests)

    def _forget(self) -> None:
        """Drop whatever was learnt about the device layout (it is found again at the next read)."""


# -- SunSpec ---------------------------------------------------------------------------------------------------------


class _SunSpecDevice(_Device):
    def __init__(
        self, bus: RegisterBus, unit: int, base: int | None, name: str | None, read_only: bool, clock: Clock
    ) -> None:
        super().__init__(bus, unit, name, read_only, clock)
        self.base = base
        self.models: dict[int, int] | None = None  # model id -> address of its ID register
        self.lengths: dict[int, int] = {}
        self.identity: dict[str, str | None] = {}

    def _forget(self) -> None:
        self.models = None

    async def discover(self) -> dict[int, int]:
        """Find the "SunS" marker and walk the model chain; read the common model (Mn, Md, SN)."""
        bases = (self.base,) if self.base is not None else R.SUNSPEC_BASES
        found: int | None = None
        errors: list[str] = []
        for b in bases:
            try:
                R.check_suns(await self._get(b, 2))
                found = b
                break
            except (DeviceError, R.DecodeError) as exc:
                if self.base is not None:
                    raise
                errors.append(f"{b}: {_describe(exc)}")
        if found is None:
            raise R.DecodeError(f"no SunSpec marker at {', '.join(errors)}")
        models: dict[int, int] = {}
        at = found + 2
        for _ in range(64):  # a chain of more models than this is not a device we know
            hdr = R.model_header(await self._get(at, 2))
            if hdr is None:
                break
            mid, length = hdr
            models.setdefault(mid, at)
            self.lengths.setdefault(mid, length)
            at += 2 + length
            if at > 0xFFFF:
                raise R.DecodeError("SunSpec model chain runs past the register space")
        if 1 in models:
            common = R.decode_block(R.MODEL_1, await self._get(models[1], R.MODEL_1.length), 0)
            self.identity = {k: common[k] for k in ("Mn", "Md", "SN")}  # type: ignore[misc]
        self.models = models
        await self._discovered()
        return models

    async def _discovered(self) -> None:
        """Check the models this device needs are there."""

    async def _model(self, block: R.Block, stop: int | None = None) -> dict[str, float | str | None]:
        """Read one model from its ID register up to `stop` (offset) and decode it; DecodeError if the id moved."""
        assert self.models is not None and block.model_id is not None
        at = self.models[block.model_id]
        n = stop if stop is not None else block.span[1]
        words = await self._get(at, n)
        if words[0] != block.model_id:
            raise R.DecodeError(f"model {block.model_id} expected at {at}, found id {words[0]}")
        return R.decode_block(block, words, 0, partial=stop is not None)


def _f(x: float | str | None) -> float:
    return float(x) if isinstance(x, int | float) else math.nan


class SunSpecMeter(_SunSpecDevice):
    """A SunSpec AC meter (model 203, or 213 float): {"power_w" (+ = import), "freq_hz"}. One request a read."""

    kind = "sunspec-meter"

    def __init__(
        self,
        bus: RegisterBus,
        unit: int,
        base: int | None = 40000,
        *,
        name: str | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(bus, unit, base, name, True, clock)

    def nan_values(self) -> dict[str, float | FloatArray]:
        return {"power_w": math.nan, "freq_hz": math.nan}

    async def _discovered(self) -> None:
        assert self.models is not None
        if 203 not in self.models and 213 not in self.models:
            raise R.DecodeError(f"no meter model (203 or 213) among {sorted(self.models)}")

    async def _read(self) -> dict[str, float | FloatArray]:
        if self.models is None:
            await self.discover()
        assert self.models is not None
        if 203 in self.models:
            v = await self._model(R.MODEL_203, 23)  # ID .. W_SF
        else:
            v = await self._model(R.MODEL_213, 30)  # ID .. W
        return {"power_w": _f(v["W"]), "freq_hz": _f(v["Hz"])}


class SunSpecBattery(_SunSpecDevice):
    """A SunSpec storage system: models 701 (AC power, state), 704 (setpoint), 802 (SoC, rate limits, heartbeat)
    — 713 is read for the SoC when 802 is absent.

    Values: "power_w" (+ = discharging into the campus), "soc_frac", "max_charge_w", "max_discharge_w",
    "online" (1.0 when 802 State is CONNECTED and 701 ConnSt is CONNECTED), "setpoint_revert_s" (704 time left).
    """

    kind = "sunspec-battery"

    def __init__(
        self,
        bus: RegisterBus,
        unit: int,
        base: int | None = 40000,
        *,
        name: str | None = None,
        read_only: bool = False,
        max_power_w: float | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(bus, unit, base, name, read_only, clock)
        if max_power_w is not None and not (math.isfinite(max_power_w) and max_power_w >= 0):
            raise ValueError(f"max_power_w must be a non-negative number (got {max_power_w!r})")
        self.max_power_w = max_power_w  # the battery's rating: no setpoint beyond it is sent
        self.heartbeat = 0
        self.wset_sf: int | None = None

    def writable_spans(self) -> list[R.Span]:
        """704 WSetEna .. WSetRvrtTms and 802 CtrlHb, where discovery found them (nothing before discovery)."""
        if self.models is None:
            return []
        spans: list[R.Span] = []
        for block in (R.MODEL_704, R.MODEL_802):
            if block.model_id in self.models:
                spans += R.writable_spans(block, self.models[block.model_id or 0])
        return spans

    def nan_values(self) -> dict[str, float | FloatArray]:
        keys = ("power_w", "soc_frac", "max_charge_w", "max_discharge_w", "online", "setpoint_revert_s")
        return dict.fromkeys(keys, math.nan)

    async def _discovered(self) -> None:
        assert self.models is not None
        if 701 not in self.models:
            raise R.DecodeError(f"no DER measurement model 701 among {sorted(self.models)}")
        if 802 not in self.models and 713 not in self.models:
            raise R.DecodeError(f"no battery model (802 or 713) among {sorted(self.models)}")

    async def _read(self) -> dict[str, float | FloatArray]:
        if self.models is None:
            await self.discover()
        assert self.models is not None
        m701 = await self._model(R.MODEL_701)
        out = self.nan_values()
        out["power_w"] = _f(m701["W"])
        conn = _f(m701["ConnSt"])
        if 802 in self.models:
            m802 = await self._model(R.MODEL_802)
            out["soc_frac"] = _f(m802["SoC"]) / 100.0
            out["max_charge_w"] = _f(m802["WChaRteMax"])
            out["max_discharge_w"] = _f(m802["WDisChaRteMax"])
            state = _f(m802["State"])
            if math.isnan(state):  # the battery does not say: the inverter's grid connection decides
                out["online"] = math.nan if math.isnan(conn) else float(conn == 2.0)
            else:
                out["online"] = float(state == R.BATTERY_CONNECTED and conn != 1.0)
        else:
            m713 = await self._model(R.MODEL_713)
            out["soc_frac"] = _f(m713["SoC"]) / 100.0
            out["online"] = math.nan if math.isnan(conn) else float(conn == 2.0)
        if 704 in self.models:
            m704 = await self._model(R.MODEL_704, 37)  # ID .. WSetRvrtRem
            out["setpoint_revert_s"] = _f(m704["WSetRvrtRem"])
        return out

    async def write_setpoint(self, power_w: float, revert_s: float) -> None:
        """Set the active power (+ = discharge) through model 704 (WSetEna, WSetMod = watts, WSet, reversion to
        0 W after `revert_s` without a new write), then bump the controller heartbeat (802 CtrlHb)."""
        if self.read_only:
            raise DeviceReadOnly("configured read-only: setpoint not written", unit=self.unit)
        if not math.isfinite(power_w):
            raise self._refuse(f"setpoint must be finite (got {power_w!r})")
        if self.max_power_w is not None and abs(power_w) > self.max_power_w * (1 + 1e-9):
            raise self._refuse(f"setpoint {power_w:.6g} W beyond the battery's rating of ±{self.max_power_w:.6g} W")
        if not (math.isfinite(revert_s) and 0 < revert_s < 2**32 - 1):
            raise self._refuse(f"revert_s must be positive (got {revert_s!r})")
        if self.models is None:
            await self.discover()
        assert self.models is not None
        if 704 not in self.models:
            raise DeviceError(f"no DER controls model 704 among {sorted(self.models)}", unit=self.unit)
        at = self.models[704]
        if self.wset_sf is None:
            words = await self._get(at + 59, 1)
            self.wset_sf = R.decode_sf(words[0])
        sf = 0 if self.wset_sf is None else self.wset_sf
        values: dict[str, float | str | int | None] = {
            "WSetEna": 1,
            "WSetMod": R.WSET_MOD_WATTS,
            "WSet": power_w,
            "WSetRvrt": 0.0,
            "WSetPct": None,
            "WSetPctRvrt": None,
            "WSetRvrtEna": 1,
            "WSetRvrtTms": math.ceil(revert_s),
            "WSet_SF": sf,
        }
        try:
            block = R.encode_block(R.MODEL_704, values)
        except R.EncodeError as exc:
            raise DeviceError(f"setpoint {power_w:.6g} W does not fit the device's registers: {exc}") from None
        await self._put(at + 22, block[22:35])
        if 802 in self.models:
            self.heartbeat = (self.heartbeat + 1) & 0xFFFF
            await self._put(self.models[802] + 19, [self.heartbeat])


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
        hdr = R.decode_block(R.RACK_HEADER, await self._get(0, R.RACK_HEADER.length))
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

    Values: arrays "domain_power_w", "domain_limit_w", "domain_thermal_frac" (n_domains,) and "job_running"
    (n_jobs,); scalars "pcc_limit_w", "ramp_limit_w_per_min", "grid_freq_hz", "update_count".
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
    ) -> None:
        if not 1 <= n_domains <= R.SITE_MAX_DOMAINS:
            raise ValueError(f"n_domains must be in 1..{R.SITE_MAX_DOMAINS}")
        if not 0 <= n_jobs <= R.SITE_MAX_JOBS:
            raise ValueError(f"n_jobs must be in 0..{R.SITE_MAX_JOBS}")
        super().__init__(bus, unit, name, True, clock)
        self.n_domains = int(n_domains)
        self.n_jobs = int(n_jobs)

    def nan_values(self) -> dict[str, float | FloatArray]:
        d = self.n_domains
        out: dict[str, float | FloatArray] = {
            "domain_power_w": np.full(d, np.nan),
            "domain_limit_w": np.full(d, np.nan),
            "domain_thermal_frac": np.full(d, np.nan),
            "job_running": np.full(self.n_jobs, np.nan),
        }
        return out | dict.fromkeys(("pcc_limit_w", "ramp_limit_w_per_min", "grid_freq_hz", "update_count"), math.nan)

    async def _read(self) -> dict[str, float | FloatArray]:
        words = await self._get(0, R.SITE_JOB_BASE + self.n_jobs)
        hdr = R.decode_block(R.SITE_HEADER, words[: R.SITE_HEADER.length])
        if hdr["magic"] != R.SITE_MAGIC:
            raise R.DecodeError(f"not a {R.SITE_MAGIC} device (magic {hdr['magic']!r})")
        if hdr["version"] != R.SITE_VERSION:
            raise R.DecodeError(f"site map version {hdr['version']} (this daemon speaks {R.SITE_VERSION})")
        if hdr["n_domains"] != self.n_domains or hdr["n_jobs"] != self.n_jobs:
            raise R.DecodeError(
                f"device has {_f(hdr['n_domains']):.0f} domains and {_f(hdr['n_jobs']):.0f} jobs, "
                f"configured {self.n_domains} and {self.n_jobs}"
            )
        jobs = R.decode_records(R.SITE_JOB, words[R.SITE_JOB_BASE :], self.n_jobs, 1)["running"]
        dom = R.decode_records(
            R.SITE_DOMAIN,
            await self._get(R.SITE_DOMAIN_BASE, R.SITE_DOMAIN_STRIDE * self.n_domains),
            self.n_domains,
            R.SITE_DOMAIN_STRIDE,
        )
        out: dict[str, float | FloatArray] = {
            "domain_power_w": dom["power_w"],
            "domain_limit_w": dom["limit_w"],
            "domain_thermal_frac": dom["thermal_frac"],
            "job_running": jobs,
        }
        out |= {k: _f(hdr[k]) for k in ("pcc_limit_w", "ramp_limit_w_per_min", "grid_freq_hz", "update_count")}
        return out


Device = SunSpecMeter | SunSpecBattery | RackDevice | SiteDevice
