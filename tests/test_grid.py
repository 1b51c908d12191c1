"""Grid side: the single-area frequency model against its closed forms, the GB replay, the import metrics."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from pydantic import ValidationError

from dimmer.errors import InputError
from gridsim.plant.grid import (
    FrequencyModel,
    FrequencyReplay,
    FrequencySpec,
    band_rms_w,
    effective_band_hz,
    load_frequency_csv,
    max_freq_dev_hz,
    max_rocof_hz_per_s,
    overlimit_s,
    pre_run_w,
    ramp_violation_s,
    ramp_w_per_min,
    steady_state_dev_hz,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
GB_FILE = DATA / "gridfreq_gb_neso_1s_2019-08-09_event.csv"


def _gb_file() -> Path:
    if not GB_FILE.is_file():
        pytest.skip(f"measured data {GB_FILE} is absent")
    return GB_FILE


# ---- frequency model ---------------------------------------------------------------------------------------
SPECS = [
    FrequencySpec(),
    FrequencySpec(nominal_hz=60.0, system_base_mw=2_000.0, inertia_h_s=3.0, damping_d_pu=2.0),
    FrequencySpec(inertia_h_s=9.0, droop_r_pu=0.04, damping_d_pu=0.8, governor_tg_s=0.3, turbine_tt_s=0.6),
]


@pytest.mark.parametrize(("spec", "dt_s"), [(s, dt) for s in SPECS for dt in (0.001, 0.01)] + [(FrequencySpec(), 0.1)])
def test_initial_rocof_closed_form(spec: FrequencySpec, dt_s: float) -> None:
    # rocof_hz_per_s is the mean over the last tick: right after a step it reads low by ~D·dt/(4H)
    # (0.5 % at dt 0.1 s with the defaults, 1.7 % with H 3 s, D 2): the coarse tick is checked on the defaults
    step_w = 150e6
    m = FrequencyModel(spec, load0_w=400e6, dt_s=dt_s)
    m.step(400e6 + step_w)
    dpl = step_w / (spec.system_base_mw * 1e6)
    expected = -dpl / (2.0 * spec.inertia_h_s) * spec.nominal_hz  # −ΔPL/(2H) pu/s, in Hz/s
    assert m.rocof_hz_per_s == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("spec", SPECS)
def test_steady_state_closed_form(spec: FrequencySpec) -> None:
    step_w = -80e6
    m = FrequencyModel(spec, load0_w=200e6, dt_s=0.1)
    for _ in range(3000):  # 300 s
        f = m.step(200e6 + step_w)
    dpl = step_w / (spec.system_base_mw * 1e6)
    expected = -dpl / (spec.damping_d_pu + 1.0 / spec.droop_r_pu) * spec.nominal_hz
    assert f - spec.nominal_hz == pytest.approx(expected, rel=0.01)
    assert m.dev_hz == pytest.approx(expected, rel=0.01)
    assert abs(m.rocof_hz_per_s) < 1e-6 * abs(expected)
    # the governor has picked up the load: ΔPm = ΔPL − D·Δf in pu at equilibrium
    _, pv, pm = m.state_pu
    assert pm == pytest.approx(dpl + spec.damping_d_pu * expected / spec.nominal_hz, rel=1e-6)
    assert pv == pytest.approx(pm, rel=1e-6)


def test_sign_conventions() -> None:
    spec = FrequencySpec()
    up = FrequencyModel(spec, load0_w=100e6, dt_s=0.1)
    down = FrequencyModel(spec, load0_w=100e6, dt_s=0.1)
    same = FrequencyModel(spec, load0_w=100e6, dt_s=0.1)
    f_up = [up.step(150e6) for _ in range(50)]
    f_down = [down.step(50e6) for _ in range(50)]
    f_same = [same.step(100e6) for _ in range(50)]
    assert all(f < 50.0 for f in f_up)
    assert all(f > 50.0 for f in f_down)
    assert f_same == [50.0] * 50
    assert up.freq_hz == f_up[-1] == 50.0 + up.dev_hz
    # linear: the rise after a drop mirrors the fall after a rise
    assert np.allclose(np.asarray(f_up) - 50.0, -(np.asarray(f_down) - 50.0), rtol=1e-12)


def test_discretisation_is_exact_across_dt() -> None:
    spec = FrequencySpec()
    rng = np.random.default_rng(7)
    loads = 300e6 + rng.uniform(-50e6, 50e6, size=200)  # piecewise constant over 0.1 s, 20 s in all
    coarse = FrequencyModel(spec, load0_w=300e6, dt_s=0.1)
    fine = FrequencyModel(spec, load0_w=300e6, dt_s=0.01)
    f_coarse = np.array([coarse.step(p) for p in loads])
    f_fine = np.array([fine.step(p) for p in np.repeat(loads, 10)])
    dev_c = f_coarse - 50.0
    dev_f = f_fine[9::10] - 50.0
    assert np.max(np.abs(dev_c)) > 1e-3  # something happened
    assert np.allclose(dev_c, dev_f, rtol=1e-9, atol=1e-12)


def test_extra_deviation_sits_on_top() -> None:
    spec = FrequencySpec()
    a = FrequencyModel(spec, 0.0, 0.1)
    b = FrequencyModel(spec, 0.0, 0.1)
    for i in range(20):
        fa = a.step(50e6)
        fb = b.step(50e6, extra_dev_hz=-0.01 * i)
        assert fb == pytest.approx(fa - 0.01 * i, abs=1e-12)
        assert b.model_dev_hz == a.model_dev_hz
    assert b.rocof_hz_per_s == pytest.approx(a.rocof_hz_per_s - 0.1, abs=1e-9)
    b.reset()
    assert b.state_pu == (0.0, 0.0, 0.0) and b.dev_hz == 0.0


def test_spec_rejects_unstable_and_unknown() -> None:
    with pytest.raises(ValidationError, match="unstable"):
        FrequencySpec(inertia_h_s=0.5, droop_r_pu=0.01)
    with pytest.raises(ValidationError):
        FrequencySpec(system_base_mw=0.0)
    with pytest.raises(ValidationError):
        FrequencySpec(inertia_s=5.0)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        FrequencyModel(FrequencySpec(), 0.0, 0.0)


# ---- measured frequency ------------------------------------------------------------------------------------
def test_gb_file_is_read() -> None:
    t, f = load_frequency_csv(_gb_file(), "scenario.toml", "grid.frequency.replay_csv")
    assert t.shape == f.shape == (360,)
    assert np.all(np.diff(t) == 1.0) and t[0] == 0.0
    assert f.min() == pytest.approx(48.787, abs=1e-9)  # the 9 Aug 2019 nadir
    assert t[np.argmin(f)] == 120.0
    assert f[0] == pytest.approx(50.045) and f[-1] == pytest.approx(50.089)
    # the measured RoCoF at 1 s resolution (largest 1 s step in the file: 0.151 Hz)
    assert max_rocof_hz_per_s(f, 1.0, 1.0) == pytest.approx(0.151, abs=1e-9)
    assert max_freq_dev_hz(f, 50.0) == pytest.approx(50.0 - 48.787, abs=1e-9)


def test_replay_is_the_absolute_record_to_the_sample() -> None:
    """Issue 12 item 3: the replay was f - f(first sample), 45 mHz off the record (nadir 48.742 for 48.787 Hz)."""
    t, f = load_frequency_csv(_gb_file(), "s.toml", "k")
    rp = FrequencyReplay(t, f, start_s=1000.0, nominal_hz=50.0)
    # every sample of the record, scalar and vectorised, is the measured frequency itself
    assert np.array_equal(50.0 + rp.dev_hz_array(1000.0 + t), 50.0 + (f - 50.0))
    assert max(abs(50.0 + rp.dev_hz(1000.0 + x) - y) for x, y in zip(t, f, strict=True)) < 1e-12
    ts = np.arange(700.0, 1800.0, 0.1)
    freq = 50.0 + rp.dev_hz_array(ts)
    assert freq.min() == pytest.approx(48.787, abs=1e-9)  # the measured nadir, at its sample
    assert ts[np.argmin(freq)] == pytest.approx(1120.0)
    assert np.allclose(rp.dev_hz_array(ts), [rp.dev_hz(x) for x in ts], atol=1e-12)


def test_replay_has_no_step_at_either_end() -> None:
    """The record ended with the deviation dropping to 0 in one tick (50.0437 -> 49.9997 Hz); now it relaxes to
    nominal first-order with settle_tau_s after the end (and leaves nominal the same way before the start)."""
    t, f = load_frequency_csv(_gb_file(), "s.toml", "k")
    tau = 60.0
    rp = FrequencyReplay(t, f, start_s=1000.0, nominal_hz=50.0, settle_tau_s=tau)
    end = 1000.0 + t[-1]
    dt = 0.1
    ts = np.arange(0.0, end + 10 * tau, dt)
    freq = 50.0 + rp.dev_hz_array(ts)
    steps = np.abs(np.diff(freq))
    inside = (ts[1:] > 1000.0) & (ts[1:] <= end)
    outside = ~inside
    # the largest tick-to-tick move outside the record: the relaxation's first tick, (f - 50)(1 - e^{-dt/tau})
    edge = max(abs(f[0] - 50.0), abs(f[-1] - 50.0)) * (1.0 - math.exp(-dt / tau))
    assert steps[outside].max() == pytest.approx(edge, rel=1e-6)
    assert steps[outside].max() < 0.2e-3  # 0.15 mHz, where the old end step was 44 mHz
    assert steps[outside].max() < 0.02 * steps[inside].max()  # far below the record's own moves
    # continuous at both edges, and back at nominal: within 1 % of the last deviation after 5 tau
    assert rp.dev_hz(end + 1e-9) == pytest.approx(f[-1] - 50.0, abs=1e-9)
    assert rp.dev_hz(1000.0 - 1e-9) == pytest.approx(f[0] - 50.0, abs=1e-9)
    assert rp.dev_hz(end + tau) == pytest.approx((f[-1] - 50.0) / math.e, rel=1e-12)
    assert abs(rp.dev_hz(end + 5 * tau)) < 0.01 * abs(f[-1] - 50.0)
    assert rp.dev_hz(1000.0 - 3 * tau) == pytest.approx((f[0] - 50.0) * math.exp(-3), rel=1e-12)


def test_replay_on_the_frequency_model_keeps_the_model_closed_forms() -> None:
    """The replay sits on top of the modelled deviation: a campus step during a replay still settles at
    -dP/(D + 1/R) above the record, and the replayed part is the record's deviation from nominal."""
    spec = FrequencySpec()
    dt = 0.1
    rp = FrequencyReplay(np.array([0.0, 100.0]), np.array([49.9, 49.9]), start_s=0.0, nominal_hz=spec.nominal_hz)
    m = FrequencyModel(spec, 0.0, dt)
    dp = 200e6
    for k in range(int(90.0 / dt)):
        f = m.step(dp, rp.dev_hz(k * dt))
    assert f - 49.9 == pytest.approx(steady_state_dev_hz(spec, dp), rel=1e-3)


