"""Register blocks: fields at offsets, decoded and encoded as a whole, and fixed records decoded in one numpy pass.

A `Block` is either a SunSpec model (built from its published definition by `dimmer.daemon.registers.sunspec`)
or one of the project's own maps (`dimmer.daemon.registers.maps`). Numbers decode to floats — NaN where not
implemented, outside the field's declared range, or whose scale factor is missing — strings to str or None,
scale factors to their int or None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dimmer.daemon.registers.words import (
    SIZES,
    DecodeError,
    FloatArray,
    WordArray,
    apply_sf,
    as_words,
    decode_sf,
    decode_string,
    decoder,
    encode_kind,
    encode_sf,
    encode_string,
    na_words,
)

Span = tuple[int, int]  # [start, stop) register addresses
ILLEGAL_ADDRESS, ILLEGAL_VALUE = 2, 3  # Modbus exception codes a refused write is answered with
Values = Mapping[str, float | str | int | None]


@dataclass(frozen=True)
class Field:
    """One point of a register block.

    `offset` counts registers from the block start; `sf` names the scale-factor field of the same block; `lo..hi`
    is the declared range of the decoded (scaled) value: outside it the value decodes to NaN. `access` is "R" or
    "RW"; `unit` is the unit of the decoded value. For SunSpec points, `mandatory` and `static` come from the
    definition and `symbols` are the enum / bitfield names and their values, as the definition gives them.
    """

    name: str
    offset: int
    kind: str
    size: int = 0  # 0: the kind's natural size (strings must give it)
    unit: str = ""
    sf: str | None = None
    lo: float = -math.inf
    hi: float = math.inf
    access: str = "R"
    desc: str = ""
    mandatory: bool = False
    static: bool = False
    symbols: tuple[tuple[str, int], ...] = ()

    @property
    def n(self) -> int:
        return self.size or SIZES[self.kind]

    def symbol(self, name: str) -> int:
        """The value of the symbol `name` (KeyError naming the field if it has none of that name)."""
        for s, v in self.symbols:
            if s == name:
                return v
        raise KeyError(f"{self.name} has no symbol {name!r} (it has {', '.join(s for s, _ in self.symbols)})")


@dataclass(frozen=True)
class Block:
    """A fixed register block: its fields, its length in registers, and (for SunSpec models) the model id."""

    name: str
    length: int  # registers in the block (for a SunSpec model: L + 2)
    fields: tuple[Field, ...]
    model_id: int | None = None
    source: str = ""

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name}: no point {name!r}")

    def offset(self, name: str) -> int:
        """The offset of point `name` from the block start."""
        return self.field(name).offset

    @property
    def span(self) -> tuple[int, int]:
        """The smallest [start, stop) that covers every field (what a device needs to read)."""
        return min(f.offset for f in self.fields), max(f.offset + f.n for f in self.fields)

    def stop(self, *names: str) -> int:
        """The offset just past the last of the points named (what a read from +0 must cover to decode them and
        their scale factors)."""
        fields = [self.field(n) for n in names]
        fields += [self.field(f.sf) for f in fields if f.sf is not None]
        return max(f.offset + f.n for f in fields)


def _check_range(values: FloatArray, f: Field) -> FloatArray:
    if f.lo > -math.inf or f.hi < math.inf:
        with np.errstate(invalid="ignore"):
            bad = (values < f.lo) | (values > f.hi)
        if np.any(bad):
            values = values.copy()
            values[bad] = np.nan
    return values


def decode_block(
    block: Block, words: Sequence[int] | WordArray, start: int = 0, partial: bool = False
) -> dict[str, float | str | None]:
    """Decode every field of `block` from `words`, which hold the block's registers from offset `start` on.

    DecodeError if `words` do not cover every field, unless `partial`: then only the fields they cover are
    decoded (a value whose scale factor is not covered is NaN). Opaque points (pad, addresses) are skipped.
    """
    w = as_words(words)
    out: dict[str, float | str | None] = {}
    sfs: dict[str, int | None] = {}
    covered = [f for f in block.fields if f.offset >= start and f.offset - start + f.n <= w.shape[0]]
    if not partial and len(covered) < len(block.fields):
        f = next(f for f in block.fields if f not in covered)
        raise DecodeError(f"{block.name}: registers do not cover {f.name} at offset {f.offset}")
    for f in covered:
        if f.kind == "sunssf":
            sfs[f.name] = decode_sf(int(w[f.offset - start]))
    for f in covered:
        a, b = f.offset - start, f.offset - start + f.n
        chunk = w[a:b]
        if f.kind == "sunssf":
            out[f.name] = sfs[f.name]
        elif f.kind == "string":
            out[f.name] = decode_string(chunk)
        elif f.kind in ("pad", "eui48", "ipv6addr"):
            continue
        else:
            v = decoder(f.kind)(chunk)
            if f.sf is not None:
                v = apply_sf(v, sfs.get(f.sf))
            out[f.name] = float(_check_range(v, f)[0])
    return out


def encode_value(block: Block, f: Field, v: float | str | int | None, sf: int | None = None) -> list[int]:
    """The words of one point from its engineer value (None or NaN: "not implemented"); a scaled point needs its
    scale factor `sf` (None: the value is written as not implemented)."""
    if f.kind == "string":
        return encode_string(None if v is None else str(v), f.n)
    if f.kind == "sunssf":
        return encode_sf(None if v is None else int(v))
    if f.kind in ("pad", "eui48", "ipv6addr"):
        return na_words(f.kind, f.n)
    x = math.nan if v is None else float(v)
    if f.sf is not None:
        x = math.nan if sf is None else x / 10.0 ** int(sf)
    return encode_kind(f.kind, x)


def encode_block(block: Block, values: Values, fill_na: bool = True) -> list[int]:
    """The block's registers (length `block.length`) from engineer values; unspecified fields get their
    "not implemented" sentinel (or 0 with fill_na=False). Scaled fields use the scale factor given in `values`.
    For a SunSpec model the ID and L points are filled in. EncodeError if a value does not fit.
    """
    out = [0] * block.length
    for f in block.fields:
        if fill_na and f.kind != "pad":
            out[f.offset : f.offset + f.n] = na_words(f.kind, f.n)
    if block.model_id is not None:
        out[0], out[1] = block.model_id, block.length - 2
    for f in block.fields:
        if f.name not in values or f.name in ("ID", "L"):
            continue
        sf = values.get(f.sf) if f.sf is not None else None
        out[f.offset : f.offset + f.n] = encode_value(block, f, values[f.name], None if sf is None else int(sf))
    return out


def decode_records(
    fields: Sequence[Field], words: Sequence[int] | WordArray, n: int, stride: int
) -> dict[str, FloatArray]:
    """Decode `n` fixed records of `stride` registers (vectorised: one numpy pass per field).

    Only numeric fields without scale factors (the project's own maps). Values out of range -> NaN.
    """
    w = as_words(words)
    if w.shape[0] < n * stride:
        raise DecodeError(f"expected {n * stride} registers for {n} records of {stride}, got {w.shape[0]}")
    rec = w[: n * stride].reshape(n, stride)
    out: dict[str, FloatArray] = {}
    for f in fields:
        cols = rec[:, f.offset : f.offset + f.n]
        v = decoder(f.kind)(cols.reshape(-1)).reshape(n, -1)[:, 0]
        out[f.name] = _check_range(v, f)
    return out


def encode_records(fields: Sequence[Field], values: Mapping[str, FloatArray], n: int, stride: int) -> list[int]:
    """`n` fixed records of `stride` registers from per-record arrays (missing fields -> their NA sentinel)."""
    rec = np.zeros((n, stride), dtype=np.int64)
    for f in fields:
        if f.name in values:
            arr = np.broadcast_to(np.asarray(values[f.name], dtype=np.float64), (n,))
            words = np.asarray(encode_kind(f.kind, arr), dtype=np.int64).reshape(n, f.n)
        else:
            words = np.tile(np.asarray(na_words(f.kind, f.n), dtype=np.int64), (n, 1))
        rec[:, f.offset : f.offset + f.n] = words
    return rec.reshape(-1).tolist()


# -- what a client may write -------------------------------------------------------------------------------------


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    """Sorted, with overlapping and adjacent spans merged."""
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


_merge = merge_spans


def writable_spans(block: Block, at: int = 0) -> list[Span]:
    """The registers of `block`'s RW fields as [start, stop) spans from address `at` (adjacent fields merged)."""
    return merge_spans((at + f.offset, at + f.offset + f.n) for f in block.fields if f.access == "RW")


def span_allowed(spans: Sequence[Span], address: int, count: int) -> bool:
    """True when [address, address + count) lies inside one of `spans` (merged spans: one must hold it all)."""
    return count > 0 and any(a <= address and address + count <= b for a, b in spans)


def out_of_range(fields: Sequence[Field], values: Mapping[str, FloatArray]) -> str | None:
    """Why `values` (per-record arrays of the fields named) may not be written, or None: a value that is NaN, or
    outside its field's declared range (an infinity only where the range is unbounded). The first offence."""
    for f in fields:
        if f.name not in values:
            continue
        v = np.asarray(values[f.name], dtype=np.float64).reshape(-1)
        with np.errstate(invalid="ignore"):
            bad = np.isnan(v) | (v < f.lo) | (v > f.hi)
        if np.any(bad):
            i = int(np.argmax(bad))
            return f"{f.name} {float(v[i])!r} at record {i} outside its declared range {field_range(f) or 'any number'}"
    return None


def field_range(f: Field) -> str:
    """The declared range as text ("" when unbounded)."""
    if f.lo == -math.inf and f.hi == math.inf:
        return ""
    lo = "" if f.lo == -math.inf else f"{f.lo:g}"
    hi = "" if f.hi == math.inf else f"{f.hi:g}"
    return f"{lo}..{hi}"


def write_error(
    block: Block, address: int, count: int, cand: Sequence[int] | WordArray, *, na_ok: bool = False
) -> tuple[int, str] | None:
    """Why a write of `count` registers at `address` (from the block's start) that leaves the block's registers
    `cand` may not be stored: (Modbus exception code, why), or None. The one vetting path of every device map the
    project serves (the agent's and the plant's rack devices, the plant's site and SunSpec devices); the writable
    spans are the caller's to check first.

    - a point of several registers written in part (only the high word of a float, say): ILLEGAL_ADDRESS, the code
      a SunSpec device answers a write that does not cover whole points with, and the Modbus meaning of 0x02 (the
      address and the count do not fit the data): a value is written whole, in one request;
    - each point it touches, decoded (its scale factor applied): within the declared range `lo..hi` (an infinity
      only where that side is unbounded), an enum one of its symbols, and not NaN — unless `na_ok` (SunSpec: a point
      may be written "not implemented", and the model's own rules say where that is refused): ILLEGAL_VALUE.
    Strings, pads, bitfields and scale factors are not vetted here.
    """
    w = as_words(cand)
    stop = address + count
    touched = [f for f in block.fields if f.offset < stop and address < f.offset + f.n]
    for f in touched:
        if f.offset < address or f.offset + f.n > stop:
            return ILLEGAL_ADDRESS, f"{f.name} is {f.n} registers at {f.offset}: written in part"
    for f in touched:
        if f.kind in ("string", "pad", "eui48", "ipv6addr", "sunssf") or f.kind.startswith("bitfield"):
            continue
        v = float(decoder(f.kind)(w[f.offset : f.offset + f.n])[0])
        if f.sf is not None:
            v = float(apply_sf(v, decode_sf(int(w[block.field(f.sf).offset]))))
        if math.isnan(v):
            if na_ok and not f.symbols:
                continue
            return ILLEGAL_VALUE, f"{f.name} nan: not a number (nor a value of its declared range)"
        if f.symbols and v not in {sym for _, sym in f.symbols}:
            return ILLEGAL_VALUE, f"{f.name} {v:g}: not one of its symbols"
        if not f.lo <= v <= f.hi:  # an infinity passes only where its side of the range is unbounded
            return ILLEGAL_VALUE, f"{f.name} {v!r} outside its declared range {field_range(f) or 'any number'}"
    return None
