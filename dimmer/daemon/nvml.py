"""GPU power limits on one host: the backend protocol, a simulated backend for tests, and NVML.

Every backend works in watts on `(n_gpus,)` arrays. NVML speaks milliwatts; `NvmlGpus` converts once at the edge,
and turns every NVML error into `GpuError`. nvidia-ml-py (import name `pynvml`) is imported only when an `NvmlGpus`
is made, so the rest of the daemon runs and tests on a machine with no GPU and no NVML.

NVML's limits, as the agent uses them:
- the *management* limit (`nvmlDeviceGetPowerManagementLimit`, set with `nvmlDeviceSetPowerManagementLimit`, root
  only) is what this host asks for; it lasts until it is set again or the driver is reloaded;
- the *default* limit (`nvmlDeviceGetPowerManagementDefaultLimit`) is the board's own, what the agent restores at exit;
- the *enforced* limit (`nvmlDeviceGetEnforcedPowerLimit`) is the lowest of every limit in force (the management
  limit, an out-of-band limit from the BMC, ...): what the GPU actually holds, and what the agent reports;
- the settable range is `nvmlDeviceGetPowerManagementLimitConstraints` ([min, max]).

`NvmlGpus(read_only=True)` (and `read_gpus`, what `bench/nvml_readonly.py` prints) reaches NVML through a guard that
lets through only `nvmlInit`, `nvmlShutdown` and the `nvmlDeviceGet*` / `nvmlSystemGet*` queries: nothing on that
path can set anything.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from dimmer.errors import DimmerError

FloatArray = npt.NDArray[np.float64]


# nvml.h: NVML_TOTAL_POWER_SAMPLES (nvmlSamplingType_t 0), NVML_ERROR_NOT_SUPPORTED (nvmlReturn_t 3)
_TOTAL_POWER_SAMPLES = 0
_ERROR_NOT_SUPPORTED = 3


class GpuError(DimmerError):
    """The GPU backend cannot be used (no NVML, no GPU, no permission) or a call failed."""


class GpuBackend(Protocol):
    """What the agent needs from the GPUs of one host."""

    @property
    def n_gpus(self) -> int: ...

    def constraints_w(self) -> tuple[FloatArray, FloatArray]:
        """(lowest, highest) settable power limit of each GPU."""
        ...

    def limit_w(self) -> FloatArray:
        """The power limit each GPU is set to now (NVML's management limit)."""
        ...

    def default_limit_w(self) -> FloatArray:
        """Each GPU's default power limit (the board's own): what the agent restores at exit."""
        ...

    def enforced_limit_w(self) -> FloatArray:
        """The limit each GPU actually enforces (the lowest of every limit in force): what the agent reports."""
        ...

    def power_w(self) -> FloatArray:
        """Each GPU's power draw (NVML: a 1 s average on Ampere and later)."""
        ...

    def peak_power_w(self) -> FloatArray:
        """Each GPU's highest power sample since the last call (NVML's power samples); NaN where none is kept."""
        ...

    def set_limit_w(self, limit_w: FloatArray) -> None:
        """Set each GPU's power limit (already clamped to its constraints by the caller)."""
        ...

    def close(self) -> None: ...


class SimulatedGpus:
    """GPUs that draw `demand_w` up to the limit they enforce; every limit set is recorded (tests and demos).

    `default_w` is the boards' default limit (default: `max_w`), `start_w` the limit they are set to when the agent
    starts (default: `default_w`; someone may have left another). `external_w` is another limit in force (a BMC's,
    say; +inf: none): the enforced limit is the lower of it and the limit set.
    """

    def __init__(
        self,
        n_gpus: int,
        *,
        min_w: float = 200.0,
        max_w: float = 1400.0,
        demand_w: float | None = None,
        default_w: float | None = None,
        start_w: float | None = None,
    ) -> None:
        if n_gpus < 1:
            raise GpuError("at least one GPU")
        self._n = n_gpus
        self.min_w = np.full(n_gpus, float(min_w))
        self.max_w = np.full(n_gpus, float(max_w))
        self.default_w = np.full(n_gpus, float(max_w if default_w is None else default_w))
        self.limits_w = self.default_w.copy() if start_w is None else np.full(n_gpus, float(start_w))
        for name, v in (("default_w", self.default_w), ("start_w", self.limits_w)):
            if np.any(v < self.min_w) or np.any(v > self.max_w):
                raise GpuError(f"{name} outside {min_w:g}..{max_w:g} W")
        self.external_w = np.full(n_gpus, np.inf)
        self.demand_w = np.full(n_gpus, float(max_w if demand_w is None else demand_w))
        self.history: list[FloatArray] = []  # every set_limit_w call
        self.closed = False
        self.fail_next = 0  # the next this-many calls to set_limit_w raise GpuError (fault injection)

    @property
    def n_gpus(self) -> int:
        return self._n

    def constraints_w(self) -> tuple[FloatArray, FloatArray]:
        return self.min_w.copy(), self.max_w.copy()

    def limit_w(self) -> FloatArray:
        return self.limits_w.copy()

    def default_limit_w(self) -> FloatArray:
        return self.default_w.copy()

    def enforced_limit_w(self) -> FloatArray:
        out: FloatArray = np.minimum(self.limits_w, self.external_w)
        return out

    def power_w(self) -> FloatArray:
        out: FloatArray = np.minimum(self.demand_w, self.enforced_limit_w())
        return out

    def peak_power_w(self) -> FloatArray:
        return self.power_w()  # (they draw their demand steadily: their highest sample is what they draw)

    def set_limit_w(self, limit_w: FloatArray) -> None:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise GpuError("simulated failure")
        lim = np.asarray(limit_w, dtype=np.float64)
        if np.any(lim < self.min_w - 1e-9) or np.any(lim > self.max_w + 1e-9):
            raise GpuError("limit outside the GPU's constraints")
        self.limits_w = lim.copy()
        self.history.append(lim.copy())

    def close(self) -> None:
        self.closed = True


_READ_ONLY_NAMES = frozenset({"nvmlInit", "nvmlShutdown", "NVMLError"})


class _ReadOnlyNvml:
    """pynvml behind a guard: only nvmlInit, nvmlShutdown, NVMLError and the nvmlDeviceGet* / nvmlSystemGet* queries
    get through; any other name (every set, reset and clear function) raises GpuError."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if name in _READ_ONLY_NAMES or name.startswith(("nvmlDeviceGet", "nvmlSystemGet")):
            return getattr(self._module, name)
        raise GpuError(f"NVML: {name} refused: this NVML backend is read-only")


def _import_pynvml() -> Any:
    try:
        return importlib.import_module("pynvml")  # nvidia-ml-py
    except ImportError:
        raise GpuError("NVML backend needs nvidia-ml-py: python3 -m pip install nvidia-ml-py") from None


class NvmlGpus:
    """Every GPU NVML sees on this host (or the `indices` given). Setting limits needs root (or CAP_SYS_ADMIN).

    `read_only=True`: every NVML call goes through a guard that lets only queries through; `set_limit_w` raises.
    """

    def __init__(self, indices: list[int] | None = None, *, read_only: bool = False) -> None:
        module = _import_pynvml()
        self.read_only = read_only
        self._nv: Any = _ReadOnlyNvml(module) if read_only else module
        self._error: type[Exception] = module.NVMLError
        try:
            self._nv.nvmlInit()
        except self._error as exc:
            raise GpuError(f"NVML unavailable ({exc}): no NVIDIA driver or no GPU on this host") from None
        try:
            count = int(self._call(self._nv.nvmlDeviceGetCount))
            if count == 0:
                raise GpuError("NVML sees no GPU on this host")
            idx = list(range(count)) if indices is None else list(indices)
            bad = [i for i in idx if not 0 <= i < count]
            if bad:
                raise GpuError(f"GPU index {bad[0]} does not exist (this host has {count})")
            if len(set(idx)) != len(idx):
                raise GpuError(f"GPU indices repeated: {idx}")
            self._handles = [self._call(self._nv.nvmlDeviceGetHandleByIndex, i) for i in idx]
        except BaseException:
            self.close()
            raise
        self.indices = idx
        self._last_sample_us = [0] * len(idx)  # the newest power sample seen of each GPU
        self._samples_ok = [True] * len(idx)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._error as exc:
            raise GpuError(f"NVML: {getattr(fn, '__name__', 'call')} failed: {exc}") from None

    @property
    def n_gpus(self) -> int:
        return len(self._handles)

    def _each_w(self, fn: Callable[[Any], Any]) -> FloatArray:
        # one NVML call per GPU of this host (at most a handful): NVML has no batched form; mW -> W once
        return np.asarray([self._call(fn, h) for h in self._handles], dtype=np.float64) / 1e3

    def constraints_w(self) -> tuple[FloatArray, FloatArray]:
        fn = self._nv.nvmlDeviceGetPowerManagementLimitConstraints  # [min, max] in mW
        arr = np.asarray([self._call(fn, h) for h in self._handles], dtype=np.float64).reshape(-1, 2) / 1e3
        return arr[:, 0].copy(), arr[:, 1].copy()

    def limit_w(self) -> FloatArray:
        return self._each_w(self._nv.nvmlDeviceGetPowerManagementLimit)

    def default_limit_w(self) -> FloatArray:
        return self._each_w(self._nv.nvmlDeviceGetPowerManagementDefaultLimit)

    def enforced_limit_w(self) -> FloatArray:
        return self._each_w(self._nv.nvmlDeviceGetEnforcedPowerLimit)

    def power_w(self) -> FloatArray:
        return self._each_w(self._nv.nvmlDeviceGetPowerUsage)

    def peak_power_w(self) -> FloatArray:
        # NVML keeps a buffer of recent power samples per GPU (NVML_TOTAL_POWER_SAMPLES, mW, timestamped in us);
        # asking for those after the last one seen gives the samples since the last call. NOT_FOUND: none new.
        out = np.full(len(self._handles), np.nan)
        for i, h in enumerate(self._handles):
            if not self._samples_ok[i]:
                continue
            try:
                _, samples = self._nv.nvmlDeviceGetSamples(h, _TOTAL_POWER_SAMPLES, self._last_sample_us[i])
            except self._error as exc:
                if getattr(exc, "value", None) == _ERROR_NOT_SUPPORTED:
                    self._samples_ok[i] = False  # this GPU keeps none: asked no more
                continue
            if samples:
                self._last_sample_us[i] = max(int(x.timeStamp) for x in samples)
                out[i] = max(float(x.sampleValue.uiVal) for x in samples) / 1e3
        return out

    def names(self) -> list[str]:
        """Each GPU's product name (bytes from older nvidia-ml-py decoded)."""
        out = [self._call(self._nv.nvmlDeviceGetName, h) for h in self._handles]
        return [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in out]

    def set_limit_w(self, limit_w: FloatArray) -> None:
        if self.read_only:
            raise GpuError("NVML: this backend is read-only: no limit is set")
        mw = np.rint(np.asarray(limit_w, dtype=np.float64) * 1e3).astype(np.int64).tolist()
        try:
            for h, v in zip(self._handles, mw, strict=True):
                self._nv.nvmlDeviceSetPowerManagementLimit(h, int(v))
        except self._error as exc:
            raise GpuError(f"NVML: setting a power limit failed ({exc}); it needs root") from None

    def close(self) -> None:
        with contextlib.suppress(self._error):
            self._nv.nvmlShutdown()


def _json_w(v: float) -> float | None:
    """A reading for JSON: None where not measured (JSON has no NaN)."""
    return float(v) if math.isfinite(v) else None


def read_gpus(indices: list[int] | None = None) -> list[dict[str, Any]]:
    """What NVML reports for each GPU, read only (no NVML set function can be reached): index, name, power,
    the highest of NVML's buffered power samples (None where the GPU keeps none), management, default and enforced
    limit, settable range, in W. GpuError if NVML cannot be used."""
    gpus = NvmlGpus(indices, read_only=True)
    try:
        lo, hi = gpus.constraints_w()
        cols = {
            "power_w": gpus.power_w(),
            "peak_power_w": gpus.peak_power_w(),
            "limit_w": gpus.limit_w(),
            "default_limit_w": gpus.default_limit_w(),
            "enforced_limit_w": gpus.enforced_limit_w(),
            "min_limit_w": lo,
            "max_limit_w": hi,
        }
        names = gpus.names()
        return [
            {"index": idx, "name": names[k], **{key: _json_w(v[k]) for key, v in cols.items()}}
            for k, idx in enumerate(gpus.indices)
        ]
    finally:
        gpus.close()
