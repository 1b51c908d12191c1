"""`gridsim compare` and the scenario library's smoke test."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from dimmer.control import controller_names
from gridsim import compare as compare_mod
from gridsim.cli import main
from gridsim.compare import FILES, compare, compare_csv, compare_png, parse_controllers
from gridsim.metrics import SUMMARY_KEYS
from gridsim.scenario import load_scenario

from .conftest import SCENARIOS, skip_without_shared_data

TIMING = {"controller_step_ms_p50", "controller_step_ms_p99", "sim_speed_x_realtime"}
LIBRARY = sorted(SCENARIOS.glob("*.toml"))

# Two rows of ten racks, two jobs of different priority, a battery and a curtailment after the first 60 s:
# small enough that every registered controller runs in a fraction of a second.
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
[site.storage.bess]
power_mw = 0.5
energy_mwh = 0.2
[[jobs]]
name = "a"
gpus = 640
priority = 5
[[jobs]]
name = "b"
gpus = 512
priority = 1
[[events]]
kind = "curtail"
at_s = 65
limit_mw = 2.0
over_s = 10
"""


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


def _untimed(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in TIMING}


def test_compare_writes_every_file_with_one_summary_per_controller(small: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", str(small), "--out", str(out), "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)

    names = controller_names()
    rows = json.loads((out / "compare.json").read_text())
    assert isinstance(rows, list) and len(rows) == len(names)
    assert all(tuple(r) == SUMMARY_KEYS for r in rows)
    assert sorted(r["controller"] for r in rows) == sorted(names)
    assert rows[0]["controller"] == "none"  # the baseline comes first
    assert {r["seed"] for r in rows} == {4}
    assert all(r["duration_s"] == pytest.approx(90) for r in rows)

    with (out / "compare.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    for line, row in zip(table, rows, strict=True):
        assert tuple(line) == SUMMARY_KEYS
        assert line["controller"] == row["controller"]
        assert int(line["breaker_trips"]) == row["breaker_trips"]
        assert float(line["band_rms_mw"]) == row["band_rms_mw"]  # written at full precision
        assert json.loads(line["band_hz"]) == row["band_hz"]

    md = (out / "compare.md").read_text()
    assert "![grid import of every controller](compare.png)" in md
    header = next(line for line in md.splitlines() if line.startswith("| metric |"))
    assert header == "| metric | " + " | ".join(f"`{r['controller']}`" for r in rows) + " |"
    assert "| breaker trips |" in md

    width, height = _png_size((out / "compare.png").read_bytes())
    assert width >= 1000 and height >= 200 * len(names)
    assert not list(tmp_path.glob(".cmp.*")), "the staging directory is removed"


def test_none_row_equals_gridsim_run(small: Path, tmp_path: Path) -> None:
    run_out, cmp_out = tmp_path / "run", tmp_path / "cmp"
    assert main(["run", str(small), "--controller", "none", "--seed", "11", "--out", str(run_out), "--quiet"]) == 0
    assert main(["compare", str(small), "--seed", "11", "--out", str(cmp_out), "--quiet"]) == 0
    single = json.loads((run_out / "summary.json").read_text())
    rows = {r["controller"]: r for r in json.loads((cmp_out / "compare.json").read_text())}
    assert _untimed(rows["none"]) == _untimed(single)
    assert rows["none"]["seed"] == 11


def test_every_controller_ran_on_the_same_plant(small: Path) -> None:
    results = compare(load_scenario(small), controller_names())
    assert [r.controller for r in results] == controller_names()
    assert all(r.summary and tuple(r.summary) == SUMMARY_KEYS for r in results)
    assert {r.seed for r in results} == {4}
    assert {r.site.n_racks for r in results} == {20}
    # `none` draws exactly its demand and leaves the battery idle: the reference the others are read against
    none = next(r for r in results if r.controller == "none")
    assert none.summary["grid_energy_mwh"] == pytest.approx(none.summary["demand_energy_mwh"], rel=1e-4)
    assert none.summary["goodput_loss_power_pct"] == 0.0


def test_progress_reports_each_controller_in_order(small: Path) -> None:
    calls: list[tuple[str, int, int, float]] = []
    names = ["none"]
    compare(load_scenario(small), names, progress=lambda n, i, k, f: calls.append((n, i, k, f)))
    assert calls and calls[-1] == ("none", 0, 1, 1.0)
    assert all(0.0 < f <= 1.0 for *_, f in calls)


def test_cli_progress_to_stderr_and_default_out_dir(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(small), "--controllers", "none", "--set", "duration_s=20"]) == 0
    assert (tmp_path / "out" / "small-compare" / "compare.json").is_file()
    cap = capsys.readouterr()
    assert "1/1 none" in cap.err and "100.0 %" in cap.err
    assert cap.out.splitlines()[0].startswith("controller") and "wrote out/small-compare/compare.json" in cap.out


