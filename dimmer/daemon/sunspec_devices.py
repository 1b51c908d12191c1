"""SunSpec meters and batteries on a register bus, driven through the published model definitions.

Every offset, type, scale factor and enum value comes from `dimmer.daemon.registers.sunspec` (pysunspec2's
bundled definitions); nothing here is a number typed from a document.

- Discovery: the "SunS" marker at the configured base, or at 40000, 0 and 50000 in that order when none is
  configured; then the model chain. A model we speak whose length L differs from its published definition is not
  read at all (its points would land on the wrong registers: the 2020 draft of 704 had L = 69, the published
  one 65) — the device is refused with the two lengths named.
- Meters: 201-204 (int16 + scale factors) or 211-214 (float32); `W` (+ = import) and `Hz`. One request a read.
- Batteries: 701 (W, + = injecting = discharging; St, ConnSt), 802 (SoC, nameplate rates, State, Hb), 713 or 124
  for the SoC where 802 is absent, 704 for the setpoint (124 where 704 is absent).
- Writes touch only writable points, one contiguous writable span a request (the base class refuses anything
  else before it is sent), and are read back: a device that stored something else raises `DeviceError`.
  Through 704: [WSetEna, WSetMod = WATTS, WSet, WSetRvrt = 0 W] and [WSetEnaRvrt = ENABLED, WSetRvrtTms], so the
  battery reverts to 0 W by itself `revert_s` after the last write. Through 124: StorCtl_Mod (both limits on),
  [OutWRte, InWRte, InOutWRte_WinTms = 0, InOutWRte_RvrtTms]: the charge and discharge limits pinned to the
  setpoint as a percentage of WChaMax, reverting to the device's own limits after the timeout. 802 CtrlHb, the
  controller heartbeat, is bumped after every setpoint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from dimmer.daemon import registers as R
from dimmer.daemon.bus import DeviceError, DeviceReadOnly, DeviceRefused, RegisterBus
from dimmer.daemon.device_base import BusDevice, Clock, FloatArray, describe
from dimmer.daemon.device_base import as_float as _f

M701, M704, M713, M124, M802 = (R.model(m) for m in (701, 704, 713, 124, 802))
ST_ON = R.symbol(701, "St", "ON")
CONN_CONNECTED = R.symbol(701, "ConnSt", "CONNECTED")
CONN_DISCONNECTED = R.symbol(701, "ConnSt", "DISCONNECTED")
STATE_CONNECTED = R.symbol(802, "State", "CONNECTED")
ENABLED = R.symbol(704, "WSetEna", "ENABLED")
WSET_MOD_WATTS = R.symbol(704, "WSetMod", "WATTS")
ENA_RVRT_ENABLED = R.symbol(704, "WSetEnaRvrt", "ENABLED")
# 704: the two writable spans a setpoint is written in, from WSetEna and from WSetEnaRvrt
SETPOINT_POINTS = ("WSetEna", "WSetMod", "WSet", "WSetRvrt")
REVERT_POINTS = ("WSetEnaRvrt", "WSetRvrtTms")
RATE_POINTS = ("OutWRte", "InWRte", "InOutWRte_WinTms", "InOutWRte_RvrtTms")


def _bit(model_id: int, point: str, name: str) -> int:
    # bitfield symbols are bit numbers; the definitions spell some names oddly (124: "DiSCHARGE"), so match any case
    for s, v in R.model(model_id).field(point).symbols:
        if s.lower() == name.lower():
            return 1 << v
    raise KeyError(f"{model_id} {point}: no bit {name}")


STORCTL_BOTH = _bit(124, "StorCtl_Mod", "CHARGE") | _bit(124, "StorCtl_Mod", "DISCHARGE")


@dataclass(frozen=True)
class BatteryWrite:
    """What one setpoint write sent: the model it went through, the scale factor used, every request's address and
    raw words, and whether the device's registers read back as written. `as_audit()` is its audit-log form."""

    power_w: float
    model: int
    scale_factor: int | None
    requests: tuple[tuple[int, tuple[int, ...]], ...]
    read_back: bool

    def as_audit(self) -> dict[str, object]:
        return {
            "power_w": self.power_w,
            "model": self.model,
            "scale_factor": self.scale_factor,
            "requests": [{"address": a, "words": list(w)} for a, w in self.requests],
            "read_back": self.read_back,
        }


