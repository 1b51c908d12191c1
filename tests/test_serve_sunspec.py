"""The served plant's SunSpec devices (issue 10), without a network: what the images hold, the write rules, the
setpoint and reversion semantics the battery follows. Over loopback against other implementations:
tests/test_interop_sunspec.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from dimmer.daemon import registers as R
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel
from gridsim.engine import Simulation
from gridsim.scenario import LoadedScenario, load_scenario
from gridsim.serve import BATTERY_MODELS, METER_MODELS, SUNSPEC_BASE, PlantServer, ServedBattery, ServedMeter
from gridsim.serve.battery import WSET_POINTS
from gridsim.serve.sunspec import SunSpecDevice
from tests.test_serve import scenario

REPO = Path(__file__).resolve().parents[1]
ILLEGAL_ADDRESS, ILLEGAL_VALUE = 2, 3
M704, M802 = R.MODEL_704, R.MODEL_802

# the optional points each served model implements (every other optional point is "not implemented")
OPTIONAL_SERVED = {
    1: {"Vr", "DA", "Pad"},
    203: {"Hz_SF", "WphA", "WphB", "WphC"},
    701: {"St", "InvSt", "ConnSt", "Alrm", "W", "A", "LLV", "LNV", "Hz", "TotWhInj", "TotWhAbs"}
    | {"A_SF", "V_SF", "Hz_SF", "W_SF", "TotWh_SF"},
    704: set(WSET_POINTS) | {"WSetRvrtRem", "WSet_SF", "WSetPct_SF"},
    713: {"WHRtg", "WHAvail", "SoC", "Sta", "WH_SF", "Pct_SF"},
    802: {"SoCMax", "SoCMin", "SocRsvMax", "SoCRsvMin", "ChaSt", "Hb", "CtrlHb", "AChaMax", "ADisChaMax", "W_SF"},
}


class _Recorder:
    name = "recorder"

    def __init__(self, site: SiteModel) -> None:
        self.site = site
        self.observations: list[Observation] = []

    def step(self, obs: Observation) -> Actions:
        self.observations.append(obs)
        return Actions.hands_off(self.site)


def observations(loaded: LoadedScenario) -> list[Observation]:
    """The observations of an in-process hands-off run, one per control period."""
    site = loaded.site()
    rec = _Recorder(site)
    Simulation(loaded, site, rec, loaded.scenario.seed).run()
    return rec.observations


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedScenario:
    return scenario(tmp_path_factory.mktemp("sunspec"), duration=6.0)


@pytest.fixture(scope="module")
def obs(loaded: LoadedScenario) -> Observation:
    return observations(loaded)[-1]


def devices(loaded: LoadedScenario, obs: Observation | None = None) -> tuple[ServedMeter, ServedBattery]:
    site = loaded.site()
    meter, battery = ServedMeter(site, "test"), ServedBattery(site, "test")
    if obs is not None:
        meter.publish(obs)
        battery.publish(obs, 7)
    return meter, battery


def chain(dev: SunSpecDevice) -> list[tuple[int, int]]:
    w = dev.image.words.astype(int).tolist()
    assert (w[0], w[1]) == R.SUNS_MARKER
    out, at = [], 2
    while w[at] != 0xFFFF:
        out.append((w[at], w[at + 1]))
        at += 2 + w[at + 1]
    assert (w[at], w[at + 1]) == R.SUNSPEC_END and at + 2 == len(w)
    return out


def write(dev: SunSpecDevice, address: int, words: list[int], t_s: float = 0.0) -> int | None:
    """A write as the plant applies it: exception 2 unless it covers whole writable points of one model."""
    target = dev.target(address, len(words))
    return ILLEGAL_ADDRESS if target is None else dev.write(target, address, words, t_s)


def words_of(block: R.Block, values: R.Values, *names: str) -> list[int]:
    """The registers of the points `names` (contiguous), encoded from `values` (scale factors included)."""
    full = R.encode_block(block, values)
    a, last = block.offset(names[0]), block.field(names[-1])
    return full[a : last.offset + last.n]


# -- what the images hold ------------------------------------------------------------------------------------


def test_the_chains_are_the_published_models_at_their_published_lengths(loaded: LoadedScenario) -> None:
    meter, battery = devices(loaded)
    assert chain(meter) == [(b.model_id, R.model_length(b.model_id or 0)) for b in METER_MODELS]
    assert chain(battery) == [(b.model_id, R.model_length(b.model_id or 0)) for b in BATTERY_MODELS]
    assert [m for m, _ in chain(battery)] == [1, 701, 704, 713, 802]
    assert dict(chain(battery))[704] == 65 and dict(chain(meter))[203] == 105


def test_every_mandatory_point_is_served_and_no_other_point_reads_zero(
    loaded: LoadedScenario, obs: Observation
) -> None:
    for dev in devices(loaded, obs):
        for mid, block in dev.blocks.items():
            words = dev.image.get(dev.at[mid], block.length)
            values = dev.values(mid)
            for f in block.fields:
                w = words[f.offset : f.offset + f.n].tolist()
                na = w == R.na_words(f.kind, f.n) and f.kind != "pad"
                if f.mandatory:
                    v = values.get(f.name, 0.0)
                    assert not na and v is not None, (mid, f.name)
                    assert not (isinstance(v, float) and math.isnan(v)), (mid, f.name)
                elif f.name in OPTIONAL_SERVED[mid]:
                    assert not na, (mid, f.name)
                else:
                    assert na, (mid, f.name, w)  # not implemented: its sentinel, never 0


def test_before_the_first_observation_the_measurements_are_not_implemented(loaded: LoadedScenario) -> None:
    meter, battery = devices(loaded)
    assert math.isnan(meter.values(203)["W"]) and math.isnan(meter.values(203)["TotWhImp"])  # type: ignore[arg-type]
    assert math.isnan(battery.values(802)["SoC"]) and math.isnan(battery.values(701)["W"])  # type: ignore[arg-type]
    assert meter.values(203)["W_SF"] == meter.w_sf  # the nameplate is there from the start
    assert battery.values(802)["WChaRteMax"] == 0.5e6


@pytest.mark.parametrize("online", [True, False])
def test_every_enum_and_bitfield_value_is_one_of_its_symbols(
    loaded: LoadedScenario, obs: Observation, online: bool
) -> None:
    meter, battery = devices(loaded, dataclasses.replace(obs, bess_online=online))
    for dev in (meter, battery):
        for mid, block in dev.blocks.items():
            values = dev.values(mid)
            for f in block.fields:
                v = values.get(f.name)
                if f.kind.startswith(("enum", "bitfield")) and isinstance(v, float) and not math.isnan(v):
                    if f.kind.startswith("enum"):
                        assert int(v) in {s for _, s in f.symbols}, (mid, f.name, v)
                    else:
                        allowed = sum(1 << s for _, s in f.symbols)
                        assert int(v) & ~allowed == 0, (mid, f.name, v)
    m701, m802 = battery.values(701), battery.values(802)
    # 0- or 1-based exactly as the definitions say
    assert (m701["St"], m701["ConnSt"], m802["State"]) == ((1, 1, 3) if online else (0, 0, 1))
    assert m701["ACType"] == R.symbol(701, "ACType", "THREE_PHASE") == 2
    assert m802["Typ"] == R.symbol(802, "Typ", "LITHIUM_ION") and m802["LocRemCtl"] == 0  # REMOTE
    assert battery.values(704)["WSetMod"] == R.symbol(704, "WSetMod", "WATTS") == 1


def test_the_values_are_physical(loaded: LoadedScenario, obs: Observation) -> None:
    meter, battery = devices(loaded, obs)
    m = meter.values(203)
    res = 10.0**meter.w_sf
    assert abs(m["W"] - obs.pcc_power_w) <= res / 2  # type: ignore[operator]
    assert m["PhV"] == pytest.approx(277.1, abs=0.1) and m["PPV"] == 480.0
    assert m["A"] * m["PhV"] == pytest.approx(abs(obs.pcc_power_w), rel=2e-3)  # type: ignore[operator]
    assert m["AphA"] == m["AphB"] == m["AphC"] == pytest.approx(m["A"] / 3, abs=1)  # type: ignore[operator]
    assert m["Hz"] == pytest.approx(obs.grid_freq_hz, abs=0.005) and m["Evt"] == 0
    b701, b802, b713 = battery.values(701), battery.values(802), battery.values(713)
    assert b802["SoC"] == pytest.approx(100 * obs.bess_soc_frac, abs=0.005) == b713["SoC"]
    assert b802["V"] == 800.0 and b802["AHRtg"] * b802["V"] == pytest.approx(b802["WHRtg"])  # type: ignore[operator]
    assert b802["A"] * b802["V"] == pytest.approx(obs.bess_power_w, abs=80.0)  # type: ignore[operator]
    assert b802["WHRtg"] == 250e3 and b802["WDisChaRteMax"] == 0.5e6 and b713["WHRtg"] == 250e3
    assert b701["W"] == pytest.approx(obs.bess_power_w, abs=10.0**battery.w_sf / 2)
    assert b802["Hb"] == 7 and b802["Evt1"] == 0 and b802["SetOp"] == R.symbol(802, "SetOp", "CONNECT")


@pytest.mark.parametrize("name", ["eight", "swing-8k", "oversubscribed-row"])  # the last: no battery
def test_the_scale_factors_fit_the_extremes(tmp_path: Path, obs: Observation, name: str) -> None:
    loaded = scenario(tmp_path) if name == "eight" else load_scenario(REPO / "scenarios" / f"{name}.toml")
    site = loaded.site()
    meter, battery = ServedMeter(site, "x"), ServedBattery(site, "x")
    top = 1.2 * max(site.pcc_limit_w, float(site.rack_max_w().sum()))
    rated = site.bess.power_w
    nr, nd, nj = site.n_racks, site.n_domains, site.n_jobs
    base = dataclasses.replace(
        obs,
        rack_power_w=np.zeros(nr),
        rack_load_w=np.zeros(nr),
        rack_age_s=np.zeros(nr),
        rack_cap_w=np.zeros(nr),
        rack_floor_w=np.zeros(nr),
        rack_bbu_soc_frac=np.zeros(nr),
        rack_energized=np.ones(nr, dtype=bool),
        domain_power_w=np.zeros(nd),
        domain_age_s=np.zeros(nd),
        domain_limit_w=np.zeros(nd),
        domain_thermal_frac=np.zeros(nd),
        job_running=np.zeros(nj, dtype=bool),
    )
    for pcc, bess in ((top, rated), (-top, -rated)):
        o = dataclasses.replace(base, pcc_power_w=pcc, bess_power_w=bess)
        meter.publish(o)
        battery.publish(o, 1)
        m, b = meter.values(203), battery.values(802)
        for k in ("W", "WphA", "A", "AphA", "PhV", "PPV"):
            assert math.isfinite(m[k]), k  # type: ignore[arg-type]
        assert m["W"] == pytest.approx(pcc, abs=10.0**meter.w_sf)
        for k in ("W", "A", "V", "WHRtg", "AHRtg", "WChaRteMax"):
            assert math.isfinite(b[k]), k  # type: ignore[arg-type]
        assert battery.values(701)["W"] == pytest.approx(bess, abs=10.0**battery.w_sf)


def test_the_meter_counts_energy_each_way(loaded: LoadedScenario, obs: Observation) -> None:
    meter, _ = devices(loaded)
    sf = int(meter.values(203)["TotWh_SF"])  # type: ignore[arg-type]
    assert sf >= 0
    for t, w in ((3600.0, 1.0e6), (5400.0, -0.4e6), (7200.0, 0.2e6), (7300.0, math.nan)):
        meter.publish(dataclasses.replace(obs, t_s=t, pcc_power_w=w))
    m = meter.values(203)
    assert m["TotWhImp"] == pytest.approx(1.0e6 + 0.2e6 / 2, abs=10.0**sf)  # a NaN reading adds nothing
    assert m["TotWhExp"] == pytest.approx(0.4e6 / 2, abs=10.0**sf)
    fresh, _ = devices(loaded, dataclasses.replace(obs, t_s=1.0, pcc_power_w=1e5))
    assert fresh.values(203)["TotWhExp"] == 10.0**sf  # one count: an acc32 of 0 would mean "not accumulated"


# -- writes -------------------------------------------------------------------------------------------------


def daemon_spans(power_w: float, revert_s: int, sf: int = 0) -> tuple[list[int], list[int]]:
    """The two requests dimmer.daemon.sunspec_devices writes a setpoint with: [WSetEnaRvrt, WSetRvrtTms] and
    [WSetEna, WSetMod, WSet, WSetRvrt]."""
    values: R.Values = {
        "WSetEna": 1,
        "WSetMod": 1,
        "WSet": power_w,
        "WSetRvrt": 0.0,
        "WSet_SF": sf,
        "WSetEnaRvrt": 1,
        "WSetRvrtTms": revert_s,
    }
    return (
        words_of(M704, values, "WSetEnaRvrt", "WSetRvrtTms"),
        words_of(M704, values, "WSetEna", "WSetMod", "WSet", "WSetRvrt"),
    )


def test_the_daemons_two_spans_and_a_standard_clients_single_points_are_accepted(loaded: LoadedScenario) -> None:
    _, bat = devices(loaded)
    at = bat.at[704]
    rvrt, setp = daemon_spans(-200e3, 5)
    assert write(bat, at + M704.offset("WSetEnaRvrt"), rvrt, 1.0) is None
    assert not bat.setpoint_written  # the reversion span alone is not a setpoint (hold_until_first_write waits)
    assert write(bat, at + M704.offset("WSetEna"), setp, 1.0) is None
    assert bat.setpoint_written
    v = bat.values(704)
    assert (v["WSetEna"], v["WSetMod"], v["WSet"], v["WSetEnaRvrt"], v["WSetRvrtTms"]) == (1, 1, -200e3, 1, 5)
    assert bat.setpoint(2.0) == -200e3 and bat.values(704)["WSetRvrtRem"] == 4
    # a pysunspec2 client writes only the points it changed: WSet alone (2 registers), WSetEna alone (1)
    assert write(bat, at + M704.offset("WSet"), R.encode_int32(150e3), 3.0) is None
    assert bat.setpoint(3.0) == 150e3
    assert write(bat, at + M704.offset("WSetEna"), [0], 3.0) is None
    assert bat.setpoint(3.0) == 0.0
    # the controller heartbeat, any value: a counter wraps through them all
    for hb in (1, 0xFFFF, 0):
        assert write(bat, bat.at[802] + M802.offset("CtrlHb"), [hb]) is None


@pytest.mark.parametrize(
    ("point", "words", "code"),
    [
        ("WSetMod", [7], ILLEGAL_VALUE),  # not a symbol
        ("WSetEna", [2], ILLEGAL_VALUE),
        ("WSetEnaRvrt", [0xFFFF], ILLEGAL_VALUE),  # "not implemented" is not a symbol either
        ("WSet", R.encode_int32(0.6e6), ILLEGAL_VALUE),  # beyond the battery's 0.5 MW
        ("WSetRvrt", R.encode_int32(-0.6e6), ILLEGAL_VALUE),
        ("WSetPct", R.encode_int16(15000), ILLEGAL_VALUE),  # 150 %
        ("WSetRvrtTms", R.encode_uint32(math.nan), ILLEGAL_VALUE),
        ("WSet", [0], ILLEGAL_ADDRESS),  # half a point
        ("WSetRvrtRem", R.encode_uint32(3), ILLEGAL_ADDRESS),  # read only
        ("VarSetEna", [1], ILLEGAL_ADDRESS),  # RW in the definition, not implemented here
        ("WSet_SF", [0], ILLEGAL_ADDRESS),
        ("ID", [704], ILLEGAL_ADDRESS),
    ],
)
def test_a_bad_704_write_is_refused_and_applies_nothing(
    loaded: LoadedScenario, point: str, words: list[int], code: int
) -> None:
    _, bat = devices(loaded)
    before = bat.image.words.copy()
    assert write(bat, bat.at[704] + M704.offset(point), words) == code
    np.testing.assert_array_equal(bat.image.words, before)
    assert bat.written_at is None


def test_a_not_implemented_setpoint_in_force_is_refused(loaded: LoadedScenario) -> None:
    _, bat = devices(loaded)
    at = bat.at[704]
    nan_wset = R.encode_int32(math.nan)
    assert write(bat, at + M704.offset("WSet"), nan_wset) is None  # the function is disabled: no setpoint in force
    assert write(bat, at + M704.offset("WSetEna"), [1]) == ILLEGAL_VALUE  # enabling it would put NaN in force
    assert write(bat, at + M704.offset("WSet"), R.encode_int32(1000)) is None
    assert write(bat, at + M704.offset("WSetEna"), [1]) is None
    assert write(bat, at + M704.offset("WSet"), nan_wset) == ILLEGAL_VALUE  # while enabled
    assert write(bat, at + M704.offset("WSetRvrt"), nan_wset) is None
    assert write(bat, at + M704.offset("WSetEnaRvrt"), [1]) == ILLEGAL_VALUE  # NaN would be the reversion


def test_writes_that_span_models_or_read_only_points_are_refused(loaded: LoadedScenario) -> None:
    meter, bat = devices(loaded)
    end704 = bat.at[704] + M704.length
    assert write(bat, end704 - 1, [0, 0]) == ILLEGAL_ADDRESS  # 704's last register and 713's ID
    assert write(bat, bat.at[701] + R.MODEL_701.offset("W"), [0]) == ILLEGAL_ADDRESS
    assert write(bat, SUNSPEC_BASE, [0, 0]) == ILLEGAL_ADDRESS  # the marker
    assert write(meter, meter.at[203] + R.MODEL_203.offset("W"), [0]) == ILLEGAL_ADDRESS
    # model 1 DA: the device address, "written" only to what it is
    assert write(meter, meter.at[1] + R.MODEL_1.offset("DA"), [1]) is None
    assert write(meter, meter.at[1] + R.MODEL_1.offset("DA"), [5]) == ILLEGAL_VALUE
    assert write(bat, bat.at[1] + R.MODEL_1.offset("DA"), [2]) is None


@pytest.mark.parametrize(
    ("point", "value", "code"),
    [
        ("SetOp", R.symbol(802, "SetOp", "DISCONNECT"), None),
        ("SetOp", 0, ILLEGAL_VALUE),  # 802's SetOp is 1-based
        ("SetInvState", R.symbol(802, "SetInvState", "INVERTER_STANDBY"), None),
        ("SetInvState", 4, ILLEGAL_VALUE),
        ("AlmRst", 1, None),
        ("AlmRst", 2, ILLEGAL_VALUE),
        ("SocRsvMax", 5000, None),  # 50 %
        ("SocRsvMax", 500, ILLEGAL_VALUE),  # 5 %: below SoCRsvMin (10 %)
        ("SoCRsvMin", 10100, ILLEGAL_VALUE),  # 101 %
        ("SoCRsvMin", 0xFFFF, ILLEGAL_VALUE),
        ("SoC", 5000, ILLEGAL_ADDRESS),  # read only
    ],
)
def test_802_writes_are_vetted(loaded: LoadedScenario, point: str, value: int, code: int | None) -> None:
    _, bat = devices(loaded)
    address = bat.at[802] + M802.offset(point)
    assert write(bat, address, [value]) == code
    if code is None:
        assert bat.image.get(address, 1).tolist() == [value]  # read back as written


# -- what the battery does ----------------------------------------------------------------------------------


def test_setpoint_modes(loaded: LoadedScenario) -> None:
    _, bat = devices(loaded)
    at = bat.at[704]
    assert bat.setpoint(1.0) == 0.0  # never written
    assert write(bat, at + M704.offset("WSet"), R.encode_int32(100e3)) is None
    assert bat.setpoint(1.0) == 0.0  # WSetEna DISABLED
    assert write(bat, at + M704.offset("WSetEna"), [1]) is None
    assert bat.setpoint(1.0) == 100e3  # WATTS
    values: R.Values = {"WSetMod": 0, "WSet": 0.0, "WSetRvrt": 0.0, "WSetPct": -40.0, "WSetPct_SF": -2, "WSet_SF": 0}
    pct = words_of(M704, values, "WSetMod", "WSet", "WSetRvrt", "WSetPct")
    assert write(bat, at + M704.offset("WSetMod"), pct) is None
    assert bat.setpoint(1.0) == pytest.approx(-0.4 * 0.5e6)  # W_MAX_PCT: -40 % of the rated power: charge


@pytest.mark.parametrize("ena_rvrt", [0, 1])
def test_reversion_after_the_timer_then_a_new_write_takes_over(loaded: LoadedScenario, ena_rvrt: int) -> None:
    _, bat = devices(loaded)
    at = bat.at[704]
    values: R.Values = {"WSetEnaRvrt": ena_rvrt, "WSetRvrtTms": 4, "WSet": -250e3, "WSetRvrt": 50e3, "WSet_SF": 0}
    values = {**values, "WSetEna": 1, "WSetMod": 1}
    assert write(bat, at + 22, words_of(M704, values, "WSetEna", "WSetMod", "WSet", "WSetRvrt"), 10.0) is None
    assert write(bat, at + 30, words_of(M704, values, "WSetEnaRvrt", "WSetRvrtTms"), 10.0) is None
    assert bat.values(704)["WSetRvrtRem"] == 4
    assert bat.setpoint(12.5) == -250e3 and bat.values(704)["WSetRvrtRem"] == 2
    # a heartbeat does not restart the timer
    assert write(bat, bat.at[802] + M802.offset("CtrlHb"), [9], 13.0) is None
    assert bat.setpoint(14.0) == (50e3 if ena_rvrt else 0.0) and bat.reverted
    assert bat.values(704)["WSetRvrtRem"] == 0
    assert bat.setpoint(100.0) == (50e3 if ena_rvrt else 0.0)  # it stays reverted
    assert write(bat, at + M704.offset("WSet"), R.encode_int32(-100e3), 101.0) is None  # a new setpoint write
    assert bat.setpoint(102.0) == -100e3 and not bat.reverted and bat.values(704)["WSetRvrtRem"] == 3


def test_no_reversion_without_a_reversion_time(loaded: LoadedScenario) -> None:
    _, bat = devices(loaded)
    at = bat.at[704]
    values: R.Values = {"WSetEna": 1, "WSetMod": 1, "WSet": 80e3, "WSet_SF": 0}
    assert write(bat, at + 22, words_of(M704, values, "WSetEna", "WSetMod", "WSet"), 1.0) is None
    assert bat.setpoint(1e6) == 80e3 and bat.values(704)["WSetRvrtRem"] == 0


def test_the_served_plant_builds_both_sunspec_devices(loaded: LoadedScenario) -> None:
    srv = PlantServer(loaded)
    assert srv.map_size(1) == 2 + sum(b.length for b in METER_MODELS) + 2
    assert srv.map_size(2) == 2 + sum(b.length for b in BATTERY_MODELS) + 2
    assert srv.meter_sf == srv.meter.w_sf and not srv.bess_written
