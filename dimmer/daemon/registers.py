"""Sans-IO register codecs and the register maps the daemon speaks. No sockets here.

Conventions (Modbus holding registers, 16-bit words):

- Bytes in a register are big-endian (Modbus); multi-register values are **big-endian word order** too: the
  most significant word comes first (the SunSpec rule, and "ABCD" in the usual notation).
- "Not implemented" sentinels decode to NaN (numbers) or None (strings), never to zero:
  int16 0x8000, uint16 / enum16 0xFFFF, int32 0x80000000, uint32 / bitfield32 0xFFFFFFFF, acc32 0x00000000,
  float32 NaN (0x7FC00000 is what we write), sunssf 0x8000, string all NUL.
- SunSpec scale factors: value = raw x 10^sf, sf a signed int16 in [-10, 10]; an unimplemented or out-of-range
  scale factor makes every value that uses it NaN.
- A decoded value outside its field's declared range is NaN (an error value), never clamped.
- Arbitrary words never raise anything but `DecodeError` (wrong length, a word outside 0..65535, a missing
  "SunS" marker, a block with the wrong model id or magic).

The maps (every register is listed in docs/registers.md, rendered by `registers_markdown()`):

- SunSpec: the "SunS" marker at base 40000 (0 and 50000 are the other places to look), then a chain of models
  `[ID, L, L registers...]` ended by `[0xFFFF, 0]`. We use model 1 (common: Mn, Md, SN), 203 (int + scale factor
  meter) or 213 (float meter) for total W, 701 (DER AC measurement: W, state), 704 (DER AC controls: WSet,
  WSetEna, reversion), 802 (battery: SoC, charge / discharge rate limits, controller heartbeat) and, read only
  as a fallback for the SoC, 713 (storage capacity). Point offsets are those of the sunspec/models JSON files.
- `dimmer-rack-v1`: the project's map of a rack power / cap device (one device serves up to 64 racks).
- `dimmer-site-v1`: the project's map of the site device (domain meters, limits in force, grid, jobs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dimmer.errors import DimmerError

FloatArray = npt.NDArray[np.float64]
WordArray = npt.NDArray[np.uint16]


class RegisterError(DimmerError):
    """Base of the codec errors."""


class DecodeError(RegisterError):
    """Registers that cannot be decoded at all: wrong length, a word out of 0..65535, a bad marker, magic or id."""


class EncodeError(RegisterError):
    """A value that cannot be represented in its register type (too large, not an integer where one is needed)."""


# -- sentinels -----------------------------------------------------------------------------------------------------

I16_NA = 0x8000
U16_NA = 0xFFFF
I32_NA = 0x80000000
U32_NA = 0xFFFFFFFF
ACC32_NA = 0x00000000
F32_NA = 0x7FC00000
SF_NA = 0x8000
SF_MIN, SF_MAX = -10, 10

SUNS_MARKER = (0x5375, 0x6E53)  # "SunS"
SUNSPEC_BASES = (40000, 0, 50000)  # where to look for the marker, in this order
SUNSPEC_END = (0xFFFF, 0x0000)
MAX_READ = 125  # Modbus: registers per read request (function 3)
MAX_WRITE = 123  # Modbus: registers per write request (function 16)

KINDS = ("uint16", "int16", "enum16", "sunssf", "uint32", "int32", "acc32", "bitfield32", "float32", "string", "pad")
_SIZE = {"uint16": 1, "int16": 1, "enum16": 1, "sunssf": 1, "pad": 1, "uint32": 2, "int32": 2, "acc32": 2}
_SIZE |= {"bitfield32": 2, "float32": 2}


# -- word arrays -----------------------------------------------------------------------------------------------------


def as_words(words: Sequence[int] | npt.NDArray[np.integer], count: int | None = None) -> WordArray:
    """The words as a uint16 array; DecodeError if one is outside 0..65535 or the count is not `count`."""
    try:
        arr = np.asarray(words, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        raise DecodeError("register words must be integers in 0..65535") from None
    if arr.ndim != 1:
        raise DecodeError("register words must be a flat sequence")
    if count is not None and arr.shape[0] != count:
        raise DecodeError(f"expected {count} registers, got {arr.shape[0]}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFF):
        raise DecodeError("register words must be integers in 0..65535")
    return arr.astype(np.uint16)


def _pairs(w: WordArray) -> npt.NDArray[np.uint32]:
    if w.shape[-1] % 2:
        raise DecodeError(f"32-bit values need an even number of registers, got {w.shape[-1]}")
    w32 = w.astype(np.uint32)
    out: npt.NDArray[np.uint32] = (w32[..., 0::2] << np.uint32(16)) | w32[..., 1::2]
    return out


def _split32(u: npt.NDArray[np.uint32]) -> WordArray:
    out = np.empty((*u.shape[:-1], u.shape[-1] * 2), dtype=np.uint16)
    out[..., 0::2] = (u >> np.uint32(16)).astype(np.uint16)
    out[..., 1::2] = (u & np.uint32(0xFFFF)).astype(np.uint16)
    return out


# -- decoders: words -> float arrays (NaN where not implemented) ----------------------------------------------------


def decode_uint16(words: Sequence[int] | WordArray) -> FloatArray:
    """One value per register; 0xFFFF -> NaN."""
    w = as_words(words)
    out = w.astype(np.float64)
    out[w == U16_NA] = np.nan
    return out


def decode_int16(words: Sequence[int] | WordArray) -> FloatArray:
    """One value per register, two's complement; 0x8000 -> NaN."""
    w = as_words(words)
    out = w.view(np.int16).astype(np.float64)
    out[w == I16_NA] = np.nan
    return out


