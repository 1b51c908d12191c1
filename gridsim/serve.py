"""The simulated plant served over Modbus TCP, in exactly the register map the daemon reads (docs/registers.md).

Units (Modbus device ids) on one endpoint:

| unit | device | map |
|---|---|---|
| 1 | the PCC meter | SunSpec at 40000: models 1, 203 |
| 2 | the campus battery | SunSpec at 40000: models 1, 701, 704, 802 |
| 3 | the site device | dimmer-site-v1 |
| 10, 11, ... | rack devices, 64 racks each in tree order (the last one holds the rest) | dimmer-rack-v1 |

Any other unit id gets Modbus exception 0x0B (gateway target failed to respond; `dimmer.daemon.agent.
unknown_unit_device`). It listens on 127.0.0.1 unless given another host.

The plant is the ordinary engine (`gridsim.engine.Simulation`) running in a worker thread with an adapter in the
controller's seat: every simulated control period the adapter waits until wall time catches up with
`obs.t_s / speed`, publishes the observation into the registers, and returns the Actions decoded from what was
last written — honouring leases as real equipment would: a rack device whose lease ran out (no write for
`lease_s` of plant time) falls back to its safe cap, floors off, BBUs to backup only; a battery setpoint reverts
to WSetRvrt (0 W) once WSetRvrtTms passes without a write. A rack device nobody has written yet runs hands-off.
Every register access happens on the event loop's thread, so a read never sees half a publication.

The engine runs its first control period hands-off and calls the controller's seat first at t = one period. With
`hold_until_first_write`, the plant stops there: it publishes that observation and waits (plant time frozen) for a
client's first accepted write — then for every rack device and the battery to be written, or HOLD_GRACE_WALL_S of
wall time, so one whole daemon cycle lands — and applies it from that instant, as the in-process engine applies
its controller's first step. A served run then starts exactly like the in-process run of the same scenario instead
of drifting hands-off for as long as the daemon takes to connect, discover and decide. A plant nobody writes to
holds until `stop()`.

Every write is recorded (`writes`), including refused ones. At the end the normal run outputs are written with
`gridsim.output.write_run` (summary.json, time series, plots, report.md) plus `serve.json` (writes, refusals,
lease expiries, the device map). In a served run `controller_step_ms_*` measure the adapter's wait for wall time,
not a controller.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.daemon import registers as R
from dimmer.daemon.agent import unknown_unit_device
from dimmer.daemon.config import uniform_cap_bound_w
from dimmer.errors import InputError
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel
from gridsim.engine import SimResult, Simulation
from gridsim.scenario import LoadedScenario

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

METER_UNIT = 1
BATTERY_UNIT = 2
SITE_UNIT = 3
FIRST_RACK_UNIT = 10
MAX_UNIT = 247  # Modbus device ids 1..247
SUNSPEC_BASE = 40000
ILLEGAL_ADDRESS = 2
ILLEGAL_VALUE = 3
# hold_until_first_write: after the first accepted write, how long (wall seconds) the rest of that cycle's writes
# may take to land before the plant starts anyway (it starts at once when every rack device and the battery are in)
HOLD_GRACE_WALL_S = 0.25
# the latest writes kept for inspection (tests, serve.json counts the rest): a days-long served run must not grow
WRITES_KEPT = 100_000

# SunSpec device images: which models, in chain order
METER_MODELS = (R.MODEL_1, R.MODEL_203)
BATTERY_MODELS = (R.MODEL_1, R.MODEL_701, R.MODEL_704, R.MODEL_802)


@dataclass(frozen=True)
class WriteRecord:
    """One write request as the server saw it: monotonic wall time, plant time, unit, address, the words, and the
    Modbus exception code it was refused with (None when accepted)."""

    t_wall_s: float
    t_plant_s: float
    unit: int
    address: int
    values: tuple[int, ...]
    refused: int | None = None


def fallback_cap_w(site: SiteModel) -> float:
    """The highest per-GPU cap at which every domain stays within its rating — every breaker, and the interconnect
    limit at the campus — with every rack drawing its cap and every BBU recharging.

    This is what a rack device falls back to when its lease runs out: then nobody controls the plant, the campus
    battery has reverted to idle and the racks' BBUs are backup only, recharging uncoordinated, so the caps alone
    must hold every limit. Rack AC power is affine in the per-GPU draw, so each domain gives one bound (the racks'
    fixed load — idle spare GPUs, host overhead — and their BBU recharge come off its rating). Clipped to the GPU's
    settable range: a site whose load at the lowest cap exceeds a limit gets the lowest cap.
    """
    rs = site.rack_storage
    recharge_w = np.where(rs.bbu_energy_j > 0, rs.bbu_recharge_w, 0.0)
    bound = uniform_cap_bound_w(site, site.domain_rating_w, recharge_w)
    return float(np.clip(np.min(bound), site.gpu.min_cap_w, site.gpu.rated_w))


class _Image:
    """One device's registers from `start`; `writable` marks what a client may write."""

    def __init__(self, unit: int, start: int, words: Sequence[int], writable: npt.NDArray[np.bool_]) -> None:
        self.unit = unit
        self.start = start
        self.words = np.asarray(words, dtype=np.uint16).copy()
        self.writable = writable
        self.stalled = False  # fault injection: measurements stop updating
        self.refuse_code: int | None = None  # fault injection: every write refused with this code

    def set(self, address: int, words: Sequence[int] | npt.NDArray[np.integer]) -> None:
        a = address - self.start
        arr = np.asarray(words)
        self.words[a : a + arr.shape[0]] = arr

    def get(self, address: int, count: int) -> npt.NDArray[np.uint16]:
        a = address - self.start
        return self.words[a : a + count]


