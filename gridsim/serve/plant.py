"""`PlantServer`: the plant of a scenario served over Modbus TCP — its devices, the Modbus side (every access on
the event loop's thread), the publication of each observation and the Actions decoded from what was written. The
engine runs in a worker thread (`gridsim.serve.worker`); the package docstring says how it all fits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.daemon import registers as R
from dimmer.daemon.netguard import ConnectionLimits
from dimmer.errors import InputError
from dimmer.observation import Actions, Observation
from gridsim.engine import SimResult
from gridsim.scenario import LoadedScenario
from gridsim.serve.battery import ServedBattery
from gridsim.serve.common import (
    BATTERY_UNIT,
    FIRST_RACK_UNIT,
    FUNCTIONS_SERVED,
    ILLEGAL_ADDRESS,
    ILLEGAL_FUNCTION,
    MAX_UNIT,
    METER_UNIT,
    SITE_UNIT,
    SUNSPEC_BASE,
    WRITE_FUNCTIONS,
    Image,
    WriteRecord,
)
from gridsim.serve.maps import (
    RackDevices,
    cap_settle_s,
    fallback_cap_w,
    publish_site,
    rack_device_spans,
    site_image,
    site_parts,
)
from gridsim.serve.sunspec import ServedMeter, SunSpecDevice
from gridsim.serve.worker import PlantWorker

# the latest writes kept for inspection (tests, serve.json counts the rest): a days-long served run must not grow
WRITES_KEPT = 100_000


class PlantServer:
    """The plant of `loaded` served over Modbus TCP on `host:port` (port 0: a free port), advancing `speed` x
    wall-clock time. `start()` binds and starts the plant; `done` is set when the run has finished and its outputs
    are written (or it failed: see `error`), `ended` as soon as the engine reaches the scenario's end (before the
    outputs); `stop()` ends everything early, `abandon(reason)` ends the run without outputs from any thread.

    Leases and reversion times are counted in plant time (wall time x speed), the clock the engine runs on: a
    daemon that steps once per simulated control period renews them exactly as it would at speed 1.

    `hold_until_first_write`: the plant stops at its first control point (t = one control period, the
    observation published) until a client writes, and applies that write from there (package docstring).
    `limits`: connections served at once and how long one may stay silent (`dimmer.daemon.netguard`).
    `start()` raises `ListenError` (one line: host:port and why) when it cannot listen.
    """

    def __init__(
        self,
        loaded: LoadedScenario,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        speed: float = 1.0,
        out_dir: Path | str | None = None,
        seed: int | None = None,
        safe_cap_w: float | None = None,
        controller_label: str = "daemon",
        hold_until_first_write: bool = False,
        limits: ConnectionLimits | None = None,
    ) -> None:
        if not speed > 0:
            raise InputError("--speed", "speed", f"a positive number (got {speed!r})")
        if not 0 <= int(port) <= 65535:
            raise InputError("--port", "port", f"0..65535 (got {port!r})")
        self.loaded = loaded
        self.host = host
        self.limits = limits or ConnectionLimits()
        self._port = int(port)
        self.speed = float(speed)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.seed = loaded.scenario.seed if seed is None else int(seed)
        self.controller_label = controller_label
        self.site = site = loaded.site()
        n_devices = int(rack_device_spans(site)[0].size)
        if FIRST_RACK_UNIT + n_devices - 1 > MAX_UNIT:
            raise InputError(loaded.source, "site", f"at most {(MAX_UNIT - FIRST_RACK_UNIT + 1) * R.RACK_MAX} racks")
        self.site_parts = site_parts(site)
        if SITE_UNIT + len(self.site_parts) > FIRST_RACK_UNIT or site.n_jobs > R.SITE_MAX_JOBS:
            most = (FIRST_RACK_UNIT - SITE_UNIT) * R.SITE_MAX_DOMAINS
            raise InputError(
                loaded.source, "site", f"a site the dimmer-site-v1 map can hold: at most {most} domains, 256 jobs"
            )
        self.safe_cap_w = fallback_cap_w(site) if safe_cap_w is None else float(safe_cap_w)

        # the devices
        name = loaded.scenario.name
        self.meter = ServedMeter(site, name)
        self.battery = ServedBattery(site, name)
        self.racks = racks = RackDevices(site, self.safe_cap_w, cap_settle_s(loaded.scenario))
        self.n_rack_devices = racks.n_devices
        self.rack_first, self.rack_count = racks.first, racks.count
        # what the racks are told (arrays shared with `racks`, updated in place)
        self.cmd_cap_w, self.cmd_floor_w = racks.cmd_cap_w, racks.cmd_floor_w
        self.cmd_bbu_threshold_w, self.cmd_bbu_recharge_w = racks.cmd_bbu_threshold_w, racks.cmd_bbu_recharge_w
        self.dev_written, self.dev_last_write_s, self.dev_lease_s = racks.written, racks.last_write_s, racks.lease_s
        self._sunspec: dict[int, SunSpecDevice] = {METER_UNIT: self.meter, BATTERY_UNIT: self.battery}
        self._images: dict[int, Image] = {METER_UNIT: self.meter.image, BATTERY_UNIT: self.battery.image}
        for k, (first, n) in enumerate(self.site_parts):
            self._images[SITE_UNIT + k] = site_image(site, first, n, SITE_UNIT + k)
        for k, img in enumerate(racks.images):
            self._images[FIRST_RACK_UNIT + k] = img

        self.writes: list[WriteRecord] = []  # the latest WRITES_KEPT to 2 x WRITES_KEPT, oldest first
        self.n_writes = 0
        self.n_writes_refused = 0
        self.published: dict[int, Observation] = {}  # update_count -> the observation published with it
        self.update_count = 0
        self.last_obs: Observation | None = None
        self.result: SimResult | None = None
        self.summary: dict[str, Any] | None = None
        self.error: str | None = None
        self.ended = asyncio.Event()  # the engine reached the scenario's end (set before the outputs are written)
        self.done = asyncio.Event()
        self.abandon_reason: str | None = None
        self._server: Any = None
        self.hold_until_first_write = bool(hold_until_first_write)
        self.first_write_wall_s: float | None = None  # when the first write was accepted (monotonic)
        self.worker = PlantWorker(self, self.speed, self.hold_until_first_write)

    # -- public ------------------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound port (the one the OS chose when constructed with port=0) once started."""
        return self._port

    @property
    def bound_address(self) -> tuple[str, int] | None:
        """(host, port) the listening socket is bound to, as the OS reports it; None when not listening."""
        transport = getattr(self._server, "transport", None)
        sockets = getattr(transport, "sockets", None) or []
        if not sockets:
            return None
        host, port = sockets[0].getsockname()[:2]
        return str(host), int(port)

    @property
    def meter_sf(self) -> int:
        """The PCC meter's W_SF (its resolution is 10^W_SF W)."""
        return self.meter.w_sf

    @property
    def dev_expired(self) -> npt.NDArray[np.bool_]:
        return self.racks.expired

    @property
    def lease_expiries(self) -> int:
        return self.racks.lease_expiries

    @property
    def bess_written(self) -> bool:
        """A client has written the battery's setpoint (704 WSetEna, WSetMod, WSet or WSetPct): with
        hold_until_first_write the plant waits for it, not only for the reversion points a daemon writes first."""
        return self.battery.setpoint_written

    def device_map(self) -> dict[str, Any]:
        """Plain data a daemon config can be generated from: host, port and every device's kind, unit and span."""
        devices: list[dict[str, Any]] = [
            {"name": "pcc-meter", "kind": "sunspec-meter", "unit": METER_UNIT, "base": SUNSPEC_BASE},
            {"name": "campus-battery", "kind": "sunspec-battery", "unit": BATTERY_UNIT, "base": SUNSPEC_BASE},
        ]
        for k, (first, n) in enumerate(self.site_parts):
            devices.append(
                {"name": "site" if k == 0 else f"site-{k}", "kind": "site", "unit": SITE_UNIT + k,
                 "first_domain": first, "n_domains": n, "n_jobs": self.site.n_jobs}
            )  # fmt: skip
        for k in range(self.n_rack_devices):
            devices.append(
                {
                    "name": f"racks-{k}",
                    "kind": "rack",
                    "unit": FIRST_RACK_UNIT + k,
                    "first_rack": int(self.rack_first[k]),
                    "n_racks": int(self.rack_count[k]),
                }
            )
        return {
            "host": self.host,
            "port": self.port,
            "scenario": self.loaded.scenario.name,
            "speed": self.speed,
            "control_period_s": self.loaded.scenario.engine.control_period_s,
            "time_base": "lease_s and reversion times are plant seconds (wall seconds x speed)",
            "safe_cap_w": self.safe_cap_w,
            "devices": devices,
        }

    @property
    def holding(self) -> bool:
        """hold_until_first_write: the plant is still held at its first control point."""
        return self.worker.holding

    def plant_time_s(self) -> float:
        """Plant (simulated) time now: wall time since the start x speed; NaN before start; frozen while holding."""
        return self.worker.plant_time_s()

    async def start(self) -> None:
        """Bind the Modbus server and start the plant."""
        await self._listen(self._port)
        self.worker.start(asyncio.get_running_loop())

    async def stop(self) -> None:
        """Stop the plant (a run not yet finished is abandoned: no outputs) and close the server."""
        await self.worker.stop()
        await self._close_listener()
        if not self.done.is_set():
            self.done.set()

    def abandon(self, reason: str) -> None:
        """Stop the run without outputs (from any thread); `error` becomes `reason`. For a plant whose daemon is
        gone: a report of the run would claim a control that stopped partway."""
        self.abandon_reason = reason
        self.worker.abandon()

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the run to finish; False on timeout."""
        try:
            await asyncio.wait_for(self.done.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    # fault injection, for tests of the daemon
    async def pause_network(self) -> None:
        """Close the listener and every connection, as if the server process died (the plant keeps running)."""
        await self._close_listener()

    async def resume_network(self) -> None:
        """Listen again on the same port."""
        await self._listen(self._port)

    def stall(self, unit: int, stalled: bool = True) -> None:
        """Make a device stop (or resume) updating its measurements: it keeps answering with old values."""
        self._images[unit].stalled = stalled

    def refuse_writes(self, unit: int, code: int | None = 4) -> None:
        """Refuse every write to `unit` with Modbus exception `code` (None: accept again)."""
        self._images[unit].refuse_code = code

    def set_battery_online(self, online: bool) -> None:
        """Take the campus battery off line (or back), from the next control period."""
        self.worker.pending_bess_online = bool(online)

    def words(self, unit: int, address: int, count: int) -> list[int]:
        """The registers as served (for tests)."""
        return self._images[unit].get(address, count).astype(int).tolist()

    def map_size(self, unit: int) -> int:
        """How many registers `unit` serves from its first address (SunSpec devices: from SUNSPEC_BASE)."""
        return self._images[unit].size

    # -- the Modbus side (event loop thread) ----------------------------------------------------------------------

    async def _listen(self, port: int) -> None:
        from gridsim.serve.modbus import listen

        self._server, self._port = await listen(
            self._images, self._on_access, self._on_refused, self.host, port, self.limits
        )

    async def _close_listener(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(Exception):
                await server.shutdown()
            await asyncio.sleep(0)

    def _on_access(
        self,
        img: Image,
        fc: int,
        start: int,
        address: int,
        count: int,
        regs: list[int],
        values: list[int] | list[bool] | None,
    ) -> Any:
        from pymodbus.constants import ExcCodes

        if fc not in FUNCTIONS_SERVED:  # the server's gate answers these before any device sees them
            return ExcCodes.ILLEGAL_FUNCTION
        off = address - start
        if values is None:  # a read: serve our image
            regs[off : off + count] = img.get(address, count).tolist()
            return None
        words = [int(v) for v in values]
        t_plant = self.plant_time_s()
        code = self._apply_write(img, address, words, t_plant) if fc in WRITE_FUNCTIONS else ILLEGAL_FUNCTION
        self._record(WriteRecord(time.monotonic(), t_plant, img.unit, address, tuple(words), code, fc))
        return ExcCodes(code) if code else None

    def _on_refused(self, unit: int, fc: int, address: int, values: tuple[int, ...]) -> None:
        """A request to write by a function code the plant does not serve (refused by the server's gate)."""
        self._record(WriteRecord(time.monotonic(), self.plant_time_s(), unit, address, values, ILLEGAL_FUNCTION, fc))

    def _record(self, w: WriteRecord) -> None:
        self.writes.append(w)
        self.n_writes += 1
        self.n_writes_refused += w.refused is not None
        if len(self.writes) >= 2 * WRITES_KEPT:
            del self.writes[:WRITES_KEPT]  # in halves: amortised O(1) a write
        if w.refused is None and self.first_write_wall_s is None:
            self.first_write_wall_s = w.t_wall_s

    def _apply_write(self, img: Image, address: int, words: list[int], t_plant: float) -> int | None:
        """Validate and apply one write; the Modbus exception code if refused (nothing applied then)."""
        dev = self._sunspec.get(img.unit)
        if dev is not None:
            target = dev.target(address, len(words))
            if target is None:
                return ILLEGAL_ADDRESS
            if img.refuse_code is not None:
                return img.refuse_code
            return dev.write(target, address, words, t_plant)
        if not img.may_write(address, len(words)):
            return ILLEGAL_ADDRESS
        if img.refuse_code is not None:
            return img.refuse_code
        if img.unit >= FIRST_RACK_UNIT:
            return self.racks.write(img.unit - FIRST_RACK_UNIT, address, words, t_plant)
        return ILLEGAL_ADDRESS

    # -- the plant side ----------------------------------------------------------------------------------------

    def _write_outputs(self, res: SimResult) -> None:
        from gridsim.output import write_run

        assert self.out_dir is not None
        write_run(res, self.out_dir)
        serve = {
            "device_map": self.device_map(),
            "writes": self.n_writes,
            "writes_refused": self.n_writes_refused,
            "lease_expiries": self.lease_expiries,
            "safe_cap_w": self.safe_cap_w,
        }
        (self.out_dir / "serve.json").write_text(json.dumps(serve, indent=2) + "\n")

    def all_written(self) -> bool:
        """Every rack device and the battery's setpoint have been written (hold_until_first_write)."""
        return bool(self.dev_written.all()) and self.bess_written

    async def _publish_async(self, obs: Observation) -> None:
        self._publish(obs)

    async def _exchange(self, obs: Observation) -> Actions:
        """On the loop thread: publish the observation, then decode what the devices were told."""
        self.racks.update_leases(obs.t_s)  # leases, in plant time
        self._publish(obs)
        cap, floor, thr, rec = self.racks.commands()
        return Actions(
            rack_cap_w=cap,
            rack_floor_w=floor,
            bess_setpoint_w=self.battery.setpoint(obs.t_s),
            rack_bbu_threshold_w=thr,
            rack_bbu_recharge_w=rec,
            job_suspend=np.zeros(self.site.n_jobs, dtype=bool),
        )

    def _publish(self, obs: Observation) -> None:
        self.update_count = uc = (self.update_count + 1) & 0xFFFFFFFF
        self.last_obs = obs
        self.published[uc] = obs
        self.published.pop(uc - 8, None)
        if not self.meter.image.stalled:
            self.meter.publish(obs)
        if not self.battery.image.stalled:
            self.battery.publish(obs, uc)
        for k, (first, _) in enumerate(self.site_parts):
            publish_site(self._images[SITE_UNIT + k], self.site, obs, uc, first)
        self.racks.publish(obs, uc)
