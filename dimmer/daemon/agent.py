"""`dimmer agent`: the GPU power caps of one host, served to the controller as a `dimmer-rack-v1` cap device.

The agent runs on a GPU server. It reads each GPU's power and *enforced* limit (the lowest of every limit in force,
what the GPU actually holds) through a `GpuBackend` (NVML on real hardware, `SimulatedGpus` in tests), publishes
them in the `dimmer-rack-v1` register map (one "rack": this host), and applies the per-GPU cap the controller
writes, clamped to each GPU's settable range. It holds its own lease: if the controller stops writing for `lease_s`
(default: `lease_periods` periods, or the lease the controller wrote if that is shorter) it lowers every GPU to
the safe cap on its own. At exit it puts every GPU back to its *default* limit (NVML's default power limit, not
whatever limit it found at start: a limit left by an earlier run that died is not made permanent).

What it accepts (`RegisterServer`, `dimmer.daemon.agent_server`): connections from its allow-list only (default
loopback); writes to the header's `lease_s` / `heartbeat` and to the command record of its one rack only (anything
else, a rack index >= 1 included, or a value of two registers written in part: exception 2); values within the map's
declared ranges only (a NaN, infinite, negative or too large cap, floor or recharge, a NaN BBU threshold, a
`lease_s` that is not a positive number of seconds up to 86400: exception 3) — the one vetting path of the map,
`registers.rack_write_error`, that the served plant's rack devices answer by too. A write the GPUs refuse is
exception 4. A refused write changes nothing: neither the registers, nor the GPUs, nor the lease. Every write is
logged and counted by client address.

Power floors (GPU power smoothing) and BBU fields are vetted, stored and otherwise ignored: NVML's power-smoothing
profiles are not driven here; the status reports a floor of 0 and no BBU (NaN).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.daemon.agent_server import (
    WRITES_KEPT,
    AllowList,
    RegisterServer,
    WriteRecord,
    WriteRefused,
    unknown_unit_device,
)
from dimmer.daemon.netguard import ConnectionLimits
from dimmer.daemon.nvml import GpuBackend, GpuError
from dimmer.daemon.registers import (
    LEASE_EXPIRED,
    LEASE_HELD,
    LEASE_NONE,
    RACK_CMD_STRIDE,
    RACK_COMMAND,
    RACK_HEADER,
    RACK_MAGIC,
    RACK_MAX,
    RACK_STATUS,
    RACK_STATUS_BASE,
    RACK_STATUS_STRIDE,
    RACK_VERSION,
    decode_block,
    decode_float32,
    encode_block,
    encode_records,
    rack_cmd_address,
    rack_status_address,
    rack_writable_spans,
    rack_write_error,
)

__all__ = [
    "RACK_IMAGE_SIZE",
    "WRITES_KEPT",
    "AllowList",
    "CapAgent",
    "RegisterServer",
    "WriteRecord",
    "rack_image",
    "rack_writable",
    "rack_write_error",
    "unknown_unit_device",
]

log = logging.getLogger("dimmer.agent")

FloatArray = npt.NDArray[np.float64]

RACK_IMAGE_SIZE = RACK_STATUS_BASE + RACK_STATUS_STRIDE * RACK_MAX  # every register of the map
LEASE_FIELD = RACK_HEADER.field("lease_s")
LEASE_MAX_S = LEASE_FIELD.hi  # 86400: the map's declared range of lease_s
CAP_FIELD = next(f for f in RACK_COMMAND if f.name == "cap_w")


def rack_image(first_rack: int, n_racks: int, safe_cap_w: float, lease_s: float) -> npt.NDArray[np.uint16]:
    """A fresh dimmer-rack-v1 image: the header, commands never written (NaN), statuses unknown (NaN)."""
    img = np.zeros(RACK_IMAGE_SIZE, dtype=np.uint16)
    header: dict[str, float | str | int | None] = {
        "magic": RACK_MAGIC,
        "version": RACK_VERSION,
        "n_racks": n_racks,
        "first_rack": first_rack,
        "safe_cap_w": safe_cap_w,
        "lease_state": LEASE_NONE,
        "update_count": 0,
        "lease_s": lease_s,
        "heartbeat": 0,
    }
    img[: RACK_HEADER.length] = encode_block(RACK_HEADER, header)
    img[rack_cmd_address(0) : rack_cmd_address(RACK_MAX)] = encode_records(RACK_COMMAND, {}, RACK_MAX, RACK_CMD_STRIDE)
    img[RACK_STATUS_BASE:] = encode_records(RACK_STATUS, {}, RACK_MAX, RACK_STATUS_STRIDE)
    return img


def rack_writable(n_racks: int = RACK_MAX) -> list[tuple[int, int]]:
    """Where a controller may write: the header's lease_s and heartbeat, and the command records of racks 0..n-1."""
    return rack_writable_spans(n_racks)


