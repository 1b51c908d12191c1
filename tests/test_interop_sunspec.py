"""The served plant's SunSpec devices against implementations we did not write (issue 10), on loopback:

a. pysunspec2 (the SunSpec Alliance's client, with its own Modbus TCP code) scans the PCC meter and the battery:
   no model error, every length the definition's, every mandatory point implemented, every enum / bitfield value
   among its symbols, every scaled point's scale factor implemented, and the values the plant's physics;
b. pysunspec2 writes a 704 setpoint (its own scale handling, only the points it changed), the plant follows it
   and reverts to 0 W after WSetRvrtTms with no further write;
c. mbpoll (Debian package; skipped when absent) reads the marker, the model chain and a scaled meter value;
d. a pymodbus client's coil, discrete input, input register, mask write, read/write multiple and device
   identification requests are refused with exception 1 and apply nothing.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sunspec2 import device as sunspec_device
from sunspec2.modbus.client import SunSpecModbusClientDeviceTCP

from dimmer.daemon import registers as R
from gridsim.serve import BATTERY_MODELS, BATTERY_UNIT, METER_MODELS, METER_UNIT, SUNSPEC_BASE, PlantServer
from tests.test_serve import scenario, serve, until

ILLEGAL_FUNCTION, GATEWAY_TARGET_FAILED = 1, 0x0B


def scanned(port: int, unit: int) -> SunSpecModbusClientDeviceTCP:
    """A pysunspec2 client device for `unit`, scanned (every model read), disconnected."""
    dev = SunSpecModbusClientDeviceTCP(slave_id=unit, ipaddr="127.0.0.1", ipport=port, timeout=2.0)
    dev.scan()
    for m in dev.model_list:
        m.read()
    dev.close()
    return dev


def points(group: Any) -> Iterator[Any]:
    """Every point of a pysunspec2 model or group, its groups' included."""
    yield from group.points.values()
    for g in group.groups.values():
        for sub in g if isinstance(g, list) else [g]:
            yield from points(sub)


def deviations(dev: SunSpecModbusClientDeviceTCP) -> list[str]:
    """Everything in a scanned device that does not follow the model definitions, as pysunspec2 reads them."""
    out: list[str] = []
    for m in dev.model_list:
        mid = m.model_id
        if m.error_info:
            out.append(f"{mid}: {m.error_info.strip()}")
        if m.model_len != m.len:
            out.append(f"{mid}: L = {m.model_len}, the definition's {m.len}")
        for p in points(m):
            pdef, v = p.pdef, p.value
            name = f"{mid} {pdef['name']}"
            if pdef.get("mandatory") == "M" and v is None:
                out.append(f"{name}: mandatory, not implemented")
            syms = [int(s["value"]) for s in pdef.get("symbols", [])]
            if v is not None and pdef["type"].startswith("enum") and syms and v not in syms:
                out.append(f"{name}: {v} is not one of its symbols {syms}")
            if v is not None and pdef["type"].startswith("bitfield") and syms and v & ~sum(1 << s for s in syms):
                out.append(f"{name}: bits {v:#x} outside its symbols")
            if v is not None and p.sf_required and p.sf is not None:
                sf = m.points.get(p.sf)
                if sf is None or sf.value is None:
                    out.append(f"{name}: its scale factor {p.sf} is not implemented")
    return out


def symbol(dev: SunSpecModbusClientDeviceTCP, model_id: int, point: str, name: str) -> int:
    """A symbol's value from pysunspec2's own copy of the definition (not ours)."""
    gdef = sunspec_device.get_model_def(model_id)["group"]
    pdef = next(p for p in gdef["points"] if p["name"] == point)
    return int(next(s["value"] for s in pdef["symbols"] if s["name"] == name))


# -- a. pysunspec2 scans ---------------------------------------------------------------------------------------


