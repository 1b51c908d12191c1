"""The way out: the summary.json contract, computed from a SimResult.

Every key is defined in docs/models.md ("Metrics"); a key may be added, never renamed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gridsim.engine import SimResult
from gridsim.errors import ResultError
from gridsim.plant.grid import (
    band_rms_w,
    effective_band_hz,
    max_freq_dev_hz,
    max_rocof_hz_per_s,
    overlimit_s,
    ramp_violation_s,
    ramp_w_per_min,
)
from gridsim.ridethrough import voltage_summary

SUMMARY_KEYS = (
    "scenario",
    "controller",
    "seed",
    "duration_s",
    "gpus",
    "racks",
    "breaker_trips",
    "pcc_overlimit_s",
    "ramp_violation_s",
    "max_ramp_mw_per_min",
    "band_hz",
    "band_rms_mw",
    "demand_band_rms_mw",
    "peak_grid_mw",
    "grid_energy_mwh",
    "demand_energy_mwh",
    "energy_overhead_pct",
    "goodput_pct",
    "goodput_loss_power_pct",
    "min_bess_soc_frac",
    "min_bbu_soc_frac",
    "bess_equivalent_cycles",
    "max_freq_dev_hz",
    "max_rocof_hz_per_s",
    "controller_step_ms_p50",
    "controller_step_ms_p99",
    "sim_speed_x_realtime",
    "max_grid_step_mw",
    "bbu_equivalent_cycles",
    "bbu_cycles_per_day",
    "bbu_throughput_cycles_per_day",
    "min_bbu_ride_through_s",
    "min_voltage_pu",
    "voltage_violation_s",
    "load_lost_mw",
    "ride_through_violations",
    "max_breaker_heat_frac",
    "breaker_overload_s",
)

J_PER_MWH = 3.6e9
DAY_S = 86400.0
POWER_LOSSES = ("cap", "suspend", "trip")


def _finite(x: float) -> float | None:
    """JSON has no NaN or inf: an undefined metric is null."""
    return float(x) if math.isfinite(x) else None


# Series that may hold a non-finite value by contract, and which: the interconnect limit +inf (none set), the BBU
# state of charge NaN (a site with no BBUs). Every other recorded series must be finite.
_NON_FINITE_OK = {"pcc_limit_w": "inf", "bbu_soc_min_frac": "nan", "bbu_soc_mean_frac": "nan"}


def check_finite(res: SimResult) -> None:
    """Raise ResultError if a series the summary is computed from holds data it cannot judge.

    A NaN compares False with every limit: a grid import of NaN was 0 s over the interconnect limit, its peak null
    and its breakers never tripped -- a run that went wrong read as a run that held. One isfinite per series.
    """
    series = [(name, res.t_s, v) for name, v in res.tick.items()]
    series += [(f"period.{name}", res.period_t_s, v) for name, v in res.period.items()]
    for name, t_axis, v in series:
        finite = np.isfinite(v)
        if finite.all():
            continue
        bad = ~finite
        ok = _NON_FINITE_OK.get(name.removeprefix("period."))
        if ok == "inf":
            bad &= v != np.inf
        elif ok == "nan":
            bad &= ~np.isnan(v)
        rows = bad.reshape(bad.shape[0], -1).any(axis=1)  # a sample (tick or period) with any bad column
        if not rows.any():
            continue
        first = int(np.argmax(rows))
        value = float(v[first][bad[first]].flat[0]) if v.ndim > 1 else float(v[first])
        what = (
            f"is {value!r} at {int(np.count_nonzero(rows))} of {rows.size} samples "
            f"(first at t = {float(t_axis[first]):g} s)"
        )
        raise ResultError(res.scenario, res.controller, name, what)


def summarize(res: SimResult) -> dict[str, Any]:
    """The summary.json of a run (docs/models.md, "Metrics"); ResultError if its series hold non-finite data."""
    check_finite(res)
    site, dt = res.site, res.tick_s
    grid = res.tick["grid_w"]
    demand = res.tick["demand_w"]
    window = site.ramp_window_s
    # the ramp and the band count the controller's own steps from the first tick (demand is the reference)
    ramps = ramp_w_per_min(grid, dt, window, reference_w=demand)
    lo, hi = effective_band_hz(dt, *res.band_hz)

    acc = res.accounting
    allocated = float(acc["allocated"].sum()) if acc["allocated"].size else 0.0
    useful = float(acc["useful"].sum()) if acc["useful"].size else 0.0
    # clamp the rounding residue of the accounting (~1e-8 GPU-s) so a loss never reads as -0.0 %
    power_lost = max(sum(float(acc[k].sum()) for k in POWER_LOSSES), 0.0)
    demand_j = float(demand.sum()) * dt
    grid_j = float(grid.sum()) * dt
    overhead_j = float(res.tick["floor_burn_w"].sum()) * dt + res.storage["bess_loss_j"] + res.storage["bbu_loss_j"]

    freq = res.tick["freq_hz"]
    steps = res.step_ms[np.isfinite(res.step_ms)]
    bess_soc = res.tick["bess_soc_frac"]
    bbu_soc = res.period["bbu_soc_min_frac"]

    summary: dict[str, Any] = {
        "scenario": res.scenario,
        "controller": res.controller,
        "seed": res.seed,
        "duration_s": res.duration_s,
        "gpus": site.n_gpus,
        "racks": site.n_racks,
        "breaker_trips": len(res.trips),
        "pcc_overlimit_s": overlimit_s(grid, dt, res.tick["pcc_limit_w"]),
        "ramp_violation_s": ramp_violation_s(grid, dt, window, site.ramp_limit_w_per_min, reference_w=demand),
        "max_ramp_mw_per_min": float(np.max(np.abs(ramps))) / 1e6 if ramps.size else 0.0,
        "band_hz": [lo, hi],
        "band_rms_mw": band_rms_w(grid, dt, lo, hi, reference_w=demand) / 1e6,
        "demand_band_rms_mw": band_rms_w(demand, dt, lo, hi) / 1e6,
        "peak_grid_mw": float(grid.max()) / 1e6,
        "grid_energy_mwh": grid_j / J_PER_MWH,
        "demand_energy_mwh": demand_j / J_PER_MWH,
        "energy_overhead_pct": 100.0 * overhead_j / demand_j if demand_j > 0 else 0.0,
        "goodput_pct": 100.0 * useful / allocated if allocated > 0 else 100.0,
        "goodput_loss_power_pct": 100.0 * power_lost / allocated if allocated > 0 else 0.0,
        "min_bess_soc_frac": _finite(float(bess_soc.min())) if site.bess.energy_j > 0 else None,
        "min_bbu_soc_frac": _finite(float(np.nanmin(bbu_soc))) if bbu_soc.size else None,
        "bess_equivalent_cycles": res.storage["bess_equivalent_cycles"],
        "max_freq_dev_hz": max_freq_dev_hz(freq, res.nominal_hz),
        "max_rocof_hz_per_s": max_rocof_hz_per_s(freq, dt),
        "controller_step_ms_p50": float(np.percentile(steps, 50)) if steps.size else 0.0,
        "controller_step_ms_p99": float(np.percentile(steps, 99)) if steps.size else 0.0,
        "sim_speed_x_realtime": res.duration_s / res.wall_s if res.wall_s > 0 else math.inf,
    }
    summary["sim_speed_x_realtime"] = _finite(summary["sim_speed_x_realtime"])
    # steps the utility sees, from t = 0: the first tick's import is the site as it stood before the run
    summary["max_grid_step_mw"] = float(np.max(np.abs(np.diff(grid)), initial=0.0)) / 1e6
    # BBU wear: the worst rack's depth-weighted rainflow cycles, and the fleet's discharge throughput
    per_day = DAY_S / res.duration_s if res.duration_s > 0 else math.nan
    st = res.storage
    cycles = st.get("bbu_equivalent_cycles_max", math.nan)
    usable = st.get("bbu_usable_j", 0.0)
    summary["bbu_equivalent_cycles"] = _finite(cycles)
    summary["bbu_cycles_per_day"] = _finite(cycles * per_day)
    throughput = st["bbu_energy_out_j"] / usable * per_day if usable > 0 else math.nan
    summary["bbu_throughput_cycles_per_day"] = _finite(throughput)
    summary["min_bbu_ride_through_s"] = _finite(st.get("bbu_min_ride_through_s", math.nan))
    v_pu = res.voltage.v_pu if res.voltage is not None else None
    if v_pu is not None and not np.isfinite(v_pu).all():  # (the voltage is not a tick series: checked here)
        first = int(np.argmax(~np.isfinite(v_pu)))
        raise ResultError(
            res.scenario, res.controller, "pcc_voltage_pu", f"is {float(v_pu[first])!r} at t = {first * dt:g} s"
        )
    summary |= voltage_summary(res.voltage, dt, res.t_s.size)  # the PCC voltage (gridsim/ridethrough.py)
    # the breakers' heat: a site that trips nothing may still run a breaker above its rating for minutes
    summary["max_breaker_heat_frac"] = res.breakers.get("max_heat_frac", 0.0)
    summary["breaker_overload_s"] = res.breakers.get("overload_s", 0.0)
    assert tuple(summary) == SUMMARY_KEYS
    res.summary = summary
    return summary
