"""What every listener of the project holds against a hostile network, without sockets (issue 12, items 8, 11, 12).

Used by the Modbus TCP servers (`dimmer.daemon.agent_net`: `dimmer agent`, `gridsim serve`) and the Prometheus
endpoint (`dimmer.daemon.metrics_http`):

- `listen_error`: a failure to listen (port in use, no such host or address, a port below 1024 without root, a port
  out of range) as one `ListenError` naming host:port and the reason (exit status 2, like any bad address given).
- `ConnectionLimits` and `ConnectionTable`: at most `max_connections` open at once per listener, and a connection
  that has sent nothing for `idle_timeout_s` closed. A connection over the cap is made room for by closing the
  connection silent for longest among those of the client address holding the most: a client that holds many idle
  sockets loses its own, and a legitimate client (another address, or one that keeps asking) keeps being served.
  Closing the oldest rather than refusing the newest is what keeps a scanner from locking the daemon out.
- `next_frame` / `refusal`: the Modbus TCP framing (MBAP) read here, before pymodbus's decoder: a stream that is not
  Modbus TCP (protocol id not 0, a length outside 2..254) is closed; a request to a unit the server does not have is
  exception 0x0B; a function code outside the documented set (docs/registers.md: 3, 6, 16) exception 0x01; a
  request of a served function whose counts do not add up exception 0x03 — all answered here, so that pymodbus
  never decodes (and never logs, at 300 bytes and a traceback a frame) what it cannot serve.
- `EveryDoubling`: what is logged of a flood: the 1st, 2nd, 4th, 8th, ... event of each kind from each client (a
  bounded table of clients), so 66,000 malformed frames cost 17 lines, not 20 MB.
"""

from __future__ import annotations

import errno
import math
import socket
import struct
from collections import Counter
from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from dimmer.errors import ListenError

K = TypeVar("K", bound=Hashable)

MAX_CONNECTIONS = 32  # per listener: a daemon needs one per endpoint; tools and a scraper a few more
IDLE_TIMEOUT_S = 120.0  # a client silent this long is closed (a daemon asks every period, at most 60 s)
CLIENTS_KEPT = 256  # client addresses whose events are counted one by one; any further one counts as "other"

# Modbus exception codes (Modbus Application Protocol v1.1b3, section 7)
ILLEGAL_FUNCTION, ILLEGAL_VALUE, GATEWAY_TARGET_FAILED = 0x01, 0x03, 0x0B
FUNCTIONS = (3, 6, 16)  # the documented set: read holding registers, write single / multiple registers
MBAP = struct.Struct(">HHHB")  # transaction id, protocol id (0), length (unit + PDU), unit id
MAX_READ, MAX_WRITE = 125, 123  # registers in one request (the protocol's limits)


def host_port(host: str, port: int) -> str:
    """host:port, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_error(host: str, port: int, exc: BaseException | None) -> ListenError:
    """The one-line error for a listener that could not listen on host:port because of `exc`."""
    where = host_port(host or "0.0.0.0", port)
    if isinstance(exc, socket.gaierror):
        return ListenError(where, f"no such host ({exc.strerror or exc})")
    if isinstance(exc, OverflowError | ValueError) or not 0 <= port <= 65535:
        return ListenError(where, "a TCP port in 0..65535")
    if isinstance(exc, OSError):
        if exc.errno == errno.EADDRINUSE:
            return ListenError(where, "address already in use (another process listens on that port)")
        if exc.errno == errno.EACCES:
            why = "permission denied (a port below 1024 needs root or CAP_NET_BIND_SERVICE)" if port < 1024 else ""
            return ListenError(where, why or "permission denied")
        if exc.errno == errno.EADDRNOTAVAIL:
            return ListenError(where, "no such address on this host")
        return ListenError(where, (exc.strerror or str(exc)).lower())
    return ListenError(where, str(exc) if exc is not None else "could not listen")


@dataclass(frozen=True)
class ConnectionLimits:
    """At most `max_connections` connections open at once on a listener; one silent for `idle_timeout_s` is closed."""

    max_connections: int = MAX_CONNECTIONS
    idle_timeout_s: float = IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int):
            raise ValueError(f"max_connections: a whole number from 1 to 10000 (got {self.max_connections!r})")
        if not 1 <= self.max_connections <= 10_000:
            raise ValueError(f"max_connections: a whole number from 1 to 10000 (got {self.max_connections!r})")
        if not (math.isfinite(self.idle_timeout_s) and 0 < self.idle_timeout_s <= 86_400):
            raise ValueError(f"idle_timeout_s: a number of seconds in (0, 86400] (got {self.idle_timeout_s!r})")

    @property
    def sweep_s(self) -> float:
        """How often to look for idle connections: a quarter of the timeout, between 50 ms and 1 s."""
        return min(1.0, max(0.05, self.idle_timeout_s / 4.0))


class ConnectionTable(Generic[K]):
    """The open connections of one listener: each one's client address and when it last sent a byte.

    Pure (the caller gives the clock and closes what it is told to): `add` returns the connections to close so that
    at most `max_connections` stay open, `idle` those silent for `idle_timeout_s`."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._open: dict[K, tuple[str, float]] = {}
        self.evicted = 0  # closed to make room for a new connection
        self.timed_out = 0  # closed for silence

    def __len__(self) -> int:
        return len(self._open)

    def add(self, key: K, host: str, now_s: float) -> list[K]:
        """Open `key` (from `host`); the connections to close to make room: the longest-silent of the client address
        that holds the most (never `key` itself, unless its client holds every connection and it is the oldest)."""
        self._open[key] = (host, now_s)
        out: list[K] = []
        while len(self._open) > self.limits.max_connections:
            per_host = Counter(h for h, _ in self._open.values())
            most = max(per_host.values())
            victim = min(
                (k for k, (h, _) in self._open.items() if per_host[h] == most and k != key),
                key=lambda k: self._open[k][1],
                default=key,
            )
            del self._open[victim]
            out.append(victim)
            self.evicted += 1
        return out

    def seen(self, key: K, now_s: float) -> None:
        """`key` sent something."""
        if key in self._open:
            self._open[key] = (self._open[key][0], now_s)

    def remove(self, key: K) -> None:
        self._open.pop(key, None)

    def idle(self, now_s: float) -> list[K]:
        """The connections silent for `idle_timeout_s` or longer, removed from the table (the caller closes them)."""
        limit = now_s - self.limits.idle_timeout_s
        out = [k for k, (_, last) in self._open.items() if last <= limit]
        for k in out:
            del self._open[k]
        self.timed_out += len(out)
        return out

    def hosts(self) -> Counter[str]:
        """Open connections by client address."""
        return Counter(h for h, _ in self._open.values())


