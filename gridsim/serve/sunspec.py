"""The served SunSpec devices: register images built only from the published model definitions
(`dimmer.daemon.registers`, from pysunspec2's bundled JSON), with the published lengths, and the rules every
write to them follows. The PCC meter is here; the campus battery, with its controls, is in `battery`.

- **Points.** Every mandatory point is served with a value once the first observation is published (before that
  the measurements read as not implemented); every optional point not served is its "not implemented" sentinel.
  Enum values are the definition's own symbols (0- or 1-based as it says), named, never typed as numbers.
- **Writes.** A write must cover whole writable points of one model (points the definition marks RW *and* the
  device implements), else exception 2; each point's value must be one of its symbols (enums) and the model's
  own rules must accept the registers as they would be after the write, else exception 3. Nothing of a refused
  write is applied.
- **Electrical values.** Three-phase wye at a nominal voltage: 480 V line-line (277 V line-neutral) for a PCC
  limit up to 2.5 MW, 34.5 kV above (a medium-voltage interconnection); unity power factor, balanced phases, so
  each phase carries W / 3 and I = W / (3 · V_LN); the total current `A` is the sum of the phase currents. The
  energy counters integrate the observed power (the value observed at t held since the previous observation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dimmer import __version__
from dimmer.daemon import registers as R
from dimmer.observation import Observation
from dimmer.site import SiteModel
from gridsim.serve.common import ILLEGAL_VALUE, METER_UNIT, SUNSPEC_BASE, Image

METER_MODELS = (R.MODEL_1, R.MODEL_203)

LV_LL_V, MV_LL_V = 480.0, 34_500.0  # nominal line-line voltages: a 480 V service, a 34.5 kV interconnection
LV_MAX_W = 2.5e6  # above this PCC limit the campus is taken to connect at medium voltage
HZ_SF = -2
ENERGY_YEARS = 1.0  # the energy counters' scale factor is chosen so that a year at full power fits before a wrap
Values = dict[str, float | int | str | None]
Target = tuple[int, tuple[R.Field, ...]]  # a write's model id and the points it covers


def nominal_ll_v(site: SiteModel) -> float:
    """The campus's nominal line-line AC voltage (V)."""
    return LV_LL_V if site.pcc_limit_w <= LV_MAX_W else MV_LL_V


def energy_sf(max_w: float, words: int = 2) -> int:
    """The smallest scale factor >= 0 at which ENERGY_YEARS at `max_w` fits an accumulator of `words` registers."""
    wh = max(max_w, 1.0) * 8760.0 * ENERGY_YEARS
    sf = 0
    while wh / 10.0**sf > 2.0 ** (16 * words) - 1 and sf < R.SF_MAX:
        sf += 1
    return sf


def common_model(maker_model: str, serial: str, unit: int) -> Values:
    """Model 1: manufacturer, model, version, serial number, device address."""
    ascii_serial = serial.encode("ascii", "replace").decode("ascii").replace("\x00", "?")
    return {"Mn": "dimmer-gridsim", "Md": maker_model, "Vr": __version__, "SN": ascii_serial[:32], "DA": unit}


def symbols(f: R.Field) -> frozenset[int]:
    return frozenset(v for _, v in f.symbols)


@dataclass
class EnergyCounter:
    """The energy through a point in each direction (Wh): `pos_wh` while the power is positive, `neg_wh` while it
    is negative. Each observed power is held since the previous observation; a NaN adds nothing."""

    pos_wh: float = 0.0
    neg_wh: float = 0.0
    t_s: float = 0.0

    def add(self, t_s: float, w: float) -> None:
        dt = t_s - self.t_s
        if dt > 0 and math.isfinite(w):
            if w > 0:
                self.pos_wh += w * dt / 3600.0
            else:
                self.neg_wh -= w * dt / 3600.0
        self.t_s = max(self.t_s, t_s)


