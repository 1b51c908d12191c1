"""A SunSpec meter and battery built directly from pysunspec2's model objects, served over Modbus TCP on loopback.

Nothing here uses dimmer's codecs: the register image is what pysunspec2's `Model.get_mb()` lays out from the
published definitions, written points are decoded by pysunspec2 (`Point.cvalue`), enum values are looked up in
pysunspec2's point definitions, and writes are accepted only where those definitions say RW. The battery follows
704 (or 124) the way the standard describes: the setpoint while it is enabled, the reversion value once the
reversion time has passed without a write. Tests drive it with the daemon's client and check what the *device*
understood.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sunspec2 import device as sunspec_device

from tests.sunspec_reference import points, to_bytes, to_words

END = (0xFFFF, 0)


def sym(p: Any, name: str) -> int:
    """The value of symbol `name` of a pysunspec2 point, from its definition."""
    for s in p.pdef.get("symbols", []):
        if s["name"].lower() == name.lower():
            return int(s["value"])
    raise KeyError(name)


def new_model(model_id: int, values: dict[str, Any]) -> Any:
    """A pysunspec2 model with raw point values set (scale factors included); everything else not implemented."""
    m = sunspec_device.Model(model_id=model_id)
    flat = dict(points(m))
    for name, v in values.items():
        flat[name].value = v
    return m


@dataclass
class DeviceWrite:
    t_s: float
    address: int
    words: list[int]
    refused: int | None


class PysunspecDevice:
    """A chain of pysunspec2 models at `base`, served as unit `unit` by a pymodbus TCP server on loopback."""

    def __init__(
        self, models: list[Any], base: int = 40000, unit: int = 1, clock: Callable[[], float] = time.monotonic
    ):
        self.base, self.unit, self.clock = base, unit, clock
        self.models = models
        data = b"SunS"
        self.model_at: dict[int, int] = {}
        self.writable: set[int] = set()
        for m in models:
            at = base + len(data) // 2
            self.model_at[m.model_id] = at
            for _, p in points(m):
                if p.pdef.get("access") == "RW":
                    self.writable.update(range(at + p.offset, at + p.offset + p.len))
            data += m.get_mb()
        data += struct.pack(">2H", *END)
        self.words = to_words(data)
        self.writes: list[DeviceWrite] = []
        self._server: Any = None

    def model(self, model_id: int) -> Any:
        """The model as pysunspec2 reads it from the device's registers now."""
        at = self.model_at[model_id] - self.base
        n = next(m.len for m in self.models if m.model_id == model_id)
        return sunspec_device.Model(model_id=model_id, model_len=n - 2, data=to_bytes(self.words[at : at + n]))

    def point(self, model_id: int, name: str) -> Any:
        return dict(points(self.model(model_id)))[name]

    def set_point(self, model_id: int, name: str, raw: int) -> None:
        p = self.point(model_id, name)
        at = self.model_at[model_id] - self.base + p.offset
        self.words[at : at + p.len] = to_words(p.info.to_data(raw, p.len * 2))

    def on_write(self, address: int, words: list[int]) -> int | None:
        """Store a write if every register it covers is writable; the Modbus exception code otherwise."""
        if not all(a in self.writable for a in range(address, address + len(words))):
            return 2
        at = address - self.base
        self.words[at : at + len(words)] = words
        return None

    async def start(self) -> int:
        from pymodbus.constants import ExcCodes
        from pymodbus.server import ModbusTcpServer
        from pymodbus.simulator import DataType, SimData, SimDevice

        async def action(fc: int, start: int, address: int, count: int, regs: list[int], values: Any = None) -> Any:
            off = address - start
            if values is None:
                self.refresh()
                regs[off : off + count] = self.words[address - self.base : address - self.base + count]
                return None
            words = [int(v) for v in values]
            code = self.on_write(address, words)
            self.writes.append(DeviceWrite(self.clock(), address, words, code))
            return ExcCodes(code) if code else None

        data = SimData(self.base, count=len(self.words), values=0, datatype=DataType.REGISTERS)
        self._server = ModbusTcpServer([SimDevice(self.unit, simdata=[data], action=action)], address=("127.0.0.1", 0))
        await self._server.serve_forever(background=True)
        return int(self._server.transport.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.shutdown()
            self._server = None

    def refresh(self) -> None:
        """Update what the device computes on its own before a read (subclasses)."""


class PysunspecBattery(PysunspecDevice):
    """A storage system: 1, 701, 802 and 704 (control="704") or 124 (control="124"), laid out by pysunspec2.

    `setpoint_w()` is the active power the device holds now (+ = discharge), as the standard says it must read
    what was written: 704 WSetEna ENABLED and WSetMod WATTS -> WSet (x 10^WSet_SF), reverting to WSetRvrt (or off)
    WSetRvrtTms seconds after the last write; 124 -> the window [-InWRte, OutWRte] of WChaMax, reverting to no
    limit (the device's own mode: here idle) after InOutWRte_RvrtTms.
    """

    def __init__(
        self,
        control: str = "704",
        *,
        base: int = 40000,
        unit: int = 2,
        soc_raw: int = 612,
        soc_sf: int = -1,
        w_raw: int = -1500,
        w_sf: int = 3,
        wset_sf: int = 1,
        rating_w: float = 500e3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.control = control
        self.rating_w = rating_w
        common = new_model(1, {"Mn": "pysunspec2-built", "Md": "battery", "SN": "t-1"})
        m701 = sunspec_device.Model(model_id=701)
        pts = dict(points(m701))
        for name, v in {"ACType": sym(pts["ACType"], "THREE_PHASE"), "St": sym(pts["St"], "ON"),
                        "ConnSt": sym(pts["ConnSt"], "CONNECTED"), "W": w_raw, "W_SF": w_sf}.items():  # fmt: skip
            pts[name].value = v
        m802 = sunspec_device.Model(model_id=802)
        p802 = dict(points(m802))
        rate_raw = int(rating_w / 1e3)
        for name, v in {"AHRtg": 600, "AHRtg_SF": 0, "WHRtg": 250, "WHRtg_SF": 3, "WChaRteMax": rate_raw,
                        "WDisChaRteMax": rate_raw, "WChaDisChaMax_SF": 3, "SoC": soc_raw, "SoC_SF": soc_sf,
                        "State": sym(p802["State"], "CONNECTED"), "LocRemCtl": sym(p802["LocRemCtl"], "REMOTE"),
                        "Typ": sym(p802["Typ"], "LITHIUM_ION"), "V": 800, "V_SF": 0, "A": 0, "A_SF": 0,
                        "W": w_raw, "W_SF": w_sf, "CtrlHb": 0, "Hb": 0}.items():  # fmt: skip
            p802[name].value = v
        if control == "704":
            m704 = sunspec_device.Model(model_id=704)
            p704 = dict(points(m704))
            for name, v in {"WSetEna": sym(p704["WSetEna"], "DISABLED"), "WSetMod": sym(p704["WSetMod"], "WATTS"),
                            "WSet": 0, "WSetRvrt": 0, "WSetEnaRvrt": sym(p704["WSetEnaRvrt"], "DISABLED"),
                            "WSetRvrtTms": 0, "WSetRvrtRem": 0, "WSet_SF": wset_sf}.items():  # fmt: skip
                p704[name].value = v
            ctl = m704
        else:
            m124 = sunspec_device.Model(model_id=124)
            p124 = dict(points(m124))
            for name, v in {"WChaMax": rate_raw, "WChaMax_SF": 3, "WChaGra": 100, "WDisChaGra": 100,
                            "WChaDisChaGra_SF": 0, "StorCtl_Mod": 0, "OutWRte": 10000, "InWRte": 10000,
                            "InOutWRte_SF": -2, "InOutWRte_RvrtTms": 0, "InOutWRte_WinTms": 0}.items():  # fmt: skip
                p124[name].value = v
            ctl = m124
        super().__init__([common, m701, ctl, m802], base=base, unit=unit, clock=clock)
        self.last_setpoint_write_s = -math.inf
        self.started_s = clock()

    def on_write(self, address: int, words: list[int]) -> int | None:
        code = super().on_write(address, words)
        ctl = 704 if self.control == "704" else 124
        if code is None:
            at = self.model_at[ctl]
            n = next(m.len for m in self.models if m.model_id == ctl)
            if address < at + n and address + len(words) > at:  # any write to the controls restarts the timer
                self.last_setpoint_write_s = self.clock()
        return code

    def _reverted(self, tms: Any) -> bool:
        t = tms.value
        return t is not None and t > 0 and self.clock() - self.last_setpoint_write_s > t

    def setpoint_w(self) -> float:
        if self.control == "704":
            p = dict(points(self.model(704)))
            if self._reverted(p["WSetRvrtTms"]):
                enabled = p["WSetEnaRvrt"].value == sym(p["WSetEnaRvrt"], "ENABLED")
                return float(p["WSetRvrt"].cvalue or 0.0) if enabled else 0.0
            if p["WSetEna"].value != sym(p["WSetEna"], "ENABLED"):
                return 0.0
            if p["WSetMod"].value == sym(p["WSetMod"], "WATTS"):
                return float(p["WSet"].cvalue)
            return float(p["WSetPct"].cvalue) / 100.0 * self.rating_w
        p = dict(points(self.model(124)))
        if self._reverted(p["InOutWRte_RvrtTms"]):
            return 0.0
        wmax = float(p["WChaMax"].cvalue)
        mode = int(p["StorCtl_Mod"].value or 0)
        hi = float(p["OutWRte"].cvalue) / 100.0 * wmax if mode & 2 else wmax  # discharge limit
        lo = -float(p["InWRte"].cvalue) / 100.0 * wmax if mode & 1 else -wmax  # charge limit (negative)
        return min(max(0.0, lo), hi)  # idle unless the window excludes 0 W

    def refresh(self) -> None:
        # 802 Hb: "incremented every second with periodic resets to zero"
        self.set_point(802, "Hb", int(self.clock() - self.started_s) & 0xFFFF)
        if self.control == "704":
            p = self.point(704, "WSetRvrtTms")
            left = (
                0 if p.value in (None, 0) else max(0, math.ceil(p.value - (self.clock() - self.last_setpoint_write_s)))
            )
            self.set_point(704, "WSetRvrtRem", int(left))


class PysunspecMeter(PysunspecDevice):
    """An AC meter (1, 203) laid out by pysunspec2; `W` raw x 10^W_SF (+ = import)."""

    def __init__(self, w_raw: int, w_sf: int = 2, *, base: int = 40000, unit: int = 1) -> None:
        common = new_model(1, {"Mn": "pysunspec2-built", "Md": "meter", "SN": "m-1"})
        m203 = new_model(203, {"W": w_raw, "W_SF": w_sf, "Hz": 6000, "Hz_SF": -2, "A": 0, "A_SF": 0})
        super().__init__([common, m203], base=base, unit=unit)
