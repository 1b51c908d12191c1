"""SunSpec models as the SunSpec Alliance publishes them, read from the definitions pysunspec2 ships — never retyped.

Each model we speak is built once from `sunspec2/models/json/model_<id>.json` (the JSON of the `sunspec/models`
repository that pysunspec2 bundles) into a `Block`: every point's offset and size, type, scale-factor point,
access, mandatory / static flags and enum / bitfield symbols, and the model length L. Fixed groups (704's
`PFWInj` ... `PFWAbsRvrt`) are laid out after the top-level points in definition order, their points named
`Group.Point`; repeating groups (count 0, none in the models we speak) would be refused.

Device logic names points and symbols (`block.offset("WSet_SF")`, `symbol(704, "WSetMod", "WATTS")`), so a
layout or an enum base can never again be typed differently on the two sides of the wire.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import cache
from importlib import metadata
from typing import Any

from sunspec2 import device as sunspec_device
from sunspec2 import mdef as sunspec_mdef

from dimmer.daemon.registers.blocks import Block, Field, Values, encode_block
from dimmer.daemon.registers.words import SIZES, DecodeError, WordArray, as_words

SUNS_MARKER = (0x5375, 0x6E53)  # "SunS"
SUNSPEC_BASES = (40000, 0, 50000)  # where to look for the marker, in this order
SUNSPEC_END = (0xFFFF, 0x0000)

# the models the daemon reads or writes, and the served plant serves
SPOKEN = (1, 124, 201, 202, 203, 204, 211, 212, 213, 214, 701, 704, 713, 802)
METERS_INT = (201, 202, 203, 204)  # ac_meter, int16 + scale factors: single phase, split phase, wye, delta
METERS_FLOAT = (211, 212, 213, 214)  # the same meters in float32
DEFINITIONS_DIR = os.path.join(sunspec_device.models_dir, "json")


def pysunspec2_version() -> str:
    """The version of pysunspec2 whose model definitions are in use."""
    try:
        return metadata.version("pysunspec2")
    except metadata.PackageNotFoundError:  # pragma: no cover - an unpackaged checkout of pysunspec2
        return "unknown"


@cache
def definition(model_id: int) -> dict[str, Any]:
    """The published definition of a model (the JSON pysunspec2 ships), loaded from pysunspec2's own directory —
    not from the working directory, which pysunspec2's own loader searches first."""
    path = os.path.join(DEFINITIONS_DIR, sunspec_mdef.to_json_filename(model_id))
    try:
        d: dict[str, Any] = sunspec_mdef.from_json_file(path)
    except FileNotFoundError:
        raise KeyError(f"no SunSpec model {model_id} among pysunspec2's definitions") from None
    return d


def _fields(group: Mapping[str, Any], at: int, prefix: str) -> tuple[list[Field], int]:
    out: list[Field] = []
    for p in group.get("points", []):
        kind = str(p["type"])
        size = int(p.get("size") or SIZES[kind])
        if kind != "string" and size != SIZES.get(kind, size):
            raise DecodeError(f"{prefix}{p['name']}: size {size} does not match type {kind}")
        out.append(
            Field(
                name=prefix + str(p["name"]),
                offset=at,
                kind=kind,
                size=size if kind == "string" else 0,
                unit=str(p.get("units") or ""),
                sf=_sf_name(p, prefix),
                access=str(p.get("access", "R")),
                desc=str(p.get("desc") or p.get("label") or ""),
                mandatory=p.get("mandatory") == "M",
                static=p.get("static") == "S",
                symbols=tuple((str(s["name"]), int(s["value"])) for s in p.get("symbols", [])),
            )
        )
        at += size
    for g in group.get("groups", []):
        count = g.get("count", 1)
        if not isinstance(count, int) or count < 1:
            raise DecodeError(f"{prefix}{g['name']}: repeating group (count {count!r}) in a fixed model")
        for i in range(count):
            name = g["name"] if count == 1 else f"{g['name']}[{i}]"
            sub, at = _fields(g, at, f"{prefix}{name}.")
            out += sub
    return out, at


def _sf_name(p: Mapping[str, Any], prefix: str) -> str | None:
    # a group point's scale factor is a top-level point of the model (704: PFWInj.PF uses PF_SF), named as is
    sf = p.get("sf")
    if sf is None:
        return None
    if not isinstance(sf, str):
        raise DecodeError(f"{prefix}{p['name']}: a constant scale factor ({sf!r}) is not supported")
    return sf


@cache
def model(model_id: int) -> Block:
    """The `Block` of a SunSpec model, from its published definition: offsets from the ID register (+0)."""
    d = definition(model_id)
    if int(d["id"]) != model_id:
        raise DecodeError(f"model_{model_id}.json defines model {d['id']}")
    g = d["group"]
    fields, length = _fields(g, 0, "")
    if [f.name for f in fields[:2]] != ["ID", "L"]:
        raise DecodeError(f"model {model_id}: the definition does not start with ID, L")
    return Block(
        name=str(g["name"]),
        length=length,
        fields=tuple(fields),
        model_id=model_id,
        source=f"pysunspec2 {pysunspec2_version()}: models/json/model_{model_id}.json",
    )


def model_length(model_id: int) -> int:
    """L, the model length the definition gives (registers after ID and L)."""
    return model(model_id).length - 2


def symbol(model_id: int, point: str, name: str) -> int:
    """The value of symbol `name` of `point` in a model (0-based or 1-based as the definition says)."""
    return model(model_id).field(point).symbol(name)


def check_suns(words: Sequence[int] | WordArray) -> None:
    """DecodeError unless the two words are the "SunS" marker."""
    w = as_words(words, 2)
    if (int(w[0]), int(w[1])) != SUNS_MARKER:
        raise DecodeError(f"no SunSpec marker (got 0x{int(w[0]):04X} 0x{int(w[1]):04X}, expected 'SunS')")


def model_header(words: Sequence[int] | WordArray) -> tuple[int, int] | None:
    """(model id, L) of a model header, or None at the end marker (id 0xFFFF)."""
    w = as_words(words, 2)
    if int(w[0]) == 0xFFFF:
        return None
    return int(w[0]), int(w[1])


def sunspec_image(models: Sequence[tuple[Block, Values]]) -> list[int]:
    """A SunSpec device's register image from its base: "SunS", each model's block, the end marker."""
    out = list(SUNS_MARKER)
    for block, values in models:
        out += encode_block(block, values)
    return out + list(SUNSPEC_END)


def model_offsets(models: Sequence[Block]) -> dict[int, int]:
    """Offsets (from the base) of each model's ID register in an image built by `sunspec_image`."""
    out: dict[int, int] = {}
    at = 2
    for b in models:
        out[b.model_id or 0] = at
        at += b.length
    return out
