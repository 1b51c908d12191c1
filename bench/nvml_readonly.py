"""What NVML reports for each GPU of this host, as JSON, read only: nothing is set.

    python3 bench/nvml_readonly.py                 # every GPU NVML sees
    python3 bench/nvml_readonly.py --gpu-index 0   # only these (repeatable)

A JSON list, one object a GPU: index, name, power_w (NVML's power usage), peak_power_w (the highest of NVML's
buffered power samples, nvmlDeviceGetSamples with NVML_TOTAL_POWER_SAMPLES: what `dimmer agent` reports as the
rack's peak; null where the GPU keeps none), limit_w (the management limit),
default_limit_w, enforced_limit_w (what the GPU holds: what `dimmer agent` reports), min_limit_w, max_limit_w. It
goes through `dimmer.daemon.nvml.read_gpus`, whose NVML handle lets only nvmlInit, nvmlShutdown and the
nvmlDeviceGet* / nvmlSystemGet* queries through: no NVML set function can be reached from here. Needs
nvidia-ml-py (`python3 -m pip install nvidia-ml-py`) and an NVIDIA driver; no root. Exit status 1 with a one-line
error when NVML cannot be used.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from dimmer.daemon.nvml import GpuError, read_gpus


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu-index", type=int, action="append", metavar="I", help="only these NVML GPU indices")
    args = p.parse_args(argv)
    try:
        rows = read_gpus(args.gpu_index)
    except GpuError as exc:
        sys.stderr.write(f"nvml_readonly: {exc}\n")
        return 1
    sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
