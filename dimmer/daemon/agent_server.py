"""A holding-register image per unit served over Modbus TCP (pymodbus): a client allow-list, every write vetted,
recorded, counted by client address and logged (logger "dimmer.agent").

`RegisterServer` is what `dimmer agent` is built on; tests also use it as a stand-in device that records writes.

- **Who may connect**: `AllowList` (default: loopback only, 127.0.0.0/8 and ::1). A connection from any other
  address is closed as soon as it is accepted, before any request is read: a refused client gets no Modbus answer
  at all, only a closed connection. Refused connections are counted by address (`connections_refused`) and logged
  (the 1st, 2nd, 4th, 8th, ... from each address, so that a scan cannot flood the log).
- **What may be written**: only the `writable` spans of a unit (else exception 2, ILLEGAL_ADDRESS), then whatever
  the `on_write` hook says of the candidate image (it may refuse with `WriteRefused(code, why)`, e.g. exception 3
  for a value out of range; a DimmerError from it is exception 4, DEVICE_FAILURE). A refused write changes nothing.
- **What is kept**: every write, accepted or refused, is a `WriteRecord` (client address, outcome) in `writes`
  (the latest WRITES_KEPT to 2 x WRITES_KEPT, oldest first), counted in `n_writes`, `n_writes_refused`,
  `writes_by_client` and `refused_by_client`, and logged: accepted at INFO, refused at WARNING.
- A request to a unit it does not serve gets exception 0x0B (`unknown_unit_device`), without a traceback in the log.
- **What is answered at all** (`agent_net.GuardedTcpServer`, `netguard`): function codes 3, 6 and 16 only (any other
  is exception 1), requests whose counts add up (else exception 3), Modbus TCP framing (else the connection is
  closed); at most `limits.max_connections` connections at once (a new one closes the longest-silent connection of
  the client holding the most) and none silent for longer than `limits.idle_timeout_s`. A listen failure is a
  `ListenError`: "cannot listen on host:port: why".
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.daemon.netguard import ConnectionLimits
from dimmer.errors import DimmerError

log = logging.getLogger("dimmer.agent")

WRITES_KEPT = 10_000  # `writes` holds the latest WRITES_KEPT to 2 x WRITES_KEPT; n_writes counts them all
CLIENTS_KEPT = 256  # addresses counted one by one; any further address is counted under "other"
LOOPBACK = ("127.0.0.0/8", "::1/128")
ILLEGAL_FUNCTION, ILLEGAL_ADDRESS, ILLEGAL_VALUE, DEVICE_FAILURE = 1, 2, 3, 4

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
OnWrite = Callable[[int, int, list[int], npt.NDArray[np.uint16]], str | None]

# (host, port) of the client whose request is being served; set per request by agent_net's connection handler
PEER: ContextVar[tuple[str, int] | None] = ContextVar("dimmer_agent_peer", default=None)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    addr = ipaddress.ip_address(host.split("%", 1)[0])  # a scoped IPv6 address: its scope does not matter here
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped  # a dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d
    return addr


def client_host(host: str) -> str:
    """The canonical text of a client address (IPv4-mapped IPv6 as IPv4); anything unparsable as it came."""
    try:
        return str(_ip(host))
    except ValueError:
        return host


@dataclass(frozen=True)
class AllowList:
    """The client addresses a server accepts connections from."""

    networks: tuple[Network, ...]
    anyone: bool = False

    @classmethod
    def parse(cls, entries: Iterable[str] = (), *, loopback: bool = True) -> AllowList:
        """Loopback (unless `loopback=False`) and each entry: an address (10.20.0.5, fd00::5) or a network
        (10.20.0.0/24). ValueError, one line, for anything else (a host name, host bits set in a network)."""
        nets: list[Network] = [ipaddress.ip_network(n) for n in LOOPBACK] if loopback else []
        for entry in entries:
            try:
                nets.append(ipaddress.ip_network(entry.strip(), strict=True))
            except ValueError:
                raise ValueError(
                    f"an IP address or network such as 10.20.0.5 or 10.20.0.0/24 (got {entry!r})"
                ) from None
        return cls(tuple(nets))

    @classmethod
    def everyone(cls) -> AllowList:
        return cls((), anyone=True)

    def allows(self, host: str) -> bool:
        if self.anyone:
            return True
        try:
            addr = _ip(host)
        except ValueError:
            return False
        return any(addr in net for net in self.networks)

    def __str__(self) -> str:
        return "anyone" if self.anyone else ", ".join(str(n) for n in self.networks) or "nobody"


class WriteRefused(Exception):
    """Raised by an `on_write` hook: answer the write with Modbus exception `code`, apply nothing."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code
        self.why = why


@dataclass(frozen=True)
class WriteRecord:
    t_mono_s: float
    unit: int
    address: int
    values: tuple[int, ...]
    client: str = ""  # the client's address ("" when unknown)
    refused: int | None = None  # the Modbus exception code it was answered with; None: accepted


def _key(counter: Counter[str], host: str) -> str:
    return host if host in counter or len(counter) < CLIENTS_KEPT else "other"


