"""pymodbus's ModbusTcpServer with the project's guards: a gate on every connection, a cap on connections and an idle
timeout, the function-code and framing gate before pymodbus's decoder, and the client's address on every request.

Both Modbus servers of the project are built on `GuardedTcpServer`: `dimmer agent` (`agent_server.RegisterServer`)
and the served plant (`gridsim.serve.modbus`). What each guard does is in `dimmer.daemon.netguard`; here is how it
sits in pymodbus 3.16.1:

- pymodbus makes one `ServerRequestHandler` per accepted TCP connection (`callback_new_connection`) and asyncio
  gives it the socket in `connection_made`. The handler asks `admit(host, port)` there and closes the connection at
  once if refused (`ModbusProtocol.close` also drops it from the listener's table of connections), so a refused
  client's bytes are never read. An admitted one enters the listener's `ConnectionTable`; the connections it says
  to close (the cap) are closed there, and a sweeper task closes the silent ones (the idle timeout).
- Every byte received goes through `callback_data`, where the MBAP header is read (`netguard.next_frame`): a stream
  that is not Modbus TCP is closed; a request refused by `netguard.refusal` (unit, function code, counts) is
  answered here, written straight to the transport; only a request the server serves reaches pymodbus's decoder
  and datastore, one at a time as pymodbus handles them. Refusals are logged on the server's logger for the 1st,
  2nd, 4th, ... of each kind from each client (`netguard.EveryDoubling`); a unit the server does not have is
  answered 0x0B without a log line (probing unit ids fills no log).
- Each request it serves runs inside `handle_request`, one asyncio task per request, with `agent_server.PEER` set
  to the client: the device's action, which runs in that task, reads it.
- pymodbus's `listen` swallows the error of a failed bind (a warning on its own logger, then a RuntimeError without
  the reason from `serve_forever`); `start` keeps it and raises `ListenError` naming host:port and the reason.

Imported only when a server starts, so that the rest of the daemon imports without pymodbus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from pymodbus.server import ModbusTcpServer
from pymodbus.server.requesthandler import ServerRequestHandler

from dimmer.daemon.agent_server import PEER
from dimmer.daemon.netguard import (
    FUNCTIONS,
    GATEWAY_TARGET_FAILED,
    ConnectionLimits,
    ConnectionTable,
    EveryDoubling,
    Frame,
    NotModbus,
    host_port,
    listen_error,
    next_frame,
    refusal,
)

Admit = Callable[[str, int], bool]
# (unit, function code, PDU) of a request refused before any device saw it (the plant records refused writes)
OnRefused = Callable[[int, int, bytes], None]


def peer_of(peername: Any) -> tuple[str, int]:
    """(host, port) from a socket's peername (IPv4 2-tuple, IPv6 4-tuple); ("", 0) when there is none."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        return str(peername[0]), int(peername[1])
    return "", 0