def test_replay_interpolates_linearly() -> None:
    rp = FrequencyReplay(np.array([0.0, 1.0, 3.0]), np.array([50.0, 49.0, 50.0]), start_s=10.0, nominal_hz=50.0)
    assert rp.dev_hz(10.5) == pytest.approx(-0.5)
    assert rp.dev_hz(12.0) == pytest.approx(-0.5)
    assert rp.dev_hz(13.0) == pytest.approx(0.0)
    assert rp.duration_s == 3.0
    with pytest.raises(ValueError):
        FrequencyReplay(np.array([0.0, 0.0]), np.array([50.0, 50.0]), 0.0)
    with pytest.raises(ValueError):
        FrequencyReplay(np.array([0.0, 1.0]), np.array([50.0, 50.0]), 0.0, settle_tau_s=0.0)


def test_csv_crlf_and_lf(tmp_path: Path) -> None:
    for nl in ("\r\n", "\n"):
        p = tmp_path / "f.csv"
        p.write_bytes(nl.join(["index,frequency_hz", "0,50.0", "1,49.9", "2,49.95", ""]).encode())
        t, f = load_frequency_csv(p, "s.toml", "k")
        assert t.tolist() == [0.0, 1.0, 2.0] and f.tolist() == [50.0, 49.9, 49.95]
    t, _ = load_frequency_csv(p, "s.toml", "k", sample_s=0.5)
    assert t.tolist() == [0.0, 0.5, 1.0]


