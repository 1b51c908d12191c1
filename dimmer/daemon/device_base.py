"""What every device on a register bus shares: the `Reading` a read returns, and the write gate.

A device has a `name`, a `read_only` flag, `async read() -> Reading` that never raises (a failure comes back as
`ok=False` with every value NaN and the reason in `error`), and write methods that raise `DeviceError`
(`DeviceReadOnly` when the device is configured read-only, without sending anything). Every write goes through
`_put`, which refuses (`WriteNotAllowed`) anything outside the device's writable spans before it is sent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dimmer.daemon import registers as R
from dimmer.daemon.bus import DeviceError, DeviceReadOnly, RegisterBus, WriteNotAllowed

FloatArray = npt.NDArray[np.float64]
Value = float | FloatArray
Clock = Callable[[], float]


@dataclass(frozen=True)
class Reading:
    """One read of one device: `values` (NaN where unknown), the monotonic time `t_s` the read began, `ok`, and
    `error` (None when ok). A failed read has every value NaN."""

    values: dict[str, float | FloatArray]
    t_s: float
    ok: bool
    error: str | None = None
    requests: int = field(default=0, compare=False)

    def array(self, key: str) -> FloatArray:
        """A per-rack / per-domain / per-job value as a float array."""
        return np.asarray(self.values[key], dtype=np.float64)

    def scalar(self, key: str) -> float:
        """A single value as a float (NaN when unknown)."""
        v = self.values[key]
        if isinstance(v, np.ndarray):
            raise TypeError(f"{key} is an array; use Reading.array")
        return float(v)


def describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, DeviceError | R.RegisterError) else f"{type(exc).__name__}: {exc}"


class BusDevice:
    kind = "device"

    def __init__(self, bus: RegisterBus, unit: int, name: str | None, read_only: bool, clock: Clock) -> None:
        if not 0 <= unit <= 255:
            raise ValueError(f"unit {unit} outside 0..255")
        self.bus = bus
        self.unit = int(unit)
        self.name = name or f"{self.kind}@{unit}"
        self.read_only = bool(read_only)
        self.clock = clock
        self._requests = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, unit={self.unit})"

    def nan_values(self) -> dict[str, float | FloatArray]:
        """The value keys this device returns, all NaN (what a failed read carries)."""
        raise NotImplementedError

    async def _read(self) -> dict[str, float | FloatArray]:
        raise NotImplementedError

    async def _get(self, address: int, count: int) -> list[int]:
        self._requests += -(-count // 124)
        return await self.bus.read(self.unit, address, count)

    def writable_spans(self) -> list[R.Span]:
        """The [start, stop) register spans this device may be written in (none unless a subclass says so)."""
        return []

    def _refuse(self, why: str, address: int | None = None) -> WriteNotAllowed:
        return WriteNotAllowed(why, endpoint=getattr(self.bus, "endpoint", ""), unit=self.unit, address=address)

    async def _put(self, address: int, words: list[int]) -> None:
        """Every write goes through here: nothing outside the device's writable blocks reaches the wire."""
        if self.read_only:
            raise DeviceReadOnly("configured read-only: not written", unit=self.unit, address=address)
        if not R.span_allowed(self.writable_spans(), address, len(words)):
            raise self._refuse(f"{len(words)} registers outside the writable blocks of its map", address)
        await self.bus.write(self.unit, address, words)

    async def read(self) -> Reading:
        """Read the device; never raises (failures come back as ok=False with NaN values)."""
        t = self.clock()
        self._requests = 0
        try:
            values = await self._read()
        except Exception as exc:  # the contract: a read never raises; the reason travels in `error`
            self._forget()
            return Reading(self.nan_values(), t, False, describe(exc), self._requests)
        return Reading(values, t, True, None, self._requests)

    def _forget(self) -> None:
        """Drop whatever was learnt about the device layout (it is found again at the next read)."""


def as_float(x: float | str | None) -> float:
    """A decoded value as a float (NaN for a string, None or anything not a number)."""
    return float(x) if isinstance(x, int | float) else math.nan
