"""`gridsim sweep`: the grid, the results, the figures, resuming, bad sweep files and the Dask path."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from gridsim import sweep as sweep_mod
from gridsim.cli import main
from gridsim.engine import run
from gridsim.metrics import SUMMARY_KEYS, summarize
from gridsim.scenario import load_scenario
from gridsim.sweep import (
    FIGURE_METRICS,
    SweepPlan,
    SweepPoint,
    answers,
    connect,
    parquet_available,
    plan_sweep,
    result_columns,
    run_sweep,
    sweep_figure,
)

TIMING = {"controller_step_ms_p50", "controller_step_ms_p99", "sim_speed_x_realtime"}

# Two rows of ten racks; a 640-GPU job starts at 3 s, a step of about 0.7 MW; the ramp is measured over 2 s so that
# a 10 s run has whole windows. Each run takes a few hundredths of a second.
TINY = """
name = "tiny"
seed = 2
duration_s = 10
[site.pcc]
limit_mw = 2.5
ramp_mw_per_min = 2.0
ramp_window_s = 2
[[site.levels]]
level = "row"
count = 2
rating_kw = 1200
[[site.levels]]
level = "rack"
count = 10
[site.storage.bess]
power_mw = 0.5
energy_mwh = 0.2
[[jobs]]
name = "a"
gpus = 640
priority = 5
start_s = 3
"""

SWEEP = """
scenario = "scen/tiny.toml"
set = ["duration_s=10"]
[grid]
"site.storage.bess.energy_mwh" = [0.001, 0.1]
"site.pcc.ramp_mw_per_min" = [5, 60]
controller = ["none", "dimmer"]
"""

ENERGY, RAMP = "site.storage.bess.energy_mwh", "site.pcc.ramp_mw_per_min"


@pytest.fixture
def sweep_file(tmp_path: Path) -> Path:
    (tmp_path / "scen").mkdir()
    (tmp_path / "scen" / "tiny.toml").write_text(TINY)
    p = tmp_path / "sweep.toml"
    p.write_text(SWEEP)
    return p


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR", "a PNG starts with its IHDR chunk"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def _untimed(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in TIMING}


def _summaries(out: Path) -> dict[str, tuple[int, str]]:
    """run id -> (mtime_ns, text) of every summary.json under out/runs."""
    return {p.parent.name: (p.stat().st_mtime_ns, p.read_text()) for p in (out / "runs").glob("*/summary.json")}


def test_plan_is_the_product_of_the_grid_in_grid_order(sweep_file: Path) -> None:
    plan = plan_sweep(sweep_file)
    assert list(plan.axes) == [ENERGY, RAMP, "controller"]
    assert len(plan.points) == 8
    assert [tuple(p.values.values()) for p in plan.points[:3]] == [(0.001, 5, "none"), (0.001, 5, "dimmer"),
                                                                  (0.001, 60, "none")]  # fmt: skip
    p = plan.points[5]  # 0.1 MWh, 5 MW/min, dimmer
    assert p.controller == "dimmer"
    assert p.raw["site"]["storage"]["bess"]["energy_mwh"] == 0.1 and p.raw["site"]["pcc"]["ramp_mw_per_min"] == 5
    assert p.raw["duration_s"] == 10
    assert len({q.run_id for q in plan.points}) == 8
    assert plan.numeric_axes == [ENERGY, RAMP]
    # the id depends on the scenario: the same point of an edited scenario is another run
    (sweep_file.parent / "scen" / "tiny.toml").write_text(TINY.replace("seed = 2", "seed = 3"))
    assert plan_sweep(sweep_file).points[5].run_id != p.run_id


def test_sweep_writes_one_row_per_run_summaries_figures_and_report(
    sweep_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["sweep", str(sweep_file), "--out", str(out), "--workers", "2"]) == 0
    cap = capsys.readouterr()
    assert "8/8 runs" in cap.err and "100.0 %" in cap.err
    assert "8 runs: 8 ran, 0 reused" in cap.out and "2 local worker process(es)" in cap.out
    assert ("results.parquet (pyarrow)" if parquet_available() else "pyarrow is not installed") in cap.out

    plan = plan_sweep(sweep_file)
    with (out / "results.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 8
    assert list(table[0]) == result_columns(plan)
    assert result_columns(plan)[:4] == ["run_id", ENERGY, RAMP, "controller"]
    assert set(SUMMARY_KEYS) <= set(result_columns(plan))
    for line, point in zip(table, plan.points, strict=True):
        assert line["run_id"] == point.run_id
        assert float(line[ENERGY]) == point.values[ENERGY] and float(line[RAMP]) == point.values[RAMP]
        summary = json.loads((out / "runs" / point.run_id / "summary.json").read_text())
        assert tuple(summary) == SUMMARY_KEYS
        assert summary["controller"] == line["controller"] == point.controller
        assert float(line["ramp_violation_s"]) == summary["ramp_violation_s"]  # full precision
        assert json.loads((out / "runs" / point.run_id / "point.json").read_text())["grid"] == point.values
    # the step breaks a 5 MW/min limit with no control and holds a 60 MW/min one
    by = {(float(r[ENERGY]), float(r[RAMP]), r["controller"]): r for r in table}
    assert float(by[(0.1, 5, "none")]["ramp_violation_s"]) > 0
    assert float(by[(0.1, 60, "none")]["ramp_violation_s"]) == 0

    if parquet_available():
        import pandas as pd

        frame = pd.read_parquet(out / "results.parquet")
        assert list(frame.columns) == result_columns(plan) and len(frame) == 8
        assert frame["ramp_violation_s"].tolist() == [float(r["ramp_violation_s"]) for r in table]
    else:
        assert not (out / "results.parquet").exists()

    md = (out / "sweep.md").read_text()
    for m in FIGURE_METRICS:
        width, height = _png_size((out / "figures" / f"{m}.png").read_bytes())
        assert width >= 600 and height >= 250
        assert f"](figures/{m}.png)" in md
    assert "with none at pcc ramp_mw_per_min = 5: no bess energy_mwh in the grid" in md
    assert sum(line.startswith("| `") for line in md.splitlines()) == 8  # one table row per run
    assert not list(out.glob(".stage.*")), "the staging directory is removed"


def test_a_sweep_run_equals_a_single_run_with_the_same_overrides(sweep_file: Path, tmp_path: Path) -> None:
    plan = plan_sweep(sweep_file)
    outcome = run_sweep(plan, tmp_path / "out", workers=2)
    assert sorted(outcome.ran) == sorted(p.run_id for p in plan.points) and not outcome.failed
    point = next(p for p in plan.points if p.values == {ENERGY: 0.1, RAMP: 5, "controller": "dimmer"})
    scen = sweep_file.parent / "scen" / "tiny.toml"
    single = summarize(run(load_scenario(scen, ["duration_s=10", f"{ENERGY}=0.1", f"{RAMP}=5"]), controller="dimmer"))
    assert _untimed(outcome.summaries[point.run_id]) == _untimed(single)
    assert single["min_bess_soc_frac"] is not None


def _no_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The figures are tested on their own; tests about runs skip drawing them (0.2 s each)."""

    def stub(plan: SweepPlan, rows: Any, metric: str, path: Path) -> str:
        path.write_bytes(b"")
        return "heatmap"

    monkeypatch.setattr(sweep_mod, "sweep_figure", stub)


