"""Register buses: where device reads and writes go. Modbus TCP (pymodbus) for real equipment, in memory for tests.

Every failure is translated here, at the boundary, into one tree:

    DimmerError
     └── DeviceError              a device could not do what was asked (has .endpoint, .unit, .address)
          ├── DeviceUnreachable   no answer: connection refused or lost, timeout after the retries
          ├── DeviceRefused       the device answered with a Modbus exception (.code: 1 illegal function,
          │                       2 illegal address, 3 illegal value, 4 device failure, 6 busy, 11 gateway...)
          ├── DeviceReadOnly      we refused locally: the device is configured read-only
          └── WriteNotAllowed     we refused locally: registers the device's map does not declare writable, or a
                                  value outside what the device may be told (also a ValueError); nothing was sent

Nothing from pymodbus (ModbusException, ConnectionException, asyncio.TimeoutError, OSError) leaks past a bus.

Addresses are 0-based protocol addresses (what goes on the wire), registers are 16-bit holding registers
(read: function 3; write: function 16). Reads of more than 124 registers and writes of more than 122 are split
into several requests at even offsets, so a 32-bit value never straddles two requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from dimmer.errors import DimmerError

log = logging.getLogger(__name__)

READ_CHUNK = 124  # <= 125 (Modbus limit), even
WRITE_CHUNK = 122  # <= 123 (Modbus limit), even


class DeviceError(DimmerError):
    """A device could not do what was asked. `endpoint` is "host:port" (or "memory"), `unit` the device id."""

    def __init__(self, message: str, *, endpoint: str = "", unit: int | None = None, address: int | None = None):
        self.endpoint = endpoint
        self.unit = unit
        self.address = address
        where = (
            endpoint + (f" unit {unit}" if unit is not None else "") + (f" @{address}" if address is not None else "")
        )
        super().__init__(f"{where}: {message}" if where else message)


class DeviceUnreachable(DeviceError):
    """No reply: connection refused or lost, or no answer within the timeout after every retry."""


class DeviceRefused(DeviceError):
    """The device replied with a Modbus exception `code` (2 illegal address, 3 illegal value, 4 failure, ...)."""

    def __init__(
        self, code: int, message: str = "", *, endpoint: str = "", unit: int | None = None, address: int | None = None
    ):
        self.code = int(code)
        text = f"refused with Modbus exception {self.code} ({EXCEPTION_NAMES.get(self.code, 'unknown')})"
        super().__init__(f"{text}{': ' + message if message else ''}", endpoint=endpoint, unit=unit, address=address)


class DeviceReadOnly(DeviceError):
    """A write to a device configured read-only: refused here, nothing was sent."""


class WriteNotAllowed(DeviceError, ValueError):
    """A write refused here, before anything was sent: registers outside the device's writable blocks, or a value
    outside its declared range or the ratings the device was built with (a GPU cap outside the GPU's settable range,
    a battery setpoint beyond its rating). A bug upstream, never a device fault: the daemon's safety net keeps every
    value it writes inside these bounds."""


EXCEPTION_NAMES = {
    1: "illegal function",
    2: "illegal data address",
    3: "illegal data value",
    4: "server device failure",
    5: "acknowledge",
    6: "server device busy",
    8: "memory parity error",
    10: "gateway path unavailable",
    11: "gateway target failed to respond",
}


@runtime_checkable
class RegisterBus(Protocol):
    """Holding registers of the devices behind one endpoint, by unit (Modbus device id)."""

    async def read(self, unit: int, address: int, count: int) -> list[int]:
        """`count` registers from `address`; DeviceError on failure."""
        ...

    async def write(self, unit: int, address: int, values: list[int]) -> None:
        """Write `values` from `address`; DeviceError on failure."""
        ...

    async def close(self) -> None:
        """Release the connection; the bus may be used again (it reconnects)."""
        ...


def _check_span(address: int, count: int) -> None:
    if count < 1 or address < 0 or address + count > 0x10000:
        raise ValueError(f"register span {address}+{count} outside 0..65535")


def chunks(address: int, count: int, size: int) -> list[tuple[int, int]]:
    """Split [address, address+count) into (start, n) pieces of at most `size` registers."""
    return [(a, min(size, address + count - a)) for a in range(address, address + count, size)]


# -- Modbus TCP ----------------------------------------------------------------------------------------------------


class ModbusTcpBus:
    """One Modbus TCP endpoint (host:port) through one pymodbus AsyncModbusTcpClient, shared by every unit behind it.

    Each request waits at most `timeout_s` for its reply and is retried `retries` times on a fresh connection,
    `backoff_s`, 2·`backoff_s`, ... apart. A connection that cannot be opened, or a request whose every retry
    went unanswered, marks the endpoint down: until a backoff that starts at `backoff_s` and doubles (up to
    `max_backoff_s`) with each consecutive failure has passed, requests fail at once (DeviceUnreachable), so a
    dead endpoint costs a cycle one connection attempt, not a pile of timeouts. A Modbus exception reply is an
    answer, not a failure: it raises DeviceRefused at once, without retrying. Requests to one endpoint are
    serialised (one in flight per connection, as pymodbus would anyway); concurrent callers simply queue. A request
    cancelled while on the wire (the caller's own timeout, `asyncio.wait_for` around a device read) drops the
    connection before the cancellation goes on: a late reply is never matched to another request.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float = 0.5,
        retries: int = 2,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError("timeout_s > 0, retries >= 0 and backoff_s >= 0 are required")
        self.host = host
        self.port = int(port)
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.endpoint = f"{host}:{port}"
        self._client: object | None = None  # pymodbus AsyncModbusTcpClient
        self._lock: asyncio.Lock | None = None
        self._prober: object | None = None  # the request retrying after a timeout
        self._failures = 0  # consecutive connection failures
        self._next_connect_s = 0.0  # monotonic time before which we do not try to connect again
        self.requests = 0  # counters, for metrics
        self.errors = 0
        self.reconnects = 0

    def __repr__(self) -> str:
        return f"ModbusTcpBus({self.endpoint})"

    @property
    def connected(self) -> bool:
        c = self._client
        return bool(c is not None and c.connected)  # type: ignore[attr-defined]

    async def read(self, unit: int, address: int, count: int) -> list[int]:
        _check_span(address, count)
        out: list[int] = []
        for a, n in chunks(address, count, READ_CHUNK):
            regs = await self._call(unit, a, "read", n)
            if len(regs) != n:
                raise DeviceRefused(
                    4, f"asked for {n} registers, got {len(regs)}", endpoint=self.endpoint, unit=unit, address=a
                )
            out += regs
        return out

    async def write(self, unit: int, address: int, values: list[int]) -> None:
        _check_span(address, len(values))
        if any(not 0 <= int(v) <= 0xFFFF for v in values):
            raise ValueError("register values must be in 0..65535")
        for a, n in chunks(address, len(values), WRITE_CHUNK):
            await self._call(unit, a, "write", n, [int(v) for v in values[a - address : a - address + n]])

    async def close(self) -> None:
        self._drop()

    # -- internals ------------------------------------------------------------------------------------------------

    def _drop(self) -> None:
        c, self._client = self._client, None
        if c is not None:
            with contextlib.suppress(Exception):
                c.close()  # type: ignore[attr-defined]

    async def _connect(self, unit: int) -> object:
        """The live client, connecting if needed (called with the request lock held)."""
        from pymodbus.client import AsyncModbusTcpClient

        if self._client is not None and self._client.connected:  # type: ignore[attr-defined]
            return self._client
        self._drop()
        now = time.monotonic()
        if now < self._next_connect_s:
            raise DeviceUnreachable(
                f"down; next connection attempt in {self._next_connect_s - now:.2f} s",
                endpoint=self.endpoint,
                unit=unit,
            )
        client = AsyncModbusTcpClient(
            self.host,
            port=self.port,
            timeout=self.timeout_s,
            retries=0,  # we retry, with our backoff and a fresh connection
            reconnect_delay=0,  # no background reconnection: we decide when
        )
        try:
            ok = await asyncio.wait_for(client.connect(), self.timeout_s * 2)
        except asyncio.CancelledError:  # the caller gave up: close the half-open client, do not mark us down
            with contextlib.suppress(Exception):
                client.close()
            raise
        except Exception as exc:  # pymodbus raises several kinds here (OSError, TimeoutError, its own)
            ok = False
            log.debug("connect %s failed: %s", self.endpoint, exc)
        if not ok:
            with contextlib.suppress(Exception):
                client.close()
            self._mark_down()
            raise DeviceUnreachable("connection failed", endpoint=self.endpoint, unit=unit)
        if self._failures:
            self.reconnects += 1
        self._failures = 0
        self._next_connect_s = 0.0
        self._client = client
        return client

    def _mark_down(self) -> None:
        self._failures += 1
        self._next_connect_s = time.monotonic() + min(self.backoff_s * 2 ** (self._failures - 1), self.max_backoff_s)

    async def _call(self, unit: int, address: int, op: str, count: int, values: list[int] | None = None) -> list[int]:
        """One request with retries. A connection that cannot be opened fails at once (the backoff paces the next
        attempt); a request without a reply is retried on a fresh connection while requests queued behind it fail
        fast instead of each waiting out its own timeouts; after the last retry the endpoint is marked down."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        token = object()
        try:
            return await self._attempts(token, unit, address, op, count, values)
        finally:
            if self._prober is token:
                self._prober = None

    async def _attempts(
        self, token: object, unit: int, address: int, op: str, count: int, values: list[int] | None
    ) -> list[int]:
        from pymodbus.exceptions import ModbusException

        assert self._lock is not None
        last: DeviceError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            async with self._lock:  # one request in flight per endpoint (pymodbus would queue them anyway)
                if self._prober is not None and self._prober is not token:
                    raise DeviceUnreachable(
                        "not answering (another request is retrying)", endpoint=self.endpoint, unit=unit
                    )
                client = await self._connect(unit)
                self.requests += 1
                try:
                    if op == "read":
                        coro = client.read_holding_registers(address, count=count, device_id=unit)  # type: ignore[attr-defined]
                    else:
                        coro = client.write_registers(address, values, device_id=unit)  # type: ignore[attr-defined]
                    resp = await asyncio.wait_for(coro, self.timeout_s * 1.5)
                except asyncio.CancelledError:
                    # The caller's own timeout cancelled us mid-request. The reply may still come, and on this
                    # connection the next request would queue behind it on the device, and meet it: pymodbus skips
                    # it only when the transaction id tells it apart (not from a device that answers with id 0).
                    # Drop the connection (the next request reconnects) and let the cancellation through.
                    self.errors += 1
                    self._drop()
                    raise
                except (ModbusException, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
                    self.errors += 1
                    self._drop()  # a late reply must never be matched to the next request
                    last = DeviceUnreachable(
                        f"no reply to {op} of {count} registers ({type(exc).__name__}: {exc})",
                        endpoint=self.endpoint,
                        unit=unit,
                        address=address,
                    )
                    self._prober = token  # the others fail fast while this one retries
                    if attempt == self.retries:
                        self._mark_down()
                    continue
            if resp.isError():
                self.errors += 1
                raise DeviceRefused(
                    int(getattr(resp, "exception_code", 4)), op, endpoint=self.endpoint, unit=unit, address=address
                )
            return list(resp.registers) if op == "read" else []
        assert last is not None
        raise last


# -- in memory -----------------------------------------------------------------------------------------------------


@dataclass
class _Fault:
    kind: str  # "unreachable" | "refused"
    code: int
    units: frozenset[int] | None
    ops: frozenset[str]
    remaining: int | None  # None: until healed


@dataclass
class InMemoryBus:
    """Registers in a dict per unit, for tests. Unset addresses read as illegal (DeviceRefused 2), like a device.

    `fail(...)` makes requests fail on demand (all or some units, reads and/or writes, for n requests or until
    `heal()`); `protect(unit, start, stop)` makes a range read-only (writes refused with code 2); every successful
    write is recorded in `writes` as (unit, address, values).
    """

    units: dict[int, dict[int, int]] = field(default_factory=dict)
    endpoint: str = "memory"
    writes: list[tuple[int, int, list[int]]] = field(default_factory=list)
    reads: int = 0
    _faults: list[_Fault] = field(default_factory=list)
    _protected: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def set_words(self, unit: int, address: int, words: Iterable[int]) -> None:
        regs = self.units.setdefault(unit, {})
        for i, w in enumerate(words):
            if not 0 <= int(w) <= 0xFFFF:
                raise ValueError(f"register value {w} outside 0..65535")
            regs[address + i] = int(w)

    def get_words(self, unit: int, address: int, count: int) -> list[int]:
        regs = self.units.get(unit, {})
        return [regs.get(address + i, 0) for i in range(count)]

    def load(self, images: Mapping[int, Mapping[int, Iterable[int]]]) -> None:
        """Preload {unit: {address: words}}."""
        for unit, blocks in images.items():
            for address, words in blocks.items():
                self.set_words(unit, address, words)

    def protect(self, unit: int, start: int, stop: int) -> None:
        self._protected.setdefault(unit, []).append((start, stop))

    def fail(
        self,
        kind: str = "unreachable",
        *,
        code: int = 4,
        units: Iterable[int] | None = None,
        ops: Iterable[str] = ("read", "write"),
        times: int | None = None,
    ) -> None:
        """Make matching requests fail: kind "unreachable" (DeviceUnreachable) or "refused" (DeviceRefused(code))."""
        if kind not in ("unreachable", "refused"):
            raise ValueError("kind must be 'unreachable' or 'refused'")
        self._faults.append(_Fault(kind, int(code), None if units is None else frozenset(units), frozenset(ops), times))

    def heal(self) -> None:
        self._faults.clear()

    def _maybe_fail(self, unit: int, address: int, op: str) -> None:
        for f in self._faults:
            if (f.units is None or unit in f.units) and op in f.ops and (f.remaining is None or f.remaining > 0):
                if f.remaining is not None:
                    f.remaining -= 1
                if f.kind == "unreachable":
                    raise DeviceUnreachable(f"injected: no reply to {op}", endpoint=self.endpoint, unit=unit)
                raise DeviceRefused(f.code, f"injected on {op}", endpoint=self.endpoint, unit=unit, address=address)

    async def read(self, unit: int, address: int, count: int) -> list[int]:
        _check_span(address, count)
        await asyncio.sleep(0)
        self._maybe_fail(unit, address, "read")
        if unit not in self.units:
            raise DeviceUnreachable("no such unit", endpoint=self.endpoint, unit=unit)
        regs = self.units[unit]
        missing = [a for a in range(address, address + count) if a not in regs]
        if missing:
            raise DeviceRefused(2, f"register {missing[0]} not mapped", endpoint=self.endpoint, unit=unit)
        self.reads += 1
        return [regs[a] for a in range(address, address + count)]

    async def write(self, unit: int, address: int, values: list[int]) -> None:
        _check_span(address, len(values))
        await asyncio.sleep(0)
        self._maybe_fail(unit, address, "write")
        if unit not in self.units:
            raise DeviceUnreachable("no such unit", endpoint=self.endpoint, unit=unit)
        for start, stop in self._protected.get(unit, []):
            if address < stop and address + len(values) > start:
                raise DeviceRefused(2, "read-only registers", endpoint=self.endpoint, unit=unit, address=address)
        self.set_words(unit, address, values)
        self.writes.append((unit, address, [int(v) for v in values]))

    async def close(self) -> None:
        return None
