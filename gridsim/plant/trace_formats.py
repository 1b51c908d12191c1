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

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dimmer.errors import InputError

FloatArray = npt.NDArray[np.float64]

FORMATS = ("nvidia-smi", "dcgm-prometheus", "redfish", "pdu-util", "csv")
LEVEL_OF_FORMAT = {"nvidia-smi": "gpu", "dcgm-prometheus": "gpu", "redfish": "node", "pdu-util": "pdu", "csv": None}
DCGM_POWER = "DCGM_FI_DEV_POWER_USAGE"
_REDFISH_POWER = ("PowerConsumedWatts", "PowerWatts/Reading", "PowerWatts")
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
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        f = [x.strip() for x in line.split(",")]
        if len(f) != len(header):
            raise err(f":{lineno}", f"{len(header)} comma-separated fields as in the header (got {len(f)})")
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
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        f = [x.strip() for x in line.split(",")]
        if len(f) != len(header):
            raise err(f":{lineno}", f"{len(header)} comma-separated fields as in the header (got {len(f)})")
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
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        f = [x.strip() for x in line.split(",")]
        if len(f) != len(header):
            raise err(f":{lineno}", f"{len(header)} comma-separated fields as in the header (got {len(f)})")
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


def _channels(err: _Err, series: dict[str, list[tuple[int, float, str]]]) -> RawTrace:
    """Several channels with their own times -> one table on the times of the channel with the most samples; a
    channel's failed reads stay NaN at its own times and are marked where they fall on the common grid."""
    if not series:
        raise err("", "samples of the power metric (none found)")
    names = tuple(sorted(series))
    ref = max(names, key=lambda n: len(series[n]))
    base = sorted(series[ref], key=lambda s: s[0])
    times = [s[0] for s in base]
    where = [s[2] for s in base]
    cols = []
    t_grid = np.asarray(times, dtype=np.float64)
    for c, n in enumerate(names):
        pts = sorted(series[n], key=lambda s: s[0])
        t = np.asarray([p[0] for p in pts], dtype=np.float64)
        v = np.asarray([p[1] for p in pts])
        if t.size == t_grid.size and np.array_equal(t, t_grid):
            cols.append(v)
            continue
        ok = np.isfinite(v)
        if ok.sum() < 1:
            raise err("", f"a valid reading on channel {c + 1} of {len(names)} (every one failed or is 0 W)")
        col = np.interp(t_grid, t[ok], v[ok])
        # a failed read on this channel marks the nearest grid sample as failed too, so it is counted as a gap
        bad = np.searchsorted(t_grid, t[~ok]).clip(0, t_grid.size - 1)
        col[bad] = np.nan
        cols.append(col)
    rows = np.stack(cols, axis=1).tolist()
    return _finish(err, times, rows, where, names)


def read_prometheus_text(text: str, err: _Err) -> RawTrace:
    """`DCGM_FI_DEV_POWER_USAGE{gpu="0",Hostname="n1",...} 245.5 1765388410592` per line (value in W, timestamp in
    ms since the epoch, required: a log of scrapes needs one per sample); other metrics and comments are skipped."""
    series: dict[str, list[tuple[int, float, str]]] = {}
    pat = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+(\S+))?\s*")
    for lineno, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = pat.fullmatch(s)
        if m is None:
            raise err(f":{lineno}", "a Prometheus sample 'name{labels} value timestamp_ms'")
        if m.group(1) != DCGM_POWER:
            continue
        if m.group(4) is None:
            raise err(f":{lineno}", "a timestamp in ms after the value (each scraped sample needs its time)")
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        chan = f"{labels.get('Hostname', labels.get('instance', ''))}/{labels.get('gpu', labels.get('UUID', '0'))}"
        try:
            t = round(float(m.group(4)) * 1e3)
        except ValueError:
            raise err(f":{lineno}", "a timestamp in ms since the epoch after the value") from None
        try:
            v = parse_watts(m.group(3))
        except ValueError:
            raise err(f":{lineno}", "a power in W >= 0 (NaN for a failed read)") from None
        series.setdefault(chan, []).append((t, v, f":{lineno}"))
    return _channels(err, series)


