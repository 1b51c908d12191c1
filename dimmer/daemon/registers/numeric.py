"""Decoding the project's own numeric blocks with `struct`: what a coordinator reading dozens of building devices a
period can afford.

`decode_block` and `decode_records` make a few numpy calls per point (or per field); for a header of ~30 points
read from each of 44 buildings a second that was ~1 ms a building, two thirds of a 1M-GPU coordinator's own CPU a
cycle. Here one `struct.Struct` unpacks a whole block (or a handful of records) from its words, and the
"not implemented" sentinels and declared ranges are applied point by point in plain Python: the same values
(tests/test_registers.py holds the two equal on random words), about 30x less CPU.

Numbers without scale factors only (the project's own maps); strings decode as `decode_block` does.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from dimmer.daemon.registers.blocks import Block, Field
from dimmer.daemon.registers.words import (
    ACC32_NA,
    I16_NA,
    I32_NA,
    U16_NA,
    U32_NA,
    DecodeError,
    FloatArray,
    WordArray,
    decode_string,
)

# struct code and the value its "not implemented" sentinel unpacks to (NaN: a float's own NaN, never equal)
CODES: dict[str, tuple[str, float]] = {
    "uint16": ("H", U16_NA),
    "enum16": ("H", U16_NA),
    "int16": ("h", I16_NA - 0x10000),
    "uint32": ("I", U32_NA),
    "bitfield32": ("I", U32_NA),
    "int32": ("i", I32_NA - 0x100000000),
    "acc32": ("I", ACC32_NA),
    "float32": ("f", math.nan),
}
OPAQUE_KINDS = ("string", "pad", "eui48", "ipv6addr")
NOT_WORDS = "register words must be integers in 0..65535"


def words_bytes(words: Sequence[int] | WordArray, n: int, what: str) -> bytes:
    """The first `n` words as big-endian bytes; DecodeError if fewer, or one is not a word."""
    if len(words) < n:
        raise DecodeError(f"{what}: {len(words)} registers do not cover its {n}")
    try:
        return struct.pack(f">{n}H", *words[:n])
    except struct.error:
        raise DecodeError(NOT_WORDS) from None


class _Layout:
    """The numeric points of some fields as one struct (gaps and opaque points skipped), with what applies to each
    unpacked value: its sentinel and its declared range."""

    def __init__(self, fields: Sequence[Field], length: int) -> None:
        numeric = sorted((f for f in fields if f.kind not in OPAQUE_KINDS), key=lambda f: f.offset)
        if any(f.sf is not None or f.kind not in CODES for f in numeric):
            raise ValueError("scaled points or types struct does not carry: use decode_block")
        fmt, at = ">", 0
        for f in numeric:
            if f.offset < at:
                raise ValueError(f"{f.name} overlaps the point before it")
            fmt += "xx" * (f.offset - at) + CODES[f.kind][0]
            at = f.offset + len(struct.pack(">" + CODES[f.kind][0], 0)) // 2
        fmt += "xx" * (length - at)
        self.struct = struct.Struct(fmt)
        self.points = [(f.name, CODES[f.kind][1], f.lo, f.hi) for f in numeric]

    def values(self, unpacked: Sequence[Any]) -> list[float]:
        out = []
        for (_, na, lo, hi), v in zip(self.points, unpacked, strict=True):
            out.append(math.nan if v == na or not lo <= v <= hi else float(v))
        return out


class NumericDecoder:
    """`decode_block` for a block of the project's own maps: one struct unpack, not a numpy call per point."""

    def __init__(self, block: Block) -> None:
        if any(f.sf is not None or f.kind == "sunssf" for f in block.fields):
            raise ValueError(f"{block.name}: scaled points: use decode_block")
        self.block = block
        self.length = max(f.offset + f.n for f in block.fields)
        self.strings = [f for f in block.fields if f.kind == "string"]
        self.layout = _Layout(block.fields, self.length)
        self.names = [name for name, *_ in self.layout.points]

    def decode(self, words: Sequence[int] | WordArray) -> dict[str, float | str | None]:
        raw = words_bytes(words, self.length, self.block.name)
        out: dict[str, float | str | None] = {}
        for f in self.strings:
            out[f.name] = decode_string(np.frombuffer(raw, ">u2", f.n, 2 * f.offset).astype(np.uint16))
        out.update(zip(self.names, self.layout.values(self.layout.struct.unpack(raw)), strict=True))
        return out


class RecordDecoder:
    """`decode_records` for a few fixed records (a building's priority groups): one struct pass over them all."""

    def __init__(self, fields: Sequence[Field], stride: int) -> None:
        self.layout = _Layout(fields, stride)
        self.stride = stride

    def decode(self, words: Sequence[int] | WordArray, n: int) -> dict[str, FloatArray]:
        raw = words_bytes(words, n * self.stride, f"{n} records of {self.stride}")
        rows = [self.layout.values(v) for v in self.layout.struct.iter_unpack(raw)]
        cols = np.array(rows, dtype=np.float64).reshape(n, len(self.layout.points))
        return {name: cols[:, i].copy() for i, (name, *_) in enumerate(self.layout.points)}