def test_pysunspec2_scans_the_served_devices_with_zero_deviations(tmp_path: Path) -> None:
    async def body(srv: PlantServer) -> None:
        await until(lambda: srv.update_count >= 3)
        obs, uc = srv.last_obs, srv.update_count
        srv.stall(METER_UNIT)  # on the loop's thread, before any other publication: the images hold `obs`
        srv.stall(BATTERY_UNIT)
        assert obs is not None
        meter = await asyncio.to_thread(scanned, srv.port, METER_UNIT)
        battery = await asyncio.to_thread(scanned, srv.port, BATTERY_UNIT)
        assert deviations(meter) == [] and deviations(battery) == []
        assert [m.model_id for m in meter.model_list] == [b.model_id for b in METER_MODELS]
        assert [m.model_id for m in battery.model_list] == [b.model_id for b in BATTERY_MODELS]
        for m in meter.model_list + battery.model_list:
            assert m.model_len == R.model_length(m.model_id)

        # the values are the plant's physics
        ac = meter.models[203][0]
        res = 10.0**ac.W_SF.value
        assert ac.W_SF.value == srv.meter_sf and abs(ac.W.cvalue - obs.pcc_power_w) <= res / 2 + 1e-9
        assert ac.Hz.cvalue == pytest.approx(obs.grid_freq_hz, abs=0.005)
        assert ac.PPV.cvalue == 480.0 and ac.PhV.cvalue == pytest.approx(480.0 / math.sqrt(3), abs=0.05)
        assert ac.A.cvalue * ac.PhV.cvalue == pytest.approx(abs(obs.pcc_power_w), rel=5e-3)
        assert sum(getattr(ac, f"Wph{p}").cvalue for p in "ABC") == pytest.approx(ac.W.cvalue, abs=3 * res)
        wh_res = 10.0**ac.TotWh_SF.value
        assert ac.TotWhImp.cvalue == pytest.approx(srv.meter.energy.pos_wh, abs=wh_res)
        assert ac.TotWhImp.cvalue == pytest.approx(obs.pcc_power_w * obs.t_s / 3600, rel=0.3)  # ~ mean power x t
        assert ac.TotWhExp.cvalue == wh_res  # nothing exported: the counter's first count
        assert ac.Evt.value == 0
        common = battery.models[1][0]
        assert (common.Mn.value, common.Md.value, common.DA.value) == ("dimmer-gridsim", "campus battery", 2)
        m701, m713, m802 = (battery.models[k][0] for k in (701, 713, 802))
        assert m701.St.value == symbol(battery, 701, "St", "ON")
        assert m701.ConnSt.value == symbol(battery, 701, "ConnSt", "CONNECTED")
        assert m802.State.value == symbol(battery, 802, "State", "CONNECTED")
        assert m701.ACType.value == symbol(battery, 701, "ACType", "THREE_PHASE")
        assert m701.W.cvalue == pytest.approx(obs.bess_power_w, abs=10.0**m701.W_SF.value / 2 + 1e-9)
        assert m802.SoC.cvalue == pytest.approx(100 * obs.bess_soc_frac, abs=0.005)
        assert m713.SoC.cvalue == m802.SoC.cvalue
        assert m802.WChaRteMax.cvalue == m802.WDisChaRteMax.cvalue == srv.site.bess.power_w
        assert m802.WHRtg.cvalue == m713.WHRtg.cvalue == srv.site.bess.energy_j / 3600
        assert m802.V.cvalue == 800.0 and m802.AHRtg.cvalue * 800.0 == pytest.approx(m802.WHRtg.cvalue)
        assert m802.Typ.value == symbol(battery, 802, "Typ", "LITHIUM_ION")
        assert m802.Hb.value == uc & 0xFFFF  # the battery's heartbeat: the update count of `obs`

    serve(scenario(tmp_path), body, speed=20.0)


def test_pysunspec2_sees_the_battery_go_off_line(tmp_path: Path) -> None:
    async def body(srv: PlantServer) -> None:
        await until(lambda: srv.update_count >= 2)
        srv.set_battery_online(False)
        await until(lambda: srv.last_obs is not None and not srv.last_obs.bess_online)
        battery = await asyncio.to_thread(scanned, srv.port, BATTERY_UNIT)
        m701, m802 = battery.models[701][0], battery.models[802][0]
        assert m701.St.value == symbol(battery, 701, "St", "OFF") == 0
        assert m701.ConnSt.value == symbol(battery, 701, "ConnSt", "DISCONNECTED") == 0
        assert m802.State.value == symbol(battery, 802, "State", "DISCONNECTED") == 1
        assert all(m.error_info == "" for m in battery.model_list)

    serve(scenario(tmp_path), body, speed=20.0)


# -- b. pysunspec2 writes a setpoint ------------------------------------------------------------------------


