"""Register words and the value types they carry: sans-IO decoders and encoders, no sockets and no maps.

- Bytes in a register are big-endian (Modbus); multi-register values are **big-endian word order** too: the
  most significant word comes first (the SunSpec rule, and "ABCD" in the usual notation).
- "Not implemented" sentinels decode to NaN (numbers) or None (strings), never to zero. They are the SunSpec
  ones, taken from pysunspec2 (`sunspec2.mb.create_unimpl_value`) rather than retyped: int16 0x8000, uint16 /
  count / enum16 / bitfield16 0xFFFF, acc16 / acc32 / acc64 / ipaddr 0, int32 0x80000000, uint32 / enum32 /
  bitfield32 0xFFFFFFFF, int64 0x8000..., uint64 0xFFFF..., float32 0x7FC00000 (any NaN pattern reads as NaN),
  float64 0x7FF8..., sunssf 0x8000, string all NUL. The project's own maps follow the same convention.
- SunSpec scale factors: value = raw x 10^sf, sf a signed int16 in [-10, 10]; an unimplemented or out-of-range
  scale factor makes every value that uses it NaN.
- Arbitrary words never raise anything but `DecodeError` (wrong length, a word outside 0..65535).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt
from sunspec2 import mb as sunspec_mb

from dimmer.errors import DimmerError

FloatArray = npt.NDArray[np.float64]
WordArray = npt.NDArray[np.uint16]


class RegisterError(DimmerError):
    """Base of the codec errors."""


class DecodeError(RegisterError):
    """Registers that cannot be decoded at all: wrong length, a word out of 0..65535, a bad marker, magic or id."""


class EncodeError(RegisterError):
    """A value that cannot be represented in its register type (too large, not an integer where one is needed)."""


# -- types and their sentinels -----------------------------------------------------------------------------------

# registers per value; strings give their own size
SIZES: dict[str, int] = {
    "int16": 1, "uint16": 1, "count": 1, "acc16": 1, "enum16": 1, "bitfield16": 1, "sunssf": 1, "pad": 1,
    "int32": 2, "uint32": 2, "acc32": 2, "enum32": 2, "bitfield32": 2, "ipaddr": 2, "float32": 2,
    "int64": 4, "uint64": 4, "acc64": 4, "float64": 4, "eui48": 4, "ipv6addr": 8,
}  # fmt: skip
KINDS = (*SIZES, "string")
_SIZE = SIZES
SIGNED = frozenset({"int16", "int32", "int64", "sunssf"})
FLOATS = frozenset({"float32", "float64"})
OPAQUE = frozenset({"eui48", "ipv6addr", "pad"})  # carried, never decoded to a number


def _unimpl_words(kind: str, size: int = 0) -> tuple[int, ...]:
    raw = sunspec_mb.create_unimpl_value(kind, 2 * size if kind == "string" else None)
    return struct.unpack(f">{len(raw) // 2}H", raw)


# "not implemented", as pysunspec2 writes it, per type (a string: all NUL)
NA_WORDS: dict[str, tuple[int, ...]] = {k: _unimpl_words(k) for k in SIZES if k not in ("pad",)}
NA_WORDS["pad"] = (0,)


def _na_int(kind: str) -> int:
    v = 0
    for w in NA_WORDS[kind]:
        v = (v << 16) | w
    return v


I16_NA = _na_int("int16")
U16_NA = _na_int("uint16")
I32_NA = _na_int("int32")
U32_NA = _na_int("uint32")
ACC32_NA = _na_int("acc32")
F32_NA = _na_int("float32")
SF_NA = _na_int("sunssf")
SF_MIN, SF_MAX = -10, 10

MAX_READ = 125  # Modbus: registers per read request (function 3)
MAX_WRITE = 123  # Modbus: registers per write request (function 16)


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


def _wide(w: WordArray, n: int) -> npt.NDArray[np.uint64]:
    """Values of `n` registers each (n = 1, 2 or 4), high word first, as unsigned integers."""
    if w.shape[-1] % n:
        raise DecodeError(f"{n}-register values need a multiple of {n} registers, got {w.shape[-1]}")
    parts = w.astype(np.uint64).reshape(*w.shape[:-1], -1, n)
    out = np.zeros(parts.shape[:-1], dtype=np.uint64)
    for i in range(n):
        out = (out << np.uint64(16)) | parts[..., i]
    return out


def decode_kind(kind: str, words: Sequence[int] | WordArray) -> FloatArray:
    """Values of any numeric SunSpec type (one per `SIZES[kind]` registers) as floats; NaN where not implemented.

    Signed types are two's complement; floats are IEEE 754 (any NaN pattern is NaN); 64-bit integers lose
    precision above 2^53 (no quantity we read comes near it). DecodeError for a type that carries no number.
    """
    w = as_words(words)
    if kind in ("float32", "float64") or kind in OPAQUE or kind == "string" or kind not in SIZES:
        if kind == "float32":
            return decode_float32(w)
        if kind == "float64":
            u64 = _wide(w, 4)
            with np.errstate(invalid="ignore"):
                f64: FloatArray = u64.view(np.float64).astype(np.float64)
            return f64
        raise DecodeError(f"{kind}: not a numeric register type")
    n = SIZES[kind]
    u = _wide(w, n)
    na = np.uint64(_na_int(kind))
    if kind in SIGNED:
        bits = 16 * n
        signed = u.astype(np.int64) if bits < 64 else u.view(np.int64)
        if bits < 64:
            signed = np.where(signed >= 1 << (bits - 1), signed - (1 << bits), signed)
        out = signed.astype(np.float64)
    else:
        out = u.astype(np.float64)
    out[u == na] = np.nan
    return out


def encode_kind(kind: str, values: Iterable[float] | FloatArray | float) -> list[int]:
    """Words of any numeric SunSpec type from values (NaN -> its "not implemented" sentinel); EncodeError when a
    value does not fit (the sentinel itself is not a value)."""
    if kind in _ENCODERS:
        return _ENCODERS[kind](values)
    if kind not in SIZES or kind in OPAQUE or kind == "float64":
        raise EncodeError(f"{kind}: not a register type we write")
    n = SIZES[kind]
    bits = 16 * n
    na = _na_int(kind)
    if kind in SIGNED:
        lo, hi = -(1 << (bits - 1)) + 1, (1 << (bits - 1)) - 1
    elif na == 0:  # accumulators and addresses: 0 is "not implemented"
        lo, hi = 1, (1 << bits) - 1
    else:
        lo, hi = 0, na - 1
    hi = min(hi, 2**63 - 1)  # values pass through int64
    v = _ints(values, lo, hi, 0, kind)
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64))
    out: list[int] = []
    for x, nan in zip(v.tolist(), np.isnan(arr).tolist(), strict=True):
        u = na if nan else int(x) & ((1 << bits) - 1)
        out += [(u >> (16 * (n - 1 - i))) & 0xFFFF for i in range(n)]
    return out


def na_words(kind: str, size: int = 0) -> list[int]:
    """The "not implemented" words of a type (a string of `size` registers: all NUL)."""
    if kind == "string":
        return [0] * size
    return list(NA_WORDS[kind])


_DECODERS: dict[str, Callable[[Sequence[int] | WordArray], FloatArray]] = {
    "uint16": decode_uint16,
    "enum16": decode_uint16,
    "int16": decode_int16,
    "uint32": decode_uint32,
    "bitfield32": decode_uint32,
    "int32": decode_int32,
    "acc32": decode_acc32,
    "float32": decode_float32,
}
_ENCODERS: dict[str, Callable[[Iterable[float] | FloatArray | float], list[int]]] = {
    "uint16": encode_uint16,
    "enum16": encode_uint16,
    "int16": encode_int16,
    "uint32": encode_uint32,
    "bitfield32": encode_uint32,
    "int32": encode_int32,
    "acc32": encode_acc32,
    "float32": encode_float32,
}


def decoder(kind: str) -> Callable[[Sequence[int] | WordArray], FloatArray]:
    """The vectorised decoder of a numeric type."""
    return _DECODERS.get(kind) or (lambda w: decode_kind(kind, w))
