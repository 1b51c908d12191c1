"""Measured power traces in the formats sites log them, parsed into one shape, with failed reads marked.

Formats (`trace_format`), each with the level it measures unless the scenario declares another (`trace_level`):

- `nvidia-smi` (gpu): `nvidia-smi --query-gpu=timestamp,power.draw,... --format=csv[,nounits]`, rows alternate GPUs.
- `dcgm-prometheus` (gpu): DCGM-exporter's `DCGM_FI_DEV_POWER_USAGE` (W), as Prometheus text exposition with a
  timestamp (ms) on every sample, or a range query's JSON result (`resultType` `matrix`).
- `redfish` (node): DMTF Redfish `MetricReport`(s) whose `MetricValues` carry `PowerControl/N/PowerConsumedWatts`
  (Power) or `PowerWatts/Reading` (EnvironmentMetrics); one JSON document, or one report per line.
- `pdu-util` (pdu): power as a fraction of the PDU's rating (Google PowerData 2019:
  `index,time,pdu,measured_power_util`, time in µs from the trace's start).
- `csv` (level declared): a `time` column (ISO 8601, with or without fractions and offset; or seconds in `t_s`)
  and a power column (`power_w`, `power_kw`, or `power [W]` / `power [kW]`).

Every parser returns a RawTrace: sample times, one column per channel (GPU, node, PDU), NaN where a read failed
(`[N/A]`, empty, `null`, `NaN`, or an exact 0 W, which a live device never draws), and where each sample came from, so
a later error (a gap too long) can name the file and the line. A malformed value is an InputError naming the file,
the line (or JSON key) and what was expected, never what the file holds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import numpy.typing as npt

from dimmer.errors import InputError

FloatArray = npt.NDArray[np.float64]

FORMATS = ("nvidia-smi", "dcgm-prometheus", "redfish", "pdu-util", "csv")
LEVEL_OF_FORMAT = {"nvidia-smi": "gpu", "dcgm-prometheus": "gpu", "redfish": "node", "pdu-util": "pdu", "csv": None}
DCGM_POWER = "DCGM_FI_DEV_POWER_USAGE"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NVSMI_TIME = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S")


@dataclass(frozen=True)
class RawTrace:
    """`t_s` `(n,)` seconds from the first sample, non-decreasing; `power_w` `(n, k)`, NaN = a failed read;
    `where(i)` names sample i's origin (`file:line` or `file: key`); `unit` is "W" or "frac" (of a rating)."""

    t_s: FloatArray
    power_w: FloatArray
    where: Callable[[int], str]
    channels: tuple[str, ...]
    unit: str = "W"
    path: str = ""


class _Err:
    """Raises InputError(source, key, ...) with the file's name in front."""

    def __init__(self, path: Path, source: str, key: str) -> None:
        self.path, self.source, self.key = path, source, key

    def __call__(self, where: str, expected: str) -> InputError:
        return InputError(self.source, self.key, f"{self.path}{where}: {expected}")


def parse_time(text: str) -> int:
    """Microseconds since the epoch (exact: epoch seconds as floats round to ~0.2 us) from ISO 8601
    (`2025-12-10T17:40:10Z`, `...10.592+01:00`, a space for the T) or nvidia-smi's
    `2025/12/10 17:40:10.592`; a time with no offset is UTC. Raises ValueError."""
    t = text.strip()
    d: datetime | None = None
    try:
        d = datetime.fromisoformat(t[:-1] + "+00:00" if t.endswith(("Z", "z")) else t)
    except ValueError:
        for fmt in _NVSMI_TIME:
            try:
                d = datetime.strptime(t, fmt)
                break
            except ValueError:
                continue
    if d is None:
        raise ValueError(text)
    if d.tzinfo is None:
        d = d.replace(tzinfo=UTC)
    return (d - _EPOCH) // timedelta(microseconds=1)


def parse_watts(text: str, unit_w: float = 1.0) -> float:
    """W from `195.48 W`, `195.48`, `0.2 kW`; NaN for a failed read (`[N/A]`, empty, `NaN`, `null`, 0).
    Raises ValueError for anything else (a negative, an unknown unit, text)."""
    s = text.strip().strip('"')
    if not s or (s.startswith("[") and s.endswith("]")) or s.lower() in ("nan", "null", "none", "n/a"):
        return math.nan
    m = re.fullmatch(r"([-+0-9.eE]+)\s*(kW|W|mW)?", s)
    if m is None:
        raise ValueError(text)
    value = float(m.group(1)) * {"kW": 1000.0, "W": 1.0, "mW": 1e-3, None: unit_w}[m.group(2)]
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return math.nan if value == 0.0 else value


def _finish(err: _Err, times: list[int], rows: list[list[float]], lines: list[str], chans: tuple[str, ...],
            unit: str = "W") -> RawTrace:  # fmt: skip
    if len(times) < 2:
        raise err("", f"at least 2 samples (got {len(times)})")
    t_us = np.asarray(times, dtype=np.int64)
    t = (t_us - t_us[0]).astype(np.float64) * 1e-6  # times are integer µs, exact until here
    back = np.flatnonzero(np.diff(t) < 0)
    if back.size:
        raise err(lines[int(back[0]) + 1], "timestamps that never go backwards")
    if t[-1] <= t[0]:
        raise err("", f"timestamps that span some time (all {t.size} samples are at one instant)")
    if not float(np.median(np.diff(t))) > 0:
        raise err("", "samples at distinct times (the median sample step is 0)")
    path = err.path
    return RawTrace(t, np.asarray(rows, dtype=np.float64), lambda i: f"{path}{lines[i]}", chans, unit, str(path))


def _header_col(header: list[str], *names: str) -> int:
    for i, h in enumerate(header):
        if h.split("[")[0].strip().lower() in names:
            return i
    return -1


