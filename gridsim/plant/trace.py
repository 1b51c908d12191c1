"""Measured GPU power traces: a parser for `nvidia-smi --query-gpu=timestamp,power.draw,... --format=csv`.

nvidia-smi writes one row per GPU per sample, so with several GPUs the rows alternate GPU 0, 1, ..., g-1,
then the next sample. Values may carry unit suffixes (`195.48 W`, `--format=csv`) or not (`csv,nounits`).
A read the driver failed (`[N/A]`, `[Unknown Error]`, `[Not Supported]`, or an exact `0 W`, which a live GPU
never draws) is a gap, filled by linear interpolation in time from the same GPU's neighbouring samples.

The path may name any file (a scenario is not trusted): it is read only if it is a regular file of at most
dimmer.inputfile.MAX_DATA_BYTES, and an error says what was expected at which line, never what the file holds.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

from dimmer.errors import InputError
from dimmer.inputfile import MAX_DATA_BYTES, read_input_text

FloatArray = npt.NDArray[np.float64]

_TIME_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S.%f")


def _column(header: list[str], name: str) -> int:
    """Index of the column whose name (before any ` [unit]`) is `name`, or -1."""
    for i, h in enumerate(header):
        if h.split("[")[0].strip().lower() == name:
            return i
    return -1


def _parse_time(text: str) -> datetime:
    for fmt in _TIME_FORMATS:
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC)  # no DST jumps
        except ValueError:
            continue
    raise ValueError(text)


def _parse_power(text: str) -> float:
    """Watts from `195.48 W` or `195.48`; NaN for a failed read. Raises ValueError for anything else."""
    if text.startswith("[") and text.endswith("]"):
        return math.nan  # [N/A], [Unknown Error], [Not Supported], ...
    number = text[:-1].strip() if text.endswith("W") else text
    value = float(number)
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return math.nan if value == 0.0 else value


def load_nvsmi_trace(path: str | Path, gpus: int, source: str, key: str) -> tuple[FloatArray, FloatArray]:
    """Read an nvidia-smi CSV power log whose rows alternate GPUs `0..gpus-1`.

    Returns `(t_s, power_w)`: `t_s` `(n,)` seconds from the first sample (the timestamp of each sample's first
    row), `power_w` `(n, gpus)` with gaps filled. A trailing incomplete sample (the log was cut mid-sample) is
    dropped. Raises InputError naming `source`, `key`, the file and the line for a missing or malformed file.
    """
    p = Path(path)
    if gpus < 1:
        raise InputError(source, key, f"trace_gpus >= 1 (got {gpus})")
    what = f"power trace (nvidia-smi CSV, {p})"
    text = read_input_text(p, source, key, what, MAX_DATA_BYTES)

    lines = text.splitlines()  # LF or CRLF
    if not lines:
        raise InputError(source, key, f"{p}:1: a header line 'timestamp, power.draw [W], ...' (the file is empty)")
    header = [h.strip() for h in lines[0].split(",")]
    i_time = _column(header, "timestamp")
    i_power = _column(header, "power.draw")
    if i_time < 0 or i_power < 0:
        raise InputError(source, key, f"{p}:1: a header with 'timestamp' and 'power.draw [W]' columns")
    n_cols = len(header)

    times: list[datetime] = []
    powers: list[float] = []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != n_cols:
            raise InputError(
                source, key, f"{p}:{lineno}: {n_cols} comma-separated fields as in the header (got {len(fields)})"
            )
        try:
            times.append(_parse_time(fields[i_time]))
        except ValueError:
            raise InputError(
                source,
                key,
                f"{p}:{lineno}: a timestamp like '2025/12/10 17:40:10.592' in column {i_time + 1}",
            ) from None
        try:
            powers.append(_parse_power(fields[i_power]))
        except ValueError:
            raise InputError(
                source, key, f"{p}:{lineno}: a power like '195.48 W' or '[N/A]' in column {i_power + 1}"
            ) from None

    n = len(powers) // gpus
    if n < 2:
        raise InputError(source, key, f"{p}: at least 2 samples of {gpus} GPU rows each (got {len(powers)} rows)")
    first = times[0]
    # seconds from the first row, exact to the microsecond (epoch seconds as floats would round to ~0.2 us)
    t_all = np.asarray([(d - first).total_seconds() for d in times[: n * gpus]], dtype=np.float64)
    t_abs = t_all.reshape(n, gpus)[:, 0]
    power_w = np.asarray(powers[: n * gpus], dtype=np.float64).reshape(n, gpus)
    steps = np.diff(t_abs)
    if np.any(steps < 0):
        bad = int(np.flatnonzero(steps < 0)[0]) + 1
        raise InputError(source, key, f"{p}:{2 + bad * gpus}: timestamps that never go backwards")
    t_s = t_abs - t_abs[0]
    if t_s[-1] <= 0:
        raise InputError(source, key, f"{p}: timestamps that span some time (all {n} samples are at one instant)")

    for g in range(gpus):  # a loop over the trace's few GPUs, once at load time
        col = power_w[:, g]
        ok = np.isfinite(col)
        if not ok.any():
            raise InputError(source, key, f"{p}: a valid power reading for GPU {g} (every one failed or is 0 W)")
        if not ok.all():
            col[~ok] = np.interp(t_s[~ok], t_s[ok], col[ok])
    return t_s, power_w
