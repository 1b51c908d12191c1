"""Issue 15 item 1: a job carries its own throughput curve (points, a measured preset, or a profile file), and the
plant and the controller both use it; without one every job keeps the GPU preset's curve, to the bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.control import make_controller
from dimmer.control.allocation import cap_cost, plan_groups, priority_groups
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import JobPlacementSpec, LevelSpec, PccSpec, SiteSpec
from dimmer.throughput import THROUGHPUT_PRESETS, ThroughputCurve, curve_from_points
from gridsim.cli import main
from gridsim.plant.gpu import GpuActuationSpec, GpuBank
from gridsim.scenario import load_scenario

from .conftest import SHARED_DATA
from .test_dimmer_controller import _job_caps, _obs

FLAT = [[0.5, 0.95], [1.0, 1.0]]  # a job that hardly slows under a cap (memory-bound)
PROFILE = SHARED_DATA / "zeus_perseus_stage_profile_gpt3-175b_a100_sxm_bf16.csv"


def _site(curves: tuple[object, object] = (None, None), priorities: tuple[int, int] = (1, 1)) -> SiteModel:
    """One row of 4 GB300 racks rated 400 kW (a full row is over), two jobs of 2 racks each."""
    spec = SiteSpec(
        pcc=PccSpec(limit_mw=5.0, ramp_mw_per_min=60.0),
        spare_rack_frac=0.0,
        levels=[LevelSpec(level="row", count=1, rating_kw=400), LevelSpec(level="rack", count=4)],
    )
    jobs = [
        JobPlacementSpec(name=n, priority=p, racks=r, throughput_curve=c)  # type: ignore[arg-type]
        for n, p, r, c in zip(("a", "b"), priorities, ((0, 2), (2, 4)), curves, strict=True)
    ]
    return build_site(spec, jobs)


def test_without_a_curve_every_job_shares_the_gpu_presets_object() -> None:
    site = _site()
    assert all(c is site.gpu.throughput for c in site.job_throughput)
    assert site._own_curve_racks == ()
    frac = np.linspace(0.3, 1.2, site.n_racks)
    assert np.array_equal(site.rack_throughput_frac(frac), site.gpu.throughput(frac))
    # and the controller plans by priority alone, as before
    assert [g.tolist() for g in plan_groups(site)] == [g.tolist() for g in priority_groups(site.job_priority)]


def test_plant_runs_each_rack_on_its_jobs_curve() -> None:
    site = _site((FLAT, "a40-bloom-176b"))
    bank = GpuBank(site, GpuActuationSpec(tau_s=0.0))
    peak = np.full(site.n_racks, 1000.0)
    speed = bank.rack_speed_frac(peak, np.full(site.n_racks, 600.0))
    assert speed[:2].tolist() == pytest.approx([0.95 + 0.05 * 0.2] * 2)  # 0.6 on [[0.5, 0.95], [1, 1]]
    assert speed[2:].tolist() == pytest.approx(THROUGHPUT_PRESETS["a40-bloom-176b"](0.6).repeat(2).tolist())
    # the period path evaluates the same per-rack curves on a block of ticks
    block = np.tile(np.array([0.6, 0.7, 0.8, 0.9]), (3, 1))
    np.testing.assert_array_equal(site.rack_throughput_frac(block)[1], site.rack_throughput_frac(block[1]))


def test_controller_cuts_the_job_that_loses_least_first_within_a_priority() -> None:
    plain, curved = _site(), _site((FLAT, None))
    caps = {}
    for name, site in (("plain", plain), ("curved", curved)):
        ctrl = make_controller("dimmer", site)
        act = ctrl.step(_obs(site, 1.0, 1260.0, domain_thermal_frac=np.full(site.n_domains, np.nan)))
        caps[name] = _job_caps(site, act.rack_cap_w)
    assert caps["plain"]["a"] == caps["plain"]["b"] < plain.gpu.rated_w  # one priority, one curve: even cut
    assert caps["curved"]["a"] < caps["curved"]["b"]  # the flat-curve job gives first
    assert [g.tolist() for g in plan_groups(curved)] == [[0], [1]]
    # priority still comes first: a lower-priority job with the steep curve is cut before a flat one above it
    assert [g.tolist() for g in plan_groups(_site((FLAT, None), (2, 1)))] == [[1], [0]]


def test_scenario_keys_points_preset_and_profile(tmp_path: Path) -> None:
    (tmp_path / "prof.csv").write_text(
        "stage,instruction,frequency,time,energy\r\n"
        + "".join(f"0,forward,{f},{1.0 / s},{p / s}\r\n" for f, p, s in ((900, 0.5, 0.66), (1100, 0.77, 0.92),
                                                                       (1300, 0.9, 0.97), (1410, 1.0, 1.0)))
    )  # fmt: skip
    sc = tmp_path / "s.toml"
    sc.write_text(
        'name = "s"\nduration_s = 10\n[site]\ngpu = "h100"\ngpus_per_rack = 8\nactive_gpus_per_rack = 8\n'
        'spare_rack_frac = 0\n[site.pcc]\nlimit_mw = 1\n[[site.levels]]\nlevel = "rack"\ncount = 4\n'
        '[[jobs]]\nname = "p"\nracks = [0, 1]\nthroughput_curve = [[0.5, 0.7], [1.0, 1.0]]\n'
        '[[jobs]]\nname = "n"\nracks = [1, 2]\nthroughput_curve = "a40-bloom-176b"\n'
        '[[jobs]]\nname = "f"\nracks = [2, 3]\nthroughput_profile = "prof.csv"\n'
        '[[jobs]]\nname = "d"\nracks = [3, 4]\n'
    )
    site = load_scenario(sc).site()
    p, n, f, d = (site.job_curve(j) for j in range(4))
    assert p.points == [[0.5, 0.7], [1.0, 1.0]]
    assert n is THROUGHPUT_PRESETS["a40-bloom-176b"]
    assert float(f(0.77)) == pytest.approx(0.92, abs=0.02) and f.power_frac[0] == pytest.approx(0.5)
    assert d is site.gpu.throughput


@pytest.mark.parametrize(
    ("job", "says"),
    [
        ("throughput_curve = [[0.5, 0.9], [0.7, 0.8], [1.0, 1.0]]", "monotone"),
        ("throughput_curve = [[0.5, 0.9], [0.9, 0.95]]", "[1.0, 1.0]"),
        ('throughput_curve = "v100"', "preset"),
        ('throughput_profile = "missing.csv"', "throughput_profile"),
        ('throughput_curve = "a40-bloom-176b"\nthroughput_profile = "x.csv"', "at most one"),
    ],
)
def test_bad_curves_are_one_line_naming_file_and_key(
    job: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sc = tmp_path / "bad.toml"
    sc.write_text(
        'name = "bad"\nduration_s = 10\n[site]\ngpus_per_rack = 8\nactive_gpus_per_rack = 8\n[site.pcc]\n'
        f'limit_mw = 1\n[[site.levels]]\nlevel = "rack"\ncount = 2\n[[jobs]]\nname = "j"\ngpus = 8\n{job}\n'
    )
    assert main(["validate", str(sc)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.toml" in err and "jobs[0]" in err and says in err, err


def test_shared_perseus_profile_as_a_job_curve() -> None:
    if not PROFILE.is_file():
        pytest.skip(f"measured data {PROFILE} is absent (the checkout's parent holds shared/data)")
    spec = SiteSpec(pcc=PccSpec(limit_mw=5.0), levels=[LevelSpec(level="rack", count=2)])
    site = build_site(spec, [JobPlacementSpec(name="g", racks=(0, 2), throughput_profile=str(PROFILE))])
    curve = site.job_curve(0)
    assert curve is not site.gpu.throughput
    # the fit against the shipped table it was drawn from: within 2.5 points over the measured range
    p = np.linspace(0.5, 1.0, 51)
    assert np.max(np.abs(curve(p) - site.gpu.throughput(p))) <= 0.025


# ---- properties -----------------------------------------------------------------------------------------------
_point = st.tuples(st.floats(0.05, 0.999), st.floats(0.01, 0.999))


@st.composite
def _curves(draw: st.DrawFn) -> ThroughputCurve:
    raw = draw(st.lists(_point, min_size=1, max_size=8, unique_by=lambda t: round(t[0], 6)))
    ps = sorted({round(p, 6) for p, _ in raw})
    ts = sorted(draw(st.lists(st.floats(0.01, 1.0), min_size=len(ps), max_size=len(ps))))
    return curve_from_points("h", [*zip(ps, ts, strict=True), (1.0, 1.0)], source="hypothesis")


@settings(max_examples=60, deadline=None)
@given(_curves(), _curves())
def test_curves_monotone_bounded_and_the_same_for_plant_and_controller(
    c0: ThroughputCurve, c1: ThroughputCurve
) -> None:
    p = np.linspace(0.0, 1.5, 301)
    for c in (c0, c1):
        y = c(p)
        assert np.all(np.diff(y) >= 0.0) and np.all(y <= 1.0) and np.all(y >= 0.0)
        assert np.all(c(p[p >= c.power_frac[0]]) > 0.0)  # in (0, 1] from its lowest point up
    site = _site((c0.points, c1.points))
    assert [site.job_curve(j).points for j in range(2)] == [c0.points, c1.points]
    # the plant: a rack's throughput is its job's curve at the power it is held to
    bank = GpuBank(site, GpuActuationSpec(tau_s=0.0))
    frac = np.array([0.55, 0.8, 0.55, 0.8])
    speed = bank.rack_speed_frac(np.full(4, 1000.0), 1000.0 * frac)
    np.testing.assert_array_equal(speed, np.concatenate([c0(frac[:2]), c1(frac[2:])]))
    # the controller: the job whose curve loses less at the top gives first (one group where they cost the same)
    groups = [g.tolist() for g in plan_groups(site)]
    k0, k1 = cap_cost(site.job_curve(0)), cap_cost(site.job_curve(1))
    assert groups == ([[0, 1]] if k0 == k1 else [[0], [1]] if k0 < k1 else [[1], [0]])
