"""Traces where sites measure power: formats (nvidia-smi, DCGM/Prometheus, Redfish, PDU utilisation, csv), the level
map (no host or rectifier loss added twice), gaps (filled by a stated rule, counted, too long is an error) and the
idle -> idle, peak -> peak map, on the measured files in ../shared/data and the format fixtures in tests/data."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dimmer.errors import InputError
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import LevelSpec, PccSpec, SiteSpec
from gridsim.cli import main
from gridsim.plant.trace import fill_gaps, load_raw_trace
from gridsim.plant.trace_formats import RawTrace, parse_time
from gridsim.plant.trace_map import TraceFields, _unit, map_trace, trace_levels
from gridsim.plant.workload import JobSpec
from gridsim.scenario import load_scenario

from .conftest import MINIMAL_SCENARIO, SCENARIOS

DATA = Path(__file__).resolve().parent / "data"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TITANX = SHARED / "gpu_titanx_2gpu_ddp_gpt_train_nvsmi100ms_noburn_2025-12-10.csv"
PDU = SHARED / "pdu_power_google2019_cella_pdu6_5min.csv"


def _shared(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"measured trace {path} is absent (the ../shared/data folder beside the checkout)")
    return path


def _site(gpu: str = "gb300") -> SiteModel:
    spec = SiteSpec(
        gpu=gpu,
        pcc=PccSpec(limit_mw=1000),
        levels=[LevelSpec(level="row", count=2, rating_kw=5000), LevelSpec(level="rack", count=4)],
    )
    return build_site(spec, [JobSpec(name="t", racks=(0, 8), kind="trace", trace_path="x")])


def _levels(path: Path, site: SiteModel | None = None, **kw: Any) -> tuple[np.ndarray, float, Any]:
    spec = TraceFields(trace_path=str(path), **kw)
    return trace_levels(spec, site or _site(), "scn.toml", "jobs[0].trace_path", {})


# -- formats -----------------------------------------------------------------------------------------------------
FIXTURES = {
    "redfish_metricreport_node.json": ("redfish", (120, 1), 2, 1),
    "redfish_envmetrics_2nodes.jsonl": ("redfish", (60, 2), 0, 0),
    "dcgm_power.prom": ("dcgm-prometheus", (60, 2), 1, 1),
    "dcgm_power_range.json": ("dcgm-prometheus", (40, 2), 0, 0),
    "node_power_kw.csv": ("csv", (40, 1), 1, 1),
}


@pytest.mark.parametrize("name", list(FIXTURES))
def test_each_format_fixture_parses_and_counts_its_failed_reads(name: str) -> None:
    fmt, shape, failed, gaps = FIXTURES[name]
    raw, found = load_raw_trace(DATA / name, "auto", "s", "k")
    assert found == fmt
    assert raw.power_w.shape == shape
    power, stats = fill_gaps(raw, None, "linear")
    assert (stats.failed_reads, stats.gaps) == (failed, gaps)
    assert np.all(np.isfinite(power)) and power.min() > 0  # a failed read never became a zero


def test_redfish_failed_reads_are_interpolated_in_time() -> None:
    raw, _ = load_raw_trace(DATA / "redfish_metricreport_node.json", "auto", "s", "k")
    assert np.isnan(raw.power_w[40, 0]) and np.isnan(raw.power_w[41, 0])  # null and "0"
    lin, _ = fill_gaps(raw, None, "linear")
    a, b = raw.power_w[39, 0], raw.power_w[42, 0]
    np.testing.assert_allclose(lin[40:42, 0], [a + (b - a) / 3, a + 2 * (b - a) / 3])
    hold, _ = fill_gaps(raw, None, "hold")
    np.testing.assert_allclose(hold[40:42, 0], [a, a])


def test_iso_times_with_and_without_fractions_and_offsets() -> None:
    base = parse_time("2026-01-05T10:00:00Z")
    assert parse_time("2026-01-05T10:00:00.250Z") - base == 250_000
    assert parse_time("2026-01-05 11:00:00.5+01:00") - base == 500_000
    assert parse_time("2026-01-05T10:00:00") == base  # no offset: UTC
    assert parse_time("2026/01/05 10:00:01.000") - base == 1_000_000  # nvidia-smi's own form
    raw, _ = load_raw_trace(DATA / "node_power_kw.csv", "csv", "s", "k")
    np.testing.assert_allclose(raw.t_s[:3], [0.0, 2.5, 5.0])
    assert raw.power_w[0, 0] == pytest.approx(2396.0)  # kW in the header's unit


def test_dcgm_text_and_range_query_agree_on_the_gpus() -> None:
    text, _ = load_raw_trace(DATA / "dcgm_power.prom", "auto", "s", "k")
    rng, _ = load_raw_trace(DATA / "dcgm_power_range.json", "auto", "s", "k")
    assert text.channels == rng.channels == ("node-a/0", "node-a/1")
    assert text.t_s[-1] == pytest.approx(59.0) and rng.t_s[-1] == pytest.approx(585.0)


# -- the measured files ------------------------------------------------------------------------------------------
def test_google_pdu_month_parses_as_utilisation_of_a_rating() -> None:
    raw, fmt = load_raw_trace(_shared(PDU), "auto", "s", "k")
    assert fmt == "pdu-util" and raw.unit == "frac"
    assert raw.t_s.size == 8928  # 31 days of 5-minute samples
    assert raw.t_s[-1] == pytest.approx(31 * 86400 - 300)
    assert float(np.median(np.diff(raw.t_s))) == 300.0
    u = raw.power_w[:, 0]
    assert (u.min(), u.max()) == (0.612, 0.771)
    _, stats = fill_gaps(raw, None, "linear")
    assert (stats.failed_reads, stats.gaps) == (0, 0)


def test_pdu_utilisation_maps_to_rack_power_with_host_and_loss_taken_out_once() -> None:
    site = _site()
    level, step_s, st_ = _levels(_shared(PDU), site, trace_level="pdu")
    assert (st_.map, step_s, st_.clipped_frac) == ("absolute", 300.0, 0.0)
    # the model's rack AC power at the replayed per-GPU demand is the measured utilisation of the rack's full draw
    rack_w = site.rack_power_w(np.full(site.n_racks, level[0]))[0]
    full_w = site.gpus_per_rack * (site.gpu.rated_w + site.gpu.host_overhead_w) / site.rectifier_eff
    assert rack_w == pytest.approx(0.659 * full_w, rel=1e-9)
    # with the PDU's own rating and the racks it feeds: 0.659 of 1,000 kW over 8 racks
    level2, _, _ = _levels(PDU, site, trace_level="pdu", trace_rating_kw=1000.0, trace_racks=8)
    assert site.rack_power_w(np.full(site.n_racks, level2[0]))[0] == pytest.approx(0.659 * 1e6 / 8, rel=1e-9)


def test_titanx_trace_maps_idle_to_idle_and_peak_to_peak_with_nothing_clipped() -> None:
    site = _site("gb300")
    level, _, st_ = _levels(_shared(TITANX), site, trace_gpus=2, trace_rated_w=250.0)
    assert (st_.clipped_low, st_.clipped_high) == (0, 0)
    assert level.min() == pytest.approx(site.gpu.idle_w)  # its idle lead-in (17.2 W a GPU) is the preset's idle
    assert st_.anchors[0] == pytest.approx(17.165)
    # its peak (214.0 W, the mean of the two GPUs) keeps its share of its rating; the replay grid (the median step)
    # falls between samples, so the table's own maximum is within 0.3 % of it
    assert st_.targets_w[1] == pytest.approx(site.gpu.rated_w * 213.97 / 250.0)
    assert st_.targets_w[1] * 0.997 < level.max() <= st_.targets_w[1]
    # the map it replaced (trace / 250 W x 1,400 W, clipped to [idle, rated]) clipped 5.8 % of the samples at idle
    raw, _ = load_raw_trace(TITANX, "nvidia-smi", "s", "k", gpus=2)
    old = raw.power_w.mean(axis=1) / 250.0 * site.gpu.rated_w
    assert np.mean(old < site.gpu.idle_w) == pytest.approx(0.058, abs=0.001)


def test_a_node_trace_gets_no_second_host_or_rectifier_loss() -> None:
    """absolute map at node level: the model's 8-GPU node power at the replayed demand is the measured power."""
    site = _site("h100")
    spec = TraceFields(trace_path="x", trace_level="node", trace_map="absolute")
    x = np.array([3000.0, 6000.0, 8400.0])
    p, _, _ = map_trace(x, "node", "absolute", site, spec, None)
    node_w = 8 * (p + site.gpu.host_overhead_w) / site.rectifier_eff
    np.testing.assert_allclose(node_w, x)
    # the idle-peak map at node level sends the node's idle to the GPU's idle (the host comes back once, in the model)
    level, _, st_ = _levels(DATA / "redfish_metricreport_node.json", site)
    assert (st_.level, st_.map) == ("node", "idle-peak")
    assert level.min() == pytest.approx(site.gpu.idle_w) and level.max() == pytest.approx(site.gpu.rated_w)