@pytest.mark.parametrize(
    ("text", "values", "sample_s", "t_s", "f_hz"),
    [
        # NESO: index,frequency_hz at 1 s, with its header, without it, or another header naming Hz
        ("index,frequency_hz\n0,50.045\n1,50.042\n", "frequency_hz", 1.0, [0, 1], [50.045, 50.042]),
        ("0,50.045\n1,50.042\n", "frequency_hz", 1.0, [0, 1], [50.045, 50.042]),
        ("time,f\n0,50.045\n1,50.042\n", "frequency_hz", 1.0, [0, 1], [50.045, 50.042]),
        # one value a line at a stated sample period (10 Hz), with and without a header
        ("50.0\n49.99\n49.98\n", "frequency_hz", 0.1, [0, 0.1, 0.2], [50.0, 49.99, 49.98]),
        ("frequency_hz\n50.0\n49.99\n49.98\n", "frequency_hz", 0.1, [0, 0.1, 0.2], [50.0, 49.99, 49.98]),
        # deviations in mHz, as operators publish them: with an index, alone, with or without a header
        ("index,deviation_mhz\n0,45\n2,-1213\n", "deviation_mhz", 0.5, [0, 1], [50.045, 48.787]),
        ("45\n-1213\n", "deviation_mhz", 1.0, [0, 1], [50.045, 48.787]),
        ("\ufeffdf_mhz\r\n45\r\n\r\n-1213\r\n", "deviation_mhz", 1.0, [0, 1], [50.045, 48.787]),
    ],
)
def test_accepted_formats(
    tmp_path: Path, text: str, values: Literal["frequency_hz", "deviation_mhz"], sample_s: float, t_s: list[float],
    f_hz: list[float],
) -> None:  # fmt: skip
    p = tmp_path / "f.csv"
    p.write_bytes(text.encode())
    t, f = load_frequency_csv(p, "s.toml", "k", sample_s=sample_s, values=values, nominal_hz=50.0)
    assert t == pytest.approx(t_s, abs=1e-12) and f == pytest.approx(f_hz, abs=1e-12)