class SunSpecDevice(BusDevice):
    """Discovery and model reads shared by meters and batteries."""

    def __init__(
        self, bus: RegisterBus, unit: int, base: int | None, name: str | None, read_only: bool, clock: Clock
    ) -> None:
        super().__init__(bus, unit, name, read_only, clock)
        if base is not None and not 0 <= base <= 0xFFFF - 4:
            raise ValueError(f"base {base} outside 0..65531")
        self.base = base
        self.found_base: int | None = None
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
                errors.append(f"{b}: {describe(exc)}")
        if found is None:
            raise R.DecodeError(f"no SunSpec marker at {', '.join(errors)}")
        models: dict[int, int] = {}
        lengths: dict[int, int] = {}
        at = found + 2
        for _ in range(64):  # a chain of more models than this is not a device we know
            hdr = R.model_header(await self._get(at, 2))
            if hdr is None:
                break
            mid, length = hdr
            if mid not in models:
                models[mid], lengths[mid] = at, length
            at += 2 + length
            if at > 0xFFFF:
                raise R.DecodeError("SunSpec model chain runs past the register space")
        for mid in set(models) & set(self.needs()):
            if lengths[mid] != R.model_length(mid):
                raise R.DecodeError(
                    f"model {mid} has L = {lengths[mid]}, its published definition L = {R.model_length(mid)} "
                    f"(pysunspec2 {R.pysunspec2_version()}): not a layout we can read"
                )
        self.lengths = lengths
        if 1 in models and lengths[1] == R.model_length(1):
            common = R.decode_block(R.MODEL_1, await self._get(models[1], R.MODEL_1.length), 0)
            self.identity = {k: common[k] for k in ("Mn", "Md", "SN")}  # type: ignore[misc]
        self.models = models
        self.found_base = found
        self._discovered()
        return models

    def needs(self) -> tuple[int, ...]:
        """The models this device reads or writes (their lengths are checked against the definitions)."""
        return ()

    def _discovered(self) -> None:
        """Check the models this device needs are there."""

    async def _model(self, block: R.Block, *points: str) -> dict[str, float | str | None]:
        """Read one model from its ID register through the points named (all of it when none) and decode them;
        DecodeError if the model id moved."""
        assert self.models is not None and block.model_id is not None
        at = self.models[block.model_id]
        n = block.stop(*points) if points else block.length
        words = await self._get(at, n)
        if words[0] != block.model_id:
            raise R.DecodeError(f"model {block.model_id} expected at {at}, found id {words[0]}")
        return R.decode_block(block, words, 0, partial=True)