# -- properties --------------------------------------------------------------------------------------------------
@given(
    st.lists(st.one_of(st.none(), st.floats(1.0, 2000.0)), min_size=2, max_size=60),
    st.sampled_from(["linear", "hold"]),
)
def test_gap_filling_never_invents_a_zero(values: list[float | None], rule: str) -> None:
    if all(v is None for v in values):
        values[0] = 5.0
    col = np.array([math.nan if v is None else v for v in values])
    raw = RawTrace(np.arange(col.size, dtype=np.float64), col[:, None], lambda i: f"f:{i}", ("GPU 0",))
    out, stats = fill_gaps(raw, math.inf, rule)
    good = col[np.isfinite(col)]
    assert np.all(out >= good.min()) and np.all(out <= good.max())
    assert np.array_equal(out[np.isfinite(col), 0], good)
    assert stats.failed_reads == int(np.isnan(col).sum())


@given(
    st.lists(st.floats(10.0, 5000.0), min_size=3, max_size=50, unique=True),
    st.sampled_from(["gpu", "node", "rack"]),
    st.sampled_from(["h100", "gb200", "gb300"]),
)
def test_idle_peak_map_sends_the_trace_idle_and_peak_to_the_presets_exactly(
    values: list[float], level: str, gpu: str
) -> None:
    site = _site(gpu)
    x = np.array(values)
    spec = TraceFields(trace_path="x")
    p, (lo, hi), targets = map_trace(x, level, "idle-peak", site, spec, None)
    assert (lo, hi) == (x.min(), x.max())
    assert targets == (site.gpu.idle_w, site.gpu.rated_w)
    assert p[np.argmin(x)] == pytest.approx(site.gpu.idle_w) and p[np.argmax(x)] == pytest.approx(site.gpu.rated_w)
    assert np.all(p >= site.gpu.idle_w - 1e-9) and np.all(p <= site.gpu.rated_w + 1e-9)  # nothing to clip


