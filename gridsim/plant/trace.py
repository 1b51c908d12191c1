"""Measured power traces: read (any format of gridsim.plant.trace_formats), failed reads filled, gaps counted.

A read the device failed (`[N/A]`, empty, `null`, an exact 0 W, which a live device never draws) is a gap, never a
real drop to zero load. A gap is also a hole in time: consecutive good samples further apart than 1.5 median sample
steps. Gaps are filled per channel by a stated rule, from that channel's good samples on either side:

- `linear` (default): linear interpolation in time between the good samples either side;
- `hold`: the last good sample before the gap (sample-and-hold, as a meter that keeps its last reading).

Failed reads before the first good sample take that sample (and after the last, the last one) under either rule.
A gap longer than `max_gap_s` (good sample to good sample) is an InputError naming the file and the line (or JSON
key) of the first sample after it was lost. The path may name any file (a scenario is not trusted): it is read only
if it is a regular file of at most dimmer.inputfile.MAX_DATA_BYTES.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from dimmer.errors import InputError
from dimmer.inputfile import MAX_DATA_BYTES, read_input_text
from gridsim.plant.trace_formats import (
    DCGM_POWER,
    FORMATS,
    RawTrace,
    _Err,
    read_csv,
    read_nvsmi,
    read_pdu_util,
)
from gridsim.plant.trace_telemetry import read_prometheus_json, read_prometheus_text, read_redfish

FloatArray = npt.NDArray[np.float64]

FILL_RULES = ("linear", "hold")
DEFAULT_GAP_STEPS = 10  # the default longest gap: 10 median sample steps (1 s at 100 ms, 50 min at 5 min)


@dataclass(frozen=True)
class GapStats:
    failed_reads: int  # samples (over all channels) whose read failed and were filled
    gaps: int  # runs of failed reads plus holes in time, over all channels
    longest_gap_s: float  # good sample to good sample
    max_gap_s: float  # the limit applied
    rule: str


def _channel(raw: RawTrace, c: int) -> str:
    """A channel by its number (its name came from the file, and an error never echoes the file)."""
    return f"GPU {c}" if raw.channels[c].startswith("GPU ") else f"channel {c + 1} of {len(raw.channels)}"


def fill_gaps(raw: RawTrace, max_gap_s: float | None, rule: str = "linear") -> tuple[FloatArray, GapStats]:
    """`raw.power_w` with every failed read filled by `rule`; raises InputError for a gap over `max_gap_s`
    (None: DEFAULT_GAP_STEPS median sample steps) or a channel with no good read. Filled values lie between
    good readings of the same channel, so a fill never invents a zero."""
    if rule not in FILL_RULES:
        raise ValueError(f"fill rule one of {FILL_RULES} (got {rule!r})")
    t = raw.t_s
    power = raw.power_w.copy()
    step = float(np.median(np.diff(t)))
    limit = DEFAULT_GAP_STEPS * step if max_gap_s is None else float(max_gap_s)
    failed = gaps = 0
    longest = 0.0
    for c in range(power.shape[1]):  # once per channel (GPUs, nodes of a trace), at load time
        col = power[:, c]
        ok = np.isfinite(col)
        good = np.flatnonzero(ok)
        if good.size == 0:
            msg = f"{raw.path}: a valid reading on {_channel(raw, c)} (every one failed or is 0 W)"
            raise InputError("", "", msg)
        # good sample to good sample, with the trace's ends as bounds for failed reads before / after
        bounds = np.concatenate(([0], good, [t.size - 1]))
        spans = np.diff(t[bounds])
        lost = np.diff(bounds) > 1  # failed reads between
        hole = spans > 1.5 * step
        is_gap = lost | hole
        gaps += int(is_gap.sum())
        failed += int((~ok).sum())
        if is_gap.any():
            longest = max(longest, float(spans[is_gap].max()))
        over = np.flatnonzero(is_gap & (spans > limit + 1e-9))
        if over.size:
            g = int(over[0])
            first_lost = int(bounds[g]) + 1 if lost[g] else int(bounds[g + 1])
            raise InputError(
                "",
                raw.where(min(first_lost, t.size - 1)),
                f"no gap longer than trace_max_gap_s = {limit:g} s (this one is {spans[g]:g} s: failed reads or "
                f"missing samples on {_channel(raw, c)}; raise trace_max_gap_s to fill it by the "
                f"'{rule}' rule)",
            )
        if good.size < t.size:
            if rule == "linear":
                col[~ok] = np.interp(t[~ok], t[good], col[good])
            else:
                idx = np.searchsorted(good, np.flatnonzero(~ok), side="right") - 1
                col[~ok] = col[good[np.maximum(idx, 0)]]
    return power, GapStats(failed, gaps, longest, limit, rule)


def detect_format(text: str) -> str | None:
    head = text[:4096].lstrip()
    first = head.splitlines()[0].lower() if head else ""
    if head.startswith(("{", "[")):
        if "MetricValues" in head or "MetricReport" in head:
            return "redfish"
        if "resultType" in head or '"data"' in head:
            return "dcgm-prometheus"
        return None
    if DCGM_POWER in head:
        return "dcgm-prometheus"
    if "power.draw" in first:
        return "nvidia-smi"
    if "measured_power_util" in first:
        return "pdu-util"
    if "," in first:
        return "csv"
    return None


def read_trace(text: str, fmt: str, path: Path, source: str, key: str, gpus: int = 1) -> tuple[RawTrace, str]:
    """Parse `text` (the file at `path`) as `fmt` ("auto" detects it); returns the trace and the format read."""
    err = _Err(path, source, key)
    if not text.strip():
        raise err(":1", "a power trace (the file is empty)")
    if fmt == "auto":
        found = detect_format(text)
        if found is None:
            raise err(":1", f"a power trace in one of the formats {', '.join(FORMATS)} (set trace_format)")
        fmt = found
    if fmt == "nvidia-smi":
        return read_nvsmi(text, err, gpus), fmt
    if fmt == "csv":
        return read_csv(text, err), fmt
    if fmt == "pdu-util":
        return read_pdu_util(text, err), fmt
    if fmt == "redfish":
        return read_redfish(text, err), fmt
    if fmt == "dcgm-prometheus":
        is_json = text.lstrip().startswith(("{", "["))
        return (read_prometheus_json(text, err) if is_json else read_prometheus_text(text, err)), fmt
    raise err("", f"trace_format one of {', '.join(FORMATS)}")


def load_raw_trace(path: str | Path, fmt: str, source: str, key: str, gpus: int = 1) -> tuple[RawTrace, str]:
    """Read the file safely and parse it as `fmt` ("auto" to detect); returns the raw trace and its format."""
    p = Path(path)
    if gpus < 1:
        raise InputError(source, key, f"trace_gpus >= 1 (got {gpus})")
    text = read_input_text(p, source, key, f"power trace ({p})", MAX_DATA_BYTES)
    return read_trace(text, fmt, p, source, key, gpus)


def filled(raw: RawTrace, source: str, key: str, max_gap_s: float | None, rule: str) -> tuple[FloatArray, GapStats]:
    """fill_gaps with the error's source and key set (the file and line are in its text)."""
    try:
        return fill_gaps(raw, max_gap_s, rule)
    except InputError as exc:
        where = f"{exc.key}: " if exc.key else ""
        raise InputError(source, key, f"{where}{exc.expected}") from None


def load_nvsmi_trace(path: str | Path, gpus: int, source: str, key: str) -> tuple[FloatArray, FloatArray]:
    """Read an nvidia-smi CSV power log whose rows alternate GPUs `0..gpus-1`.

    Returns `(t_s, power_w)`: `t_s` `(n,)` seconds from the first sample (the timestamp of each sample's first
    row), `power_w` `(n, gpus)` with failed reads filled by linear interpolation (no gap limit). A trailing
    incomplete sample is dropped. Raises InputError naming `source`, `key`, the file and the line.
    """
    p = Path(path)
    if gpus < 1:
        raise InputError(source, key, f"trace_gpus >= 1 (got {gpus})")
    text = read_input_text(p, source, key, f"power trace (nvidia-smi CSV, {p})", MAX_DATA_BYTES)
    raw = read_nvsmi(text, _Err(p, source, key), gpus)
    power, _ = filled(raw, source, key, float("inf"), "linear")
    return raw.t_s, power