def test_png_has_one_row_per_result(small: Path, tmp_path: Path) -> None:
    loaded = load_scenario(small, ["duration_s=30"])
    one = compare(loaded, ["none"], seed=1)
    three = one + compare(loaded, ["none"], seed=2) + compare(loaded, ["none"], seed=3)
    compare_png(one, tmp_path / "one.png")
    compare_png(three, tmp_path / "three.png")
    w1, h1 = _png_size((tmp_path / "one.png").read_bytes())
    w3, h3 = _png_size((tmp_path / "three.png").read_bytes())
    assert w1 == w3 >= 1000
    assert h3 - h1 == pytest.approx(2 * 230, abs=2)  # 2.3 in a row at 100 dpi
    assert (tmp_path / "three.png").stat().st_size > 30_000


def test_csv_writes_null_as_empty_and_lists_as_json() -> None:
    row = dict.fromkeys(SUMMARY_KEYS, 1.5) | {"controller": "x", "band_hz": [0.1, 5.0], "min_bess_soc_frac": None}
    header, line = compare_csv([row]).splitlines()
    cells = dict(zip(header.split(","), next(csv.reader([line])), strict=True))
    assert cells["min_bess_soc_frac"] == "" and cells["band_hz"] == "[0.1, 5.0]" and cells["goodput_pct"] == "1.5"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--controllers", "none,bogus"], "'bogus'"),
        (["--controllers", ","], "comma-separated"),
        (["--controllers", "none,none"], "once"),
        (["--seed", "-1"], "--seed"),
        (["--set", "duration_s=-5"], "duration_s"),
    ],
    ids=["unknown", "empty", "twice", "seed", "override"],
)
def test_bad_input_exits_2_and_writes_nothing(
    small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = main(["compare", str(small), "--out", str(tmp_path / "cmp"), *argv])
    except SystemExit as exc:  # a number out of its range (--seed -1) is refused as it is parsed
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("gridsim: ") and err.count("\n") == 1 and expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_bad_controller_parameter_fails_before_anything_runs(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_run(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a controller ran before every controller was checked")

    monkeypatch.setattr(compare_mod, "run", no_run)
    small.write_text(SMALL + "\n[controllers.none]\nbogus = 1\n")
    assert main(["compare", str(small), "--out", str(tmp_path / "cmp"), "--controllers", "none"]) == 2
    assert "bogus" in capsys.readouterr().err
    assert not (tmp_path / "cmp").exists()


def test_out_dir_that_is_a_file_is_bad_input(small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("keep me")
    assert main(["compare", str(small), "--out", str(blocker / "cmp"), "--controllers", "none"]) == 2
    assert "--out" in capsys.readouterr().err
    assert blocker.read_text() == "keep me"


def test_default_controllers_put_the_baseline_first() -> None:
    names = parse_controllers(None)
    assert names[0] == "none" and sorted(names) == controller_names()
    assert parse_controllers(" none ") == ["none"]


@pytest.mark.parametrize("path", LIBRARY, ids=[p.stem for p in LIBRARY])
def test_library_scenario_runs_for_a_minute(path: Path, tmp_path: Path) -> None:
    skip_without_shared_data(path)
    out = tmp_path / "run"
    assert main(["run", str(path), "--set", "duration_s=60", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert tuple(summary) == SUMMARY_KEYS
    assert summary["duration_s"] == pytest.approx(60)
    assert summary["peak_grid_mw"] > 0