class SunSpecMeter(SunSpecDevice):
    """A SunSpec AC meter (201-204, or 211-214 float): {"power_w" (+ = import), "freq_hz"}. One request a read."""

    kind = "sunspec-meter"

    def __init__(
        self,
        bus: RegisterBus,
        unit: int,
        base: int | None = None,
        *,
        name: str | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(bus, unit, base, name, True, clock)

    def nan_values(self) -> dict[str, float | FloatArray]:
        return {"power_w": math.nan, "freq_hz": math.nan}

    def needs(self) -> tuple[int, ...]:
        return R.METERS_INT + R.METERS_FLOAT

    def meter_model(self) -> int:
        assert self.models is not None
        return next(m for m in self.needs() if m in self.models)

    def _discovered(self) -> None:
        assert self.models is not None
        if not set(self.needs()) & set(self.models):
            raise R.DecodeError(f"no meter model (201-204 or 211-214) among {sorted(self.models)}")

    async def _read(self) -> dict[str, float | FloatArray]:
        if self.models is None:
            await self.discover()
        v = await self._model(R.model(self.meter_model()), "W", "Hz")
        return {"power_w": _f(v["W"]), "freq_hz": _f(v["Hz"])}


def _pct(x: float) -> float:
    return x / 100.0 if math.isfinite(x) and 0.0 <= x <= 100.0 else math.nan


class SunSpecBattery(SunSpecDevice):
    """A SunSpec storage system: 701 (AC power, state), 802 (SoC, rate limits, heartbeat) or else 713 / 124 (SoC),
    and 704 (or else 124) for the setpoint.

    Values: "power_w" (+ = discharging into the campus), "soc_frac", "max_charge_w", "max_discharge_w",
    "online" (1.0 when 802 State is CONNECTED, 701 ConnSt is not DISCONNECTED and 701 St is not OFF; without 802,
    when 701 ConnSt is CONNECTED), "setpoint_revert_s" (the reversion time left), "update_count" (802 Hb, the
    battery's own heartbeat: the daemon treats a battery whose Hb stops moving as stale, like any device whose
    update counter stops; NaN where the battery has no Hb).
    """

    kind = "sunspec-battery"

    def __init__(
        self,
        bus: RegisterBus,
        unit: int,
        base: int | None = None,
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
        self.last_write: BatteryWrite | None = None

    def needs(self) -> tuple[int, ...]:
        return (701, 704, 713, 124, 802)

    def writable_spans(self) -> list[R.Span]:
        """The writable points of 704, 124 and 802 where discovery found them (nothing before discovery)."""
        if self.models is None:
            return []
        spans: list[R.Span] = []
        for block in (M704, M124, M802):
            if block.model_id in self.models:
                spans += R.writable_spans(block, self.models[block.model_id or 0])
        return spans

    def nan_values(self) -> dict[str, float | FloatArray]:
        keys = ("power_w", "soc_frac", "max_charge_w", "max_discharge_w", "online", "setpoint_revert_s", "update_count")
        return dict.fromkeys(keys, math.nan)

    def _discovered(self) -> None:
        assert self.models is not None
        if 701 not in self.models:
            raise R.DecodeError(f"no DER measurement model 701 among {sorted(self.models)}")
        if not {802, 713, 124} & set(self.models):
            raise R.DecodeError(f"no storage model (802, 713 or 124) among {sorted(self.models)}")

    async def _read(self) -> dict[str, float | FloatArray]:
        if self.models is None:
            await self.discover()
        assert self.models is not None
        m701 = await self._model(M701, "St", "ConnSt", "W", "Hz")
        out = self.nan_values()
        out["power_w"] = _f(m701["W"])
        conn, st = _f(m701["ConnSt"]), _f(m701["St"])
        conn_online = math.nan if math.isnan(conn) else float(conn == CONN_CONNECTED)
        if 802 in self.models:
            m802 = await self._model(M802)
            out["soc_frac"] = _pct(_f(m802["SoC"]))
            out["max_charge_w"] = _f(m802["WChaRteMax"])
            out["max_discharge_w"] = _f(m802["WDisChaRteMax"])
            out["update_count"] = _f(m802["Hb"])
            state = _f(m802["State"])
            if math.isnan(state):  # the battery does not say: the inverter's grid connection decides
                out["online"] = conn_online
            else:
                out["online"] = float(state == STATE_CONNECTED and conn != CONN_DISCONNECTED and st != 0.0)
        else:
            if 713 in self.models:
                out["soc_frac"] = _pct(_f((await self._model(M713, "SoC"))["SoC"]))
            out["online"] = conn_online
        if 704 in self.models:
            m704 = await self._model(M704, "WSetRvrtRem")
            out["setpoint_revert_s"] = _f(m704["WSetRvrtRem"])
        elif 124 in self.models:
            m124 = await self._model(M124)
            if math.isnan(float(out["soc_frac"])):
                out["soc_frac"] = _pct(_f(m124["ChaState"]))
            wmax = _f(m124["WChaMax"])
            if math.isnan(float(out["max_charge_w"])):
                out["max_charge_w"] = out["max_discharge_w"] = wmax
        return out

    async def write_setpoint(self, power_w: float, revert_s: float) -> BatteryWrite:
        """Set the active power (+ = discharge) through 704 (or 124), with a reversion timer of `revert_s`, then
        bump the controller heartbeat (802 CtrlHb). Returns what was sent; DeviceError if it was not stored."""
        if self.read_only:
            raise self._read_only()
        if not math.isfinite(power_w):
            raise self._refuse(f"setpoint must be finite (got {power_w!r})")
        if self.max_power_w is not None and abs(power_w) > self.max_power_w * (1 + 1e-9):
            raise self._refuse(f"setpoint {power_w:.6g} W beyond the battery's rating of ±{self.max_power_w:.6g} W")
        if not (math.isfinite(revert_s) and 0 < revert_s < 2**32 - 1):
            raise self._refuse(f"revert_s must be a positive number of seconds (got {revert_s!r})")
        if self.models is None:
            await self.discover()
        assert self.models is not None
        if 704 in self.models:
            w = await self._write_704(power_w, math.ceil(revert_s))
        elif 124 in self.models:
            if revert_s > 0xFFFE:  # InOutWRte_RvrtTms is a uint16
                raise self._refuse(f"revert_s {revert_s:g} s beyond what model 124 can hold (65534 s)")
            w = await self._write_124(power_w, math.ceil(revert_s))
        else:
            raise DeviceError(f"no control model (704 or 124) among {sorted(self.models)}", unit=self.unit)
        if 802 in self.models:
            self.heartbeat = (self.heartbeat + 1) & 0xFFFF
            await self._put(self.models[802] + M802.offset("CtrlHb"), [self.heartbeat])
        self.last_write = w
        return w

    def _read_only(self) -> DeviceError:
        return DeviceReadOnly("configured read-only: setpoint not written", unit=self.unit)

    async def _scale(self, block: R.Block, sf_point: str) -> int:
        assert self.models is not None and block.model_id is not None
        (word,) = await self._get(self.models[block.model_id] + block.offset(sf_point), 1)
        sf = R.decode_sf(word)
        if sf is None:
            raise DeviceError(
                f"{sf_point} not implemented (0x{word:04X}): the setpoint cannot be scaled", unit=self.unit
            )
        return sf

    async def _send(
        self, power_w: float, block: R.Block, values: R.Values, spans: tuple[tuple[str, ...], ...], sf: int
    ) -> BatteryWrite:
        """Encode `values`, write each span of points as one request, read every span back."""
        assert self.models is not None and block.model_id is not None
        at = self.models[block.model_id]
        try:
            words = R.encode_block(block, values)
        except R.EncodeError as exc:
            raise DeviceError(f"setpoint does not fit the device's registers: {exc}", unit=self.unit) from None
        requests: list[tuple[int, tuple[int, ...]]] = []
        for names in spans:
            last = block.field(names[-1])
            a, b = block.offset(names[0]), last.offset + last.n
            requests.append((at + a, tuple(words[a:b])))
        for address, chunk in requests:
            await self._put(address, list(chunk))
        read_back = True
        for address, chunk in requests:
            try:
                got = tuple(await self._get(address, len(chunk)))
            except DeviceRefused:  # a device that does not allow reading its controls back
                read_back = False
                continue
            if got != chunk:
                raise DeviceError(
                    f"model {block.model_id} at {address}: wrote {list(chunk)}, read back {list(got)}", unit=self.unit
                )
        return BatteryWrite(power_w, block.model_id, sf, tuple(requests), read_back)

    async def _write_704(self, power_w: float, revert_s: int) -> BatteryWrite:
        sf = await self._scale(M704, "WSet_SF")
        values: dict[str, float | str | int | None] = {
            "WSetEna": ENABLED,
            "WSetMod": WSET_MOD_WATTS,
            "WSet": power_w,
            "WSetRvrt": 0.0,
            "WSet_SF": sf,
            "WSetEnaRvrt": ENA_RVRT_ENABLED,
            "WSetRvrtTms": revert_s,
        }
        return await self._send(power_w, M704, values, (REVERT_POINTS, SETPOINT_POINTS), sf)

    async def _write_124(self, power_w: float, revert_s: int) -> BatteryWrite:
        assert self.models is not None
        m124 = await self._model(M124)
        wmax = _f(m124["WChaMax"])
        if not (math.isfinite(wmax) and wmax > 0):
            raise DeviceError(f"124 WChaMax is {wmax!r}: no reference for a rate setpoint", unit=self.unit)
        sf = await self._scale(M124, "InOutWRte_SF")
        pct = min(abs(power_w) / wmax * 100.0, 100.0)
        # pinning the window [-InWRte, OutWRte] to one value holds the battery there: discharge at pct of WChaMax
        # (OutWRte = pct, InWRte = -pct) or charge (InWRte = pct, OutWRte = -pct)
        out_pct = pct if power_w >= 0 else -pct
        values: dict[str, float | str | int | None] = {
            "StorCtl_Mod": STORCTL_BOTH,
            "OutWRte": out_pct,
            "InWRte": -out_pct,
            "InOutWRte_WinTms": 0,
            "InOutWRte_RvrtTms": revert_s,
            "InOutWRte_SF": sf,
        }
        return await self._send(power_w, M124, values, (("StorCtl_Mod",), RATE_POINTS), sf)