def test_an_interrupted_sweep_resumes_only_the_missing_run(
    sweep_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_figures(monkeypatch)
    out = tmp_path / "out"
    assert main(["sweep", str(sweep_file), "--out", str(out), "--workers", "1", "--quiet"]) == 0
    before = _summaries(out)
    assert len(before) == 8
    lost = plan_sweep(sweep_file).points[3].run_id
    (out / "runs" / lost / "summary.json").unlink()

    ran: list[str] = []
    real = sweep_mod.run_task

    def counting(raw: dict[str, Any], source: str, base_dir: str, controller: str) -> dict[str, Any]:
        ran.append(sweep_mod.run_id(raw, controller))
        return real(raw, source, base_dir, controller)

    monkeypatch.setattr(sweep_mod, "run_task", counting)
    assert main(["sweep", str(sweep_file), "--out", str(out), "--workers", "1"]) == 0
    assert ran == [lost]
    assert "8 runs: 1 ran, 7 reused" in capsys.readouterr().out
    after = _summaries(out)
    assert set(after) == set(before)
    for rid, (mtime, text) in before.items():
        if rid != lost:
            assert after[rid] == (mtime, text), "a finished run was not redone"
    assert _untimed(json.loads(after[lost][1])) == _untimed(json.loads(before[lost][1]))
    assert len(list((out / "results.csv").read_text().splitlines())) == 9

    # a summary cut short (not a whole summary) counts as not done
    (out / "runs" / lost / "summary.json").write_text('{"scenario": "tiny"')
    ran.clear()
    assert main(["sweep", str(sweep_file), "--out", str(out), "--workers", "1", "--quiet"]) == 0
    assert ran == [lost]


def test_a_failing_run_exits_1_and_keeps_the_others(
    sweep_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    real = sweep_mod.run_task

    def flaky(raw: dict[str, Any], source: str, base_dir: str, controller: str) -> dict[str, Any]:
        if controller == "dimmer" and raw["site"]["pcc"]["ramp_mw_per_min"] == 60:
            raise RuntimeError("boom")
        return real(raw, source, base_dir, controller)

    monkeypatch.setattr(sweep_mod, "run_task", flaky)
    assert main(["sweep", str(sweep_file), "--out", str(out), "--workers", "1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "2 of 8 runs failed" in err and "boom" in err and err.count("\n") == 1
    assert len(_summaries(out)) == 6
    assert not (out / "results.csv").exists(), "no results from a partial sweep"


BAD_SWEEPS = {
    "unknown-key-path": (
        SWEEP.replace(ENERGY, "site.storage.bess.energy_kwh"),
        'grid."site.storage.bess.energy_kwh": a key and value the scenario accepts',
    ),
    "empty-grid": ('scenario = "scen/tiny.toml"\n[grid]\n', "grid: at least one key"),
    "not-a-list": (SWEEP.replace("[5, 60]", "5"), 'grid."site.pcc.ramp_mw_per_min": a list of values'),
    "empty-list": (SWEEP.replace("[5, 60]", "[]"), "a non-empty list"),
    "repeated-value": (SWEEP.replace("[5, 60]", "[5, 5]"), "each value once"),
    "table-value": (SWEEP.replace("[5, 60]", "[{a = 1}]"), "numbers, strings or booleans"),
    "bad-controller": (SWEEP.replace('"dimmer"]', '"dimer"]'), "grid.controller: controller names"),
    "scenario-missing": (SWEEP.replace("scen/tiny.toml", "scen/nope.toml"), "scenario: an existing scenario file"),
    "no-scenario-key": (SWEEP.replace('scenario = "scen/tiny.toml"', ""), "scenario: Field required"),
    "unknown-top-key": ("bogus = 1\n" + SWEEP, "bogus: unknown key"),
    "out-of-range": (SWEEP.replace("[0.001, 0.1]", "[-1, 0.1]"), "energy_mwh = -1, site.pcc.ramp_mw_per_min = 5"),
    "bad-set": (SWEEP.replace('"duration_s=10"', '"duration_s=-3"'), "set[0]: a value the scenario accepts"),
    "set-and-grid": (SWEEP.replace('"duration_s=10"', '"site.pcc.ramp_mw_per_min=3"'), "that `set` does not also fix"),
    "job-does-not-fit": (SWEEP.replace("[grid]", '[grid]\n"jobs[0].gpus" = [640, 99999]'), 'grid."jobs[0].gpus"'),
    "syntax": (SWEEP + "\n[grid\n", "(syntax)"),
}


@pytest.mark.parametrize(("name"), list(BAD_SWEEPS))
def test_bad_sweep_file_exits_2_naming_the_key_and_writes_nothing(
    name: str, sweep_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text, expected = BAD_SWEEPS[name]
    sweep_file.write_text(text)

    def no_run(*args: Any) -> Any:
        raise AssertionError("a run started before every grid point was checked")

    monkeypatch.setattr(sweep_mod, "run_task", no_run)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["sweep", str(sweep_file), "--out", str(tmp_path / "out"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gridsim: {sweep_file}: "), err
    assert err.count("\n") == 1 and expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_bad_arguments_exit_2(sweep_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:  # out of its range (1..4096): refused as it is parsed
        main(["sweep", str(sweep_file), "--out", str(tmp_path / "o"), "--workers", "0"])
    assert info.value.code == 2 and "--workers" in capsys.readouterr().err
    assert main(["sweep", str(tmp_path / "none.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "an existing sweep file" in capsys.readouterr().err
    assert main(["sweep", str(sweep_file), "--out", str(tmp_path / "o"), "--dask", "x", "--workers", "2"]) == 2
    assert not (tmp_path / "o").exists()


def test_unreachable_dask_scheduler_is_bad_input() -> None:
    pytest.importorskip("distributed")
    with pytest.raises(sweep_mod.InputError, match="--dask"):
        sweep_mod._dask_client("tcp://127.0.0.1:9", timeout_s=0.5)
    assert connect(None) is None


def test_dask_local_cluster_runs_the_sweep(
    sweep_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    distributed = pytest.importorskip("distributed")
    _no_figures(monkeypatch)
    out = tmp_path / "out"
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=2, processes=False, protocol="tcp://", host="127.0.0.1", dashboard_address=None
    ) as cluster:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")  # a real socket, on loopback
        assert main(["sweep", str(sweep_file), "--out", str(out), "--dask", cluster.scheduler_address]) == 0
    assert "8 runs: 8 ran, 0 reused" in capsys.readouterr().out
    assert "Dask cluster" in (out / "sweep.md").read_text()
    plan = plan_sweep(sweep_file)
    local = sweep_mod.run_task(plan.points[5].raw, str(plan.scenario_path), str(plan.base_dir), "dimmer")
    remote = json.loads((out / "runs" / plan.points[5].run_id / "summary.json").read_text())
    assert _untimed(remote) == _untimed(local)
    assert len(_summaries(out)) == 8


# -- answers and figures on made-up results: the closed form of each -----------------------------------------


def _plan(axes: dict[str, list[Any]], rows: list[dict[str, Any]]) -> SweepPlan:
    import itertools

    points = []
    for i, combo in enumerate(itertools.product(*axes.values())):
        values = dict(zip(axes, combo, strict=True))
        points.append(SweepPoint(i, values, str(values.get("controller", "none")), {}, f"r{i}"))
    assert len(points) == len(rows)
    return SweepPlan("s.toml", "s", Path("x.toml"), "x", Path("."), (), axes, points)


def _row(values: dict[str, Any], ramp_s: float = 0.0, lost_pct: float = 0.0, trips: int = 0) -> dict[str, Any]:
    s: dict[str, Any] = dict.fromkeys(SUMMARY_KEYS, 0.0)
    s.update(breaker_trips=trips, ramp_violation_s=ramp_s, goodput_loss_power_pct=lost_pct, band_hz=[0.1, 5.0])
    s.update(min_bess_soc_frac=None)
    return {**s, **values}


def test_answer_is_the_smallest_size_that_holds_and_the_smallest_that_also_keeps_goodput() -> None:
    e, r = "site.storage.bess.energy_mwh", "site.pcc.ramp_mw_per_min"
    axes: dict[str, list[Any]] = {e: [0.5, 1, 2, 4], r: [1.5], "controller": ["none", "dimmer"]}
    #                   none                    dimmer
    table = {0.5: [(30.0, 0.0), (0.0, 40.0)], 1: [(30.0, 0.0), (2.0, 10.0)], 2: [(30.0, 0.0), (0.0, 5.0)],
             4: [(30.0, 0.0), (0.0, 0.5)]}  # fmt: skip
    rows = [
        _row({e: size, r: 1.5, "controller": c}, *table[size][i])
        for size in axes[e]
        for i, c in enumerate(axes["controller"])
    ]
    lines = answers(_plan(axes, rows), rows)
    assert lines == [
        "with none at pcc ramp_mw_per_min = 1.5: no bess energy_mwh in the grid (up to 4) holds the limits "
        "(at 4: 30.0 s over the ramp limit)",
        "with dimmer at pcc ramp_mw_per_min = 1.5: the smallest bess energy_mwh that holds the limits is 0.5, the "
        "smallest in the grid (goodput lost 40.00 %), though not at 1; the smallest that also loses under 1 % of "
        "goodput is 4 (0.50 %)",
    ]


def test_answer_without_a_numeric_axis_names_the_controllers_that_hold() -> None:
    axes: dict[str, list[Any]] = {"controller": ["none", "dimmer", "smoothing"]}
    rows = [_row({"controller": "none"}, trips=1), _row({"controller": "dimmer"}, lost_pct=2.0),
            _row({"controller": "smoothing"}, lost_pct=1.0)]  # fmt: skip
    (line,) = answers(_plan(axes, rows), rows)
    assert line.startswith("2 of 3 runs hold the limits (with dimmer; with smoothing)")
    assert line.endswith("the one that loses the least goodput is smoothing (1.00 %)")


def test_figure_kind_follows_the_grid_shape(tmp_path: Path) -> None:
    e, r = "a.energy_mwh", "b.ramp_mw_per_min"
    two: dict[str, list[Any]] = {e: [1, 2, 3], r: [1, 2], "controller": ["none", "dimmer"]}
    rows2 = [
        _row({e: x, r: y, "controller": c}, ramp_s=x * y) for x in two[e] for y in two[r] for c in two["controller"]
    ]
    one_panel: dict[str, list[Any]] = {e: [1, 2, 3], r: [1, 2]}
    rows1 = [_row({e: x, r: y}) for x in one_panel[e] for y in one_panel[r]]
    line: dict[str, list[Any]] = {e: [1, 2, 3], "controller": ["none", "dimmer"]}
    rows_l = [_row({e: x, "controller": c}) for x in line[e] for c in line["controller"]]
    bars: dict[str, list[Any]] = {"controller": ["none", "dimmer"]}
    rows_b = [_row({"controller": c}) for c in bars["controller"]]
    assert sweep_figure(_plan(two, rows2), rows2, "ramp_violation_s", tmp_path / "h2.png") == "heatmap"
    assert sweep_figure(_plan(one_panel, rows1), rows1, "ramp_violation_s", tmp_path / "h1.png") == "heatmap"
    assert sweep_figure(_plan(line, rows_l), rows_l, "ramp_violation_s", tmp_path / "l.png") == "lines"
    assert sweep_figure(_plan(bars, rows_b), rows_b, "min_bess_soc_frac", tmp_path / "b.png") == "bars"
    w2, h2 = _png_size((tmp_path / "h2.png").read_bytes())
    w1, h1 = _png_size((tmp_path / "h1.png").read_bytes())
    assert w2 > w1 + 200 and h2 == h1, "one panel per controller, side by side"
    for name in ("l.png", "b.png"):
        assert min(_png_size((tmp_path / name).read_bytes())) >= 300
