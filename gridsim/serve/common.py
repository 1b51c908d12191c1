"""What every part of the served plant shares: the unit numbering, Modbus exception codes, the record of a write,
and one device's register image."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

METER_UNIT = 1
BATTERY_UNIT = 2
SITE_UNIT = 3
FIRST_RACK_UNIT = 10
MAX_UNIT = 247  # Modbus device ids 1..247
SUNSPEC_BASE = 40000

# Modbus exception codes (Modbus Application Protocol v1.1b3, section 7)
ILLEGAL_FUNCTION = 1
ILLEGAL_ADDRESS = 2
ILLEGAL_VALUE = 3
# the only requests the served devices answer from their registers: read holding registers, write single
# register, write multiple registers; any other function code is exception 1 (gridsim.serve.modbus)
FUNCTIONS_SERVED = (3, 6, 16)
WRITE_FUNCTIONS = (6, 16)


@dataclass(frozen=True)
class WriteRecord:
    """One write request as the server saw it: monotonic wall time, plant time, unit, address, the words, the
    Modbus exception code it was refused with (None when accepted) and its function code (6 or 16; a request to
    write coils or registers by any other function, always refused with exception 1, is recorded too, its values
    as the request carried them)."""

    t_wall_s: float
    t_plant_s: float
    unit: int
    address: int
    values: tuple[int, ...]
    refused: int | None = None
    function: int = 16


class Image:
    """One device's holding registers from `start`; `writable` marks what a client may write (each device's own
    rules then decide on the values)."""

    def __init__(self, unit: int, start: int, words: Sequence[int], writable: npt.NDArray[np.bool_]) -> None:
        self.unit = unit
        self.start = start
        self.words = np.asarray(words, dtype=np.uint16).copy()
        if writable.shape != self.words.shape:
            raise ValueError(f"unit {unit}: writable mask of {writable.shape[0]} for {self.words.shape[0]} registers")
        self.writable = writable
        self.stalled = False  # fault injection: measurements stop updating
        self.refuse_code: int | None = None  # fault injection: every write refused with this code

    @property
    def size(self) -> int:
        return int(self.words.shape[0])

    def set(self, address: int, words: Sequence[int] | npt.NDArray[np.integer]) -> None:
        a = address - self.start
        arr = np.asarray(words)
        self.words[a : a + arr.shape[0]] = arr

    def get(self, address: int, count: int) -> npt.NDArray[np.uint16]:
        a = address - self.start
        return self.words[a : a + count]

    def may_write(self, address: int, count: int) -> bool:
        """[address, address + count) lies inside the image and every register of it is writable."""
        a = address - self.start
        return count > 0 and a >= 0 and a + count <= self.size and bool(self.writable[a : a + count].all())
