"""Power traces from telemetry systems: DCGM-exporter through Prometheus (text exposition or a range query's JSON)
and DMTF Redfish MetricReports. Each holds several channels (GPUs, chassis) with their own timestamps; they are put
on the times of the channel with the most samples (gridsim.plant.trace_formats describes the formats)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from gridsim.plant.trace_formats import DCGM_POWER, RawTrace, _Err, _finish, parse_time, parse_watts

_REDFISH_POWER = ("PowerConsumedWatts", "PowerWatts/Reading", "PowerWatts")


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
