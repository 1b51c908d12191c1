"""The daemon: read every device -> Observation -> Controller.step -> write every setpoint, over real interfaces.

Layers, bottom up (see docs/registers.md for every register, docs/daemon.md for running it):

- `registers/` — sans-IO codecs and maps: `words` (every SunSpec value type, "not implemented" sentinels, scale
  factors), `blocks` (fields at offsets, records, writable spans), `sunspec` (the SunSpec models we speak, built
  from the published definitions pysunspec2 ships: 1, 124, 201-204, 211-214, 701, 704, 713, 802), `maps` (the
  project's `dimmer-rack-v1` and `dimmer-site-v1`), `docs` (the tables of docs/registers.md).
- `bus` — `RegisterBus` (Modbus TCP via pymodbus, or in memory) and the device error tree.
- `device_base`, `sunspec_devices`, `devices` — what every device shares (`Reading`, the write gate), SunSpec
  meters and batteries, rack cap devices and the site device.
- `handles`, `observe`, `safety`, `writes`, `modes`, `notify`, `audit`, `metrics`, `state`, `loop` — the cycle:
  device handles and their freshness, readings to an `Observation`, the safety net, planned writes, the mode
  machine, systemd, the audit log, the Prometheus endpoint, the state file, and the `Daemon` that runs them.
- `agent`, `agent_server`, `agent_net`, `nvml` — `dimmer agent`: one host's GPU power caps as a rack device.
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