def _hits(at: int, size: int, address: int, count: int) -> bool:
    return at < address + count and address < at + size


class CapAgent:
    """The GPUs of one host as a one-rack `dimmer-rack-v1` device, with a lease and a safe cap.

    `lease_s` (the agent's own lease) defaults to `lease_periods` x `period_s`; it must be at least one period and
    at most 86400 s (ValueError). `allow`: who may connect (default: loopback only); `limits`: connections at once
    and their idle timeout (default `netguard.ConnectionLimits()`: 32, 120 s).
    """

    def __init__(
        self,
        gpus: GpuBackend,
        *,
        safe_cap_w: float,
        period_s: float = 1.0,
        lease_periods: int = 10,
        lease_s: float | None = None,
        first_rack: int = 0,
        unit: int = 1,
        overhead_w: float = 0.0,
        allow: AllowList | None = None,
        limits: ConnectionLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"period_s must be a positive number of seconds (got {period_s!r})")
        own = lease_periods * period_s if lease_s is None else float(lease_s)
        if not (math.isfinite(own) and period_s <= own <= LEASE_MAX_S):
            raise ValueError(f"the lease must be one period to {LEASE_MAX_S:g} s (got {own!r} s)")
        self.gpus = gpus
        self.period_s = period_s
        self.own_lease_s = own
        self.unit = unit
        self.overhead_w = overhead_w
        self.clock = clock
        self.min_w, self.max_w = gpus.constraints_w()
        self.safe_w = np.clip(np.full(gpus.n_gpus, safe_cap_w), self.min_w, self.max_w)
        self.default_w = np.clip(gpus.default_limit_w(), self.min_w, self.max_w)  # restored at exit
        self.start_w = gpus.limit_w()  # what it found (logged; not restored)
        self.image = rack_image(first_rack, 1, float(np.mean(self.safe_w)), self.own_lease_s)
        self.server = RegisterServer(
            {unit: self.image}, {unit: rack_writable(1)}, self._on_write, allow=allow, limits=limits
        )
        self.lease_state = LEASE_NONE
        self.last_write_s: float | None = None
        self.commanded_w: FloatArray | None = None  # the limits last applied
        self.update_count = 0
        self.lease_expiries = 0
        self.restore_failed = False
        self._stop = asyncio.Event()
        self._restored = False

    # -- who wrote what (the server's counters) ------------------------------------------------------------------

    @property
    def writes_by_client(self) -> Counter[str]:
        """Writes (accepted or refused) by client address."""
        return self.server.writes_by_client

    @property
    def refused_by_client(self) -> Counter[str]:
        return self.server.refused_by_client

    @property
    def connections_refused(self) -> Counter[str]:
        """Connections closed unread, by client address (not in the allow-list)."""
        return self.server.connections_refused

    # -- the controller's writes ---------------------------------------------------------------------------------

    def lease_s(self) -> float:
        """The agent's own lease, or the controller's if it wrote a shorter one."""
        written = decode_block(RACK_HEADER, self.image[: RACK_HEADER.length], 0).get("lease_s")
        if isinstance(written, float) and math.isfinite(written) and written > 0:
            return min(self.own_lease_s, written)
        return self.own_lease_s

    def _on_write(self, unit: int, address: int, values: list[int], cand: npt.NDArray[np.uint16]) -> str:
        """Vet a write (WriteRefused: exception 3), apply its cap (GpuError: exception 4), renew the lease."""
        refused = rack_write_error(cand, address, len(values), 1)  # the same vetting as the served plant's racks
        if refused is not None:
            raise WriteRefused(*refused)
        notes = []
        lease_at, n = LEASE_FIELD.offset, len(values)
        if _hits(lease_at, LEASE_FIELD.n, address, n):
            notes.append(f"lease {float(decode_float32(cand[lease_at : lease_at + 2])[0]):g} s")
        at = rack_cmd_address(0) + CAP_FIELD.offset  # the cap of rack 0
        if _hits(at, CAP_FIELD.n, address, n):
            cap = float(decode_float32(cand[at : at + 2])[0])  # vetted: a number in 0..1e5
            limit = np.clip(np.full(self.gpus.n_gpus, cap), self.min_w, self.max_w)
            self.apply(limit)
            notes.append(f"cap {cap:g} W/GPU: GPUs at {_fmt_list(limit)} W")
            self._set_lease(LEASE_HELD)
        elif self.commanded_w is not None and self.lease_state != LEASE_HELD:
            self._set_lease(LEASE_HELD)
        self.last_write_s = self.clock()
        return "; ".join(notes) or "lease renewed"

    def apply(self, limit_w: FloatArray) -> None:
        # the same cap again costs no NVML write, unless the GPUs' limit was changed behind the agent's back
        # (nvidia-smi -pl, another tool): then the controller's cap is put back (NVML keeps whole milliwatts)
        if (
            self.commanded_w is not None
            and np.array_equal(limit_w, self.commanded_w)
            and np.allclose(self.gpus.limit_w(), limit_w, rtol=0.0, atol=1e-3)
        ):
            return
        try:
            self.gpus.set_limit_w(limit_w)
        except GpuError as exc:
            log.error("setting GPU limits failed: %s", exc)
            raise
        self.commanded_w = limit_w.copy()

    def _set_lease(self, state: int) -> None:
        self.lease_state = state
        self.image[RACK_HEADER.field("lease_state").offset] = state

    # -- every period --------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Check the lease, refresh the status record."""
        now = self.clock()
        lapsed = self.last_write_s is not None and now - self.last_write_s > self.lease_s()
        if self.lease_state == LEASE_HELD and lapsed and self.last_write_s is not None:
            held = self.commanded_w if self.commanded_w is not None else self.max_w
            safe = np.minimum(held, self.safe_w)
            log.warning(
                "no write from the controller for %.1f s (lease %.1f s): GPUs to the safe cap %.0f W",
                now - self.last_write_s,
                self.lease_s(),
                float(np.max(safe)),
            )
            with contextlib.suppress(GpuError):
                self.apply(safe)
            self._set_lease(LEASE_EXPIRED)
            self.lease_expiries += 1
        self.refresh()

    def refresh(self) -> None:
        """Publish power and the *enforced* limit (what the GPUs hold, whoever set it) in the status record."""
        try:
            power = self.gpus.power_w()
            enforced = self.gpus.enforced_limit_w()
            peak = self.gpus.peak_power_w()
        except GpuError as exc:
            log.warning("reading the GPUs failed: %s", exc)
            power = np.full(self.gpus.n_gpus, np.nan)
            enforced = np.full(self.gpus.n_gpus, np.nan)
            peak = power
        total = float(np.sum(power)) + self.overhead_w
        # (the sum of each GPU's highest sample: the GPUs of one synchronous job peak together, and a bound above the
        # host's true peak errs the safe way; unknown if any GPU kept none. Rounded up to the register's 100 W.)
        peak_total = max(float(np.sum(peak)) + self.overhead_w, total)
        status = {
            "power_w": np.array([total]),
            "load_w": np.array([total]),
            "cap_w": np.array([float(np.mean(enforced))]),
            "floor_w": np.array([0.0]),
            "bbu_soc_frac": np.array([np.nan]),
            "energized": np.array([1.0]),
            "load_peak_hw": np.array([math.ceil(peak_total / 100.0) if math.isfinite(peak_total) else math.nan]),
        }
        a = rack_status_address(0)
        self.image[a : a + RACK_STATUS_STRIDE] = encode_records(RACK_STATUS, status, 1, RACK_STATUS_STRIDE)
        self.update_count = (self.update_count + 1) % 0xFFFFFFFF
        self.image[: RACK_HEADER.length] = encode_block(
            RACK_HEADER, {**self._header_values(), "update_count": self.update_count}
        )

    def _header_values(self) -> dict[str, Any]:
        vals = decode_block(RACK_HEADER, self.image[: RACK_HEADER.length], 0)
        return {k: v for k, v in vals.items() if v is not None}

    # -- life ------------------------------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.refresh()
        port = await self.server.start(host, port)
        log.info(
            "agent: %d GPUs (limits %s W, default %s W, settable %.0f-%.0f W) as dimmer-rack-v1 unit %d on %s:%d, "
            "lease %.1f s; clients allowed: %s",
            self.gpus.n_gpus,
            _fmt_list(self.start_w),
            _fmt_list(self.default_w),
            float(np.min(self.min_w)),
            float(np.max(self.max_w)),
            self.unit,
            host,
            port,
            self.own_lease_s,
            self.server.allow,
        )
        return port

    async def run(self) -> None:
        """Tick every period until `request_stop()`; then restore the default limits."""
        try:
            while not self._stop.is_set():
                self.tick()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=self.period_s)
        finally:
            await self.stop()

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        await self.server.stop()
        self.restore()
        self.gpus.close()
        log.info("agent: stopped; %s", self.server.client_summary())

    def restore(self) -> None:
        """Put every GPU back to its default limit (once); `restore_failed` says if that failed."""
        if self._restored:
            return
        self._restored = True
        try:
            self.gpus.set_limit_w(self.default_w)
            log.info("agent: default GPU limits restored (%s W)", _fmt_list(self.default_w))
        except GpuError as exc:
            self.restore_failed = True
            log.error("agent: restoring the default GPU limits failed: %s", exc)


def _fmt_list(x: FloatArray) -> str:
    vals = sorted({round(float(v)) for v in x})
    return ", ".join(str(v) for v in vals[:4]) + (", ..." if len(vals) > 4 else "")