def _csv_rows(lines: list[str], n_fields: int, err: _Err) -> Iterator[tuple[int, list[str]]]:
    """(line number, stripped fields) of every non-blank line after the header; an error for a line whose field
    count is not the header's."""
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        f = [x.strip() for x in line.split(",")]
        if len(f) != n_fields:
            raise err(f":{lineno}", f"{n_fields} comma-separated fields as in the header (got {len(f)})")
        yield lineno, f


def read_nvsmi(text: str, err: _Err, gpus: int) -> RawTrace:
    lines = text.splitlines()
    if not lines:
        raise err(":1", "a header line 'timestamp, power.draw [W], ...' (the file is empty)")
    header = [h.strip() for h in lines[0].split(",")]
    i_t, i_p = _header_col(header, "timestamp"), _header_col(header, "power.draw")
    if i_t < 0 or i_p < 0:
        raise err(":1", "a header with 'timestamp' and 'power.draw [W]' columns")
    times: list[int] = []
    rows: list[list[float]] = []
    where: list[str] = []
    row: list[float] = []
    for lineno, f in _csv_rows(lines, len(header), err):
        try:
            t = parse_time(f[i_t])
        except ValueError:
            raise err(f":{lineno}", f"a timestamp like '2025/12/10 17:40:10.592' in column {i_t + 1}") from None
        try:
            row.append(parse_watts(f[i_p]))
        except ValueError:
            raise err(f":{lineno}", f"a power like '195.48 W' or '[N/A]' in column {i_p + 1}") from None
        if len(row) == 1:
            times.append(t)
            where.append(f":{lineno}")
        if len(row) == gpus:
            rows.append(row)
            row = []
    times = times[: len(rows)]  # a trailing incomplete sample (the log was cut mid-sample) is dropped
    return _finish(err, times, rows, where, tuple(f"GPU {g}" for g in range(gpus)))


_CSV_POWER = {"power_w": 1.0, "power": 1.0, "watts": 1.0, "power_kw": 1000.0, "power_mw": 1e6}


def read_csv(text: str, err: _Err) -> RawTrace:
    """`time` (ISO 8601) or `t_s` (seconds) and one power column; `power [W]` / `power [kW]` name their unit."""
    lines = text.splitlines()
    if not lines:
        raise err(":1", "a header line 'time,power_w' (the file is empty)")
    header = [h.strip().lower() for h in lines[0].split(",")]
    i_t = _header_col(header, "time", "timestamp", "t_s", "time_s")
    seconds = i_t >= 0 and header[i_t].split("[")[0].strip() in ("t_s", "time_s")
    i_p, unit_w = -1, 1.0
    for i, h in enumerate(header):
        name, _, unit = h.partition("[")
        name, unit = name.strip(), unit.rstrip("]").strip()
        if name in _CSV_POWER:
            i_p = i
            if unit:
                if unit not in ("w", "kw", "mw"):
                    raise err(":1", f"a power unit of W, kW or MW in column {i + 1} (got an unknown unit)")
                unit_w = {"w": 1.0, "kw": 1e3, "mw": 1e6}[unit]
            else:
                unit_w = _CSV_POWER[name]
            break
    if i_t < 0 or i_p < 0:
        raise err(":1", "a header with a time column (time, timestamp or t_s) and a power column (power_w, power_kw)")
    times: list[int] = []
    rows: list[list[float]] = []
    where: list[str] = []
    for lineno, f in _csv_rows(lines, len(header), err):
        try:
            times.append(round(float(f[i_t]) * 1e6) if seconds else parse_time(f[i_t]))
        except ValueError:
            what = "seconds" if seconds else "an ISO 8601 time like '2026-01-05T10:00:00.5Z'"
            raise err(f":{lineno}", f"{what} in column {i_t + 1}") from None
        try:
            rows.append([parse_watts(f[i_p], unit_w)])
        except ValueError:
            raise err(f":{lineno}", f"a power >= 0 (empty or 0 for a failed read) in column {i_p + 1}") from None
        where.append(f":{lineno}")
    return _finish(err, times, rows, where, ("power",))


def read_pdu_util(text: str, err: _Err) -> RawTrace:
    """Google PowerData 2019: `index,time,pdu,measured_power_util`, time in µs from the trace's start, one PDU."""
    lines = text.splitlines()
    header = [h.strip().lower() for h in lines[0].split(",")] if lines else []
    i_t, i_u = _header_col(header, "time"), _header_col(header, "measured_power_util")
    i_pdu = _header_col(header, "pdu")
    if i_t < 0 or i_u < 0:
        raise err(":1", "a header with 'time' (µs) and 'measured_power_util' columns")
    times: list[int] = []
    rows: list[list[float]] = []
    where: list[str] = []
    pdu: str | None = None
    for lineno, f in _csv_rows(lines, len(header), err):
        if i_pdu >= 0:
            if pdu is None:
                pdu = f[i_pdu]
            elif f[i_pdu] != pdu:
                raise err(f":{lineno}", "one PDU per file (the first rows name another)")
        try:
            times.append(round(float(f[i_t])))
        except ValueError:
            raise err(f":{lineno}", f"a time in µs from the trace's start in column {i_t + 1}") from None
        try:
            u = math.nan if f[i_u] == "" else float(f[i_u])
        except ValueError:
            u = -1.0
        if not (math.isnan(u) or 0.0 <= u <= 1.5):
            expected = f"a utilisation of the PDU's rating in [0, 1.5] (empty for a failed read) in column {i_u + 1}"
            raise err(f":{lineno}", expected)
        rows.append([math.nan if u == 0.0 else u])
        where.append(f":{lineno}")
    return _finish(err, times, rows, where, ("pdu",), unit="frac")
