"""The run report: every figure written and readable, report.md's verdict, table and links, and the series the
figures draw checked against the summary.json contract they must agree with."""

from __future__ import annotations

import itertools
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gridsim import report
from gridsim.engine import SimResult, run
from gridsim.metrics import SUMMARY_KEYS, summarize
from gridsim.output import write_run
from gridsim.scenario import load_scenario
from tests.budget import examples

# Two rows of ten racks; row r1's breaker is rated 400 kW under about 1.1 MW of load, so it trips (UL 489,
# k = 1.2, tau = 180 s) after tau ln(r² / (r² − k²)) ≈ 40 s and takes job `b` down; a 10 s ramp window so that the
# ramp is measured from 20 s on; a battery and a curtailment so every figure has something to draw.
TRIPPING = """
name = "tiny-trip"
description = "A row breaker rated far below its load trips and takes a job down. The question: is it named?"
seed = 3
duration_s = 90
[site.pcc]
limit_mw = 2.6
ramp_mw_per_min = 0.5
ramp_window_s = 10
[[site.levels]]
level = "row"
count = 2
rating_kw = 1300
[[site.levels]]
level = "rack"
count = 10
[[site.overrides]]
domain = "r1"
rating_kw = 400
[site.storage.bess]
power_mw = 0.5
energy_mwh = 0.2
[[jobs]]
name = "a"
racks = [0, 10]
priority = 5
[[jobs]]
name = "b"
racks = [10, 20]
priority = 1
[jobs.checkpoint]
interval_s = 20
duration_s = 2
[[events]]
kind = "curtail"
at_s = 30
limit_mw = 2.2
over_s = 10
"""

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURE_FILES = [f for f, _, _ in report.FIGURES]


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE, "not a PNG signature"
    assert data[12:16] == b"IHDR", "a PNG starts with its IHDR chunk"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def _run(tmp: Path, text: str, name: str, controller: str = "none") -> tuple[SimResult, str]:
    path = tmp / f"{name}.toml"
    path.write_text(text)
    loaded = load_scenario(path)
    res = run(loaded, controller=controller)
    summarize(res)
    return res, loaded.scenario.description


@pytest.fixture(scope="module")
def tripped(tmp_path_factory: pytest.TempPathFactory) -> tuple[SimResult, Path, list[Path]]:
    tmp = tmp_path_factory.mktemp("report")
    res, description = _run(tmp, TRIPPING, "tiny-trip")
    out = tmp / "out"
    written = write_run(res, out, description=description)
    return res, out, written


def test_the_scenario_trips_where_it_was_built_to(tripped: tuple[SimResult, Path, list[Path]]) -> None:
    res, _, _ = tripped
    assert [d for _, d in res.trips] == ["r1"]
    # closed form ≈ 13 s at the row's mean load (2.6 x its rating), from the heat of carrying its rating
    assert 8.0 < res.trips[0][0] < 20.0


def test_every_png_is_written_and_readable(tripped: tuple[SimResult, Path, list[Path]]) -> None:
    _, out, written = tripped
    names = {p.name for p in written}
    assert {*FIGURE_FILES, "overview.png", "report.md", "summary.json", "timeseries.csv", "jobs.csv"} <= names
    for name in [*FIGURE_FILES, "overview.png"]:
        data = (out / name).read_bytes()
        width, height = _png_size(data)
        assert 1000 <= width <= 1300, (name, width)
        if name == "overview.png":
            assert 1100 <= height <= 1500, (name, height)
        else:
            assert 450 <= height <= 800, (name, height)  # one panel ≈ 506 px, two ≈ 704 px at 110 dpi
        assert len(data) > 10_000, f"{name} is nearly empty ({len(data)} bytes)"
    assert not list(out.parent.glob(".out.*")), "the staging directory is removed"


