"""`gridsim describe`, `gridsim schema` and the Pareto figure of `gridsim compare`."""

from __future__ import annotations

import json
import re
import struct
import tomllib
from pathlib import Path
from typing import Any

import pytest

from gridsim.cli import main
from gridsim.compare import compare_pareto_png, pareto_front
from gridsim.describe import oversubscription, scenario_schema
from gridsim.metrics import SUMMARY_KEYS
from gridsim.scenario import load_scenario
from tests.conftest import skip_without_shared_data

from .conftest import SCENARIOS

# Two rows of ten racks (1,200 kW each) under a 2.5 MW interconnect; one row derated to 1,000 kW; a 640-GPU job
# (10 running racks + 1 spare) and a 512-GPU job (8 + 1); a 0.5 MW / 0.2 MWh battery; a curtailment and a crash.
SMALL = """
name = "small"
seed = 4
duration_s = 90
[site.pcc]
limit_mw = 2.5
ramp_mw_per_min = 2.0
[[site.levels]]
level = "row"
count = 2
rating_kw = 1200
[[site.levels]]
level = "rack"
count = 10
[[site.overrides]]
domain = "r1"
rating_kw = 1000
[site.storage.bess]
power_mw = 0.5
energy_mwh = 0.2
[[jobs]]
name = "a"
gpus = 640
priority = 5
mtbi_gpu_h = 6400
[[jobs]]
name = "b"
gpus = 512
priority = 1
swing_frac = 0.5
iteration_s = 0.5
[[events]]
kind = "curtail"
at_s = 65
limit_mw = 2.0
over_s = 10
[[events]]
kind = "crash"
at_s = 70
jobs = ["b"]
"""

# GB300 NVL72 rack at its maximum: 64 GPUs at 1,400 W, 8 spares idle at 165 W, 72 × 440 W of host, through 97 %
RACK_MAX_W = (64 * 1400 + 8 * 165 + 72 * 440) / 0.97
IDLE_RACK_W = 72 * (165 + 440) / 0.97


@pytest.fixture
def small(tmp_path: Path) -> Path:
    p = tmp_path / "small.toml"
    p.write_text(SMALL)
    return p


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR", "a PNG starts with its IHDR chunk"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def _line(text: str, start: str) -> list[str]:
    """The cells of the first line that starts with `start` (after indentation), split on runs of 2+ spaces."""
    line = next(row for row in text.splitlines() if row.strip().startswith(start))
    return re.split(r"\s{2,}", line.strip())


# -- describe ------------------------------------------------------------------------------------------------


def test_describe_gives_the_site_levels_ratings_and_oversubscription(
    small: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["describe", str(small)]) == 0
    out = capsys.readouterr().out
    assert f"Site: {20 * 72:,} gb300 GPUs" in out and "in 20 racks of 72" in out
    assert "2.50 MW import limit; ramp limit 2 MW/min over 60 s" in out
    # campus: 20 rack maxima over 2.5 MW
    assert _line(out, "campus") == ["campus", "1", "2.50 MW", f"{20 * RACK_MAX_W / 1e6:.2f} MW",
                                    f"{20 * RACK_MAX_W / 2.5e6:.2f}"]  # fmt: skip
    # rows: 10 rack maxima over 1,200 kW and, derated, 1,000 kW
    row = _line(out, "row ")
    assert row[:3] == ["row", "2", "1.00 MW – 1.20 MW"]
    assert row[3] == f"{10 * RACK_MAX_W / 1e6:.2f} MW"
    assert row[4] == f"{10 * RACK_MAX_W / 1.2e6:.2f} – {10 * RACK_MAX_W / 1e6:.2f}"
    # racks: default rating = nameplate of 72 GPUs at rated + host
    rack_rating_w = 72 * (1400 + 440) / 0.97
    assert _line(out, "rack ")[:4] == ["rack", "20", f"{rack_rating_w / 1e3:.1f} kW", f"{RACK_MAX_W / 1e3:.1f} kW"]
    assert f"idle rack {IDLE_RACK_W / 1e3:.1f} kW" in out