class _Stopped(Exception):
    pass


class _Adapter:
    """Sits in the engine's controller seat; called from the worker thread."""

    def __init__(self, server: PlantServer, name: str) -> None:
        self.server = server
        self.name = name

    def step(self, obs: Observation) -> Actions:
        return self.server._step(obs)


class PlantServer:
    """The plant of `loaded` served over Modbus TCP on `host:port` (port 0: a free port), advancing `speed` x
    wall-clock time. `start()` binds and starts the plant; `done` is set when the run has finished and its outputs
    are written (or it failed: see `error`); `stop()` ends everything early.

    Leases and reversion times are counted in plant time (wall time x speed), the clock the engine runs on: a
    daemon that steps once per simulated control period renews them exactly as it would at speed 1.

    `hold_until_first_write`: the plant stops at its first control point (t = one control period, the
    observation published) until a client writes, and applies that write from there (module docstring).
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
    ) -> None:
        if not speed > 0:
            raise InputError("--speed", "speed", f"a positive number (got {speed!r})")
        if not 0 <= int(port) <= 65535:
            raise InputError("--port", "port", f"0..65535 (got {port!r})")
        self.loaded = loaded
        self.host = host
        self._port = int(port)
        self.speed = float(speed)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.seed = loaded.scenario.seed if seed is None else int(seed)
        self.controller_label = controller_label
        self.site = site = loaded.site()
        n = site.n_racks
        self.n_rack_devices = max(1, -(-n // R.RACK_MAX))
        if FIRST_RACK_UNIT + self.n_rack_devices - 1 > MAX_UNIT:
            raise InputError(loaded.source, "site", f"at most {(MAX_UNIT - FIRST_RACK_UNIT + 1) * R.RACK_MAX} racks")
        if site.n_domains > R.SITE_MAX_DOMAINS or site.n_jobs > R.SITE_MAX_JOBS:
            raise InputError(loaded.source, "site", "a site the dimmer-site-v1 map can hold (domains, jobs)")
        self.safe_cap_w = fallback_cap_w(site) if safe_cap_w is None else float(safe_cap_w)
        self.rack_first = np.arange(self.n_rack_devices) * R.RACK_MAX
        self.rack_count = np.minimum(R.RACK_MAX, n - self.rack_first)
        self._rack_device = np.repeat(np.arange(self.n_rack_devices), self.rack_count)  # device of each rack

        # what the racks are told, decoded at write time; leases in plant seconds
        hands = Actions.hands_off(site)
        self._hands = hands
        self.cmd_cap_w = hands.rack_cap_w.copy()
        self.cmd_floor_w = hands.rack_floor_w.copy()
        self.cmd_bbu_threshold_w = hands.rack_bbu_threshold_w.copy()
        self.cmd_bbu_recharge_w = hands.rack_bbu_recharge_w.copy()
        self.dev_written = np.zeros(self.n_rack_devices, dtype=bool)
        self.dev_last_write_s = np.full(self.n_rack_devices, -math.inf)
        self.dev_lease_s = np.zeros(self.n_rack_devices)
        self.dev_expired = np.zeros(self.n_rack_devices, dtype=bool)
        self.lease_expiries = 0
        self.bess_written = False
        self.bess_last_write_s = -math.inf

        self.writes: list[WriteRecord] = []  # the latest WRITES_KEPT to 2 x WRITES_KEPT, oldest first
        self.n_writes = 0
        self.n_writes_refused = 0
        self.published: dict[int, Observation] = {}  # update_count -> the observation published with it
        self.update_count = 0
        self.last_obs: Observation | None = None
        self.result: SimResult | None = None
        self.summary: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = asyncio.Event()
        # PCC meter W_SF: room for 1.25 x the larger of the interconnect limit and every rack at full power
        self.meter_sf = R.sf_for(1.25 * max(site.pcc_limit_w, float(site.rack_max_w().sum()), 1.0))
        self._meter_at = SUNSPEC_BASE + R.model_offsets(list(METER_MODELS))[203]
        self._images = self._build_images()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._t0 = math.nan
        self._sim: Simulation | None = None
        self._pending_bess_online: bool | None = None
        # hold_until_first_write: plant time stays at _hold_t_s while holding; the first accepted write's wall time
        self.hold_until_first_write = bool(hold_until_first_write)
        self.holding = self.hold_until_first_write
        self._hold_t_s = 0.0
        self._first_write_wall_s: float | None = None

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

    def device_map(self) -> dict[str, Any]:
        """Plain data a daemon config can be generated from: host, port and every device's kind, unit and span."""
        devices: list[dict[str, Any]] = [
            {"name": "pcc-meter", "kind": "sunspec-meter", "unit": METER_UNIT, "base": SUNSPEC_BASE},
            {"name": "campus-battery", "kind": "sunspec-battery", "unit": BATTERY_UNIT, "base": SUNSPEC_BASE},
            {
                "name": "site",
                "kind": "site",
                "unit": SITE_UNIT,
                "n_domains": self.site.n_domains,
                "n_jobs": self.site.n_jobs,
            },
        ]
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

    def plant_time_s(self) -> float:
        """Plant (simulated) time now: wall time since the start x speed; NaN before start; frozen while holding."""
        if self.holding:
            return self._hold_t_s
        return (time.monotonic() - self._t0) * self.speed

    async def start(self) -> None:
        """Bind the Modbus server and start the plant."""
        self._loop = asyncio.get_running_loop()
        await self._listen(self._port)
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._worker, name="gridsim-serve", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the plant (a run not yet finished is abandoned: no outputs) and close the server."""
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        await self._close_listener()
        if not self.done.is_set():
            self.done.set()

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
        self._pending_bess_online = bool(online)

    def words(self, unit: int, address: int, count: int) -> list[int]:
        """The registers as served (for tests)."""
        return self._images[unit].get(address, count).astype(int).tolist()

    # -- the Modbus side ------------------------------------------------------------------------------------------

    def _build_images(self) -> dict[int, _Image]:
        site = self.site
        images: dict[int, _Image] = {}
        common = {"Mn": "dimmer-gridsim", "SN": self.loaded.scenario.name[:32], "Vr": "1"}
        pcc_sf = self.meter_sf
        meter = R.sunspec_image(
            [
                (R.MODEL_1, {**common, "Md": "PCC meter", "DA": METER_UNIT}),
                (R.MODEL_203, {"W_SF": pcc_sf, "Hz_SF": -2, "A_SF": None, "TotWh_SF": None}),
            ]
        )
        images[METER_UNIT] = _Image(METER_UNIT, SUNSPEC_BASE, meter, np.zeros(len(meter), dtype=bool))

        b = site.bess
        bess_sf = R.sf_for(2.0 * max(b.power_w, 1.0))
        rate_sf = R.sf_for(max(b.power_w, 1.0))
        wh_sf = R.sf_for(max(b.energy_j / 3600.0, 1.0))
        self._bess_sf = bess_sf
        battery = R.sunspec_image(
            [
                (R.MODEL_1, {**common, "Md": "campus battery", "DA": BATTERY_UNIT}),
                (R.MODEL_701, {"W_SF": bess_sf, "Hz_SF": -3, "St": 2, "ConnSt": 2}),
                (
                    R.MODEL_704,
                    {
                        "WSetEna": 0,
                        "WSetMod": R.WSET_MOD_WATTS,
                        "WSet": 0.0,
                        "WSetRvrt": 0.0,
                        "WSetRvrtEna": 1,
                        "WSetRvrtTms": 0,
                        "WSetRvrtRem": 0,
                        "WSet_SF": 0,
                        "WSetPct_SF": -2,
                    },
                ),
                (
                    R.MODEL_802,
                    {
                        "WHRtg": b.energy_j / 3600.0,
                        "WHRtg_SF": wh_sf,
                        "WChaRteMax": b.power_w,
                        "WDisChaRteMax": b.power_w,
                        "WChaDisChaMax_SF": rate_sf,
                        "SoCMax": b.soc_max_frac * 100,
                        "SoCMin": b.soc_min_frac * 100,
                        "SoC_SF": -2,
                        "State": R.BATTERY_CONNECTED,
                        "CtrlHb": 0,
                        "Hb": 0,
                        "W_SF": bess_sf,
                    },
                ),
            ]
        )
        self._bess_at = {k: SUNSPEC_BASE + v for k, v in R.model_offsets(list(BATTERY_MODELS)).items()}
        writable = np.zeros(len(battery), dtype=bool)
        a704 = self._bess_at[704] - SUNSPEC_BASE
        writable[a704 + 22 : a704 + 35] = True  # WSetEna .. WSetRvrtTms
        writable[self._bess_at[802] - SUNSPEC_BASE + 19] = True  # CtrlHb
        images[BATTERY_UNIT] = _Image(BATTERY_UNIT, SUNSPEC_BASE, battery, writable)

        # the site device
        nd, nj = site.n_domains, site.n_jobs
        site_words = np.zeros(R.SITE_DOMAIN_BASE + R.SITE_DOMAIN_STRIDE * nd, dtype=np.int64)
        hdr = R.encode_block(
            R.SITE_HEADER,
            {"magic": R.SITE_MAGIC, "version": R.SITE_VERSION, "n_domains": nd, "n_jobs": nj, "update_count": 0},
        )
        site_words[: len(hdr)] = hdr
        site_words[R.SITE_JOB_BASE : R.SITE_JOB_BASE + R.SITE_MAX_JOBS] = R.U16_NA
        site_words[R.SITE_DOMAIN_BASE :] = R.encode_records(R.SITE_DOMAIN, {}, nd, R.SITE_DOMAIN_STRIDE)
        images[SITE_UNIT] = _Image(SITE_UNIT, 0, site_words.tolist(), np.zeros(site_words.shape[0], dtype=bool))

        # rack devices
        for k in range(self.n_rack_devices):
            nr, first = int(self.rack_count[k]), int(self.rack_first[k])
            words = np.zeros(R.rack_status_address(nr), dtype=np.int64)
            hdr = R.encode_block(
                R.RACK_HEADER,
                {
                    "magic": R.RACK_MAGIC,
                    "version": R.RACK_VERSION,
                    "n_racks": nr,
                    "first_rack": first,
                    "safe_cap_w": self.safe_cap_w,
                    "lease_state": R.LEASE_NONE,
                    "update_count": 0,
                    "lease_s": math.nan,
                    "heartbeat": 0,
                },
            )
            words[: len(hdr)] = hdr
            sl = slice(first, first + nr)
            cmd = R.encode_records(
                R.RACK_COMMAND,
                {
                    "cap_w": self.cmd_cap_w[sl],
                    "floor_w": self.cmd_floor_w[sl],
                    "bbu_threshold_w": self.cmd_bbu_threshold_w[sl],
                    "bbu_recharge_w": self.cmd_bbu_recharge_w[sl],
                },
                nr,
                R.RACK_CMD_STRIDE,
            )
            words[R.RACK_CMD_BASE : R.RACK_CMD_BASE + len(cmd)] = cmd
            words[R.RACK_STATUS_BASE :] = R.encode_records(R.RACK_STATUS, {}, nr, R.RACK_STATUS_STRIDE)
            writable = np.zeros(words.shape[0], dtype=bool)
            writable[R.RACK_HEADER.field("lease_s").offset : R.rack_cmd_address(nr)] = True
            images[FIRST_RACK_UNIT + k] = _Image(FIRST_RACK_UNIT + k, 0, words.tolist(), writable)
        return images

    async def _listen(self, port: int) -> None:
        from pymodbus.server import ModbusTcpServer
        from pymodbus.simulator import DataType, SimData, SimDevice

        devices = [unknown_unit_device()]  # any other unit: exception 0x0B, no traceback (dimmer.daemon.agent)
        for unit, img in self._images.items():

            async def action(
                fc: int,
                start: int,
                address: int,
                count: int,
                regs: list[int],
                values: list[int] | list[bool] | None,
                _img: _Image = img,
            ) -> Any:
                return self._on_access(_img, fc, start, address, count, regs, values)

            data = SimData(img.start, count=int(img.words.shape[0]), values=0, datatype=DataType.REGISTERS)
            devices.append(SimDevice(unit, simdata=[data], action=action))
        server = ModbusTcpServer(devices, address=(self.host, port))
        await server.serve_forever(background=True)
        if server.transport is None:
            raise OSError(f"could not listen on {self.host}:{port}")
        self._server = server
        sockets = getattr(server.transport, "sockets", None) or []
        if sockets:
            self._port = int(sockets[0].getsockname()[1])

    async def _close_listener(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(Exception):
                await server.shutdown()
            await asyncio.sleep(0)

    def _on_access(
        self,
        img: _Image,
        fc: int,
        start: int,
        address: int,
        count: int,
        regs: list[int],
        values: list[int] | list[bool] | None,
    ) -> Any:
        from pymodbus.constants import ExcCodes

        off = address - start
        if values is None:  # a read: serve our image
            regs[off : off + count] = img.get(address, count).tolist()
            return None
        words = [int(v) for v in values]
        t_plant = self.plant_time_s()
        code = self._apply_write(img, address, words, t_plant)
        now = time.monotonic()
        self.writes.append(WriteRecord(now, t_plant, img.unit, address, tuple(words), code))
        self.n_writes += 1
        self.n_writes_refused += code is not None
        if len(self.writes) >= 2 * WRITES_KEPT:
            del self.writes[:WRITES_KEPT]  # in halves: amortised O(1) a write
        if code is None and self._first_write_wall_s is None:
            self._first_write_wall_s = now
        return ExcCodes(code) if code else None

    def _apply_write(self, img: _Image, address: int, words: list[int], t_plant: float) -> int | None:
        """Validate and apply one write; the Modbus exception code if refused (nothing applied then)."""
        a = address - img.start
        if a < 0 or a + len(words) > img.words.shape[0] or not img.writable[a : a + len(words)].all():
            return ILLEGAL_ADDRESS
        if img.refuse_code is not None:
            return img.refuse_code
        cand = img.words.copy()
        cand[a : a + len(words)] = words
        if img.unit == BATTERY_UNIT:
            return self._write_battery(img, cand, address, len(words), t_plant)
        if img.unit >= FIRST_RACK_UNIT:
            return self._write_rack(img, cand, address, len(words), t_plant)
        return ILLEGAL_ADDRESS

    def _write_rack(
        self, img: _Image, cand: npt.NDArray[np.uint16], address: int, n: int, t_plant: float
    ) -> int | None:
        k = img.unit - FIRST_RACK_UNIT
        nr, first = int(self.rack_count[k]), int(self.rack_first[k])
        lease_at = R.RACK_HEADER.field("lease_s").offset
        lease_s = float(R.decode_float32(cand[lease_at : lease_at + 2])[0])
        recs = R.decode_records(R.RACK_COMMAND, cand[R.RACK_CMD_BASE : R.rack_cmd_address(nr)], nr, R.RACK_CMD_STRIDE)
        if address <= lease_at + 1 < address + n and not (math.isfinite(lease_s) and lease_s > 0):
            return ILLEGAL_VALUE
        # a value written must be a number in its range; +inf only for the BBU threshold (backup only)
        for f in R.RACK_COMMAND:
            v = recs[f.name]
            if np.any(np.isnan(v)) or (f.name != "bbu_threshold_w" and not np.all(np.isfinite(v))):
                return ILLEGAL_VALUE
        img.words[:] = cand
        sl = slice(first, first + nr)
        self.cmd_cap_w[sl] = recs["cap_w"]
        self.cmd_floor_w[sl] = recs["floor_w"]
        self.cmd_bbu_threshold_w[sl] = recs["bbu_threshold_w"]
        self.cmd_bbu_recharge_w[sl] = recs["bbu_recharge_w"]
        self.dev_written[k] = True
        self.dev_last_write_s[k] = t_plant
        self.dev_lease_s[k] = lease_s if math.isfinite(lease_s) else 0.0
        return None

    def _write_battery(
        self, img: _Image, cand: npt.NDArray[np.uint16], address: int, n: int, t_plant: float
    ) -> int | None:
        a = self._bess_at[704] - img.start
        v = R.decode_block(R.MODEL_704, cand[a : a + R.MODEL_704.length])
        if v["WSetEna"] not in (0.0, 1.0) or v["WSetMod"] not in (1.0, 2.0) or v["WSetRvrtEna"] not in (0.0, 1.0):
            return ILLEGAL_VALUE
        sp = self._bess_setpoint_from(v)
        if not math.isfinite(sp) or abs(sp) > self.site.bess.power_w * (1 + 1e-9) + 1.0:
            return ILLEGAL_VALUE
        img.words[:] = cand
        lo = self._bess_at[704] + 22
        if address < lo + 13 and address + n > lo:  # a setpoint write (re)starts the reversion timer
            self.bess_written = True
            self.bess_last_write_s = t_plant
        return None

    def _bess_setpoint_from(self, v: dict[str, float | str | None]) -> float:
        if v["WSetEna"] != 1.0:
            return 0.0
        if v["WSetMod"] == 1.0:
            return float(v["WSetPct"]) / 100.0 * self.site.bess.power_w  # type: ignore[arg-type]
        return float(v["WSet"])  # type: ignore[arg-type]

    # -- the plant side (worker thread) --------------------------------------------------------------------------

    def _worker(self) -> None:
        try:
            sim = Simulation(self.loaded, self.site, _Adapter(self, self.controller_label), self.seed)
            self._sim = sim
            res = sim.run()
            from gridsim.metrics import summarize

            self.summary = summarize(res)
            self.result = res
            if self.out_dir is not None:
                self._write_outputs(res)
        except _Stopped:
            self.error = "stopped before the end of the run"
        except Exception as exc:  # the server must report, not die silently
            log.exception("served plant failed")
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self.done.set)

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

    def _step(self, obs: Observation) -> Actions:
        """Called by the engine every control period, in the worker thread."""
        if self.holding:
            self._hold(obs)
        target = self._t0 + obs.t_s / self.speed
        while True:
            left = target - time.monotonic()
            if self._stop.is_set():
                raise _Stopped
            if left <= 0:
                break
            self._stop.wait(min(left, 0.25))
        if self._pending_bess_online is not None and self._sim is not None:
            self._sim.bess.online = self._pending_bess_online
            self._pending_bess_online = None
        return self._on_loop(self._exchange(obs))

    def _on_loop(self, coro: Any) -> Any:
        """Run `coro` on the event loop's thread and wait for its result (from the worker thread)."""
        loop = self._loop
        assert loop is not None
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        while True:
            try:
                return fut.result(timeout=0.25)
            except TimeoutError:
                if self._stop.is_set():
                    fut.cancel()
                    raise _Stopped from None

    def _hold(self, obs: Observation) -> None:
        """hold_until_first_write, at the first control point: publish `obs` with plant time frozen at its time,
        wait for the first accepted write (then for the rest of that cycle's), restart the clock from there."""
        self._hold_t_s = obs.t_s
        self._on_loop(self._publish_async(obs))
        log.info("holding the plant at t = %g s until the first write", obs.t_s)
        while True:
            if self._stop.is_set():
                raise _Stopped
            first = self._first_write_wall_s
            if first is not None and (
                (self.dev_written.all() and self.bess_written) or time.monotonic() - first >= HOLD_GRACE_WALL_S
            ):
                break
            self._stop.wait(0.005)
        self._t0 = time.monotonic() - obs.t_s / self.speed  # before holding goes False: plant_time_s stays monotone
        self.holding = False
        log.info("first write: the plant runs from t = %g s", obs.t_s)

    async def _publish_async(self, obs: Observation) -> None:
        self._publish(obs)

    async def _exchange(self, obs: Observation) -> Actions:
        """On the loop thread: publish the observation, then decode what the devices were told."""
        t = obs.t_s
        # leases, in plant time
        held = self.dev_written & (t - self.dev_last_write_s <= self.dev_lease_s)
        expired = self.dev_written & ~held
        self.lease_expiries += int(np.count_nonzero(expired & ~self.dev_expired))
        self.dev_expired = expired
        self._publish(obs)
        exp_r = expired[self._rack_device]
        hands = self._hands
        cap = np.where(exp_r, self.safe_cap_w, self.cmd_cap_w)
        floor = np.where(exp_r, 0.0, self.cmd_floor_w)
        thr = np.where(exp_r, np.inf, self.cmd_bbu_threshold_w)
        rec = np.where(exp_r, hands.rack_bbu_recharge_w, self.cmd_bbu_recharge_w)
        # racks never written stay hands-off (cmd_* still hold the hands-off values)
        return Actions(
            rack_cap_w=cap,
            rack_floor_w=floor,
            bess_setpoint_w=self._bess_setpoint(t),
            rack_bbu_threshold_w=thr,
            rack_bbu_recharge_w=rec,
            job_suspend=np.zeros(self.site.n_jobs, dtype=bool),
        )

    def _bess_setpoint(self, t: float) -> float:
        img = self._images[BATTERY_UNIT]
        if not self.bess_written:
            return 0.0
        a = self._bess_at[704] - img.start
        v = R.decode_block(R.MODEL_704, img.words[a : a + R.MODEL_704.length])
        tms = v["WSetRvrtTms"]
        if v["WSetRvrtEna"] == 1.0 and isinstance(tms, float) and math.isfinite(tms) and tms > 0:
            left = tms - (t - self.bess_last_write_s)
            img.set(self._bess_at[704] + 35, R.encode_uint32(max(0.0, math.ceil(left))))
            if left < 0:
                rv = v["WSetRvrt"]
                return float(rv) if isinstance(rv, float) and math.isfinite(rv) else 0.0
        sp = self._bess_setpoint_from(v)
        return sp if math.isfinite(sp) else 0.0

    def _publish(self, obs: Observation) -> None:
        site = self.site
        self.update_count = (self.update_count + 1) & 0xFFFFFFFF
        uc = self.update_count
        self.last_obs = obs
        self.published[uc] = obs
        self.published.pop(uc - 8, None)

        meter = self._images[METER_UNIT]
        if not meter.stalled:
            m = self._meter_at
            sf = self.meter_sf
            w = R.encode_block(
                R.MODEL_203,
                {
                    "W": _clip_i16(obs.pcc_power_w, sf),
                    "W_SF": sf,
                    "Hz": obs.grid_freq_hz,
                    "Hz_SF": -2,
                    "A_SF": None,
                    "TotWh_SF": None,
                },
            )
            meter.set(m, w)

        bat = self._images[BATTERY_UNIT]
        if not bat.stalled:
            online = bool(obs.bess_online)
            a701 = self._bess_at[701]
            bat.set(a701 + 3, [2 if online else 1])
            bat.set(a701 + 5, [2 if online else 1])
            bat.set(a701 + 10, R.encode_int16(_clip_i16(obs.bess_power_w, self._bess_sf) / 10.0**self._bess_sf))
            bat.set(a701 + 17, R.encode_uint32(obs.grid_freq_hz * 1e3 if math.isfinite(obs.grid_freq_hz) else math.nan))
            a802 = self._bess_at[802]
            soc = obs.bess_soc_frac * 100.0 * 100.0  # SoC_SF = -2
            bat.set(a802 + 11, R.encode_uint16(soc if math.isfinite(soc) and 0 <= soc <= 10000 else math.nan))
            bat.set(a802 + 18, [uc & 0xFFFF])  # the battery's own heartbeat
            bat.set(a802 + 22, [R.BATTERY_CONNECTED if online else 1])
            bat.set(a802 + 47, R.encode_int16(_clip_i16(obs.bess_power_w, self._bess_sf) / 10.0**self._bess_sf))

        st = self._images[SITE_UNIT]
        if not st.stalled:
            st.set(6, R.encode_uint32(uc))
            st.set(8, R.encode_float32([obs.pcc_limit_w, obs.ramp_limit_w_per_min, obs.grid_freq_hz]))
            nj = site.n_jobs
            if nj:
                st.set(R.SITE_JOB_BASE, obs.job_running.astype(np.int64))
            st.set(
                R.SITE_DOMAIN_BASE,
                R.encode_records(
                    R.SITE_DOMAIN,
                    {
                        "power_w": obs.domain_power_w,
                        "limit_w": obs.domain_limit_w,
                        "thermal_frac": obs.domain_thermal_frac,
                    },
                    site.n_domains,
                    R.SITE_DOMAIN_STRIDE,
                ),
            )

        status = np.asarray(
            R.encode_records(
                R.RACK_STATUS,
                {
                    "power_w": obs.rack_power_w,
                    "load_w": obs.rack_load_w,
                    "cap_w": obs.rack_cap_w,
                    "floor_w": obs.rack_floor_w,
                    "bbu_soc_frac": obs.rack_bbu_soc_frac,
                    "energized": obs.rack_energized.astype(np.float64),
                },
                site.n_racks,
                R.RACK_STATUS_STRIDE,
            ),
            dtype=np.int64,
        ).reshape(site.n_racks, R.RACK_STATUS_STRIDE)
        uc_words = R.encode_uint32(uc)
        for k in range(self.n_rack_devices):  # one slice copy per device (<= 64 racks each)
            img = self._images[FIRST_RACK_UNIT + k]
            state = R.LEASE_EXPIRED if self.dev_expired[k] else (R.LEASE_HELD if self.dev_written[k] else 0)
            img.set(8, [state])
            if img.stalled:
                continue
            first, nr = int(self.rack_first[k]), int(self.rack_count[k])
            img.set(10, uc_words)
            img.set(R.RACK_STATUS_BASE, status[first : first + nr].reshape(-1))