def decode_uint32(words: Sequence[int] | WordArray) -> FloatArray:
    """One value per two registers, high word first; 0xFFFFFFFF -> NaN."""
    u = _pairs(as_words(words))
    out = u.astype(np.float64)
    out[u == U32_NA] = np.nan
    return out


def decode_int32(words: Sequence[int] | WordArray) -> FloatArray:
    """One value per two registers, high word first, two's complement; 0x80000000 -> NaN."""
    u = _pairs(as_words(words))
    out = u.view(np.int32).astype(np.float64)
    out[u == I32_NA] = np.nan
    return out


def decode_acc32(words: Sequence[int] | WordArray) -> FloatArray:
    """A SunSpec 32-bit accumulator, high word first; 0 means "not accumulated" -> NaN."""
    u = _pairs(as_words(words))
    out = u.astype(np.float64)
    out[u == ACC32_NA] = np.nan
    return out


def decode_float32(words: Sequence[int] | WordArray) -> FloatArray:
    """IEEE 754 binary32, high word first; any NaN pattern -> NaN; infinities stay infinite."""
    u = _pairs(as_words(words))
    with np.errstate(invalid="ignore"):  # a signalling NaN (e.g. 0x7F800001) is a NaN too, not a warning
        out: FloatArray = u.view(np.float32).astype(np.float64)
    return out


def decode_string(words: Sequence[int] | WordArray) -> str | None:
    """ASCII, two characters a register, high byte first, NUL padded; all NUL -> None. Non-ASCII bytes -> '?'."""
    w = as_words(words)
    raw = w.astype(">u2").tobytes().rstrip(b"\x00")
    if not raw:
        return None
    return raw.split(b"\x00", 1)[0].decode("ascii", errors="replace").replace("\ufffd", "?")


def decode_sf(word: int) -> int | None:
    """A SunSpec scale factor: a signed int16 in [-10, 10]; 0x8000 or anything outside the range -> None."""
    (w,) = as_words([word])
    if int(w) == SF_NA:
        return None
    sf = int(np.int16(w.view(np.int16)))
    return sf if SF_MIN <= sf <= SF_MAX else None


def apply_sf(raw: FloatArray | float, sf: int | None) -> FloatArray:
    """value = raw x 10^sf; NaN everywhere when the scale factor is missing."""
    arr = np.asarray(raw, dtype=np.float64)
    if sf is None:
        return np.full(arr.shape, np.nan)
    out: FloatArray = arr * (10.0**sf)
    return out


# -- encoders: values -> words ---------------------------------------------------------------------------------------


