"""The register tables of docs/registers.md, generated from the maps and the SunSpec definitions in use.

`tests/test_registers.py` checks the doc holds exactly this text, so the doc can never drift from the code or
from the published SunSpec definitions.
"""

from __future__ import annotations

from collections.abc import Sequence

from dimmer.daemon.registers import building as B
from dimmer.daemon.registers import maps as M
from dimmer.daemon.registers.blocks import Block, Field, field_range
from dimmer.daemon.registers.sunspec import model, pysunspec2_version

# the points of each SunSpec model the daemon reads or writes, or the served plant fills in beyond the mandatory
# ones (names as in the definitions; offsets, types and scale factors come from them)
POINTS_USED: dict[int, tuple[str, ...]] = {
    1: ("Mn", "Md", "Opt", "Vr", "SN", "DA"),
    124: ("WChaMax", "StorCtl_Mod", "ChaState", "ChaSt", "OutWRte", "InWRte", "InOutWRte_RvrtTms",
          "WChaMax_SF", "ChaState_SF", "InOutWRte_SF"),
    203: ("A", "A_SF", "PhV", "V_SF", "Hz", "Hz_SF", "W", "W_SF", "TotWhExp", "TotWhImp", "TotWh_SF"),
    213: ("A", "PhV", "Hz", "W", "TotWhExp", "TotWhImp"),
    701: ("St", "ConnSt", "W", "Hz", "Hz_SF", "W_SF"),
    704: ("WSetEna", "WSetMod", "WSet", "WSetRvrt", "WSetPct", "WSetPctRvrt", "WSetEnaRvrt", "WSetRvrtTms",
          "WSetRvrtRem", "WSet_SF", "WSetPct_SF"),
    713: ("WHRtg", "WHAvail", "SoC", "SoH", "WH_SF", "Pct_SF"),
    802: ("AHRtg", "WHRtg", "WChaRteMax", "WDisChaRteMax", "SoCMax", "SoCMin", "SoC", "Hb", "CtrlHb", "State", "V",
          "A", "W", "SetOp", "SetInvState", "AHRtg_SF", "WHRtg_SF", "WChaDisChaMax_SF", "SoC_SF", "V_SF", "A_SF",
          "W_SF"),
}  # fmt: skip


def _order(f: Field) -> str:
    if f.kind == "string":
        return "bytes hi→lo"
    return "hi word first" if f.n >= 2 else ""


def _table(fields: Sequence[Field], base: str, scaled: bool = True) -> list[str]:
    head = "| offset | name | type | regs | word order | unit | scale | range | access | meaning |"
    rows = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for f in fields:
        scale = f"× 10^{f.sf}" if (scaled and f.sf) else ""
        rows.append(
            f"| {base}{f.offset} | {f.name} | {f.kind} | {f.n} | {_order(f)} | {f.unit} | {scale} | "
            f"{field_range(f)} | {f.access} | {f.desc} |"
        )
    return rows


def _sunspec_table(b: Block, names: Sequence[str]) -> list[str]:
    head = "| offset | name | type | regs | scale | access | M | symbols |"
    rows = [head, "|---|---|---|---|---|---|---|---|"]
    for name in names:
        f = b.field(name)
        syms = ", ".join(f"{s} = {v}" for s, v in f.symbols)
        rows.append(
            f"| +{f.offset} | {f.name} | {f.kind} | {f.n} | {f'× 10^{f.sf}' if f.sf else ''} | {f.access} | "
            f"{'M' if f.mandatory else ''} | {syms} |"
        )
    return rows


def registers_markdown() -> str:
    """The register tables of docs/registers.md (the prose around them lives in the doc)."""
    lines: list[str] = [f"SunSpec model definitions: pysunspec2 {pysunspec2_version()} (its bundled JSON).", ""]
    for mid, names in POINTS_USED.items():
        b = model(mid)
        lines += [f"#### Model {mid}: {b.name} (L = {b.length - 2})", ""]
        lines += _sunspec_table(b, names)
        lines.append("")
    lines += ["#### dimmer-rack-v1 header (address = offset)", ""]
    lines += _table(M.RACK_HEADER.fields, "")
    lines += [
        "",
        f"#### dimmer-rack-v1 command record of rack i: {M.RACK_CMD_BASE} + {M.RACK_CMD_STRIDE}·i + offset",
        "",
    ]
    lines += _table(M.RACK_COMMAND, "+")
    lines += [
        "",
        f"#### dimmer-rack-v1 status record of rack i: {M.RACK_STATUS_BASE} + {M.RACK_STATUS_STRIDE}·i + offset",
        "",
    ]
    lines += _table(M.RACK_STATUS, "+")
    lines += ["", "#### dimmer-site-v1 header (address = offset)", ""]
    lines += _table(M.SITE_HEADER.fields, "")
    lines += ["", f"#### dimmer-site-v1 job j: {M.SITE_JOB_BASE} + j", ""]
    lines += _table(M.SITE_JOB, "+")
    lines += ["", f"#### dimmer-site-v1 domain d: {M.SITE_DOMAIN_BASE} + {M.SITE_DOMAIN_STRIDE}·d + offset", ""]
    lines += _table(M.SITE_DOMAIN, "+")
    lines += ["", "#### dimmer-building-v1 header, report and budget (address = offset)", ""]
    lines += _table(B.BUILDING_HEADER.fields, "")
    group_at = f"{B.BUILDING_GROUP_BASE} + {B.BUILDING_GROUP_STRIDE}·g + offset"
    lines += ["", f"#### dimmer-building-v1 priority group g: {group_at}", ""]
    lines += _table(B.BUILDING_GROUP, "+")
    return "\n".join(lines) + "\n"