class _GuardedHandler(ServerRequestHandler):
    """One client connection: admitted (and counted against the cap), or closed as soon as it is made; its requests
    screened before pymodbus decodes them, and run with PEER set."""

    peer: tuple[str, int] = ("", 0)
    admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        server: GuardedTcpServer = self.server
        self.peer = peer_of(transport.get_extra_info("peername"))
        self.admitted = bool(server.admit(*self.peer))
        if not self.admitted:
            self.close()
            return
        server.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        server: GuardedTcpServer = self.server
        server.table.remove(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        server: GuardedTcpServer = self.server
        server.table.seen(self, time.monotonic())
        super().data_received(data)

    def callback_data(self, data: bytes, addr: tuple[Any, ...] | None = None) -> int:
        """Answer every refused request at the head of `data` here; hand the first served one to pymodbus."""
        server: GuardedTcpServer = self.server
        used = 0
        while used < len(data):
            try:
                frame = next_frame(data[used:])
            except NotModbus as exc:
                server.note(self.peer, "not Modbus TCP", f"not a Modbus TCP stream ({exc}): connection closed")
                self.close()
                return len(data)
            if frame is None:
                return used  # wait for the rest of the frame
            refused = refusal(frame, server.units, server.functions)
            if refused is None:
                return used + super().callback_data(data[used : used + frame.size], addr)
            self._refuse(frame, *refused)
            used += frame.size
        return used

    def _refuse(self, frame: Frame, code: int, kind: str, what: str) -> None:
        server: GuardedTcpServer = self.server
        if code != GATEWAY_TARGET_FAILED:
            server.note(self.peer, kind, f"{kind}: {what} (unit {frame.unit}), answered with exception {code}")
            if server.on_refused is not None:
                server.on_refused(frame.unit, frame.function, frame.pdu)
        if self.transport is not None:
            # straight to the transport: pymodbus's send() would also empty the receive buffer, losing the requests
            # pipelined behind this one
            self.transport.write(frame.exception(code))  # type: ignore[attr-defined]

    async def handle_request(self) -> None:
        if not self.admitted:  # never reached: a refused connection is closed before it is read
            return
        token = PEER.set(self.peer)
        try:
            await super().handle_request()
        finally:
            PEER.reset(token)


class GuardedTcpServer(ModbusTcpServer):
    """A ModbusTcpServer serving function codes `functions` to units `units` only, whose connections `admit(host,
    port)` decides on, at most `limits.max_connections` at once, each closed after `limits.idle_timeout_s` of
    silence. `log`: where refusals and closed connections are told (rate-limited)."""

    def __init__(
        self,
        devices: Any,
        *,
        address: tuple[str, int],
        units: Collection[int],
        functions: Collection[int] = FUNCTIONS,
        limits: ConnectionLimits | None = None,
        admit: Admit | None = None,
        on_refused: OnRefused | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        super().__init__(devices, address=address)
        self.address = address
        self.units = frozenset(units)
        self.functions = frozenset(functions)
        self.limits = limits or ConnectionLimits()
        self.table: ConnectionTable[_GuardedHandler] = ConnectionTable(self.limits)
        self.admit: Admit = admit or (lambda host, port: True)
        self.on_refused = on_refused
        self.log = log or logging.getLogger("dimmer.modbus")
        self.listen_error: BaseException | None = None
        self._every = EveryDoubling()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Listen (ListenError, one line, if it cannot) and start the idle sweeper; the port bound."""
        try:
            await self.serve_forever(background=True)
        except RuntimeError:  # pymodbus: "Could not start listen"
            raise listen_error(*self.address, self.listen_error) from None
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return int(self.transport.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def listen(self) -> bool:
        create = self.call_create

        async def remembering() -> Any:
            try:
                return await create()
            except (OSError, OverflowError, ValueError) as exc:  # a port out of range is an OverflowError
                self.listen_error = exc
                raise OSError(str(exc)) from exc

        self.call_create = remembering
        try:
            return await super().listen()
        finally:
            self.call_create = create

    async def shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await super().shutdown()

    def callback_new_connection(self) -> _GuardedHandler:
        return _GuardedHandler(self, self.trace_packet, self.trace_pdu, self.trace_connect)

    def note(self, peer: tuple[str, int], kind: str, what: str, level: int = logging.WARNING) -> None:
        """Log `what` of a client, for the 1st, 2nd, 4th, ... of its kind from that client's address."""
        n = self._every(peer[0], kind)
        if n is not None:
            self.log.log(level, "%s from %s; %d of this kind from it so far", what, host_port(*peer), n)

    def opened(self, handler: _GuardedHandler) -> None:
        """A connection admitted: make room under the cap by closing the longest-silent of the busiest client."""
        for victim in self.table.add(handler, handler.peer[0], time.monotonic()):
            self.note(
                victim.peer,
                "closed at the cap",
                f"connection closed to stay within {self.limits.max_connections} connections (the longest silent "
                "of the client holding the most)",
            )
            victim.close()

    async def _sweep(self) -> None:
        """Close every connection silent for the idle timeout, a few times a timeout."""
        while True:
            await asyncio.sleep(self.limits.sweep_s)
            for handler in self.table.idle(time.monotonic()):
                self.note(
                    handler.peer,
                    "idle",
                    f"connection closed after {self.limits.idle_timeout_s:g} s without a request",
                    logging.INFO,  # an ordinary end for a client that went quiet
                )
                handler.close()