def _ints(values: Iterable[float] | FloatArray | float, lo: int, hi: int, na: int, kind: str) -> npt.NDArray[np.int64]:
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64))
    nan = np.isnan(arr)
    fin = np.where(nan, 0.0, arr)
    if not np.all(np.isfinite(fin)):
        raise EncodeError(f"{kind}: infinite value")
    r = np.rint(fin)
    if np.any(r < lo) or np.any(r > hi):
        bad = fin[(r < lo) | (r > hi)][0]
        raise EncodeError(f"{kind}: {bad!r} outside {lo}..{hi}")
    out = r.astype(np.int64)
    out[nan] = na
    return out


def encode_uint16(values: Iterable[float] | FloatArray | float) -> list[int]:
    """Round to the nearest integer in 0..65534; NaN -> 0xFFFF."""
    return _ints(values, 0, U16_NA - 1, U16_NA, "uint16").tolist()


def encode_int16(values: Iterable[float] | FloatArray | float) -> list[int]:
    """Round to the nearest integer in -32767..32767; NaN -> 0x8000."""
    v = _ints(values, -0x7FFF, 0x7FFF, -0x8000, "int16")
    return (v & 0xFFFF).tolist()


def encode_uint32(values: Iterable[float] | FloatArray | float) -> list[int]:
    """Round to an integer in 0..2^32-2, high word first; NaN -> 0xFFFFFFFF."""
    v = _ints(values, 0, U32_NA - 1, U32_NA, "uint32").astype(np.uint32)
    return _split32(v).tolist()


def encode_int32(values: Iterable[float] | FloatArray | float) -> list[int]:
    """Round to an integer in -(2^31-1)..2^31-1, high word first; NaN -> 0x80000000."""
    v = _ints(values, -0x7FFFFFFF, 0x7FFFFFFF, -0x80000000, "int32")
    return _split32((v & 0xFFFFFFFF).astype(np.uint32)).tolist()


def encode_acc32(values: Iterable[float] | FloatArray | float) -> list[int]:
    """A 32-bit accumulator 1..2^32-1 (it wraps to 1 past the top: 0 means "not accumulated"); NaN -> 0."""
    v = _ints(values, 0, 2**62, ACC32_NA, "acc32")
    v = np.where(v > 0, (v - 1) % 0xFFFFFFFF + 1, 0)
    return _split32(v.astype(np.uint32)).tolist()


def encode_float32(values: Iterable[float] | FloatArray | float) -> list[int]:
    """IEEE 754 binary32, high word first; NaN -> 0x7FC00000; a finite value beyond float32 -> EncodeError."""
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64))
    fin = np.isfinite(arr)
    if np.any(np.abs(arr[fin]) > float(np.finfo(np.float32).max)):
        raise EncodeError("float32: value beyond the float32 range")
    f = arr.astype(np.float32)
    u = f.view(np.uint32).copy()
    u[np.isnan(arr)] = F32_NA
    return _split32(u).tolist()


def encode_string(text: str | None, size: int) -> list[int]:
    """ASCII in `size` registers, NUL padded; None -> all NUL. EncodeError if too long, not ASCII or holds NUL."""
    if text is None:
        return [0] * size
    if "\x00" in text:
        raise EncodeError("string: NUL inside the text")
    try:
        raw = text.encode("ascii")
    except UnicodeEncodeError:
        raise EncodeError(f"string: {text!r} is not ASCII") from None
    if len(raw) > 2 * size:
        raise EncodeError(f"string: {text!r} longer than {2 * size} characters")
    raw = raw.ljust(2 * size, b"\x00")
    return np.frombuffer(raw, dtype=">u2").astype(np.int64).tolist()


def encode_sf(sf: int | None) -> list[int]:
    """A scale factor in [-10, 10]; None -> 0x8000."""
    if sf is None:
        return [SF_NA]
    if not SF_MIN <= sf <= SF_MAX or int(sf) != sf:
        raise EncodeError(f"sunssf: {sf!r} outside {SF_MIN}..{SF_MAX}")
    return [int(sf) & 0xFFFF]


def sf_for(max_abs: float, digits: int = 4) -> int:
    """The smallest scale factor (at least -digits) that fits |value| <= max_abs in an int16, for a device to serve."""
    sf = max(-digits, SF_MIN)
    if not math.isfinite(max_abs) or max_abs <= 0:
        return sf
    while max_abs / 10.0**sf > 32767 and sf < SF_MAX:
        sf += 1
    return sf