@pytest.mark.parametrize(
    ("text", "values", "what"),
    [
        (
            "index,frequency_hz\n0,50\n1,abc\n",
            "frequency_hz",
            r"line 3: 2 comma-separated numbers, 'index,frequency_hz'",
        ),
        ("index,frequency_hz\n0,50\n1,50,7\n", "frequency_hz", "line 3: 2 comma-separated"),
        ("0,50\n1,50\n49.9\n", "frequency_hz", "line 3: 2 comma-separated"),  # the layout changed
        ("50\n50\n1,50\n", "frequency_hz", r"line 3: 1 comma-separated number, 'frequency_hz'"),
        ("index,frequency_hz\n0,50\n0,50\n", "frequency_hz", "line 3: an index above the previous"),
        ("index,frequency_hz\n0,50\n1,-50\n", "frequency_hz", "line 3: a frequency in Hz, the frequency within"),
        ("index,frequency_hz\n0,50\n1,nan\n", "frequency_hz", "line 3: a frequency in Hz"),
        ("index,frequency_hz\n0,50\ninf,50\n", "frequency_hz", "line 3: a finite index"),
        ("index,frequency_hz\n0,50\n", "frequency_hz", "at least two samples"),
        ("", "frequency_hz", "at least two samples"),
        # unit mix-ups: mHz read as Hz, Hz read as mHz, a header naming the other unit, a 60 Hz record
        ("0,45\n1,-1213\n", "frequency_hz", 'line 2: .*needs values = "deviation_mhz"'),  # 45 Hz is in range
        ("0,50045\n1,48787\n", "deviation_mhz", 'line 1: .*needs values = "frequency_hz"'),
        ("index,deviation_mhz\n0,45\n1,40\n", "frequency_hz", "line 1: a value column in frequency_hz"),
        ("index,frequency_hz\n0,50\n1,50\n", "deviation_mhz", "line 1: a value column in deviation_mhz"),
        ("0,60.01\n1,59.98\n", "frequency_hz", r"within 10% of the 50 Hz nominal \(45-55 Hz\)"),
        ("a,b,c\n0,50\n", "frequency_hz", "line 1: a header of 1 or 2 columns"),
    ],
)
def test_malformed_csv_gives_input_error(tmp_path: Path, text: str, values: Any, what: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(InputError, match=what) as exc:
        load_frequency_csv(p, "scen.toml", "events[0].path", values=values)
    msg = str(exc.value)
    assert msg.startswith(f"scen.toml: events[0].path: {p}")
    assert "\n" not in msg


def test_the_error_says_what_was_expected_not_what_the_file_holds(tmp_path: Path) -> None:
    p = tmp_path / "bad.csv"
    p.write_text("index,frequency_hz\n0,50\n1,SECRET-hunter2\n")
    with pytest.raises(InputError) as exc:
        load_frequency_csv(p, "s.toml", "k")
    assert "SECRET" not in str(exc.value) and "line 3" in str(exc.value)


def test_missing_csv_gives_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"scen.toml: grid.replay: an existing frequency record"):
        load_frequency_csv(tmp_path / "nope.csv", "scen.toml", "grid.replay")