def test_describe_gives_storage_jobs_and_events(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", str(small)]) == 0
    out = capsys.readouterr().out
    # sized from the GB300 NVL72 rack (docs/models.md): trays 30 % of 72 x 1,400 W; the BBU shelf carries the rack's
    # 72 x (1,400 + 440) W = 132.48 kW in 12 modules of 12 kW and stores 90 s of it after sqrt(0.92) of loss
    assert _line(out, "capacitor trays")[1:] == [
        "20",
        "65 J per GPU, 30.24 kW",
        f"{20 * 72 * 65 / 1e6:.2f} MJ, 604.8 kW",
    ]
    bbu_kwh = 132.48 * 90 / 3600 / 0.92**0.5
    bbu = _line(out, "rack BBUs")
    assert bbu[1:3] == ["20", f"144 kW, {bbu_kwh:.3g} kWh"], bbu
    assert bbu[3].startswith(f"{20 * bbu_kwh:.1f} kWh, 2.88 MW"), bbu
    bess = _line(out, "campus BESS")
    assert bess[1:3] == ["1", "500.0 kW / 0.2 MWh"]
    assert "starts at 50 % (0.08 MWh above its floor)" in bess[3]  # 0.2 MWh × (0.5 − 0.1)

    a = _line(out, "a ")
    assert a[:5] == ["a", "640", "10 + 1", "0–10", "5"]
    assert a[5] == f"1,260 W, 35 % ({640 * 1260 * 0.35 / 0.97 / 1e6:.2f} MW)"
    assert a[6] == "2 s × 70 %"
    assert a[8] == "6,400 GPU-h (0.1/h)"  # 640 GPUs / 6,400 GPU-h
    b = _line(out, "b ")
    assert b[:5] == ["b", "512", "8 + 1", "11–19", "1"]
    assert b[5] == f"1,260 W, 50 % ({512 * 1260 * 0.5 / 0.97 / 1e6:.2f} MW)" and b[8] == "none"
    assert "every rack holds a job" in out

    assert _line(out, "65 s") == ["65 s", "curtail", "interconnect limit to 2 MW over 10 s"]
    assert _line(out, "70 s") == ["70 s", "crash", "b"]


def test_describe_applies_overrides_and_counts_idle_racks(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", str(small), "--set", "jobs[1].gpus=64", "--set", "site.storage.bess.energy_mwh=0"]) == 0
    out = capsys.readouterr().out
    assert _line(out, "b ")[:3] == ["b", "64", "1 + 1"]
    assert f"7 racks hold no job: idle, {IDLE_RACK_W / 1e3:.1f} kW each" in out  # 20 − (10 + 1) − (1 + 1)
    assert _line(out, "campus BESS")[1:3] == ["0", "none"]


def test_describe_bad_scenario_is_one_line_and_exit_2(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", str(small), "--set", "site.pcc.limit_mw=-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "site.pcc.limit_mw" in err


def test_oversubscription_is_rack_maxima_over_rating(small: Path) -> None:
    site = load_scenario(small).site()
    osub = oversubscription(site)
    assert osub[0] == pytest.approx(20 * RACK_MAX_W / 2.5e6)
    assert osub[site.domain_index("r0")] == pytest.approx(10 * RACK_MAX_W / 1.2e6)
    assert osub[site.domain_index("r1")] == pytest.approx(10 * RACK_MAX_W / 1.0e6)


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_describe_every_library_scenario(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    skip_without_shared_data(path)
    assert main(["describe", str(path)]) == 0
    out = capsys.readouterr().out
    site = load_scenario(path).site()
    assert f"Site: {site.n_gpus:,} " in out and "Storage:" in out and "Workload:" in out and "Events" in out


# -- schema --------------------------------------------------------------------------------------------------


def _strict_json(text: str) -> Any:
    def no_constant(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=no_constant)


def test_schema_is_strict_json_with_the_scenario_properties(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = _strict_json(capsys.readouterr().out)
    assert schema == scenario_schema()
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert {"name", "duration_s", "site", "jobs", "events", "controller"} <= set(schema["properties"])
    assert {"name", "duration_s", "site"} <= set(schema["required"])
    assert schema["additionalProperties"] is False
    pcc = schema["$defs"]["PccSpec"]["properties"]
    assert "default" not in pcc["ramp_mw_per_min"] and "inf" in pcc["ramp_mw_per_min"]["description"]
    assert pcc["ramp_window_s"]["default"] == 60.0


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_library_scenario_uses_only_schema_keys(path: Path) -> None:
    schema = scenario_schema()
    doc = tomllib.loads(path.read_text())
    assert set(doc) <= set(schema["properties"])
    assert set(schema["required"]) <= set(doc)
    site_props = schema["$defs"]["SiteSpec"]["properties"]
    assert set(doc["site"]) <= set(site_props)


# -- compare: the Pareto figure -------------------------------------------------------------------------------


def _row(name: str, lost: float, band: float, overhead: float = 0.0, ramp_s: float = 0.0) -> dict[str, Any]:
    s: dict[str, Any] = dict.fromkeys(SUMMARY_KEYS, 0.0)
    s.update(controller=name, breaker_trips=0, goodput_loss_power_pct=lost, band_rms_mw=band, band_hz=[0.1, 5.0])
    s.update(energy_overhead_pct=overhead, ramp_violation_s=ramp_s, demand_band_rms_mw=2.0)
    return s


def test_pareto_front_keeps_the_undominated_controllers_that_hold_the_limits() -> None:
    rows = [
        _row("none", 0.0, 1.5, ramp_s=30.0),  # best goodput but breaks the ramp limit: not on the front
        _row("a", 1.0, 0.2),
        _row("b", 2.0, 0.3),  # dominated by a
        _row("c", 5.0, 0.05),
        _row("d", 0.5, 0.9),
        _row("e", 1.0, 0.2),  # ties a: neither dominates
    ]
    assert pareto_front(rows) == ["d", "a", "e", "c"]
    assert pareto_front([_row("none", 0.0, 1.0, ramp_s=1.0)]) == []


def test_pareto_png(tmp_path: Path) -> None:
    rows = [_row("none", 0.0, 1.5, ramp_s=30.0), _row("a", 1.0, 0.2, 1.5), _row("c", 5.0, 0.05, 3.0)]
    compare_pareto_png(rows, tmp_path / "p.png")
    assert _png_size((tmp_path / "p.png").read_bytes()) == (900, 650)  # 9 × 6.5 in at 100 dpi


def test_compare_writes_and_links_the_pareto_figure(small: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    argv = ["compare", str(small), "--controllers", "none,dimmer", "--set", "duration_s=30", "--out", str(out)]
    assert main([*argv, "--quiet"]) == 0
    assert _png_size((out / "compare_pareto.png").read_bytes()) == (900, 650)
    md = (out / "compare.md").read_text()
    assert "![goodput lost against band RMS](compare_pareto.png)" in md
    rows = json.loads((out / "compare.json").read_text())
    front = pareto_front(rows)
    names = ", ".join(f"`{n}`" for n in front) or "none held them"
    assert f"Pareto front of the controllers that held the limits: {names}." in md