_DECODERS = {
    "uint16": decode_uint16,
    "enum16": decode_uint16,
    "int16": decode_int16,
    "uint32": decode_uint32,
    "bitfield32": decode_uint32,
    "int32": decode_int32,
    "acc32": decode_acc32,
    "float32": decode_float32,
}
_ENCODERS = {
    "uint16": encode_uint16,
    "enum16": encode_uint16,
    "int16": encode_int16,
    "uint32": encode_uint32,
    "bitfield32": encode_uint32,
    "int32": encode_int32,
    "acc32": encode_acc32,
    "float32": encode_float32,
}


# -- fields and blocks -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One point of a register block.

    `offset` counts registers from the block start; `sf` names the scale-factor field of the same block; `lo..hi`
    is the declared range of the decoded (scaled) value: outside it the value decodes to NaN. `access` is "R" or
    "RW"; `unit` is the unit of the decoded value.
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

    @property
    def n(self) -> int:
        return self.size or _SIZE[self.kind]


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
        raise KeyError(name)

    @property
    def span(self) -> tuple[int, int]:
        """The smallest [start, stop) that covers every field (what a device needs to read)."""
        return min(f.offset for f in self.fields), max(f.offset + f.n for f in self.fields)


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

    Numbers come back as floats (NaN where not implemented, out of range, or its scale factor is missing),
    strings as str or None, scale factors as their int or None. DecodeError if `words` do not cover every field,
    unless `partial`: then only the fields they cover are decoded (a value whose scale factor is not covered
    is NaN).
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
        elif f.kind == "pad":
            continue
        else:
            v = _DECODERS[f.kind](chunk)
            if f.sf is not None:
                v = apply_sf(v, sfs.get(f.sf))
            out[f.name] = float(_check_range(v, f)[0])
    return out


def encode_block(block: Block, values: Mapping[str, float | str | int | None], fill_na: bool = True) -> list[int]:
    """The block's registers (length `block.length`) from engineer values; unspecified fields get their
    "not implemented" sentinel (or 0 with fill_na=False). Scaled fields use the scale factor given in `values`.
    For a SunSpec model the ID and L points are filled in. EncodeError if a value does not fit.
    """
    out = [0] * block.length
    for f in block.fields:
        if fill_na and f.kind not in ("string", "pad"):
            out[f.offset : f.offset + f.n] = _na_words(f.kind)
    if block.model_id is not None:
        out[0], out[1] = block.model_id, block.length - 2
    for f in block.fields:
        if f.name not in values:
            continue
        v = values[f.name]
        if f.kind == "string":
            words = encode_string(None if v is None else str(v), f.n)
        elif f.kind == "sunssf":
            words = encode_sf(None if v is None else int(v))
        else:
            x = math.nan if v is None else float(v)
            if f.sf is not None:
                sf = values.get(f.sf)
                x = math.nan if sf is None else x / 10.0 ** int(sf)
            words = _ENCODERS[f.kind](x)
        out[f.offset : f.offset + f.n] = words
    return out


def _na_words(kind: str) -> list[int]:
    return {
        "uint16": [U16_NA],
        "enum16": [U16_NA],
        "int16": [I16_NA],
        "sunssf": [SF_NA],
        "uint32": [0xFFFF, 0xFFFF],
        "bitfield32": [0xFFFF, 0xFFFF],
        "int32": [0x8000, 0x0000],
        "acc32": [0, 0],
        "float32": [0x7FC0, 0x0000],
    }.get(kind, [0] * _SIZE.get(kind, 1))


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
        v = _DECODERS[f.kind](cols.reshape(-1)).reshape(n, -1)[:, 0]
        out[f.name] = _check_range(v, f)
    return out


def encode_records(fields: Sequence[Field], values: Mapping[str, FloatArray], n: int, stride: int) -> list[int]:
    """`n` fixed records of `stride` registers from per-record arrays (missing fields -> their NA sentinel)."""
    rec = np.zeros((n, stride), dtype=np.int64)
    for f in fields:
        if f.name in values:
            arr = np.broadcast_to(np.asarray(values[f.name], dtype=np.float64), (n,))
            words = np.asarray(_ENCODERS[f.kind](arr), dtype=np.int64).reshape(n, f.n)
        else:
            words = np.tile(np.asarray(_na_words(f.kind), dtype=np.int64), (n, 1))
        rec[:, f.offset : f.offset + f.n] = words
    return rec.reshape(-1).tolist()


