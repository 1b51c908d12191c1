"""The served campus battery: SunSpec models 1, 701 (AC measurements), 704 (the active-power setpoint),
713 (storage capacity) and 802 (the battery bank), and the setpoint semantics the plant follows.

**Setpoint (704).** `WSetEna` ENABLED and `WSetMod` WATTS: `WSet` W (+ = discharge); W_MAX_PCT: `WSetPct` % of
the battery's rated power; DISABLED: 0 W. **Reversion.** When `WSetRvrtTms` > 0 the timer (re)starts at every
accepted write to the WSet points (+22 ... +32); `WSetRvrtRem` counts the plant seconds left; at expiry the
setpoint becomes the reversion value of the mode in force (`WSetRvrt` W, or `WSetPctRvrt` %) if `WSetEnaRvrt` is
ENABLED, otherwise the function is disabled (0 W): either way the battery goes idle on its own when its controller
stops writing. A setpoint write after expiry applies again and restarts the timer.

**Writes refused with exception 3** (nothing applied): an enum value that is not one of its symbols; a `WSet` /
`WSetRvrt` beyond ± the rated power or a `WSetPct` / `WSetPctRvrt` beyond ± 100 %; a not-implemented (NaN) value
where it would be in force (the setpoint of the mode while WSetEna is ENABLED, the reversion value while
WSetEnaRvrt is ENABLED); a not-implemented `WSetRvrtTms`; 802 `SocRsvMax` / `SoCRsvMin` outside 0 ... 100 % or
crossed; `AlmRst` other than 0 or 1. 802 `CtrlHb` takes any value (a heartbeat counter wraps through them all);
`SetOp`, `SetInvState`, the reserves and `AlmRst` are stored and read back, not acted on by the plant model (its
connection follows the scenario's events and `PlantServer.set_battery_online`). Only the 704 WSet points and the
RW points of 802 and 1 are implemented; the other RW points of 704 (power factor, var, ramp and anti-islanding
functions) read as not implemented and are not writable (exception 2).

DC side (802): a nominal 800 V bank, `A` = `W` / `V`; `AHRtg` = `WHRtg` / 800 V.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from dimmer.daemon import registers as R
from dimmer.observation import Observation
from dimmer.site import SiteModel
from gridsim.serve.common import BATTERY_UNIT, ILLEGAL_VALUE
from gridsim.serve.sunspec import EnergyCounter, SunSpecDevice, Values, common_model, energy_sf, nominal_ll_v

BATTERY_MODELS = (R.MODEL_1, R.MODEL_701, R.MODEL_704, R.MODEL_713, R.MODEL_802)
M704, M802 = R.MODEL_704, R.MODEL_802
DC_V = 800.0  # nominal battery bank voltage
CELL_V_SF = -3
PCT_SF = -2  # SoC and percentages: 0.01 %
# the setpoint points of 704 (+22 ... +32, WSetEna ... WSetRvrtTms): every RW point named WSet*
WSET_POINTS = tuple(f.name for f in M704.fields if f.access == "RW" and f.name.startswith("WSet"))
SETPOINT_POINTS = frozenset({"WSetEna", "WSetMod", "WSet", "WSetPct"})  # the setpoint in force, not its reversion
BATTERY_RW_POINTS = tuple(f.name for f in M802.fields if f.access == "RW")  # SocRsvMax ... SetInvState


def _sym(model_id: int, point: str, name: str) -> int:
    return R.symbol(model_id, point, name)


ON, OFF = _sym(701, "St", "ON"), _sym(701, "St", "OFF")
CONNECTED, DISCONNECTED = _sym(701, "ConnSt", "CONNECTED"), _sym(701, "ConnSt", "DISCONNECTED")
INV_RUNNING, INV_OFF = _sym(701, "InvSt", "RUNNING"), _sym(701, "InvSt", "OFF")
ENABLED, DISABLED = _sym(704, "WSetEna", "ENABLED"), _sym(704, "WSetEna", "DISABLED")
WATTS, W_MAX_PCT = _sym(704, "WSetMod", "WATTS"), _sym(704, "WSetMod", "W_MAX_PCT")
RVRT_ENABLED, RVRT_DISABLED = _sym(704, "WSetEnaRvrt", "ENABLED"), _sym(704, "WSetEnaRvrt", "DISABLED")
STATE_CONNECTED, STATE_DISCONNECTED = _sym(802, "State", "CONNECTED"), _sym(802, "State", "DISCONNECTED")
CHA = {s: _sym(802, "ChaSt", s) for s in ("OFF", "EMPTY", "DISCHARGING", "CHARGING", "FULL", "HOLDING")}


def _f(x: object) -> float:
    """A decoded point as a float (NaN when not implemented or not a number)."""
    return float(x) if isinstance(x, float | int) else math.nan


def _finite(x: object) -> bool:
    return math.isfinite(_f(x))


class ServedBattery(SunSpecDevice):
    """The campus battery of `site` (`site.bess`: rated power, energy, SoC window)."""

    def __init__(self, site: SiteModel, serial: str) -> None:
        b = site.bess
        self.rated_w = float(b.power_w)
        self.soc_min_pct, self.soc_max_pct = 100.0 * b.soc_min_frac, 100.0 * b.soc_max_frac
        self.wh_rtg = b.energy_j / 3600.0
        self.v_ll = nominal_ll_v(site)
        self.v_ln = self.v_ll / math.sqrt(3.0)
        self.w_sf = R.sf_for(2.0 * max(self.rated_w, 1.0))
        self.energy = EnergyCounter()  # pos: injected (discharged), neg: absorbed (charged)
        self.written_at: float | None = None  # plant time of the last accepted write to the WSet points
        self.setpoint_written = False  # a write has set WSetEna, WSetMod, WSet or WSetPct
        self.reverted = False  # the reversion timer has run out since the last setpoint write
        self._controls: dict[str, float | str | None] | None = None  # 704 as last decoded
        rated = max(self.rated_w, 1.0)
        m701: Values = {
            "ACType": _sym(701, "ACType", "THREE_PHASE"),
            "Alrm": 0,  # no alarms
            "W_SF": self.w_sf,
            "A_SF": R.sf_for(2.0 * rated / self.v_ln),
            "V_SF": R.sf_for(1.2 * self.v_ll),
            "Hz_SF": -3,
            "TotWh_SF": energy_sf(rated, words=4),
        }
        m704: Values = {
            "WSetEna": DISABLED,
            "WSetMod": WATTS,
            "WSet": 0.0,
            "WSetRvrt": 0.0,
            "WSetPct": 0.0,
            "WSetPctRvrt": 0.0,
            "WSetEnaRvrt": RVRT_DISABLED,
            "WSetRvrtTms": 0,
            "WSetRvrtRem": 0,
            "WSet_SF": _int32_sf(rated),
            "WSetPct_SF": PCT_SF,
        }
        wh_sf = R.sf_for(max(self.wh_rtg, 1.0))
        m713: Values = {"WHRtg": self.wh_rtg, "WH_SF": wh_sf, "Pct_SF": PCT_SF, "Sta": _sym(713, "Sta", "OK")}
        m802: Values = {
            "AHRtg": self.wh_rtg / DC_V,
            "AHRtg_SF": R.sf_for(max(self.wh_rtg / DC_V, 1.0)),
            "WHRtg": self.wh_rtg,
            "WHRtg_SF": wh_sf,
            "WChaRteMax": self.rated_w,
            "WDisChaRteMax": self.rated_w,
            "WChaDisChaMax_SF": R.sf_for(rated),
            "SoCMax": self.soc_max_pct,
            "SoCMin": self.soc_min_pct,
            "SocRsvMax": self.soc_max_pct,
            "SoCRsvMin": self.soc_min_pct,
            "SoC_SF": PCT_SF,
            "LocRemCtl": _sym(802, "LocRemCtl", "REMOTE"),
            "Hb": 0,
            "CtrlHb": 0,
            "AlmRst": 0,
            "Typ": _sym(802, "Typ", "LITHIUM_ION"),
            "Evt1": 0,
            "Evt2": 0,
            "EvtVnd1": 0,
            "EvtVnd2": 0,
            "AChaMax": self.rated_w / DC_V,
            "ADisChaMax": self.rated_w / DC_V,
            "SetOp": _sym(802, "SetOp", "CONNECT"),
            "SetInvState": _sym(802, "SetInvState", "INVERTER_STARTED"),
            "V_SF": R.sf_for(1.2 * DC_V),
            "CellV_SF": CELL_V_SF,
            "A_SF": R.sf_for(2.0 * rated / DC_V),
            "AMax_SF": R.sf_for(rated / DC_V),
            "W_SF": self.w_sf,
        }
        models = [
            (R.MODEL_1, common_model("campus battery", serial, BATTERY_UNIT)),
            (R.MODEL_701, m701),
            (M704, m704),
            (R.MODEL_713, m713),
            (M802, m802),
        ]
        super().__init__(BATTERY_UNIT, models, {1: ("DA",), 704: WSET_POINTS, 802: BATTERY_RW_POINTS})

    # -- measurements -----------------------------------------------------------------------------------------

    def publish(self, obs: Observation, update_count: int) -> None:
        online = bool(obs.bess_online)
        w = float(obs.bess_power_w)
        self.energy.add(obs.t_s, w)
        soc = 100.0 * float(obs.bess_soc_frac)
        if not (math.isfinite(soc) and 0.0 <= soc <= 100.0):
            soc = math.nan
        self.put(
            701,
            {
                "St": ON if online else OFF,
                "InvSt": INV_RUNNING if online else INV_OFF,
                "ConnSt": CONNECTED if online else DISCONNECTED,
                "W": w,
                "A": abs(w) / self.v_ln if math.isfinite(w) else math.nan,
                "LLV": self.v_ll,
                "LNV": self.v_ln,
                "Hz": obs.grid_freq_hz,
                "TotWhInj": self.energy.pos_wh,
                "TotWhAbs": self.energy.neg_wh,
            },
        )
        avail = max(0.0, soc - self.soc_min_pct) / 100.0 * self.wh_rtg if math.isfinite(soc) else math.nan
        self.put(713, {"WHAvail": avail, "SoC": soc})
        self.put(
            802,
            {
                "SoC": soc,
                "ChaSt": self._charge_state(online, w, soc),
                "Hb": update_count & 0xFFFF,  # the battery's own heartbeat
                "State": STATE_CONNECTED if online else STATE_DISCONNECTED,
                "V": DC_V,
                "A": w / DC_V,
                "W": w,
            },
        )

    def _charge_state(self, online: bool, w: float, soc: float) -> int | None:
        if not online:
            return CHA["OFF"]
        if not (math.isfinite(w) and math.isfinite(soc)):
            return None
        idle_w = 0.01 * self.rated_w
        if w > idle_w:
            return CHA["DISCHARGING"]
        if w < -idle_w:
            return CHA["CHARGING"]
        if soc >= self.soc_max_pct - 0.5:
            return CHA["FULL"]
        if soc <= self.soc_min_pct + 0.5:
            return CHA["EMPTY"]
        return CHA["HOLDING"]

    # -- the setpoint -----------------------------------------------------------------------------------------

    def setpoint(self, t_s: float) -> float:
        """The power the battery is told to hold at plant time `t_s` (+ = discharge), after reversion; updates
        `WSetRvrtRem`."""
        if self._controls is None:  # decoded again only after a write
            self._controls = self.values(704)
        v = self._controls
        tms, at = _f(v["WSetRvrtTms"]), self.written_at
        timing = at is not None and math.isfinite(tms) and tms > 0
        left = tms - (t_s - at) if at is not None and timing else math.nan
        self.put(704, {"WSetRvrtRem": max(0.0, math.ceil(left)) if timing else 0})
        if timing and left <= 0:
            self.reverted = True
            if v["WSetEnaRvrt"] == RVRT_ENABLED:
                return self._power(v["WSetMod"], v["WSetRvrt"], v["WSetPctRvrt"])
            return 0.0
        if v["WSetEna"] == ENABLED:
            return self._power(v["WSetMod"], v["WSet"], v["WSetPct"])
        return 0.0

    def _power(self, mode: object, watts: object, pct: object) -> float:
        x = _f(watts) if mode == WATTS else _f(pct) / 100.0 * self.rated_w
        return x if math.isfinite(x) else 0.0

    # -- writes -----------------------------------------------------------------------------------------------

    def check(self, model_id: int, v: Mapping[str, float | str | None], names: frozenset[str]) -> int | None:
        if model_id == 704:
            return self._check_704(v)
        if model_id == 802:
            return self._check_802(v, names)
        return super().check(model_id, v, names)

    def _check_704(self, v: Mapping[str, float | str | None]) -> int | None:
        tol_w = self.rated_w * (1 + 1e-9) + 1.0  # WSet is integer watts x 10^WSet_SF
        for name, bound in (("WSet", tol_w), ("WSetRvrt", tol_w), ("WSetPct", 100.0), ("WSetPctRvrt", 100.0)):
            x = _f(v[name])
            if math.isfinite(x) and abs(x) > bound:
                return ILLEGAL_VALUE
        watts = v["WSetMod"] == WATTS
        if v["WSetEna"] == ENABLED and not _finite(v["WSet"] if watts else v["WSetPct"]):
            return ILLEGAL_VALUE
        if v["WSetEnaRvrt"] == RVRT_ENABLED and not _finite(v["WSetRvrt"] if watts else v["WSetPctRvrt"]):
            return ILLEGAL_VALUE
        if not _finite(v["WSetRvrtTms"]):
            return ILLEGAL_VALUE
        return None

    def _check_802(self, v: Mapping[str, float | str | None], names: frozenset[str]) -> int | None:
        if names & {"SocRsvMax", "SoCRsvMin"}:
            hi, lo = _f(v["SocRsvMax"]), _f(v["SoCRsvMin"])
            if not 0.0 <= lo <= hi <= 100.0:  # False for a NaN
                return ILLEGAL_VALUE
        if "AlmRst" in names and v["AlmRst"] not in (0.0, 1.0):
            return ILLEGAL_VALUE
        return None

    def written(self, model_id: int, names: frozenset[str], t_s: float) -> None:
        self._controls = None
        if model_id == 704 and names & set(WSET_POINTS):
            self.written_at = t_s  # (re)starts the reversion timer
            self.setpoint_written |= bool(names & SETPOINT_POINTS)
            self.reverted = False
            tms = self.values(704)["WSetRvrtTms"]
            self.put(704, {"WSetRvrtRem": tms if _finite(tms) else 0})


def _int32_sf(max_abs: float) -> int:
    """The smallest scale factor >= 0 at which ± `max_abs` fits an int32."""
    sf = 0
    while max_abs / 10.0**sf > 2**31 - 1 and sf < R.SF_MAX:
        sf += 1
    return sf