def test_pysunspec2_writes_a_704_setpoint_the_plant_follows_then_reverts(tmp_path: Path) -> None:
    revert_s = 4

    def write(port: int, power_w: float, revert: int | None) -> SunSpecModbusClientDeviceTCP:
        dev = SunSpecModbusClientDeviceTCP(slave_id=BATTERY_UNIT, ipaddr="127.0.0.1", ipport=port, timeout=2.0)
        dev.scan()
        ctl = dev.DERCtlAC[0]
        ctl.read()
        ctl.WSetEna.value = symbol(dev, 704, "WSetEna", "ENABLED")
        ctl.WSetMod.value = symbol(dev, 704, "WSetMod", "WATTS")
        ctl.WSet.cvalue = power_w  # pysunspec2 scales it with the device's WSet_SF
        if revert is not None:
            ctl.WSetRvrtTms.value = revert
        ctl.write()  # only the points changed: [WSetEna, WSetMod, WSet], then [WSetRvrtTms]
        ctl.read()
        dev.close()
        return dev

    def change_wset(port: int, power_w: float) -> None:
        dev = SunSpecModbusClientDeviceTCP(slave_id=BATTERY_UNIT, ipaddr="127.0.0.1", ipport=port, timeout=2.0)
        dev.scan()
        ctl = dev.DERCtlAC[0]
        ctl.read()
        ctl.WSet.cvalue = power_w
        ctl.write()  # WSet alone: 2 registers
        dev.close()

    async def body(srv: PlantServer) -> None:
        await until(lambda: srv.update_count >= 2)
        dev = await asyncio.to_thread(write, srv.port, -200e3, revert_s)
        t = srv.plant_time_s()
        ctl = dev.DERCtlAC[0]
        assert (ctl.WSetEna.value, ctl.WSetMod.value, ctl.WSet.cvalue) == (1, 1, -200e3)
        assert 0 < ctl.WSetRvrtRem.value <= revert_s
        battery_writes = [w for w in srv.writes if w.unit == BATTERY_UNIT]
        at704 = SUNSPEC_BASE + R.model_offsets(list(BATTERY_MODELS))[704]
        assert [(w.address - at704, len(w.values), w.refused) for w in battery_writes] == [(22, 4, None), (31, 2, None)]
        await until(lambda: srv.last_obs is not None and srv.last_obs.t_s >= t + 2.5)
        assert srv.last_obs is not None and srv.last_obs.bess_power_w == pytest.approx(-200e3, rel=0.05)
        # a standard client changing only WSet: one write of 2 registers, and the timer restarts
        await asyncio.to_thread(change_wset, srv.port, 150e3)
        t = srv.plant_time_s()
        assert (srv.writes[-1].address - at704, len(srv.writes[-1].values)) == (24, 2)
        await until(lambda: srv.last_obs is not None and srv.last_obs.t_s >= t + 2.5)
        assert srv.last_obs is not None and srv.last_obs.bess_power_w == pytest.approx(150e3, rel=0.05)
        # then silence: WSetEnaRvrt is DISABLED, so at the end of WSetRvrtTms the function is off, 0 W
        await until(lambda: srv.last_obs is not None and srv.last_obs.t_s >= t + revert_s + 4.0)
        assert abs(srv.last_obs.bess_power_w) < 5e3
        after = await asyncio.to_thread(scanned, srv.port, BATTERY_UNIT)
        assert after.DERCtlAC[0].WSetRvrtRem.value == 0 and srv.battery.reverted

    serve(scenario(tmp_path), body, speed=20.0)


# -- c. mbpoll ------------------------------------------------------------------------------------------------


def mbpoll(port: int, unit: int, address: int, count: int, kind: str = "4:hex") -> list[int]:
    cmd = ["mbpoll", "-m", "tcp", "-p", str(port), "-0", "-1", "-o", "2", "-a", str(unit)]
    cmd += ["-r", str(address), "-c", str(count), "-t", kind, "127.0.0.1"]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    out = []
    for i in range(count):
        out.append(int(text.split(f"[{address + i}]:")[1].split()[0], 0))
    return out


def _i16(w: int) -> int:
    return w - 0x10000 if w & 0x8000 else w


@pytest.mark.skipif(shutil.which("mbpoll") is None, reason="mbpoll (Debian package mbpoll) is not installed")
def test_mbpoll_reads_the_marker_the_chain_and_a_scaled_value(tmp_path: Path) -> None:
    async def body(srv: PlantServer) -> None:
        await until(lambda: srv.update_count >= 2)
        obs = srv.last_obs
        srv.stall(METER_UNIT)
        assert obs is not None
        port = srv.port
        for unit, models in ((METER_UNIT, METER_MODELS), (BATTERY_UNIT, BATTERY_MODELS)):
            assert await asyncio.to_thread(mbpoll, port, unit, 40000, 2) == [0x5375, 0x6E53]  # "SunS"
            at, found = 40002, []
            while (hdr := await asyncio.to_thread(mbpoll, port, unit, at, 2))[0] != 0xFFFF:
                found.append(tuple(hdr))
                at += 2 + hdr[1]
            assert found == [(b.model_id, R.model_length(b.model_id or 0)) for b in models]
        at203 = SUNSPEC_BASE + R.model_offsets(list(METER_MODELS))[203]
        w, *_, w_sf = await asyncio.to_thread(mbpoll, port, METER_UNIT, at203 + R.MODEL_203.offset("W"), 5)
        assert R.MODEL_203.offset("W_SF") == R.MODEL_203.offset("W") + 4
        assert _i16(w_sf) == srv.meter_sf
        assert abs(_i16(w) * 10.0 ** _i16(w_sf) - obs.pcc_power_w) <= 10.0**srv.meter_sf / 2 + 1e-9

    serve(scenario(tmp_path), body, speed=20.0)