# -- SunSpec models (offsets from the model's ID register; sunspec/models json/model_<id>.json) -------------------

_W = dict(unit="W")

MODEL_1 = Block(
    "common",
    68,
    (
        Field("Mn", 2, "string", 16, desc="manufacturer"),
        Field("Md", 18, "string", 16, desc="model"),
        Field("Opt", 34, "string", 8, desc="options"),
        Field("Vr", 42, "string", 8, desc="version"),
        Field("SN", 50, "string", 16, desc="serial number"),
        Field("DA", 66, "uint16", desc="device address"),
    ),
    model_id=1,
    source="sunspec/models json/model_1.json",
)

MODEL_203 = Block(
    "ac_meter (wye, int + sf)",
    107,
    (
        Field("A", 2, "int16", unit="A", sf="A_SF", desc="total AC current"),
        Field("A_SF", 6, "sunssf"),
        Field("Hz", 16, "int16", unit="Hz", sf="Hz_SF", lo=0.0, hi=100.0, desc="frequency"),
        Field("Hz_SF", 17, "sunssf"),
        Field("W", 18, "int16", unit="W", sf="W_SF", desc="total real power, positive = import"),
        Field("W_SF", 22, "sunssf"),
        Field("TotWhExp", 38, "acc32", unit="Wh", sf="TotWh_SF", lo=0.0, desc="energy exported"),
        Field("TotWhImp", 46, "acc32", unit="Wh", sf="TotWh_SF", lo=0.0, desc="energy imported"),
        Field("TotWh_SF", 54, "sunssf"),
    ),
    model_id=203,
    source="sunspec/models json/model_203.json",
)

MODEL_213 = Block(
    "ac_meter (wye, float)",
    126,
    (
        Field("A", 2, "float32", unit="A", desc="total AC current"),
        Field("Hz", 26, "float32", unit="Hz", lo=0.0, hi=100.0, desc="frequency"),
        Field("W", 28, "float32", unit="W", desc="total real power, positive = import"),
    ),
    model_id=213,
    source="sunspec/models json/model_213.json",
)

MODEL_701 = Block(
    "DERMeasureAC",
    155,
    (
        Field("St", 3, "enum16", lo=1, hi=2, desc="operating state: 1 off, 2 on"),
        Field("ConnSt", 5, "enum16", lo=1, hi=2, desc="grid connection: 1 disconnected, 2 connected"),
        Field("W", 10, "int16", unit="W", sf="W_SF", desc="active power, positive = injecting (discharging)"),
        Field("Hz", 17, "uint32", unit="Hz", sf="Hz_SF", lo=0.0, hi=100.0, desc="frequency"),
        Field("Hz_SF", 115, "sunssf"),
        Field("W_SF", 116, "sunssf"),
    ),
    model_id=701,
    source="sunspec/models json/model_701.json",
)

MODEL_704 = Block(
    "DERCtlAC",
    71,
    (
        Field("WSetEna", 22, "enum16", lo=0, hi=1, access="RW", desc="set active power enable: 0 off, 1 on"),
        Field("WSetMod", 23, "enum16", lo=1, hi=2, access="RW", desc="1 percent of WMax, 2 watts"),
        Field("WSet", 24, "int32", unit="W", sf="WSet_SF", access="RW", desc="active power setpoint, + = inject"),
        Field("WSetRvrt", 26, "int32", unit="W", sf="WSet_SF", access="RW", desc="reversion setpoint"),
        Field("WSetPct", 28, "int32", unit="%", sf="WSetPct_SF", access="RW", desc="setpoint in % of WMax"),
        Field("WSetPctRvrt", 30, "int32", unit="%", sf="WSetPct_SF", access="RW", desc="reversion setpoint in %"),
        Field("WSetRvrtEna", 32, "enum16", lo=0, hi=1, access="RW", desc="reversion enable"),
        Field("WSetRvrtTms", 33, "uint32", unit="s", access="RW", desc="reversion time"),
        Field("WSetRvrtRem", 35, "uint32", unit="s", desc="reversion time remaining"),
        Field("WSet_SF", 59, "sunssf"),
        Field("WSetPct_SF", 60, "sunssf"),
    ),
    model_id=704,
    source="sunspec/models json/model_704.json",
)

