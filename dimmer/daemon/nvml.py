"""GPU power limits on one host: the backend protocol, a simulated backend for tests, and NVML.

Every backend works in watts on `(n_gpus,)` arrays. NVML speaks milliwatts; `NvmlGpus` converts once at the edge.
nvidia-ml-py (import name `pynvml`) is imported only when an `NvmlGpus` is made, so the rest of the daemon runs and
tests on a machine with no GPU and no NVML.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from dimmer.errors import DimmerError

FloatArray = npt.NDArray[np.float64]


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
        """The power limit each GPU is set to now (what to restore at exit)."""
        ...

    def enforced_limit_w(self) -> FloatArray:
        """The limit each GPU actually enforces (the lowest of every limit in force)."""
        ...

    def power_w(self) -> FloatArray:
        """Each GPU's power draw (NVML: a 1 s average on Ampere and later)."""
        ...

    def set_limit_w(self, limit_w: FloatArray) -> None:
        """Set each GPU's power limit (already clamped to its constraints by the caller)."""
        ...

    def close(self) -> None: ...


class SimulatedGpus:
    """GPUs that draw `demand_w` up to their limit; every limit set is recorded (tests and demos)."""

    def __init__(
        self, n_gpus: int, *, min_w: float = 200.0, max_w: float = 1400.0, demand_w: float | None = None
    ) -> None:
        if n_gpus < 1:
            raise GpuError("at least one GPU")
        self._n = n_gpus
        self.min_w = np.full(n_gpus, float(min_w))
        self.max_w = np.full(n_gpus, float(max_w))
        self.limits_w = self.max_w.copy()
        self.original_w = self.limits_w.copy()
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

    def enforced_limit_w(self) -> FloatArray:
        return self.limits_w.copy()

    def power_w(self) -> FloatArray:
        out: FloatArray = np.minimum(self.demand_w, self.limits_w)
        return out

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


class NvmlGpus:
    """Every GPU NVML sees on this host (or the `indices` given). Setting limits needs root (or CAP_SYS_ADMIN)."""

    def __init__(self, indices: list[int] | None = None) -> None:
        try:
            pynvml: Any = importlib.import_module("pynvml")  # nvidia-ml-py
        except ImportError:
            raise GpuError("NVML backend needs nvidia-ml-py: python3 -m pip install nvidia-ml-py") from None
        self._nv: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuError(f"NVML unavailable ({exc}): no NVIDIA driver or no GPU on this host") from None
        try:
            count = int(pynvml.nvmlDeviceGetCount())
            if count == 0:
                raise GpuError("NVML sees no GPU on this host")
            idx = list(range(count)) if indices is None else indices
            bad = [i for i in idx if not 0 <= i < count]
            if bad:
                raise GpuError(f"GPU index {bad[0]} does not exist (this host has {count})")
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in idx]
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        self.indices = idx

    @property
    def n_gpus(self) -> int:
        return len(self._handles)

    def _each_w(self, fn: Any) -> FloatArray:
        # one NVML call per GPU of this host (at most a handful): NVML has no batched form
        try:
            return np.asarray([fn(h) for h in self._handles], dtype=np.float64) / 1e3
        except self._nv.NVMLError as exc:
            raise GpuError(f"NVML: {exc}") from None

    def constraints_w(self) -> tuple[FloatArray, FloatArray]:
        try:
            pairs = [self._nv.nvmlDeviceGetPowerManagementLimitConstraints(h) for h in self._handles]
        except self._nv.NVMLError as exc:
            raise GpuError(f"NVML: {exc}") from None
        arr = np.asarray(pairs, dtype=np.float64) / 1e3
        return arr[:, 0].copy(), arr[:, 1].copy()

    def limit_w(self) -> FloatArray:
        return self._each_w(self._nv.nvmlDeviceGetPowerManagementLimit)

    def enforced_limit_w(self) -> FloatArray:
        return self._each_w(self._nv.nvmlDeviceGetEnforcedPowerLimit)

    def power_w(self) -> FloatArray:
        return self._each_w(self._nv.nvmlDeviceGetPowerUsage)

    def set_limit_w(self, limit_w: FloatArray) -> None:
        mw = np.rint(np.asarray(limit_w, dtype=np.float64) * 1e3).astype(np.int64).tolist()
        try:
            for h, v in zip(self._handles, mw, strict=True):
                self._nv.nvmlDeviceSetPowerManagementLimit(h, int(v))
        except self._nv.NVMLError as exc:
            raise GpuError(f"NVML: setting a power limit failed ({exc}); it needs root") from None

    def close(self) -> None:
        with contextlib.suppress(self._nv.NVMLError):
            self._nv.nvmlShutdown()
