"""The daemon: read every device -> Observation -> Controller.step -> write every setpoint, over real interfaces.

Layers, bottom up (see docs/registers.md for every register):

- `registers` — sans-IO codecs (float32, int16, uint16, int32, uint32, acc32, strings, SunSpec scale factors,
  "not implemented" sentinels) and the register maps: the SunSpec subset (models 1, 203/213, 701, 704, 713, 802)
  and the project's own maps `dimmer-rack-v1` and `dimmer-site-v1`.
- `bus` — `RegisterBus` (Modbus TCP via pymodbus, or in memory) and the device error tree.
- `devices` — meters, batteries, rack cap devices and the site device, each returning a `Reading`.
"""

from __future__ import annotations

from dimmer.daemon.bus import (
    DeviceError,
    DeviceRefused,
    DeviceUnreachable,
    InMemoryBus,
    ModbusTcpBus,
    RegisterBus,
)
from dimmer.daemon.devices import (
    RackDevice,
    Reading,
    SiteDevice,
    SunSpecBattery,
    SunSpecMeter,
)
from dimmer.daemon.registers import DecodeError

__all__ = [
    "DecodeError",
    "DeviceError",
    "DeviceRefused",
    "DeviceUnreachable",
    "InMemoryBus",
    "ModbusTcpBus",
    "RackDevice",
    "Reading",
    "RegisterBus",
    "SiteDevice",
    "SunSpecBattery",
    "SunSpecMeter",
]