@pytest.mark.skipif(shutil.which("mbpoll") is None, reason="mbpoll (Debian package mbpoll) is not installed")
def test_mbpoll_gets_illegal_function_for_coils_and_input_registers(tmp_path: Path) -> None:
    def refused(port: int, kind: str) -> str:
        cmd = ["mbpoll", "-m", "tcp", "-p", str(port), "-0", "-1", "-o", "2", "-a", "1", "-r", "40000", "-t", kind]
        out = subprocess.run([*cmd, "127.0.0.1"], capture_output=True, text=True, timeout=10)
        return out.stdout + out.stderr

    async def body(srv: PlantServer) -> None:
        for kind in ("0", "1", "3"):  # coils, discrete inputs, input registers
            text = await asyncio.to_thread(refused, srv.port, kind)
            assert "Illegal function" in text, text

    serve(scenario(tmp_path), body, speed=20.0)


# -- d. function codes other than 3, 6, 16 ---------------------------------------------------------------------


def test_other_function_codes_are_illegal_functions_and_apply_nothing(tmp_path: Path) -> None:
    from pymodbus.client import AsyncModbusTcpClient

    async def body(srv: PlantServer) -> None:
        await until(lambda: srv.update_count >= 2)
        at704 = SUNSPEC_BASE + R.model_offsets(list(BATTERY_MODELS))[704]
        wset_ena = at704 + R.MODEL_704.offset("WSetEna")
        before = srv.words(BATTERY_UNIT, SUNSPEC_BASE, srv.map_size(BATTERY_UNIT))
        client = AsyncModbusTcpClient("127.0.0.1", port=srv.port, timeout=2, retries=0)
        await client.connect()
        try:
            requests = {
                1: client.read_coils(wset_ena, count=16, device_id=BATTERY_UNIT),
                2: client.read_discrete_inputs(wset_ena, count=16, device_id=BATTERY_UNIT),
                4: client.read_input_registers(SUNSPEC_BASE, count=2, device_id=BATTERY_UNIT),
                5: client.write_coil(wset_ena, True, device_id=BATTERY_UNIT),
                15: client.write_coils(wset_ena, [True] * 16, device_id=BATTERY_UNIT),
                22: client.mask_write_register(address=wset_ena, and_mask=0, or_mask=1, device_id=BATTERY_UNIT),
                23: client.readwrite_registers(
                    read_address=SUNSPEC_BASE, read_count=2, write_address=wset_ena, values=[1], device_id=2
                ),
                43: client.read_device_information(device_id=BATTERY_UNIT),
                8: client.diag_query_data(b"\x12\x34", device_id=BATTERY_UNIT),
            }
            for fc, request in requests.items():
                rr = await request
                assert rr.isError() and rr.exception_code == ILLEGAL_FUNCTION, (fc, rr)
                assert rr.function_code == fc | 0x80, (fc, rr)
            # a unit the plant does not have: 0x0B whatever the function
            rr = await client.read_coils(0, count=1, device_id=9)
            assert rr.isError() and rr.exception_code == GATEWAY_TARGET_FAILED
            # nothing applied, every refused write recorded
            assert srv.words(BATTERY_UNIT, SUNSPEC_BASE, srv.map_size(BATTERY_UNIT)) == before
            assert [(w.function, w.refused) for w in srv.writes] == [(fc, 1) for fc in (5, 15, 22, 23)]
            assert srv.writes[-1].values == (1,) and srv.writes[-1].address == wset_ena
            # the three functions served still are: 3, 6 (WSetEna alone), 16
            rr = await client.read_holding_registers(SUNSPEC_BASE, count=2, device_id=BATTERY_UNIT)
            assert not rr.isError() and rr.registers == list(R.SUNS_MARKER)
            rr = await client.write_register(wset_ena, 1, device_id=BATTERY_UNIT)
            assert not rr.isError() and srv.writes[-1].function == 6 and srv.writes[-1].refused is None
            rr = await client.write_registers(wset_ena, [0], device_id=BATTERY_UNIT)
            assert not rr.isError() and srv.words(BATTERY_UNIT, wset_ena, 1) == [0]
        finally:
            client.close()

    serve(scenario(tmp_path), body, speed=20.0)