def _json(text: str, err: _Err) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise err(f":{exc.lineno}", "JSON (a Redfish MetricReport or a Prometheus query result)") from None


def read_prometheus_json(text: str, err: _Err) -> RawTrace:
    """A Prometheus range query result: `{"status": "success", "data": {"resultType": "matrix", "result": [{"metric":
    {...}, "values": [[unix_s, "245.5"], ...]}, ...]}}`, each result a GPU's `DCGM_FI_DEV_POWER_USAGE`."""
    doc = _json(text, err)
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, dict) or data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
        raise err(": data.resultType", "a Prometheus range query result ('matrix')")
    series: dict[str, list[tuple[int, float, str]]] = {}
    for r, res in enumerate(data["result"]):
        metric = res.get("metric", {}) if isinstance(res, dict) else {}
        if metric.get("__name__", DCGM_POWER) != DCGM_POWER:
            continue
        chan = f"{metric.get('Hostname', metric.get('instance', ''))}/{metric.get('gpu', r)}"
        values = res.get("values")
        if not isinstance(values, list):
            raise err(f": data.result[{r}].values", 'a list of [unix_seconds, "value"] pairs')
        for i, pair in enumerate(values):
            key = f": data.result[{r}].values[{i}]"
            try:
                t, v = round(float(pair[0]) * 1e6), parse_watts(str(pair[1]))
            except (ValueError, TypeError, IndexError, KeyError):
                raise err(key, 'a pair [unix_seconds, "watts"] with a power >= 0') from None
            series.setdefault(chan, []).append((t, v, key))
    return _channels(err, series)


def read_redfish(text: str, err: _Err) -> RawTrace:
    """Redfish MetricReport(s): one JSON document (a report or a list of reports) or one report per line (as a
    BMC's event stream delivers them). Every MetricValue whose MetricProperty (or MetricId) ends in a power property
    is a sample; `MetricValue` is a string or a number, null or empty for a failed read."""
    stripped = text.lstrip()
    docs: list[tuple[str, Any]] = []
    if stripped.startswith("[") or "\n{" not in stripped.rstrip():
        doc = _json(text, err)
        docs = [(f": [{i}]", d) for i, d in enumerate(doc)] if isinstance(doc, list) else [(":", doc)]
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    docs.append((f":{lineno}", json.loads(line)))
                except json.JSONDecodeError:
                    raise err(f":{lineno}", "one Redfish MetricReport (JSON) per line") from None
    series: dict[str, list[tuple[int, float, str]]] = {}
    for where, doc in docs:
        values = doc.get("MetricValues") if isinstance(doc, dict) else None
        if not isinstance(values, list):
            raise err(where if where != ":" else ":1", "a Redfish MetricReport with a MetricValues list")
        for i, mv in enumerate(values):
            key = f"{where} MetricValues[{i}]" if where.startswith(": [") or where == ":" else f"{where}"
            if not isinstance(mv, dict):
                raise err(key, "a MetricValue object")
            prop = str(mv.get("MetricProperty") or mv.get("MetricId") or "")
            if not prop.endswith(_REDFISH_POWER):
                continue
            try:
                t = parse_time(str(mv["Timestamp"]))
            except (KeyError, ValueError):
                raise err(key + ".Timestamp", "an ISO 8601 timestamp like '2026-01-05T10:00:00Z'") from None
            raw = mv.get("MetricValue")
            try:
                v = math.nan if raw is None else parse_watts(str(raw))
            except ValueError:
                raise err(key + ".MetricValue", "a power in W >= 0 (null or empty for a failed read)") from None
            chan = prop.split("#")[0]
            series.setdefault(chan, []).append((t, v, key))
    return _channels(err, series)


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