@given(st.floats(0.0, 1e6), st.sampled_from(["gpu", "node", "rack", "pdu"]))
def test_absolute_map_round_trips_through_the_model(x: float, level: str) -> None:
    site = _site()
    a, b, _ = _unit(level, site, TraceFields(trace_path="x"))
    p, _, _ = map_trace(np.array([x]), level, "absolute", site, TraceFields(trace_path="x"), None)
    assert a * p[0] + b == pytest.approx(x, rel=1e-12, abs=1e-6)


# -- scenarios and bad input -------------------------------------------------------------------------------------
def _scenario(tmp_path: Path, trace: str, extra: str = "", name: str = "trace.csv") -> Path:
    (tmp_path / name).write_text(trace)
    job = f'gpus = 256\nkind = "trace"\ntrace_path = "{name}"\n{extra}'
    p = tmp_path / "sc.toml"
    p.write_text(MINIMAL_SCENARIO.replace("gpus = 256", job))
    return p


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], sc: Path, *parts: str) -> str:
    before = {p.name for p in tmp_path.iterdir()}
    for cmd in (["validate", str(sc)], ["run", str(sc), "--quiet", "--out", str(tmp_path / "out")]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        for part in parts:
            assert part in err, err
    assert {p.name for p in tmp_path.iterdir()} == before  # nothing written
    return err


CSV_HEAD = "time,power_w\n"


def _csv(rows: list[tuple[str, str]]) -> str:
    return CSV_HEAD + "".join(f"{t},{v}\n" for t, v in rows)


ROWS = [(f"2026-01-05T10:00:{s:02d}Z", f"{500 + 10 * s}") for s in range(12)]
BAD = {
    "malformed line": (_csv(ROWS[:3]) + "2026-01-05T10:00:03Z\n", "trace.csv:5:", "2 comma-separated fields"),
    "non-numeric power": (_csv([*ROWS[:3], ("2026-01-05T10:00:03Z", "lots")]), "trace.csv:5:", "a power >= 0"),
    "negative power": (_csv([*ROWS[:3], ("2026-01-05T10:00:03Z", "-5")]), "trace.csv:5:", "a power >= 0"),
    "unknown unit": ("time,power [hp]\n2026-01-05T10:00:00Z,5\n", "trace.csv:1:", "unknown unit"),
    "non-monotonic": (_csv([*ROWS[:3], ("2026-01-05T09:00:00Z", "700")]), "trace.csv:5:", "never go backwards"),
    "bad timestamp": (_csv([*ROWS[:3], ("noon", "700")]), "trace.csv:5:", "ISO 8601"),
    "too-long gap": (_csv(ROWS[:3] + [(t, "0") for t, _ in ROWS[3:9]] + ROWS[9:]), "trace.csv:5:", "no gap longer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_trace_is_one_line_naming_file_and_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, where, expected = BAD[case]
    sc = _scenario(tmp_path, text, 'trace_level = "gpu"\ntrace_max_gap_s = 4')
    line = _refused(tmp_path, capsys, sc, f"{sc}: jobs[0].trace_path: ", where, expected)
    assert "lots" not in line and "hp" not in line  # what was expected, never what the file holds


def test_a_long_gap_passes_under_a_raised_limit_and_is_counted(tmp_path: Path) -> None:
    text = _csv(ROWS[:3] + [(t, "") for t, _ in ROWS[3:9]] + ROWS[9:])
    sc = _scenario(tmp_path, text, 'trace_level = "gpu"\ntrace_max_gap_s = 8\ntrace_fill = "hold"')
    loaded = load_scenario(sc)
    job = loaded.scenario.jobs[0]
    spec = job.model_copy(update={"trace_path": str(loaded.resolve(str(job.trace_path)))})
    _, _, st_ = trace_levels(spec, loaded.site(), "s", "k", {})
    assert (st_.gaps.failed_reads, st_.gaps.gaps, st_.gaps.longest_gap_s, st_.gaps.rule) == (6, 1, 7.0, "hold")


def test_a_csv_trace_must_say_where_it_was_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = _scenario(tmp_path, _csv(ROWS))
    _refused(tmp_path, capsys, sc, "jobs[0].trace_level", "gpu, node, rack or pdu")


def test_describe_reports_the_trace_gaps_and_map(capsys: pytest.CaptureFixture[str]) -> None:
    _shared(TITANX)
    assert main(["describe", str(SCENARIOS / "trace-hall.toml")]) == 0
    out = capsys.readouterr().out
    assert "nvidia-smi at gpu level" in out and "clipped 0 low, 0 high" in out


@given(st.datetimes(min_value=datetime(1990, 1, 1), max_value=datetime(2090, 1, 1)), st.booleans())
def test_iso_time_round_trips_to_the_microsecond(when: datetime, zulu: bool) -> None:
    stamp = when.replace(tzinfo=UTC)
    text = stamp.isoformat().replace("+00:00", "Z") if zulu else stamp.isoformat()
    assert parse_time(text) == (stamp - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def test_a_bad_redfish_or_dcgm_file_names_its_line_or_key(tmp_path: Path) -> None:
    cases = {
        "r.json": ('{"MetricValues": [\n  {"MetricValue": "5",\n', "r.json:3", "JSON"),
        "r2.json": (
            '{"MetricValues": [{"MetricProperty": "/redfish/v1/Chassis/1/Power#/PowerControl/0/PowerConsumedWatts",'
            ' "MetricValue": "-4", "Timestamp": "2026-01-05T10:00:00Z"}]}',
            "MetricValues[0].MetricValue",
            "a power in W >= 0",
        ),
        "d.prom": (
            'DCGM_FI_DEV_POWER_USAGE{gpu="0"} 245.5 1767607200000\nDCGM_FI_DEV_POWER_USAGE{gpu="0"} 246\n',
            "d.prom:2",
            "a timestamp in ms",
        ),
    }
    for name, (text, where, expected) in cases.items():
        (tmp_path / name).write_text(text)
        fmt = "dcgm-prometheus" if name.endswith(".prom") else "redfish"
        with pytest.raises(InputError) as info:
            load_raw_trace(tmp_path / name, fmt, "scn.toml", "jobs[0].trace_path")
        msg = str(info.value)
        assert where in msg and expected in msg, msg
