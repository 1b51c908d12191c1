"""Scenario builders for benchmarks: campuses of any size in the shape the scenario library uses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from gridsim.scenario import LoadedScenario, validate_scenario

RACKS_PER_BUILDING = 320  # 4 halls x 8 rows x 10 racks: 23,040 GPUs, the seeds' ~20k-GPU building


def campus(gpus: int, duration_s: float, controller: str = "none") -> LoadedScenario:
    """A campus of about `gpus` GPUs: buildings of 320 NVL72 racks, one swinging job per building."""
    racks = math.ceil(gpus / 72)
    if racks <= RACKS_PER_BUILDING:
        levels: list[dict[str, Any]] = [
            {"level": "row", "count": math.ceil(racks / 10), "rating_mw": 1.5},
            {"level": "rack", "count": 10},
        ]
        n_buildings = 0
        racks = math.ceil(racks / 10) * 10
    else:
        n_buildings = math.ceil(racks / RACKS_PER_BUILDING)
        racks = n_buildings * RACKS_PER_BUILDING
        levels = [
            {"level": "building", "count": n_buildings, "rating_mw": 40.0},
            {"level": "hall", "count": 4, "rating_mw": 10.5},
            {"level": "row", "count": 8, "rating_mw": 1.5},
            {"level": "rack", "count": 10},
        ]
    limit_mw = racks * 0.14
    if n_buildings:
        jobs = [{"name": f"job{b}", "building": f"b{b}", "priority": b % 3} for b in range(n_buildings)]
    else:
        jobs = [{"name": "job0", "racks": [0, racks], "priority": 1}]
    raw = {
        "name": f"campus-{racks * 72}",
        "duration_s": duration_s,
        "site": {
            "gpu": "gb300",
            "pcc": {"limit_mw": limit_mw, "ramp_mw_per_min": limit_mw / 15},
            "levels": levels,
            "storage": {"bess": {"power_mw": limit_mw * 0.2, "energy_mwh": limit_mw * 0.1}},
        },
        "jobs": jobs,
        "controller": {"name": controller},
        "engine": {"record_racks": 64},
    }
    return LoadedScenario(validate_scenario(raw, "bench"), "bench", Path(tempfile.gettempdir()))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {_cores()} cores, Python {platform.python_version()}, numpy {np.__version__}"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


async def spawn_script(script: Path, *args: str, log_path: Path) -> asyncio.subprocess.Process:
    """`python script args...` with its stdout piped to us and its stderr in `log_path`."""
    with log_path.open("wb") as log_file:
        return await asyncio.create_subprocess_exec(
            sys.executable, str(script), *args, stdout=asyncio.subprocess.PIPE, stderr=log_file
        )


async def first_json_line(
    proc: asyncio.subprocess.Process, log_path: Path, what: str, timeout_s: float = 120.0
) -> dict[str, Any]:
    """The child's first stdout line, as JSON; if none comes, kill it and exit with the tail of its log."""
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=timeout_s)
    except TimeoutError:
        line = b""
    if not line:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise SystemExit(f"the {what} did not start: " + " | ".join(tail))
    result: dict[str, Any] = json.loads(line)
    return result