MODEL_713 = Block(
    "DERStorageCapacity",
    8,
    (
        Field("WHRtg", 2, "uint16", unit="Wh", desc="energy rating"),
        Field("WHAvail", 3, "uint16", unit="Wh", desc="energy available"),
        Field("SoC", 4, "uint16", unit="%", lo=0.0, hi=100.0, desc="state of charge"),
        Field("SoH", 5, "uint16", unit="%", lo=0.0, hi=100.0, desc="state of health"),
        Field("Sta", 6, "enum16", desc="status"),
        Field("WH_SF", 7, "sunssf"),
    ),
    model_id=713,
    source="sunspec/models json/model_713.json",
)

MODEL_802 = Block(
    "battery",
    64,
    (
        Field("WHRtg", 3, "uint16", unit="Wh", sf="WHRtg_SF", desc="nameplate energy"),
        Field("WChaRteMax", 4, "uint16", unit="W", sf="WChaDisChaMax_SF", desc="max charge rate"),
        Field("WDisChaRteMax", 5, "uint16", unit="W", sf="WChaDisChaMax_SF", desc="max discharge rate"),
        Field("SoCMax", 7, "uint16", unit="%", sf="SoC_SF", lo=0.0, hi=100.0, desc="max state of charge"),
        Field("SoCMin", 8, "uint16", unit="%", sf="SoC_SF", lo=0.0, hi=100.0, desc="min state of charge"),
        Field("SoC", 11, "uint16", unit="%", sf="SoC_SF", lo=0.0, hi=100.0, desc="state of charge"),
        Field("Hb", 18, "uint16", desc="battery heartbeat"),
        Field("CtrlHb", 19, "uint16", access="RW", desc="controller heartbeat (we bump it every write)"),
        Field("State", 22, "enum16", desc="1 disconnected, 2 initializing, 3 connected, 4 standby, ... 99 fault"),
        Field("W", 47, "int16", unit="W", sf="W_SF", desc="battery power"),
        Field("WHRtg_SF", 53, "sunssf"),
        Field("WChaDisChaMax_SF", 54, "sunssf"),
        Field("SoC_SF", 56, "sunssf"),
        Field("W_SF", 63, "sunssf"),
    ),
    model_id=802,
    source="sunspec/models json/model_802.json",
)

SUNSPEC_MODELS: dict[int, Block] = {b.model_id or 0: b for b in (MODEL_1, MODEL_203, MODEL_213, MODEL_701)}
SUNSPEC_MODELS |= {b.model_id or 0: b for b in (MODEL_704, MODEL_713, MODEL_802)}
BATTERY_CONNECTED = 3  # model 802 State
WSET_MOD_WATTS = 2


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


def sunspec_image(models: Sequence[tuple[Block, Mapping[str, float | str | int | None]]]) -> list[int]:
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


# -- dimmer-rack-v1 ----------------------------------------------------------------------------------------------

RACK_MAGIC = "DMRK"
RACK_VERSION = 1
RACK_MAX = 64  # racks per device
RACK_CMD_BASE = 16  # command record of rack i at RACK_CMD_BASE + RACK_CMD_STRIDE * i
RACK_CMD_STRIDE = 8
RACK_STATUS_BASE = RACK_CMD_BASE + RACK_CMD_STRIDE * RACK_MAX  # 528
RACK_STATUS_STRIDE = 12
LEASE_NONE, LEASE_HELD, LEASE_EXPIRED = 0, 1, 2
_BIG = 1e9  # declared bound of powers, W

