"""`dimmer agent`: the GPU power caps of one host, served to the controller as a `dimmer-rack-v1` cap device.

The agent runs on a GPU server. It reads each GPU's power and enforced limit through a `GpuBackend` (NVML on real
hardware, `SimulatedGpus` in tests), publishes them in the `dimmer-rack-v1` register map (one "rack": this host),
and applies the per-GPU cap the controller writes, clamped to each GPU's settable range. It holds its own lease:
if the controller stops writing for `lease_s` (default: `lease_periods` periods, or the lease the controller wrote
if that is shorter) it lowers every GPU to the safe cap on its own. It saves the limits it found at start and
restores them at exit.

Power floors (GPU power smoothing) and BBU fields are accepted and ignored: NVML's power-smoothing profiles are not
driven here; the status reports a floor of 0 and no BBU (NaN).

`RegisterServer` (a register image served by pymodbus's TCP server, every write recorded and vetted against the
writable ranges) is what the agent is built on; tests use it as a stand-in device that records writes. A request
to a unit it does not serve gets Modbus exception 0x0B (`unknown_unit_device`), without a traceback in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.daemon.nvml import GpuBackend, GpuError
from dimmer.daemon.registers import (
    LEASE_EXPIRED,
    LEASE_HELD,
    LEASE_NONE,
    RACK_COMMAND,
    RACK_HEADER,
    RACK_MAGIC,
    RACK_MAX,
    RACK_STATUS,
    RACK_STATUS_BASE,
    RACK_STATUS_STRIDE,
    RACK_VERSION,
    decode_block,
    decode_records,
    encode_block,
    encode_records,
    rack_cmd_address,
    rack_status_address,
    rack_writable_spans,
)
from dimmer.errors import DimmerError

log = logging.getLogger("dimmer.agent")

FloatArray = npt.NDArray[np.float64]

RACK_IMAGE_SIZE = RACK_STATUS_BASE + RACK_STATUS_STRIDE * RACK_MAX  # every register of the map


@dataclass(frozen=True)
class WriteRecord:
    t_mono_s: float
    unit: int
    address: int
    values: tuple[int, ...]


class RegisterServer:
    """A holding-register image per unit, served over Modbus TCP (pymodbus), with every write recorded.

    `writable[unit]` lists the [start, stop) ranges a client may write; a write outside them is refused with
    ILLEGAL_ADDRESS, a read past the image with ILLEGAL_ADDRESS too. `on_write(unit, address, values)` runs after
    an accepted write (it may raise DimmerError: the client then gets DEVICE_FAILURE).
    """

    def __init__(
        self,
        images: dict[int, npt.NDArray[np.uint16]],
        writable: dict[int, Sequence[tuple[int, int]]] | None = None,
        on_write: Callable[[int, int, list[int]], None] | None = None,
    ) -> None:
        self.images = images
        self.writable: dict[int, npt.NDArray[np.bool_]] = {}
        for unit, image in images.items():
            mask = np.zeros(image.shape[0], dtype=bool)
            for lo, hi in (writable or {}).get(unit, ()):
                mask[lo:hi] = True
            self.writable[unit] = mask
        self.on_write = on_write
        self.writes: list[WriteRecord] = []
        self.reads = 0
        self._server: Any = None
        self.port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        from pymodbus.server import ModbusTcpServer
        from pymodbus.simulator import DataType, SimData, SimDevice

        devices = [] if 0 in self.images else [unknown_unit_device()]
        for unit, image in self.images.items():
            data = SimData(0, count=int(image.shape[0]), values=0, datatype=DataType.REGISTERS)
            devices.append(SimDevice(id=unit, simdata=[data], action=self._action_for(unit)))
        self._server = ModbusTcpServer(devices, address=(host, port))
        await self._server.serve_forever(background=True)
        self.port = int(self._server.transport.sockets[0].getsockname()[1])
        return self.port

    @property
    def bound_address(self) -> tuple[str, int] | None:
        """(host, port) the listening socket is bound to, as the OS reports it; None when not serving."""
        if self._server is None or self._server.transport is None:
            return None
        host, port = self._server.transport.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.shutdown()
            self._server = None

    def _action_for(self, unit: int) -> Any:
        async def action(
            fc: int, start: int, address: int, count: int, regs: list[int], set_values: list[int] | list[bool] | None
        ) -> Any:
            return self._handle(unit, fc, start, address, count, regs, set_values)

        return action

    def _handle(
        self,
        unit: int,
        fc: int,
        start: int,
        address: int,
        count: int,
        regs: list[int],
        set_values: list[int] | list[bool] | None,
    ) -> Any:
        from pymodbus.constants import ExcCodes

        image = self.images[unit]
        if address < 0 or address + count > image.shape[0]:
            return ExcCodes.ILLEGAL_ADDRESS
        if set_values is None:  # a read: serve our image
            self.reads += 1
            a = address - start
            regs[a : a + count] = image[address : address + count].tolist()
            return None
        if fc not in (6, 16):
            return ExcCodes.ILLEGAL_FUNCTION
        values = [int(v) for v in set_values]
        if not self.writable[unit][address : address + len(values)].all():
            return ExcCodes.ILLEGAL_ADDRESS
        image[address : address + len(values)] = values
        self.writes.append(WriteRecord(time.monotonic(), unit, address, tuple(values)))
        if self.on_write is not None:
            try:
                self.on_write(unit, address, values)
            except DimmerError as exc:
                log.warning("write to unit %d at %d failed: %s", unit, address, exc)
                return ExcCodes.DEVICE_FAILURE
        return None


def unknown_unit_device() -> Any:
    """A pymodbus SimDevice answering every request to a unit the server does not have with exception 0x0B.

    pymodbus 3.16.1 routes a request for an unknown unit to the device with id 0 ("all devices, except those
    specifically defined"); without one, its lookup raises KeyError, which it logs as an ERROR with a traceback
    before answering 0x04 (server device failure). One endpoint serving several unit ids is a gateway in the
    Modbus sense, and the Modbus TCP implementation guide has a gateway answer 0x0B (gateway target device failed
    to respond) when no device answers for that unit; it is also what pymodbus answers for a unit id it knows is
    missing. 0x04 would say an existing device failed, 0x0A (gateway path unavailable) a misconfigured or
    overloaded gateway: both wrong for a unit id that does not exist. The block covers the whole register space so
    that no address check runs before the answer; only a span past 65535 is 0x02.
    """
    from pymodbus.constants import ExcCodes
    from pymodbus.simulator import DataType, SimData, SimDevice

    async def no_such_unit(
        fc: int, start: int, address: int, count: int, regs: list[int], set_values: list[int] | list[bool] | None
    ) -> Any:
        return ExcCodes.GATEWAY_NO_RESPONSE

    data = SimData(0, count=0x10000, values=0, datatype=DataType.REGISTERS)
    return SimDevice(id=0, simdata=[data], action=no_such_unit)


def rack_image(first_rack: int, n_racks: int, safe_cap_w: float, lease_s: float) -> npt.NDArray[np.uint16]:
    """A fresh dimmer-rack-v1 image: the header, commands never written (NaN), statuses unknown (NaN)."""
    img = np.zeros(RACK_IMAGE_SIZE, dtype=np.uint16)
    header: dict[str, float | str | int | None] = {
        "magic": RACK_MAGIC,
        "version": RACK_VERSION,
        "n_racks": n_racks,
        "first_rack": first_rack,
        "safe_cap_w": safe_cap_w,
        "lease_state": LEASE_NONE,
        "update_count": 0,
        "lease_s": lease_s,
        "heartbeat": 0,
    }
    img[: RACK_HEADER.length] = encode_block(RACK_HEADER, header)
    cmd_stride = rack_cmd_address(1) - rack_cmd_address(0)
    img[rack_cmd_address(0) : rack_cmd_address(RACK_MAX)] = encode_records(RACK_COMMAND, {}, RACK_MAX, cmd_stride)
    img[RACK_STATUS_BASE:] = encode_records(RACK_STATUS, {}, RACK_MAX, RACK_STATUS_STRIDE)
    return img


def rack_writable() -> list[tuple[int, int]]:
    """Where a controller may write: the header's lease_s and heartbeat, and every command record."""
    return rack_writable_spans(RACK_MAX)


class CapAgent:
    """The GPUs of one host as a one-rack `dimmer-rack-v1` device, with a lease and a safe cap."""

    def __init__(
        self,
        gpus: GpuBackend,
        *,
        safe_cap_w: float,
        period_s: float = 1.0,
        lease_periods: int = 10,
        first_rack: int = 0,
        unit: int = 1,
        overhead_w: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gpus = gpus
        self.period_s = period_s
        self.own_lease_s = lease_periods * period_s
        self.unit = unit
        self.overhead_w = overhead_w
        self.clock = clock
        self.min_w, self.max_w = gpus.constraints_w()
        self.safe_w = np.clip(np.full(gpus.n_gpus, safe_cap_w), self.min_w, self.max_w)
        self.original_w = gpus.limit_w()  # restored at exit
        self.image = rack_image(first_rack, 1, float(np.mean(self.safe_w)), self.own_lease_s)
        self.server = RegisterServer({unit: self.image}, {unit: rack_writable()}, self._on_write)
        self.lease_state = LEASE_NONE
        self.last_write_s: float | None = None
        self.commanded_w: FloatArray | None = None  # the limits last applied
        self.update_count = 0
        self.lease_expiries = 0
        self._stop = asyncio.Event()
        self._restored = False

    # -- the controller's writes ---------------------------------------------------------------------------------

    def lease_s(self) -> float:
        """The agent's own lease, or the controller's if it wrote a shorter one."""
        written = decode_block(RACK_HEADER, self.image[: RACK_HEADER.length], 0).get("lease_s")
        if isinstance(written, float) and math.isfinite(written) and written > 0:
            return min(self.own_lease_s, written)
        return self.own_lease_s

    def _on_write(self, unit: int, address: int, values: list[int]) -> None:
        self.last_write_s = self.clock()
        if address + len(values) <= rack_cmd_address(0):
            if self.lease_state != LEASE_HELD and self.commanded_w is not None:
                self._set_lease(LEASE_HELD)
            return  # a heartbeat or lease write: the lease is renewed, the caps stay
        cmd = decode_records(RACK_COMMAND, self.image[rack_cmd_address(0) : rack_cmd_address(1)], 1, 8)
        cap = float(cmd["cap_w"][0])
        if not math.isfinite(cap):
            return  # no cap written (NaN): nothing to apply
        self.apply(np.clip(np.full(self.gpus.n_gpus, cap), self.min_w, self.max_w))
        self._set_lease(LEASE_HELD)

    def apply(self, limit_w: FloatArray) -> None:
        if self.commanded_w is not None and np.array_equal(limit_w, self.commanded_w):
            return
        try:
            self.gpus.set_limit_w(limit_w)
        except GpuError as exc:
            log.error("setting GPU limits failed: %s", exc)
            raise
        self.commanded_w = limit_w.copy()

    def _set_lease(self, state: int) -> None:
        self.lease_state = state
        off = RACK_HEADER.field("lease_state").offset
        self.image[off] = state

    # -- every period --------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Check the lease, refresh the status record."""
        now = self.clock()
        lapsed = self.last_write_s is not None and now - self.last_write_s > self.lease_s()
        if self.lease_state == LEASE_HELD and lapsed:
            held = self.commanded_w if self.commanded_w is not None else self.max_w
            safe = np.minimum(held, self.safe_w)
            log.warning(
                "no write from the controller for %.1f s (lease %.1f s): GPUs to the safe cap %.0f W",
                now - (self.last_write_s or now),
                self.lease_s(),
                float(np.max(safe)),
            )
            with contextlib.suppress(GpuError):
                self.apply(safe)
            self._set_lease(LEASE_EXPIRED)
            self.lease_expiries += 1
        self.refresh()

    def refresh(self) -> None:
        try:
            power = self.gpus.power_w()
            enforced = self.gpus.enforced_limit_w()
        except GpuError as exc:
            log.warning("reading the GPUs failed: %s", exc)
            power = np.full(self.gpus.n_gpus, np.nan)
            enforced = np.full(self.gpus.n_gpus, np.nan)
        total = float(np.sum(power)) + self.overhead_w
        status = {
            "power_w": np.array([total]),
            "load_w": np.array([total]),
            "cap_w": np.array([float(np.mean(enforced))]),
            "floor_w": np.array([0.0]),
            "bbu_soc_frac": np.array([np.nan]),
            "energized": np.array([1.0]),
        }
        a = rack_status_address(0)
        self.image[a : a + RACK_STATUS_STRIDE] = encode_records(RACK_STATUS, status, 1, RACK_STATUS_STRIDE)
        self.update_count = (self.update_count + 1) % 0xFFFFFFFF
        self.image[: RACK_HEADER.length] = encode_block(
            RACK_HEADER, {**self._header_values(), "update_count": self.update_count}
        )

    def _header_values(self) -> dict[str, Any]:
        vals = decode_block(RACK_HEADER, self.image[: RACK_HEADER.length], 0)
        return {k: v for k, v in vals.items() if v is not None}

    # -- life ------------------------------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.refresh()
        port = await self.server.start(host, port)
        log.info(
            "agent: %d GPUs (limits %s W, settable %.0f-%.0f W) as dimmer-rack-v1 unit %d on %s:%d, lease %.1f s",
            self.gpus.n_gpus,
            _fmt_list(self.original_w),
            float(np.min(self.min_w)),
            float(np.max(self.max_w)),
            self.unit,
            host,
            port,
            self.own_lease_s,
        )
        return port

    async def run(self) -> None:
        """Tick every period until `request_stop()`; then restore the original limits."""
        try:
            while not self._stop.is_set():
                self.tick()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=self.period_s)
        finally:
            await self.stop()

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        await self.server.stop()
        self.restore()
        self.gpus.close()

    def restore(self) -> None:
        """Put back the limits found at start (once)."""
        if self._restored:
            return
        self._restored = True
        try:
            self.gpus.set_limit_w(np.clip(self.original_w, self.min_w, self.max_w))
            log.info("agent: original GPU limits restored (%s W)", _fmt_list(self.original_w))
        except GpuError as exc:
            log.error("agent: restoring the original GPU limits failed: %s", exc)


def _fmt_list(x: FloatArray) -> str:
    vals = sorted({round(float(v)) for v in x})
    return ", ".join(str(v) for v in vals[:4]) + (", ..." if len(vals) > 4 else "")