def test_a_malformed_replay_fails_when_the_scenario_is_loaded(tmp_path: Path) -> None:
    """Not when the event fires minutes into the run: load_scenario reads the file with the event's keys."""
    from gridsim.scenario import load_scenario

    (tmp_path / "f.csv").write_text("45\n-1213\n")  # mHz deviations
    sc = tmp_path / "s.toml"
    base = (
        'name = "r"\nduration_s = 600\n[site]\ngpu = "gb300"\n[site.pcc]\nlimit_mw = 3.0\n[[site.levels]]\n'
        'level = "row"\ncount = 1\nrating_kw = 1500\n[[site.levels]]\nlevel = "rack"\ncount = 2\n'
        '[[events]]\nkind = "frequency_replay"\nat_s = 500\npath = "f.csv"\n'
    )
    sc.write_text(base)
    with pytest.raises(InputError, match=r"s.toml: events\[0\].path: .*f.csv line 2: .*deviation_mhz"):
        load_scenario(sc)
    sc.write_text(base + 'values = "deviation_mhz"\nsample_s = 0.5\n')
    ev = load_scenario(sc).scenario.events[0]
    assert ev.kind == "frequency_replay" and ev.values == "deviation_mhz" and ev.sample_s == 0.5
    with pytest.raises(InputError, match=r"events\[0\]\..*sample_s: Input should be greater than 0"):
        sc.write_text(base + "sample_s = 0\n")
        load_scenario(sc)


# ---- metrics -----------------------------------------------------------------------------------------------
def _held_ramp_by_convolution(p: np.ndarray, dt: float, window_s: float) -> np.ndarray:
    """The ramp written the long way for a site that stood at its first sample before the run: 2W of it, then
    the run, window means by convolution."""
    n = round(window_s / dt)
    ext = np.concatenate([np.full(2 * n, p[0]), p])
    means = np.convolve(ext, np.ones(n) / n, mode="valid")  # means[i]: the window ending at ext[i + n - 1]
    return (means[n + 1 : n + 1 + p.size] - means[1 : 1 + p.size]) / (n * dt) * 60.0


def test_ramp_metric_on_a_linear_ramp() -> None:
    dt = 0.1
    t = np.arange(0.0, 300.0, dt)
    slope_w_per_s = 200e3  # 12 MW/min
    p = 100e6 + slope_w_per_s * t
    r = ramp_w_per_min(p, dt, 60.0)
    n = 600
    # Two full windows in, the difference of window means is exactly the slope.
    assert np.allclose(r[2 * n - 1 :], slope_w_per_s * 60.0, rtol=1e-9)
    # Before that the windows reach back into the run's first 10 s reflected (a demand's unknown history): the
    # ramp is measured, never above the slope.
    assert np.all(np.abs(r) <= slope_w_per_s * 60.0 * (1 + 1e-9))
    over = ramp_violation_s(p, dt, 60.0, 10e6)
    assert over == pytest.approx(np.count_nonzero(r > 10e6 * (1 + 1e-6)) * dt)
    assert (t.size - 2 * n + 1) * dt <= over < t.size * dt
    assert ramp_violation_s(p, dt, 60.0, 12e6) == 0.0  # exactly at the limit: within the 1 ppm tolerance
    assert ramp_violation_s(-p, dt, 60.0, 10e6) == pytest.approx(over)  # |ramp|: down counts too
    assert ramp_violation_s(p, dt, 60.0, math.inf) == 0.0
    # The same ramp made by the controller on a flat demand: that part stood at its first value before the run,
    # so the ramp is the held one, measured from the first tick and growing to the slope.
    flat = np.full(t.size, 100e6)
    rc = ramp_w_per_min(p, dt, 60.0, reference_w=flat)
    assert np.allclose(rc, _held_ramp_by_convolution(p, dt, 60.0), rtol=1e-9, atol=1e-3)
    assert np.allclose(rc[2 * n - 1 :], r[2 * n - 1 :], rtol=1e-9)  # from 2W on, the run alone decides
    assert rc[0] == 0.0 and rc[1] > 0 and np.all(np.diff(rc[: 2 * n - 1]) > 0)