def test_report_has_verdict_table_and_a_link_per_png(tripped: tuple[SimResult, Path, list[Path]]) -> None:
    res, out, written = tripped
    md = (out / "report.md").read_text()
    lines = md.splitlines()
    assert lines[0] == "# tiny-trip — controller `none`, seed 3"
    assert "The question: is it named?" in md
    verdict = next(line for line in lines if line.startswith("**Limits"))
    assert verdict.startswith("**Limits NOT held: 1 breaker trip (r1 at ")
    assert "r0" not in verdict
    trip_s = float(re.search(r"r1 at ([\d.,]+) s", verdict).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert trip_s == pytest.approx(res.trips[0][0], abs=0.05)
    # the table: every contract key once, with its value as summary.json has it, and a unit where it has one
    for key in SUMMARY_KEYS:
        rows = [line for line in lines if line.startswith(f"| `{key}` |")]
        assert len(rows) == 1, key
    assert "| `breaker_trips` | 1 | trips |" in md
    assert re.search(r"\| `peak_grid_mw` \| [\d.]+ \| MW \|", md)
    links = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", md)
    pngs = sorted(p.name for p in written if p.suffix == ".png")
    assert sorted(links) == pngs
    # a caption under every figure
    for name in pngs:
        block = md.split(f"]({name})", 1)[1].lstrip("\n").splitlines()[0]
        assert block.startswith("*") and block.endswith("*") and len(block) > 40, name


def test_verdict_names_every_trip_with_its_time() -> None:
    summary = {"breaker_trips": 3, "pcc_overlimit_s": 0.0, "ramp_violation_s": 12.5}
    line = report.verdict(summary, [(1284.0, "h0/r2"), (3005.2, "h0/r2"), (77.0, "h0/r3")])
    assert line == (
        "Limits NOT held: 3 breaker trips (h0/r2 at 1,284 s, 3,005 s; h0/r3 at 77.0 s); "
        "12.5 s over the utility ramp limit."
    )
    clean = {"breaker_trips": 0, "pcc_overlimit_s": 0.0, "ramp_violation_s": 0.0}
    assert report.verdict(clean, []) == "Limits held."


def test_ramp_envelope_agrees_with_the_ramp_metric(tripped: tuple[SimResult, Path, list[Path]]) -> None:
    """grid.png's orange shading is exactly the samples summary.json counts as over the ramp limit."""
    res, _, _ = tripped
    mean, low, high = report.ramp_envelope_w(res)
    n = round(res.site.ramp_window_s / res.tick_s)
    assert np.isfinite(low).all() and np.isfinite(high).all()  # from the first tick, as the metric
    # from two whole windows on, the band is centred on the previous window's mean
    prev = np.convolve(res.tick["grid_w"], np.ones(n) / n, mode="valid")[:-n]
    assert np.allclose((low + high)[2 * n - 1 :] / 2, prev, rtol=1e-9)
    width_w = high - low
    assert np.allclose(width_w, 2 * res.site.ramp_limit_w_per_min / 60 * res.site.ramp_window_s)  # ± L·W
    tol = 1e-6 * res.site.ramp_limit_w_per_min
    ok = np.isfinite(low)
    outside = (mean[ok] < low[ok] - tol) | (mean[ok] > high[ok] + tol)
    assert res.summary["ramp_violation_s"] > 0  # the trip is a ramp
    assert np.count_nonzero(outside) * res.tick_s == pytest.approx(res.summary["ramp_violation_s"], abs=1e-9)


def test_goodput_curve_ends_at_goodput_pct(tripped: tuple[SimResult, Path, list[Path]]) -> None:
    """The cumulative curve takes rolled-back work off when it is lost: it must end where the accounting does."""
    res, _, _ = tripped
    rate, campus, cumulative = report.goodput_series(res)
    assert rate.shape == res.period["job_state"].shape
    assert res.summary["goodput_pct"] < 95  # job b fell and lost work
    assert cumulative[-1] * 100 == pytest.approx(res.summary["goodput_pct"], abs=1.0)
    assert np.nanmin(campus) < 0.6  # while b is down, only a works: about half the GPUs
    assert np.all((rate[np.isfinite(rate)] >= 0) & (rate[np.isfinite(rate)] <= 1))


def test_most_stressed_domain_is_the_tripped_one(tripped: tuple[SimResult, Path, list[Path]]) -> None:
    res, _, _ = tripped
    cols, ratio = report.stressed_domains(res)
    names = [res.site.domain_name[res.recorded_domains[c]] for c in cols]
    assert names[0] == "r1" and len(names) == min(report.TOP_DOMAINS, res.recorded_domains.size)
    peaks = np.nanmax(ratio[:, cols[1:]], axis=0)
    assert np.all(np.diff(peaks) <= 0)  # the rest by falling peak load over rating


def test_limits_held_says_so_with_the_margins(tmp_path: Path) -> None:
    calm = TRIPPING.replace('domain = "r1"\nrating_kw = 400', 'domain = "r1"\nrating_kw = 1300')
    calm = calm.replace("ramp_mw_per_min = 0.5", "ramp_mw_per_min = 50").replace("limit_mw = 2.2", "limit_mw = 2.5")
    res, _ = _run(tmp_path, calm, "calm")
    assert not res.trips and res.summary["pcc_overlimit_s"] == 0 and res.summary["ramp_violation_s"] == 0
    md = report.report_md(res, figures=[report.ReportFigure("grid.png", "Grid", "a caption")])
    assert "**Limits held: no breaker trips" in md
    assert f"against {res.site.pcc_limit_w / 1e6:g} MW" in md
    assert "![Grid](grid.png)" in md and "*a caption*" in md


def test_legacy_report_md_shows_the_overview(tripped: tuple[SimResult, Path, list[Path]]) -> None:
    res, _, _ = tripped
    md = report.report_md(res, "overview.png")
    assert "![Overview](overview.png)" in md and md.count("![") == 1


def test_nothing_is_written_when_a_figure_fails(
    tripped: tuple[SimResult, Path, list[Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res, _, _ = tripped

    def broken(res: SimResult, path: Path) -> str:
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "FIGURES", (*report.FIGURES[:2], ("broken.png", "Broken", broken)))
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="disk full"):
        write_run(res, out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory left behind


def test_write_run_refuses_an_unsummarized_result(tripped: tuple[SimResult, Path, list[Path]], tmp_path: Path) -> None:
    res, _, _ = tripped
    bare = SimResult(**{**res.__dict__, "summary": {}})
    with pytest.raises(ValueError, match="summarize"):
        write_run(bare, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_trailing_mean_is_a_moving_average() -> None:
    x = np.arange(10.0) ** 2
    got = report.trailing_mean(x, 3)
    assert np.isnan(got[:2]).all()
    assert np.allclose(got[2:], np.convolve(x, np.ones(3) / 3, mode="valid"))
    assert np.isnan(report.trailing_mean(np.ones(2), 3)).all()


@settings(max_examples=examples(50), deadline=None)
@given(st.lists(st.booleans(), max_size=60))
def test_episodes_cover_exactly_the_true_samples(mask: list[bool]) -> None:
    runs = report.episodes(np.asarray(mask, dtype=bool))
    covered = np.zeros(len(mask), dtype=bool)
    for first, last in runs:
        assert first <= last and not covered[first : last + 1].any()
        covered[first : last + 1] = True
    assert covered.tolist() == mask
    # maximal runs: each is bounded by False or the ends, and they come in time order
    assert all(b[0] > a[1] + 1 for a, b in itertools.pairwise(runs))


def test_time_axis_picks_the_unit_of_the_span() -> None:
    for span, label, scale in ((120.0, "time [s]", 1.0), (3600.0, "time [min]", 60.0), (86400.0, "time [h]", 3600.0)):
        t = np.linspace(0.0, span, 5)
        scaled, got = report.time_axis(t)
        assert got == label and np.allclose(scaled, t / scale)


def test_spells_merge_excursions_closer_than_the_gap() -> None:
    mask = np.asarray([1, 0, 1, 0, 0, 0, 1, 1, 0], dtype=bool)
    assert report.episodes(mask) == [(0, 0), (2, 2), (6, 7)]
    assert report.spells(mask, 2) == [(0, 2), (6, 7)]
    assert report.spells(mask, 4) == [(0, 7)]
    assert report.spells(np.zeros(4, dtype=bool), 3) == []


BARE = """
name = "bare"
duration_s = 3
[site.pcc]
limit_mw = 1.0
[[site.levels]]
level = "rack"
count = 4
"""


def test_a_bare_site_still_gets_every_figure(tmp_path: Path) -> None:
    """No jobs, no battery, no ramp limit, shorter than a control period's worth of windows: nothing to fail on."""
    res, _ = _run(tmp_path, BARE, "bare")
    written = write_run(res, tmp_path / "out")
    pngs = [p for p in written if p.suffix == ".png"]
    assert sorted(p.name for p in pngs) == sorted([*FIGURE_FILES, "overview.png"])
    for p in pngs:
        width, _ = _png_size(p.read_bytes())
        assert width >= 1000
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**Limits held:" in md and "no ramp limit" in md
