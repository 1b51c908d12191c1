"""Writes the small synthetic trace fixtures beside this file (run by hand; the files are committed).

They are not measurements: their shapes (an idle lead-in, then a training swing) and levels (an 8-GPU H100 node at
about 2.4 kW idle and 6-8.4 kW training; H100 GPUs at 70-700 W) only make the formats realistic. Each format follows
its published definition:

- redfish_metricreport_node.json: DMTF Redfish MetricReport (schema MetricReport v1.5: MetricValues[] of MetricId,
  MetricValue as a string, Timestamp, MetricProperty, a URI with a JSON pointer), the property
  /redfish/v1/Chassis/1/Power#/PowerControl/0/PowerConsumedWatts (Power v1.7); one failed read as null, one as "0".
- redfish_envmetrics_2nodes.jsonl: one MetricReport per line (as an SSE event stream delivers them), two nodes'
  /redfish/v1/Chassis/<n>/EnvironmentMetrics#/PowerWatts/Reading (EnvironmentMetrics v1.3, a SensorPowerExcerpt).
- dcgm_power.prom: DCGM-exporter's DCGM_FI_DEV_POWER_USAGE (gauge, W) in the Prometheus text exposition format
  (`name{labels} value timestamp_ms`, # HELP / # TYPE lines), 2 GPUs scraped every second; one NaN read.
- dcgm_power_range.json: a Prometheus HTTP API range query result (status, data.resultType "matrix", data.result[] of
  metric labels and values [[unix_s, "value"], ...]) for the same metric, 2 GPUs at a 15 s step.
- node_power_kw.csv: a generic time,power [kW] CSV with ISO 8601 times with and without fractions; one empty read.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
T0 = datetime(2026, 1, 5, 10, 0, 0, tzinfo=UTC)


def iso(t: datetime) -> str:
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def node_w(t_s: float) -> float:
    """An 8-GPU node: 2.4 kW idle for 60 s, then training at 7.2 ± 1.2 kW with a 20 s period (checkpoint-like)."""
    if t_s < 60:
        return 2400.0 + 15.0 * math.sin(t_s)
    return 7200.0 + 1200.0 * math.sin(2 * math.pi * t_s / 20.0)


def gpu_w(t_s: float, g: int) -> float:
    if t_s < 20:
        return 70.0 + g
    return 520.0 + 150.0 * math.sin(2 * math.pi * t_s / 4.0) + 3 * g


def main() -> None:
    values = []
    for i in range(120):  # every 5 s for 10 min
        t = T0 + timedelta(seconds=5 * i)
        v: str | None = f"{node_w(5.0 * i):.0f}"
        if i == 40:
            v = None
        if i == 41:
            v = "0"
        values.append(
            {
                "MetricId": "PowerConsumedWatts",
                "MetricValue": v,
                "Timestamp": iso(t),
                "MetricProperty": "/redfish/v1/Chassis/1/Power#/PowerControl/0/PowerConsumedWatts",
            }
        )
    report = {
        "@odata.id": "/redfish/v1/TelemetryService/MetricReports/NodePower",
        "@odata.type": "#MetricReport.v1_5_0.MetricReport",
        "Id": "NodePower",
        "Name": "Node power every 5 s",
        "MetricReportDefinition": {"@odata.id": "/redfish/v1/TelemetryService/MetricReportDefinitions/NodePower"},
        "Timestamp": iso(T0 + timedelta(seconds=600)),
        "MetricValues": values,
    }
    (HERE / "redfish_metricreport_node.json").write_text(json.dumps(report, indent=2) + "\n")

    lines = []
    for i in range(60):  # every 10 s for 10 min, two chassis
        t = T0 + timedelta(seconds=10 * i)
        mv = [
            {
                "MetricId": f"Node{n}Power",
                "MetricValue": f"{node_w(10.0 * i + 2.5) + 40 * n:.1f}",
                "Timestamp": iso(t),
                "MetricProperty": f"/redfish/v1/Chassis/{n}/EnvironmentMetrics#/PowerWatts/Reading",
            }
            for n in (1, 2)
        ]
        rep = {
            "@odata.id": f"/redfish/v1/TelemetryService/MetricReports/EnvPower{i}",
            "@odata.type": "#MetricReport.v1_5_0.MetricReport",
            "Id": f"EnvPower{i}",
            "Name": "Chassis power",
            "MetricValues": mv,
        }
        lines.append(json.dumps(rep))
    (HERE / "redfish_envmetrics_2nodes.jsonl").write_text("\n".join(lines) + "\n")

    prom = []
    ms0 = int(T0.timestamp() * 1000)
    for i in range(60):
        prom.append("# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).")
        prom.append("# TYPE DCGM_FI_DEV_POWER_USAGE gauge")
        for g in range(2):
            v = "NaN" if (i, g) == (30, 1) else f"{gpu_w(float(i), g):.3f}"
            labels = (
                f'gpu="{g}",UUID="GPU-0000000{g}-0000-0000-0000-000000000000",device="nvidia{g}",'
                f'modelName="NVIDIA H100 80GB HBM3",Hostname="node-a"'
            )
            prom.append(f"DCGM_FI_DEV_POWER_USAGE{{{labels}}} {v} {ms0 + 1000 * i}")
        prom.append(f'DCGM_FI_DEV_GPU_TEMP{{gpu="0",Hostname="node-a"}} 41 {ms0 + 1000 * i}')
    (HERE / "dcgm_power.prom").write_text("\n".join(prom) + "\n")

    result = []
    for g in range(2):
        vals = [[T0.timestamp() + 15 * i, f"{gpu_w(15.0 * i + 0.5, g):.3f}"] for i in range(40)]
        metric = {"__name__": "DCGM_FI_DEV_POWER_USAGE", "gpu": str(g), "Hostname": "node-a", "job": "dcgm"}
        result.append({"metric": metric, "values": vals})
    doc = {"status": "success", "data": {"resultType": "matrix", "result": result}}
    (HERE / "dcgm_power_range.json").write_text(json.dumps(doc) + "\n")

    rows = ["time,power [kW]"]
    for i in range(40):
        t = T0 + timedelta(seconds=2.5 * i)
        stamp = t.isoformat().replace("+00:00", "Z")  # a fraction only where there is one
        rows.append(f"{stamp},{'' if i == 7 else f'{node_w(2.5 * i + 50) / 1000:.3f}'}")
    (HERE / "node_power_kw.csv").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