def test_ramp_metric_on_a_step_and_an_oscillation() -> None:
    dt = 0.1
    t = np.arange(0.0, 600.0, dt)
    step = np.where(t >= 100.0, 30e6, 0.0)
    r = ramp_w_per_min(step, dt, 60.0)
    assert r.max() == pytest.approx(30e6, rel=1e-9)  # a 30 MW step peaks at 30 MW per 60 s window
    assert t[np.argmax(r)] == pytest.approx(160.0, abs=dt)
    assert np.all(r[t < 100.0] == 0.0)
    # A 0.5 Hz swing of +-4 MW around a flat level is an oscillation, not a ramp, from the first tick although
    # the run starts at its peak (holding the first sample would read a 4 MW/min ramp)
    swing = 4e6 * np.sign(np.sin(2 * np.pi * 0.5 * t + 0.1))
    rs = ramp_w_per_min(swing, dt, 60.0)
    assert np.abs(rs[1199:]).max() < 0.05e6 and np.abs(rs).max() < 0.25e6
    # A step the controller makes at the first action is measured like the same step in mid-run: exactly on a
    # flat demand, within the swing's own error on a swinging one; a metric from 2W on would not see it at all.
    flat = np.full(t.size, 6.8e6)
    cut = np.where(t >= dt, 0.74e6, 0.0)
    r0 = ramp_w_per_min(flat - cut, dt, 60.0, reference_w=flat)
    assert r0.min() == pytest.approx(-0.74e6, rel=1e-9)
    assert t[np.argmin(r0)] == pytest.approx(60.0, abs=1.5 * dt)
    assert ramp_violation_s(flat - cut, dt, 60.0, 0.5e6, reference_w=flat) > 0.0
    r1 = ramp_w_per_min(swing + flat - cut, dt, 60.0, reference_w=swing + flat)
    assert r1.min() == pytest.approx(-0.74e6, abs=0.25e6)
    assert ramp_w_per_min(np.zeros(0), dt, 60.0).size == 0
    with pytest.raises(ValueError):
        ramp_w_per_min(flat, dt, 60.0, reference_w=flat[:-1])


def test_a_compensated_demand_event_is_not_a_ramp() -> None:
    """A crash 20 s in, filled by the storage so the grid stays flat, is no ramp: the history before the run is
    the demand's first 10 s, not a copy of the crash."""
    dt = 0.1
    t = np.arange(0.0, 300.0, dt)
    demand = np.where(t >= 20.0, 6.1e6, 15.4e6)
    grid = np.full(t.size, 15.0e6)
    assert np.abs(ramp_w_per_min(grid, dt, 60.0, reference_w=demand)).max() < 1e-3
    assert band_rms_w(grid, dt, reference_w=demand) < 1e-3


def test_pre_run_history_reflects_the_first_seconds() -> None:
    p = np.arange(5.0)
    assert pre_run_w(p, 12, 1.0).tolist() == [4, 3, 2, 1, 0, 1, 2, 3, 4, 3, 2, 1]  # oldest first, t = -k mirrors k
    ref = np.array([1.0, 2.0, 1.0, 2.0, 1.0])
    # the reference's swing (2, 1, 2 at t = -3, -2, -1), shifted by p - ref at the first tick (-1)
    assert pre_run_w(p, 3, 1.0, ref).tolist() == [1.0, 0.0, 1.0]
    long = np.arange(100.0)
    assert pre_run_w(long, 25, 1.0).max() == 9.0  # only the first PRE_RUN_S = 10 s (10 samples) are reflected
    assert pre_run_w(np.array([3.0]), 4, 1.0).tolist() == [3.0] * 4


def test_overlimit_seconds() -> None:
    p = np.array([1.0, 2.0, 3.0, 4.0, 5.0]) * 1e6
    assert overlimit_s(p, 0.5, 2.5e6) == 1.5
    assert overlimit_s(p, 0.5, 5e6) == 0.0
    assert overlimit_s(p, 1.0, np.array([0.0, 3.0, 2.0, 5.0, 4.0]) * 1e6) == 3.0