RACK_HEADER = Block(
    "dimmer-rack-v1 header",
    16,
    (
        Field("magic", 0, "string", 2, desc='"DMRK"'),
        Field("version", 2, "uint16", lo=1, hi=1, desc="map version (1)"),
        Field("n_racks", 3, "uint16", lo=1, hi=RACK_MAX, desc="racks this device serves"),
        Field("first_rack", 4, "uint32", desc="site index of its first rack (tree order)"),
        Field("safe_cap_w", 6, "float32", unit="W/GPU", lo=0.0, hi=1e5, desc="cap it falls back to on lease expiry"),
        Field("lease_state", 8, "enum16", lo=0, hi=2, desc="0 never written, 1 lease held, 2 expired: safe cap"),
        Field("update_count", 10, "uint32", desc="bumped at every measurement refresh (stuck = stale)"),
        Field("lease_s", 12, "float32", unit="s", lo=0.0, hi=86400.0, access="RW", desc="lease of the commands"),
        Field("heartbeat", 14, "uint32", access="RW", desc="controller heartbeat, bumped at every write"),
    ),
)
RACK_COMMAND = (
    Field("cap_w", 0, "float32", unit="W/GPU", lo=0.0, hi=1e5, access="RW", desc="per-GPU power cap"),
    Field("floor_w", 2, "float32", unit="W/GPU", lo=0.0, hi=1e5, access="RW", desc="per-GPU power floor, 0 = none"),
    Field(
        "bbu_threshold_w",
        4,
        "float32",
        unit="W",
        lo=0.0,
        hi=math.inf,
        access="RW",
        desc="BBU discharges above this rack draw; +inf = backup only",
    ),
    Field("bbu_recharge_w", 6, "float32", unit="W", lo=0.0, hi=_BIG, access="RW", desc="max BBU recharge power"),
)
RACK_STATUS = (
    Field("power_w", 0, "float32", unit="W", lo=0.0, hi=_BIG, desc="AC input from the supply (window mean)"),
    Field("load_w", 2, "float32", unit="W", lo=0.0, hi=_BIG, desc="IT load before the BBU (power-shelf output)"),
    Field("cap_w", 4, "float32", unit="W/GPU", lo=0.0, hi=1e5, desc="per-GPU cap the GPUs enforce"),
    Field("floor_w", 6, "float32", unit="W/GPU", lo=0.0, hi=1e5, desc="per-GPU floor in force"),
    Field("bbu_soc_frac", 8, "float32", unit="1", lo=0.0, hi=1.0, desc="BBU state of charge"),
    Field("energized", 10, "uint16", unit="bool", lo=0, hi=1, desc="1 powered, 0 under a tripped breaker"),
)


def rack_cmd_address(i: int) -> int:
    return RACK_CMD_BASE + RACK_CMD_STRIDE * i


def rack_status_address(i: int) -> int:
    return RACK_STATUS_BASE + RACK_STATUS_STRIDE * i


# -- dimmer-site-v1 ----------------------------------------------------------------------------------------------

SITE_MAGIC = "DMST"
SITE_VERSION = 1
SITE_JOB_BASE = 32  # job j at SITE_JOB_BASE + j
SITE_MAX_JOBS = 256
SITE_DOMAIN_BASE = SITE_JOB_BASE + SITE_MAX_JOBS  # 288: domain d at SITE_DOMAIN_BASE + SITE_DOMAIN_STRIDE * d
SITE_DOMAIN_STRIDE = 6
SITE_MAX_DOMAINS = (0x10000 - SITE_DOMAIN_BASE) // SITE_DOMAIN_STRIDE

SITE_HEADER = Block(
    "dimmer-site-v1 header",
    32,
    (
        Field("magic", 0, "string", 2, desc='"DMST"'),
        Field("version", 2, "uint16", lo=1, hi=1, desc="map version (1)"),
        Field("n_domains", 3, "uint16", lo=1, hi=SITE_MAX_DOMAINS, desc="domains, in SiteModel order"),
        Field("n_jobs", 4, "uint16", lo=0, hi=SITE_MAX_JOBS, desc="jobs, in scenario order"),
        Field("update_count", 6, "uint32", desc="bumped at every measurement refresh (stuck = stale)"),
        Field("pcc_limit_w", 8, "float32", unit="W", lo=0.0, hi=1e12, desc="interconnect limit in force"),
        Field("ramp_limit_w_per_min", 10, "float32", unit="W/min", lo=0.0, hi=1e12, desc="grid ramp limit"),
        Field("grid_freq_hz", 12, "float32", unit="Hz", lo=0.0, hi=100.0, desc="grid frequency"),
    ),
)
SITE_JOB = (Field("running", 0, "uint16", unit="bool", lo=0, hi=1, desc="1 drawing training power now"),)
SITE_DOMAIN = (
    Field("power_w", 0, "float32", unit="W", lo=-1e12, hi=1e12, desc="domain meter (the campus: net import)"),
    Field("limit_w", 2, "float32", unit="W", lo=0.0, hi=1e12, desc="rating in force (a derate lowers it)"),
    Field("thermal_frac", 4, "float32", unit="1", lo=0.0, hi=1e3, desc="breaker thermal state / trip point"),
)


