"""The simulated plant served over Modbus TCP, in exactly the register map the daemon reads (docs/registers.md).

Units (Modbus device ids) on one endpoint:

| unit | device | map |
|---|---|---|
| 1 | the PCC meter | SunSpec at 40000: models 1, 203 |
| 2 | the campus battery | SunSpec at 40000: models 1, 701, 704, 713, 802 |
| 3 | the site device | dimmer-site-v1 |
| 10, 11, ... | rack devices, 64 racks each in tree order (the last one holds the rest) | dimmer-rack-v1 |

Any other unit id gets Modbus exception 0x0B (gateway target failed to respond; `dimmer.daemon.agent.
unknown_unit_device`). Only function codes 3 (read holding registers), 6 and 16 (write registers) are served; any
other is exception 1 (`modbus`). It listens on 127.0.0.1 unless given another host.

The modules, along the way a request goes:

- `modbus`: pymodbus's server, with the function-code gate;
- `sunspec`: the SunSpec images, built from the published definitions, and their write rules; the PCC meter;
- `battery`: the campus battery (701, 704, 713, 802) and the setpoint and reversion semantics it follows;
- `maps`: the project's own site and rack devices, the rack leases and their fallback cap;
- `plant`: `PlantServer`: the devices, every register access, each observation published, the Actions decoded;
- `worker`: the engine in a worker thread, in step with wall time, with `PlantWorker` in the controller's seat;
- `cli`: `gridsim serve`.

The plant is the ordinary engine (`gridsim.engine.Simulation`) running in a worker thread with an adapter in the
controller's seat: every simulated control period the adapter (`PlantWorker`) waits until wall time catches up with
`obs.t_s / speed`, publishes the observation into the registers, and returns the Actions decoded from what was
last written — honouring leases as real equipment would: a rack device whose lease ran out (no write for
`lease_s` of plant time) falls back to its safe cap, floors off, and once the cap has taken hold its BBUs to backup
only; a battery setpoint reverts once WSetRvrtTms passes without a setpoint write (to WSetRvrt if WSetEnaRvrt is
enabled, else to 0 W). A rack
device nobody has written yet runs hands-off. Every register access happens on the event loop's thread, so a read
never sees half a publication.

The engine runs its first control period hands-off and calls the controller's seat first at t = one period. With
`hold_until_first_write`, the plant stops there: it publishes that observation and waits (plant time frozen) for a
client's first accepted write — then for every rack device and the battery's setpoint (704 WSetEna, WSetMod,
WSet or WSetPct; a daemon writes the reversion points first) to be written, or HOLD_GRACE_WALL_S of wall time,
so one whole daemon cycle lands — and applies it from that instant, as the in-process engine applies
its controller's first step. A served run then starts exactly like the in-process run of the same scenario instead
of drifting hands-off for as long as the daemon takes to connect, discover and decide. A plant nobody writes to
holds until `stop()`.

Every write is recorded (`writes`), including refused ones. At the end the normal run outputs are written with
`gridsim.output.write_run` (summary.json, time series, plots, report.md) plus `serve.json` (writes, refusals,
lease expiries, the device map). In a served run `controller_step_ms_*` measure the adapter's wait for wall time,
not a controller.
"""

from __future__ import annotations

from gridsim.serve.battery import BATTERY_MODELS, ServedBattery
from gridsim.serve.cli import add_serve_arguments, main_serve, run_serve
from gridsim.serve.common import (
    BATTERY_UNIT,
    FIRST_RACK_UNIT,
    MAX_UNIT,
    METER_UNIT,
    SITE_UNIT,
    SUNSPEC_BASE,
    WriteRecord,
)
from gridsim.serve.maps import fallback_cap_w
from gridsim.serve.plant import WRITES_KEPT, PlantServer
from gridsim.serve.sunspec import METER_MODELS, ServedMeter
from gridsim.serve.worker import HOLD_GRACE_WALL_S

__all__ = [
    "BATTERY_MODELS",
    "BATTERY_UNIT",
    "FIRST_RACK_UNIT",
    "HOLD_GRACE_WALL_S",
    "MAX_UNIT",
    "METER_MODELS",
    "METER_UNIT",
    "SITE_UNIT",
    "SUNSPEC_BASE",
    "WRITES_KEPT",
    "PlantServer",
    "ServedBattery",
    "ServedMeter",
    "WriteRecord",
    "add_serve_arguments",
    "fallback_cap_w",
    "main_serve",
    "run_serve",
]