def test_band_rms_of_sines() -> None:
    dt = 0.01
    t = np.arange(0.0, 120.0, dt)
    a = 5e6
    inside = 80e6 + a * np.sin(2 * np.pi * 1.0 * t)
    assert band_rms_w(inside, dt, 0.1, 20.0) == pytest.approx(a / math.sqrt(2), rel=0.01)
    below = 80e6 + a * np.sin(2 * np.pi * 0.005 * t)
    assert band_rms_w(below, dt, 0.1, 20.0) < 0.01 * a
    dt_fast = 0.001
    tf = np.arange(0.0, 60.0, dt_fast)
    above = a * np.sin(2 * np.pi * 200.0 * tf + 0.3)
    assert band_rms_w(above, dt_fast, 0.1, 20.0) < 0.01 * a
    assert band_rms_w(a * np.sin(2 * np.pi * 5.0 * tf), dt_fast, 0.1, 20.0) == pytest.approx(a / math.sqrt(2), rel=0.01)


def test_band_rms_nyquist_clip_and_short_series() -> None:
    dt = 0.1  # Nyquist 5 Hz: the 0.1-20 Hz band becomes "above 0.1 Hz"
    assert effective_band_hz(dt) == (0.1, 5.0)
    t = np.arange(0.0, 200.0, dt)
    a = 1e6
    assert band_rms_w(a * np.sin(2 * np.pi * 4.0 * t), dt) == pytest.approx(a / math.sqrt(2), rel=0.01)
    assert band_rms_w(a * np.sin(2 * np.pi * 0.4 * t), dt, 0.1, 0.8) == pytest.approx(a / math.sqrt(2), rel=0.01)
    assert band_rms_w(a * np.sin(2 * np.pi * 3.0 * t), dt, 0.1, 0.8) < 0.01 * a  # inter-area band only
    assert band_rms_w(np.ones(20), dt) == 0.0  # too short to filter: 0.0 by definition
    short = a * np.sin(2 * np.pi * 1.0 * np.arange(0.0, 9.0, dt))  # under 1 / lo_hz = 10 s: not measurable
    assert band_rms_w(short, dt) == 0.0
    assert band_rms_w(a * np.sin(2 * np.pi * 1.0 * np.arange(0.0, 11.0, dt)), dt) > 0.5 * a
    # a step the controller makes at the first tick is a step into the run: measured within the zero-phase
    # filter's spread of the same step in mid-run, where a mirror of the whole series would shrink it to a spike
    t400 = np.arange(0.0, 400.0, dt)
    flat = np.full(t400.size, 10e6)
    middle = band_rms_w(flat - np.where(t400 >= 150.0, 0.74e6, 0.0), dt, reference_w=flat)
    first = flat - np.where(t400 >= dt, 0.74e6, 0.0)
    assert 0.7 * middle < band_rms_w(first, dt, reference_w=flat) <= middle
    assert band_rms_w(first, dt) < 0.5 * middle  # no reference: the run's own first seconds reflected
    assert 0.9 * middle < band_rms_w(flat - np.where(t400 >= 1.0, 0.74e6, 0.0), dt, reference_w=flat) <= middle
    # a demand swinging from its peak goes on swinging before the run: no switch-on is measured
    demand = 10e6 + 2e6 * np.cos(2 * np.pi * 0.5 * t400)
    assert band_rms_w(demand, dt, reference_w=demand) == pytest.approx(2e6 / math.sqrt(2), rel=1e-3)
    assert band_rms_w(np.sin(np.arange(100.0)), 1.0, 0.6, 2.0) == 0.0  # band above Nyquist
    assert band_rms_w(np.full(1000, 7e6), dt) == pytest.approx(0.0, abs=1e-6)  # DC is out of band
    with pytest.raises(ValueError):
        band_rms_w(np.zeros(100), dt, 1.0, 0.5)


def test_max_rocof_window() -> None:
    dt = 0.1
    f = 50.0 - 0.2 * np.arange(0.0, 10.0, dt)  # −0.2 Hz/s
    assert max_rocof_hz_per_s(f, dt, 0.5) == pytest.approx(0.2, rel=1e-9)
    f2 = f.copy()
    f2[50] -= 0.05  # one noisy sample: a 0.5 s window dilutes it, a one-sample window does not
    assert max_rocof_hz_per_s(f2, dt, 0.5) == pytest.approx(0.2 + 0.05 / 0.5, rel=1e-9)
    assert max_rocof_hz_per_s(f2, dt, 0.1) == pytest.approx(0.2 + 0.05 / 0.1, rel=1e-9)
    assert max_rocof_hz_per_s(f[:3], dt, 0.5) == 0.0