def site_domain_address(d: int) -> int:
    return SITE_DOMAIN_BASE + SITE_DOMAIN_STRIDE * d


# -- what a controller may write -------------------------------------------------------------------------------------

Span = tuple[int, int]  # [start, stop) register addresses


def _merge(spans: Iterable[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def writable_spans(block: Block, at: int = 0) -> list[Span]:
    """The registers of `block`'s RW fields as [start, stop) spans from address `at` (adjacent fields merged)."""
    return _merge((at + f.offset, at + f.offset + f.n) for f in block.fields if f.access == "RW")


def rack_writable_spans(n_racks: int) -> list[Span]:
    """dimmer-rack-v1: the header's RW registers (lease_s, heartbeat) and the command records of racks 0..n-1."""
    if not 1 <= n_racks <= RACK_MAX:
        raise ValueError(f"n_racks must be in 1..{RACK_MAX} (got {n_racks})")
    return _merge([*writable_spans(RACK_HEADER), (RACK_CMD_BASE, rack_cmd_address(n_racks))])


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
            return f"{f.name} {float(v[i])!r} at record {i} outside its declared range {_range(f) or 'any number'}"
    return None


# -- documentation ---------------------------------------------------------------------------------------------------


def _range(f: Field) -> str:
    if f.lo == -math.inf and f.hi == math.inf:
        return ""
    lo = "" if f.lo == -math.inf else f"{f.lo:g}"
    hi = "" if f.hi == math.inf else f"{f.hi:g}"
    return f"{lo}..{hi}"


def _order(f: Field) -> str:
    if f.kind == "string":
        return "bytes hi→lo"
    return "hi word first" if f.n == 2 else ""


def _table(fields: Sequence[Field], base: str, scaled: bool = True) -> list[str]:
    head = "| offset | name | type | regs | word order | unit | scale | range | access | meaning |"
    rows = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for f in fields:
        scale = f"× 10^{f.sf}" if (scaled and f.sf) else ""
        rows.append(
            f"| {base}{f.offset} | {f.name} | {f.kind} | {f.n} | {_order(f)} | {f.unit} | {scale} | {_range(f)} | "
            f"{f.access} | {f.desc} |"
        )
    return rows


def registers_markdown() -> str:
    """The register tables of docs/registers.md (the prose around them lives in the doc)."""
    lines: list[str] = []
    for b in (MODEL_1, MODEL_203, MODEL_213, MODEL_701, MODEL_704, MODEL_713, MODEL_802):
        lines += [f"#### Model {b.model_id}: {b.name} (L = {b.length - 2}; {b.source})", ""]
        lines += _table(b.fields, "+")
        lines.append("")
    lines += ["#### dimmer-rack-v1 header (address = offset)", ""]
    lines += _table(RACK_HEADER.fields, "")
    lines += ["", f"#### dimmer-rack-v1 command record of rack i: {RACK_CMD_BASE} + {RACK_CMD_STRIDE}·i + offset", ""]
    lines += _table(RACK_COMMAND, "+")
    lines += [
        "",
        f"#### dimmer-rack-v1 status record of rack i: {RACK_STATUS_BASE} + {RACK_STATUS_STRIDE}·i + offset",
        "",
    ]
    lines += _table(RACK_STATUS, "+")
    lines += ["", "#### dimmer-site-v1 header (address = offset)", ""]
    lines += _table(SITE_HEADER.fields, "")
    lines += ["", f"#### dimmer-site-v1 job j: {SITE_JOB_BASE} + j", ""]
    lines += _table(SITE_JOB, "+")
    lines += ["", f"#### dimmer-site-v1 domain d: {SITE_DOMAIN_BASE} + {SITE_DOMAIN_STRIDE}·d + offset", ""]
    lines += _table(SITE_DOMAIN, "+")
    return "\n".join(lines) + "\n"