class SunSpecDevice:
    """One served SunSpec device: "SunS", the models in chain order, the end marker, from SUNSPEC_BASE.

    `models`: each model's block and its values at start (scale factors included: they never change);
    `writable`: per model id, the RW points this device implements (only they may be written).
    """

    def __init__(
        self, unit: int, models: Sequence[tuple[R.Block, Values]], writable: Mapping[int, Sequence[str]]
    ) -> None:
        blocks = [b for b, _ in models]
        self.blocks: dict[int, R.Block] = {b.model_id or 0: b for b in blocks}
        self.at = {mid: SUNSPEC_BASE + off for mid, off in R.model_offsets(blocks).items()}
        self.fields = {mid: {f.name: f for f in b.fields} for mid, b in self.blocks.items()}
        self.scale: dict[int, dict[str, int]] = {}
        for b, values in models:
            sfs = {f.name: values.get(f.name) for f in b.fields if f.kind == "sunssf"}
            self.scale[b.model_id or 0] = {k: int(v) for k, v in sfs.items() if isinstance(v, int | float)}
        words = R.sunspec_image(models)
        mask = np.zeros(len(words), dtype=bool)
        self.writable: dict[int, frozenset[str]] = {}
        for mid, names in writable.items():
            for name in names:
                f = self.fields[mid][name]
                if f.access != "RW":
                    raise ValueError(f"model {mid} {name} is not writable in its definition")
                a = self.at[mid] - SUNSPEC_BASE + f.offset
                mask[a : a + f.n] = True
            self.writable[mid] = frozenset(names)
        self.image = Image(unit, SUNSPEC_BASE, words, mask)

    @property
    def unit(self) -> int:
        return self.image.unit

    def put(self, model_id: int, values: Mapping[str, float | int | str | None]) -> None:
        """Set points from engineer values, scaled with the model's own scale factors; a value that does not fit
        its register (or NaN / None) is served as "not implemented"."""
        block, at, sfs, fields = self.blocks[model_id], self.at[model_id], self.scale[model_id], self.fields[model_id]
        for name, v in values.items():
            f = fields[name]
            sf = sfs.get(f.sf) if f.sf is not None else None
            try:
                words = R.encode_value(block, f, v, sf)
            except R.EncodeError:
                words = R.na_words(f.kind, f.n)
            self.image.set(at + f.offset, words)

    def values(self, model_id: int) -> dict[str, float | str | None]:
        """One model, decoded from the registers as served."""
        block = self.blocks[model_id]
        return R.decode_block(block, self.image.get(self.at[model_id], block.length))

    def target(self, address: int, count: int) -> Target | None:
        """The model a write of `count` registers at `address` lands in and the points it covers, when it covers
        whole writable points of one model; None when it may not be written (exception 2)."""
        if not self.image.may_write(address, count):
            return None
        for mid, at in self.at.items():
            block = self.blocks[mid]
            if at <= address and address + count <= at + block.length:
                lo, hi = address - at, address - at + count
                points = tuple(f for f in block.fields if f.offset < hi and f.offset + f.n > lo)
                if any(f.offset < lo or f.offset + f.n > hi or f.name not in self.writable[mid] for f in points):
                    return None
                return mid, points
        return None

    def write(self, target: Target, address: int, words: Sequence[int], t_s: float) -> int | None:
        """Vet a write `target` accepted and apply it; the Modbus exception code when refused (nothing applied)."""
        mid, points = target
        block, at = self.blocks[mid], self.at[mid]
        cand = self.image.get(at, block.length).copy()
        cand[address - at : address - at + len(words)] = words
        # the one vetting path of every device map: whole points, declared ranges, enums among their symbols; a
        # point may be written "not implemented" (the model's own rules, `check`, say where that is refused)
        refused = R.write_error(block, address - at, len(words), cand, na_ok=True)
        if refused is not None:
            return refused[0]
        v = R.decode_block(block, cand)
        names = frozenset(f.name for f in points)
        code = self.check(mid, v, names)
        if code is not None:
            return code
        self.image.set(address, words)
        self.written(mid, names, t_s)
        return None

    def check(self, model_id: int, v: Mapping[str, float | str | None], names: frozenset[str]) -> int | None:
        """A model's own rules on its registers as they would be after a write of the points `names`: None to
        accept, or the exception code. Model 1: the device address can only be "written" to what it is (a served
        device cannot move to another unit id)."""
        if model_id == 1 and "DA" in names and v["DA"] != self.unit:
            return ILLEGAL_VALUE
        return None

    def written(self, model_id: int, names: frozenset[str], t_s: float) -> None:
        """Called after an accepted write of the points `names`, at plant time `t_s`."""


class ServedMeter(SunSpecDevice):
    """The PCC meter: models 1 and 203 (wye, int16 + scale factors). `W` + = import."""

    def __init__(self, site: SiteModel, serial: str) -> None:
        # W_SF: room for 1.25 x the larger of the interconnect limit and every rack at full power
        max_w = 1.25 * max(site.pcc_limit_w, float(site.rack_max_w().sum()), 1.0)
        self.v_ll = nominal_ll_v(site)
        self.v_ln = self.v_ll / math.sqrt(3.0)
        self.w_sf = R.sf_for(max_w)
        self.wh_sf = energy_sf(max_w)
        self.energy = EnergyCounter()  # pos: imported, neg: exported
        m203: Values = {
            "A_SF": R.sf_for(max_w / self.v_ln),
            "V_SF": R.sf_for(1.2 * self.v_ll),
            "Hz_SF": HZ_SF,
            "W_SF": self.w_sf,
            "TotWh_SF": self.wh_sf,
            "Evt": 0,  # no events
        }
        super().__init__(
            METER_UNIT,
            [(R.MODEL_1, common_model("PCC meter", serial, METER_UNIT)), (R.MODEL_203, m203)],
            {1: ("DA",)},
        )

    def publish(self, obs: Observation) -> None:
        w = float(obs.pcc_power_w)
        self.energy.add(obs.t_s, w)
        a_ph = abs(w) / (3.0 * self.v_ln) if math.isfinite(w) else math.nan
        one_count = 10.0**self.wh_sf  # an acc32 of 0 means "not accumulated": the counters start at one count
        self.put(
            203,
            {
                "A": 3.0 * a_ph,
                "AphA": a_ph,
                "AphB": a_ph,
                "AphC": a_ph,
                "PhV": self.v_ln,
                "PhVphA": self.v_ln,
                "PhVphB": self.v_ln,
                "PhVphC": self.v_ln,
                "PPV": self.v_ll,
                "PhVphAB": self.v_ll,
                "PhVphBC": self.v_ll,
                "PhVphCA": self.v_ll,
                "Hz": obs.grid_freq_hz,
                "W": w,
                "WphA": w / 3.0,
                "WphB": w / 3.0,
                "WphC": w / 3.0,
                "TotWhExp": max(self.energy.neg_wh, one_count),
                "TotWhImp": max(self.energy.pos_wh, one_count),
            },
        )
