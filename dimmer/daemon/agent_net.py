"""pymodbus's ModbusTcpServer with a gate on every connection and the client's address on every request.

pymodbus 3.16.1 hands a simulator device's `action` the function code, addresses and values of a request, not who
sent it. The client is known only to the connection: `ModbusTcpServer.callback_new_connection` makes one
`ServerRequestHandler` per accepted TCP connection, and asyncio gives it the socket in `connection_made`. This
handler asks `admit(host, port)` there and closes the connection at once if refused (`ModbusProtocol.close` also
drops it from the listener's table of connections), so a refused client's bytes are never read. Each request of
an admitted client is served inside `handle_request`, one asyncio task per request, with `agent_server.PEER` set
to the client: the device's action, which runs in that task, reads it.

Imported only when a `RegisterServer` starts, so that the rest of the daemon imports without pymodbus.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pymodbus.server import ModbusTcpServer
from pymodbus.server.requesthandler import ServerRequestHandler

from dimmer.daemon.agent_server import PEER

Admit = Callable[[str, int], bool]


def peer_of(peername: Any) -> tuple[str, int]:
    """(host, port) from a socket's peername (IPv4 2-tuple, IPv6 4-tuple); ("", 0) when there is none."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        return str(peername[0]), int(peername[1])
    return "", 0


class _GatedHandler(ServerRequestHandler):
    """One client connection: admitted, or closed as soon as it is made; its requests run with PEER set."""

    peer: tuple[str, int] = ("", 0)
    admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.peer = peer_of(transport.get_extra_info("peername"))
        self.admitted = bool(self.server.admit(*self.peer))
        if not self.admitted:
            self.close()

    async def handle_request(self) -> None:
        if not self.admitted:  # never reached: a refused connection is closed before it is read
            return
        token = PEER.set(self.peer)
        try:
            await super().handle_request()
        finally:
            PEER.reset(token)


class GatedTcpServer(ModbusTcpServer):
    """A ModbusTcpServer whose connections `admit(host, port)` decides on.

    pymodbus's `listen` swallows the OSError of a failed bind (a warning on its own logger, then a RuntimeError
    without the reason from `serve_forever`); `listen_error` keeps it so that the caller can say why.
    """

    def __init__(self, devices: Any, *, address: tuple[str, int], admit: Admit) -> None:
        super().__init__(devices, address=address)
        self.admit = admit
        self.listen_error: OSError | None = None

    async def listen(self) -> bool:
        create = self.call_create

        async def remembering() -> Any:
            try:
                return await create()
            except OSError as exc:
                self.listen_error = exc
                raise

        self.call_create = remembering
        try:
            return await super().listen()
        finally:
            self.call_create = create

    def callback_new_connection(self) -> _GatedHandler:
        return _GatedHandler(self, self.trace_packet, self.trace_pdu, self.trace_connect)