class EveryDoubling:
    """Counts events by (client address, kind) and says which to log: the 1st, 2nd, 4th, 8th, ... of each."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._hosts: set[str] = set()

    def __call__(self, host: str, kind: str) -> int | None:
        """Count one; its number when it is one to log, else None."""
        if host not in self._hosts:
            if len(self._hosts) >= CLIENTS_KEPT:
                host = "other"
            self._hosts.add(host)
        key = (host, kind)
        self.counts[key] += 1
        n = self.counts[key]
        return n if n & (n - 1) == 0 else None


# -- Modbus TCP frames, before pymodbus decodes them ------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One whole Modbus TCP request: its transaction id, unit id, PDU (function code first) and size in bytes."""

    tid: int
    unit: int
    pdu: bytes
    size: int

    @property
    def function(self) -> int:
        return self.pdu[0]

    def exception(self, code: int) -> bytes:
        """The exception response to this request (function code | 0x80, then `code`), MBAP header included."""
        return MBAP.pack(self.tid, 0, 3, self.unit) + bytes([(self.function | 0x80) & 0xFF, code])


class NotModbus(Exception):
    """Not a Modbus TCP stream (a protocol id other than 0, a length outside 2..254): it cannot be resynchronised."""


def next_frame(buf: bytes) -> Frame | None:
    """The first whole request in `buf`; None while it is incomplete; NotModbus when the header is not Modbus TCP."""
    if len(buf) < MBAP.size:
        return None
    tid, proto, length, unit = MBAP.unpack_from(buf)
    if proto != 0:
        raise NotModbus(f"protocol id {proto}, not 0")
    if not 2 <= length <= 254:  # the unit id and a function code at least; an ADU is at most 260 bytes
        raise NotModbus(f"MBAP length {length} outside 2..254")
    size = 6 + length
    if len(buf) < size:
        return None
    return Frame(tid, unit, bytes(buf[MBAP.size : size]), size)


UNSERVED_FUNCTION = "function code not served"  # the kinds of refusal, each logged on its own doubling
MALFORMED = "malformed request"
UNKNOWN_UNIT = "unit not served"


def refusal(
    frame: Frame, units: Collection[int], functions: Collection[int] = FUNCTIONS
) -> tuple[int, str, str] | None:
    """(exception code, kind, what exactly) for a request answered before any device sees it; None to serve it.

    A unit not served: 0x0B (as a gateway answers for a unit nobody answers for); a function code outside
    `functions`: 0x01; a served function whose PDU does not add up (its length, a quantity outside 1..125 to read
    or 1..123 to write, a byte count that is not twice the quantity): 0x03, as the Modbus specification says. The
    kinds are few (UNSERVED_FUNCTION, MALFORMED, UNKNOWN_UNIT) so that a flood of varied frames logs little.
    """
    fc, pdu = frame.function, frame.pdu
    if frame.unit not in units:
        return GATEWAY_TARGET_FAILED, UNKNOWN_UNIT, f"unit {frame.unit}"
    if fc not in functions:
        return ILLEGAL_FUNCTION, UNSERVED_FUNCTION, f"function code {fc}"
    if fc in (3, 6) and len(pdu) != 5:
        return ILLEGAL_VALUE, MALFORMED, f"function {fc} request of {len(pdu)} bytes, not 5"
    if fc == 3 and not 1 <= struct.unpack_from(">H", pdu, 3)[0] <= MAX_READ:
        return ILLEGAL_VALUE, MALFORMED, f"a read of {struct.unpack_from('>H', pdu, 3)[0]} registers"
    if fc == 16:
        if len(pdu) < 6:
            return ILLEGAL_VALUE, MALFORMED, f"function 16 request of {len(pdu)} bytes"
        count, nbytes = struct.unpack_from(">HB", pdu, 3)
        if not 1 <= count <= MAX_WRITE or nbytes != 2 * count or len(pdu) != 6 + nbytes:
            return ILLEGAL_VALUE, MALFORMED, f"a write of {count} registers in {nbytes} bytes ({len(pdu) - 6} sent)"
    return None
