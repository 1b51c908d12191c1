"""GPU presets and the throughput-under-a-power-cap curve.

Figures come from ../shared/MODELS.md; docs/models.md cites each one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dimmer.throughput import ThroughputCurve

FloatArray = npt.NDArray[np.float64]

# Relative throughput at relative power, least-squares piecewise-linear fit (knots every 0.05) to the
# GPT-3 175B A100 SXM stage profile of Perseus (SOSP 2024, ml-energy/zeus sosp24_data): energy/time summed
# over stages per SM clock. Max error 0.9 % over the 38 measured clocks (0.50-1.00 of peak power); a single
# power law misses by 5 % (alpha 0.5) to 15 % (alpha 0.3). Below 0.5 the lowest segment's slope is extended.
PERF_POWER_FRAC: tuple[float, ...] = (0.50, 0.55, 0.60, 0.65, 0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 1.00)
PERF_THROUGHPUT_FRAC: tuple[float, ...] = (
    0.6648, 0.7393, 0.8223, 0.8529, 0.8873, 0.9128, 0.9357, 0.9532, 0.9688, 0.9879, 1.0,
)  # fmt: skip


# The shipped table as a curve: every GPU preset's unless a job carries its own (dimmer.throughput).
DEFAULT_CURVE = ThroughputCurve(
    "a100-gpt3-175b-table",
    PERF_POWER_FRAC,
    PERF_THROUGHPUT_FRAC,
    source="piecewise-linear least squares to Perseus GPT-3 175B A100 SXM (ml-energy/zeus sosp24_data)",
)


def throughput_frac(power_frac: npt.ArrayLike) -> FloatArray:
    """Relative throughput of a GPU held at `power_frac` of the power it would draw uncapped (the shipped table).

    1.0 at or above 1; linear extrapolation of the lowest measured segment below 0.5, floored at 0.
    """
    return DEFAULT_CURVE(power_frac)


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: its settable power-limit range and what the rest of its rack draws per GPU."""

    name: str
    rated_w: float  # default / maximum power limit
    min_cap_w: float  # lowest settable power limit
    idle_w: float  # draw with nothing running
    host_overhead_w: float  # CPUs, NICs, switches, fans in the rack, per GPU (assumption: constant)
    floor_max_frac: float = 0.9  # power-smoothing floor ceiling as a fraction of rated (Blackwell: 0-90 %)
    # throughput under a cap, for every job that does not carry its own curve
    throughput: ThroughputCurve = field(default=DEFAULT_CURVE, compare=False)

    def clamp_cap_w(self, cap_w: npt.ArrayLike) -> FloatArray:
        return np.clip(np.asarray(cap_w, dtype=np.float64), self.min_cap_w, self.rated_w)

    def clamp_floor_w(self, floor_w: npt.ArrayLike) -> FloatArray:
        return np.clip(np.asarray(floor_w, dtype=np.float64), 0.0, self.floor_max_frac * self.rated_w)


# H100 SXM: 200-700 W settable, idle ~75 W (DGX H100 guide; nvidia-smi). The rest of the node per GPU is calibrated
# on a measured 8-GPU H100 HGX node: at most 8.4 kW drawn with the GPUs near full utilisation, 18 % under the
# 10.2 kW rating (Latif et al., "Single-Node Power Demand During AI Training: Measurements on an 8-GPU NVIDIA H100
# System", IEEE Access 13, 2025; arXiv:2412.08602): 8.4 kW x 0.97 / 8 - 700 W = 318 W per GPU, taking the GPUs at
# their 700 W limit at that peak (an assumption). It was 575 W, from the 10.2 kW rating: a modelled idle node of
# 8 x (75 + 575) / 0.97 = 5.36 kW; now 3.24 kW. GB200: 200-1200 W (NVIDIA Domain Power Service spec); an NVL72 rack is
# ~120 kW, i.e. ~467 W per GPU beyond the GPUs. GB300: 1400 W rated (vendor material, low authority); 132-140 kW
# rack -> ~440 W per GPU beyond the GPUs. Idle for Blackwell parts is an assumption (~12 % of rated, as H100).
# Throughput under a cap: no public per-clock profile of H100, GB200 or GB300 was found; each carries the shipped
# table measured on A100 SXM (GPT-3 175B, Perseus), an *assumption* for these parts (docs/models.md). A job on
# them may carry a measured curve of its own (dimmer.throughput.THROUGHPUT_PRESETS, points or a profile file).
GPU_PRESETS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", rated_w=700.0, min_cap_w=200.0, idle_w=75.0, host_overhead_w=318.0),
    "gb200": GpuSpec("gb200", rated_w=1200.0, min_cap_w=200.0, idle_w=140.0, host_overhead_w=467.0),
    "gb300": GpuSpec("gb300", rated_w=1400.0, min_cap_w=200.0, idle_w=165.0, host_overhead_w=440.0),
}