def _peer_text(host: str, port: int) -> str:
    if not host:
        return "an unknown client"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RegisterServer:
    """A holding-register image per unit, served over Modbus TCP (pymodbus), with every write vetted and recorded.

    `writable[unit]` lists the [start, stop) ranges a client may write; a write outside them is refused with
    ILLEGAL_ADDRESS, a read past the image with ILLEGAL_ADDRESS too. `on_write(unit, address, values, candidate)`
    runs before a write inside them is stored, with the image as it would be after it: it returns a note for the
    log (or None), raises `WriteRefused` to refuse it, or a DimmerError (the client then gets DEVICE_FAILURE).
    Only when it returns are the written registers stored. `allow`: who may connect (default loopback only);
    `limits`: how many connections at once and how long one may stay silent (`netguard.ConnectionLimits`).
    """

    def __init__(
        self,
        images: dict[int, npt.NDArray[np.uint16]],
        writable: dict[int, Sequence[tuple[int, int]]] | None = None,
        on_write: OnWrite | None = None,
        *,
        allow: AllowList | None = None,
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.images = images
        self.limits = limits or ConnectionLimits()
        self.writable: dict[int, npt.NDArray[np.bool_]] = {}
        for unit, image in images.items():
            mask = np.zeros(image.shape[0], dtype=bool)
            for lo, hi in (writable or {}).get(unit, ()):
                mask[lo:hi] = True
            self.writable[unit] = mask
        self.on_write = on_write
        self.allow = AllowList.parse() if allow is None else allow
        self.writes: list[WriteRecord] = []  # the latest WRITES_KEPT to 2 x WRITES_KEPT, oldest first
        self.n_writes = 0
        self.n_writes_refused = 0
        self.writes_by_client: Counter[str] = Counter()
        self.refused_by_client: Counter[str] = Counter()
        self.connections_refused: Counter[str] = Counter()
        self.connections_by_client: Counter[str] = Counter()  # admitted connections
        self.reads = 0
        self._server: Any = None
        self.port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        from pymodbus.simulator import DataType, SimData, SimDevice

        from dimmer.daemon.agent_net import GuardedTcpServer

        devices = [] if 0 in self.images else [unknown_unit_device()]
        for unit, image in self.images.items():
            data = SimData(0, count=int(image.shape[0]), values=0, datatype=DataType.REGISTERS)
            devices.append(SimDevice(id=unit, simdata=[data], action=self._action_for(unit)))
        server = GuardedTcpServer(
            devices, address=(host, port), units=self.images, limits=self.limits, admit=self._admit, log=log
        )
        self.port = await server.start()  # ListenError (one line: host:port and why) if it cannot listen
        self._server = server
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

    def client_summary(self) -> str:
        """Writes by client address (refused ones in brackets) and refused connections, for the log."""
        writes = ", ".join(f"{h} {n} ({self.refused_by_client[h]} refused)" for h, n in self.writes_by_client.items())
        refused = ", ".join(f"{h} {n}" for h, n in self.connections_refused.items())
        return f"writes by client: {writes or 'none'}; connections refused: {refused or 'none'}"

    # -- connections and requests (on the event loop) ------------------------------------------------------------

    def _admit(self, host: str, port: int) -> bool:
        host = client_host(host)
        if self.allow.allows(host):
            key = _key(self.connections_by_client, host)
            self.connections_by_client[key] += 1
            n = self.connections_by_client[key]
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... from one address: a flood of connections logs little
                log.info("client %s connected; %d connections from it so far", _peer_text(host, port), n)
            return True
        key = _key(self.connections_refused, host)
        self.connections_refused[key] += 1
        n = self.connections_refused[key]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... from one address
            log.warning(
                "connection from %s refused: not in the allow-list (%s); %d refused from it so far",
                _peer_text(host, port),
                self.allow,
                n,
            )
        return False

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
        if set_values is None:  # a read: serve our image
            if address < 0 or address + count > image.shape[0]:
                return ExcCodes.ILLEGAL_ADDRESS
            self.reads += 1
            a = address - start
            regs[a : a + count] = image[address : address + count].tolist()
            return None
        values = [int(v) for v in set_values]
        code, note = self._write(unit, fc, address, values)
        self._record(unit, address, values, code, note)
        return None if code is None else ExcCodes(code)

    def _write(self, unit: int, fc: int, address: int, values: list[int]) -> tuple[int | None, str]:
        """Vet and store one write: (None, note) when stored, (exception code, why) when refused."""
        image = self.images[unit]
        n = len(values)
        if fc not in (6, 16):
            return ILLEGAL_FUNCTION, f"function {fc} is not a register write"
        if address < 0 or address + n > image.shape[0] or not self.writable[unit][address : address + n].all():
            return ILLEGAL_ADDRESS, "registers that may not be written"
        note = ""
        if self.on_write is not None:
            cand = image.copy()
            cand[address : address + n] = values
            try:
                note = self.on_write(unit, address, values, cand) or ""
            except WriteRefused as exc:
                return exc.code, exc.why
            except DimmerError as exc:
                return DEVICE_FAILURE, str(exc)
        image[address : address + n] = values
        return None, note

    def _record(self, unit: int, address: int, values: list[int], code: int | None, note: str) -> None:
        host, port = PEER.get() or ("", 0)
        key = _key(self.writes_by_client, host)
        self.writes_by_client[key] += 1
        self.n_writes += 1
        self.writes.append(WriteRecord(time.monotonic(), unit, address, tuple(values), host, code))
        if len(self.writes) >= 2 * WRITES_KEPT:
            del self.writes[:WRITES_KEPT]  # in halves: amortised O(1) a write
        what = (
            f"write {self.writes_by_client[key]} from {_peer_text(host, port)}: unit {unit}, {len(values)} at {address}"
        )
        if code is None:
            log.info("%s: accepted%s", what, f" ({note})" if note else "")
            return
        self.n_writes_refused += 1
        self.refused_by_client[key] += 1
        log.warning("%s: refused with exception %d (%s)", what, code, note)


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
