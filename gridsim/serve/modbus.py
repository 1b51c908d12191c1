"""The served plant's Modbus TCP server: pymodbus's, answering only read holding registers (3) and the two
register writes (6, 16) from the devices' images; any other function code is exception 1 (illegal function).

pymodbus 3.16.1 would answer more from a simulator device's registers: coils (1, 5, 15) and discrete inputs (2)
as bits of the same shared block, input registers (4), mask write (22) and read/write multiple (23) as register
accesses, and read device identification (43 / 14) and diagnostics (8) by itself, before any device action runs.
A SunSpec device has holding registers only, and a write must go through the device's own vetting, so the gate is
placed before pymodbus touches its datastore at all: the request handler (one per connection) answers a request
whose function code is not 3, 6 or 16 with exception 1 itself (0x0B for a unit the server does not have, as for
every request to one: `dimmer.daemon.agent.unknown_unit_device`). The refused requests that would have written
something (5, 15, 22, 23) are reported to `on_refused` so that the plant records them with the other writes.

Imported only when the server starts listening, so that `gridsim serve --help` does not import pymodbus.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from pymodbus.constants import ExcCodes
from pymodbus.pdu import ExceptionResponse
from pymodbus.server import ModbusTcpServer
from pymodbus.server.requesthandler import ServerRequestHandler
from pymodbus.simulator import DataType, SimData, SimDevice

from dimmer.daemon.agent import unknown_unit_device
from gridsim.serve.common import FUNCTIONS_SERVED, ILLEGAL_FUNCTION, Image

# (image, function code, start of the block, address, count, the block's registers, values written or None)
Access = Callable[[Image, int, int, int, int, list[int], list[int] | list[bool] | None], Any]
# (unit, function code, address, values) of a refused request that would have written
Refused = Callable[[int, int, int, tuple[int, ...]], None]
WRITES_REFUSED = (5, 15, 22, 23)  # write coil(s), mask write register, read/write multiple registers


def request_words(pdu: Any) -> tuple[int, tuple[int, ...]]:
    """(address, values) of a write request of any function code, as it carried them (bits as 0 / 1)."""
    fc = int(pdu.function_code)
    if fc == 23:
        return int(pdu.write_address), tuple(int(x) for x in pdu.write_registers)
    if fc == 22:
        return int(pdu.address), (int(pdu.and_mask), int(pdu.or_mask))
    if fc in (5, 15):
        return int(pdu.address), tuple(int(bool(b)) for b in pdu.bits)
    return int(pdu.address), tuple(int(x) for x in pdu.registers)


class _GateHandler(ServerRequestHandler):
    """One client connection; a request of a function code the plant does not serve never reaches pymodbus's
    datastore."""

    async def handle_request(self) -> None:
        pdu = self.last_pdu
        if pdu is None or pdu.function_code in FUNCTIONS_SERVED:
            await super().handle_request()
            return
        server: PlantModbusServer = self.server
        fc, unit = int(pdu.function_code), int(pdu.dev_id)
        if unit in server.units:
            code = ILLEGAL_FUNCTION
            if fc in WRITES_REFUSED:
                server.on_refused(unit, fc, *request_words(pdu))
        else:
            code = ExcCodes.GATEWAY_NO_RESPONSE
        response = ExceptionResponse(fc, code)
        response.transaction_id = pdu.transaction_id
        response.dev_id = pdu.dev_id
        self.server_send(response, self.last_addr)


class PlantModbusServer(ModbusTcpServer):
    """Every image as one pymodbus simulator device (its registers served by `on_access`), plus the device that
    answers any other unit with exception 0x0B."""

    def __init__(
        self, images: Mapping[int, Image], on_access: Access, on_refused: Refused, address: tuple[str, int]
    ) -> None:
        devices = [unknown_unit_device()]
        for img in images.values():
            data = SimData(img.start, count=img.size, values=0, datatype=DataType.REGISTERS)
            devices.append(SimDevice(img.unit, simdata=[data], action=_action(img, on_access)))
        super().__init__(devices, address=address)
        self.units = frozenset(images)
        self.on_refused = on_refused

    def callback_new_connection(self) -> _GateHandler:
        return _GateHandler(self, self.trace_packet, self.trace_pdu, self.trace_connect)


def _action(
    img: Image, on_access: Access
) -> Callable[[int, int, int, int, list[int], list[int] | list[bool] | None], Coroutine[Any, Any, ExcCodes | None]]:
    async def action(
        fc: int, start: int, address: int, count: int, regs: list[int], values: list[int] | list[bool] | None
    ) -> ExcCodes | None:
        code: ExcCodes | None = on_access(img, fc, start, address, count, regs, values)
        return code

    return action


async def listen(
    images: Mapping[int, Image], on_access: Access, on_refused: Refused, host: str, port: int
) -> tuple[PlantModbusServer, int]:
    """Start serving `images` on host:port (0: a free port); the server and the port bound."""
    server = PlantModbusServer(images, on_access, on_refused, (host, port))
    await server.serve_forever(background=True)
    if server.transport is None:
        raise OSError(f"could not listen on {host}:{port}")
    sockets = getattr(server.transport, "sockets", None) or []
    return server, int(sockets[0].getsockname()[1]) if sockets else port
