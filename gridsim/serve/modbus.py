"""The served plant's Modbus TCP server: pymodbus's, behind the project's guards (`dimmer.daemon.agent_net.
GuardedTcpServer`), answering only read holding registers (3) and the two register writes (6, 16) from the devices'
images; any other function code is exception 1 (illegal function), a request whose counts do not add up exception 3.

pymodbus 3.16.1 would answer more from a simulator device's registers: coils (1, 5, 15) and discrete inputs (2)
as bits of the same shared block, input registers (4), mask write (22) and read/write multiple (23) as register
accesses, and read device identification (43 / 14) and diagnostics (8) by itself, before any device action runs.
A SunSpec device has holding registers only, and a write must go through the device's own vetting, so the gate is
placed before pymodbus decodes the request at all: the guarded server reads the MBAP header itself and answers a
request whose function code is not 3, 6 or 16 with exception 1 (0x0B for a unit the server does not have, as for
every request to one: `dimmer.daemon.agent.unknown_unit_device`), logging the 1st, 2nd, 4th, ... of each kind from
each client. The refused requests that would have written something (5, 15, 22, 23) are reported to `on_refused`
so that the plant records them with the other writes. The server also caps its connections and closes idle ones
(`dimmer.daemon.netguard.ConnectionLimits`: `gridsim serve --max-connections`, `--idle-timeout-s`).

Imported only when the server starts listening, so that `gridsim serve --help` does not import pymodbus.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from pymodbus.constants import ExcCodes
from pymodbus.simulator import DataType, SimData, SimDevice

from dimmer.daemon.agent import unknown_unit_device
from dimmer.daemon.agent_net import GuardedTcpServer
from dimmer.daemon.netguard import ConnectionLimits
from gridsim.serve.common import FUNCTIONS_SERVED, Image

log = logging.getLogger("gridsim.serve")

# (image, function code, start of the block, address, count, the block's registers, values written or None)
Access = Callable[[Image, int, int, int, int, list[int], list[int] | list[bool] | None], Any]
# (unit, function code, address, values) of a refused request that would have written
Refused = Callable[[int, int, int, tuple[int, ...]], None]
WRITES_REFUSED = (5, 15, 22, 23)  # write coil(s), mask write register, read/write multiple registers


def request_words(pdu: bytes) -> tuple[int, tuple[int, ...]]:
    """(address, values) of a write request of function 5, 15, 22 or 23 as it carried them (bits as 0 / 1), from
    its PDU (function code first); what a PDU too short to hold them lacks is left out."""
    fc, body = pdu[0], pdu[1:]

    def words(b: bytes) -> tuple[int, ...]:
        return tuple(struct.unpack(f">{len(b) // 2}H", b[: len(b) // 2 * 2]))

    address = struct.unpack_from(">H", body)[0] if len(body) >= 2 else 0
    if fc == 5:
        return address, (int(body[2:4] == b"\xff\x00"),) if len(body) >= 4 else ()
    if fc == 15 and len(body) >= 5:
        count = struct.unpack_from(">H", body, 2)[0]
        bits = [(byte >> i) & 1 for byte in body[5:] for i in range(8)]
        return address, tuple(bits[:count])
    if fc == 22:
        return address, words(body[2:6])
    if fc == 23 and len(body) >= 9:
        return struct.unpack_from(">H", body, 4)[0], words(body[9:])
    return address, ()


class PlantModbusServer(GuardedTcpServer):
    """Every image as one pymodbus simulator device (its registers served by `on_access`), plus the device that
    answers any other unit with exception 0x0B."""

    def __init__(
        self,
        images: Mapping[int, Image],
        on_access: Access,
        on_refused: Refused,
        address: tuple[str, int],
        limits: ConnectionLimits | None = None,
    ) -> None:
        devices = [unknown_unit_device()]
        for img in images.values():
            data = SimData(img.start, count=img.size, values=0, datatype=DataType.REGISTERS)
            devices.append(SimDevice(img.unit, simdata=[data], action=_action(img, on_access)))

        def refused(unit: int, fc: int, pdu: bytes) -> None:
            if fc in WRITES_REFUSED:
                on_refused(unit, fc, *request_words(pdu))

        super().__init__(
            devices,
            address=address,
            units=images,
            functions=FUNCTIONS_SERVED,
            limits=limits,
            on_refused=refused,
            log=log,
        )


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
    images: Mapping[int, Image],
    on_access: Access,
    on_refused: Refused,
    host: str,
    port: int,
    limits: ConnectionLimits | None = None,
) -> tuple[PlantModbusServer, int]:
    """Start serving `images` on host:port (0: a free port); the server and the port bound. ListenError (one line
    naming host:port and why) when it cannot listen."""
    server = PlantModbusServer(images, on_access, on_refused, (host, port), limits)
    return server, await server.start()