def _clip_i16(value_w: float, sf: int) -> float:
    """Values beyond what an int16 with this scale factor can hold are reported as not available (NaN)."""
    if not math.isfinite(value_w) or abs(value_w) > 32767 * 10.0**sf:
        return math.nan
    return value_w


# -- the command line ------------------------------------------------------------------------------------------------


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `gridsim serve` (for gridsim/cli.py)."""
    p.add_argument("scenario", type=Path)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=5020, help="TCP port (0: a free one; default 5020)")
    p.add_argument("--speed", type=float, default=1.0, help="plant seconds per wall second (default 1)")
    p.add_argument("--out", type=Path, help="output directory (default: out/<scenario>-served)")
    p.add_argument("--seed", type=int, help="random seed (default: the scenario's)")
    p.add_argument("--hold-until-first-write", action="store_true",
                   help="stop the plant at its first control point until a client writes (a served run then starts "
                   "like the in-process one)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario key, e.g. --set duration_s=600")  # fmt: skip


def run_serve(args: argparse.Namespace) -> int:
    """`gridsim serve`: raises InputError on bad input (the caller maps it to exit status 2)."""
    from gridsim.scenario import load_scenario

    if args.seed is not None and args.seed < 0:
        raise InputError("--seed", "seed", "a non-negative integer")
    if not (math.isfinite(args.speed) and args.speed > 0):
        raise InputError("--speed", "speed", f"a positive number (got {args.speed!r})")
    loaded = load_scenario(args.scenario, args.overrides)
    out = args.out or Path("out") / f"{loaded.scenario.name}-served"
    server = PlantServer(
        loaded,
        host=args.host,
        port=args.port,
        speed=args.speed,
        out_dir=out,
        seed=args.seed,
        hold_until_first_write=bool(getattr(args, "hold_until_first_write", False)),
    )
    return asyncio.run(_serve_until_done(server))


async def _serve_until_done(server: PlantServer) -> int:
    try:
        await server.start()
    except OSError as exc:
        raise InputError("--port", "port", f"a port we can listen on ({exc})") from None
    sys.stdout.write(json.dumps(server.device_map()) + "\n")
    sys.stdout.flush()
    dur = server.loaded.scenario.duration_s
    sys.stderr.write(
        f"gridsim: serving {server.loaded.scenario.name} on {server.host}:{server.port} at {server.speed:g}x "
        f"({dur / server.speed:.0f} s of wall time"
        f"{', held at the first control point until a client writes' if server.holding else ''})\n"
    )
    try:
        await server.done.wait()
    finally:
        await server.stop()
    if server.error:
        sys.stderr.write(f"gridsim: {server.error}\n")
        return 1
    sys.stderr.write(f"gridsim: wrote {server.out_dir}/summary.json\n")
    return 0


def main_serve(argv: Sequence[str] | None = None) -> int:
    """`gridsim serve SCENARIO [--host H] [--port N] [--speed X] [--out DIR] [--hold-until-first-write]`; exit 0 done,
    2 bad input, 1 else."""
    p = argparse.ArgumentParser(prog="gridsim serve", description="Serve the simulated plant over Modbus TCP.")
    add_serve_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_serve(args)
    except InputError as exc:
        sys.stderr.write(f"gridsim: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("gridsim: interrupted\n")
        return 1


__all__ = [
    "BATTERY_UNIT",
    "FIRST_RACK_UNIT",
    "METER_UNIT",
    "SITE_UNIT",
    "PlantServer",
    "WriteRecord",
    "add_serve_arguments",
    "fallback_cap_w",
    "main_serve",
    "run_serve",
]
