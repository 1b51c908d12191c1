"""`gridsim describe` and `gridsim schema`: a scenario as a facilities engineer reads it, and the scenario schema.

`describe(loaded)` renders the site (GPUs, racks, domains and ratings per level, oversubscription per level, the
storage), the workload (jobs and background) and the events as aligned text. Oversubscription of a domain is the sum
of the maximum draw of the racks under it (every active GPU at its rated power, spares idle, host overhead, through
the rectifier) over the domain's rating; a level shows the range over its domains.

`scenario_schema()` is the JSON Schema of `gridsim.scenario.Scenario` for editors (TOML language servers read JSON
Schema); a non-finite default (`ramp_mw_per_min = inf`) has no JSON form and is moved into the description.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from dimmer.site import SiteModel
from dimmer.siteconfig import LEVEL_ORDER
from gridsim.plant.trace_map import stats_text, trace_levels
from gridsim.plant.voltage import VoltageDipEvent
from gridsim.plant.workload import JobSpec
from gridsim.scenario import (
    CurtailEvent,
    DerateEvent,
    FrequencyReplayEvent,
    FrequencyStepEvent,
    JobEvent,
    LoadedScenario,
    Scenario,
)
from gridsim.utility import UtilityEventSpec

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


# -- formatting ----------------------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str, indent: str = "  ") -> str:
    """Columns padded to their widest cell; `align` has one letter per column, `l` or `r`."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align, strict=True)]
        return (indent + "  ".join(out)).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def fmt_power_w(w: float) -> str:
    if not math.isfinite(w):
        return "none"
    if abs(w) >= 1e6:
        return f"{w / 1e6:,.2f} MW"
    return f"{w / 1e3:,.1f} kW"


def _range(values: np.ndarray, fmt: Any) -> str:
    lo, hi = float(np.min(values)), float(np.max(values))
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)} – {fmt(hi)}"


def _ratio(x: float) -> str:
    return f"{x:.2f}"


def _pct(x: float) -> str:
    return f"{100 * x:g} %"


def _num(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.4g}"


# -- the pieces ----------------------------------------------------------------------------------------------


def oversubscription(site: SiteModel) -> np.ndarray:
    """Per domain: the sum of the maximum draw of its racks over its rating."""
    out: np.ndarray = site.domain_load_w(site.rack_max_w()) / site.domain_rating_w
    return out


def site_text(site: SiteModel) -> str:
    gpu = site.gpu
    active = site.rack_active_gpus
    lines = [
        f"Site: {site.n_gpus:,} {gpu.name} GPUs ({_num(gpu.rated_w)} W rated, caps down to {_num(gpu.min_cap_w)} W) "
        f"in {site.n_racks:,} racks of {site.gpus_per_rack} ({_range(active, _num)} running a job per rack); "
        f"rectifiers {_pct(site.rectifier_eff)}",
        f"Interconnect (PCC): {fmt_power_w(site.pcc_limit_w)} import limit; ramp limit "
        + (
            f"{site.ramp_limit_w_per_min / 1e6:g} MW/min over {site.ramp_window_s:g} s"
            if math.isfinite(site.ramp_limit_w_per_min)
            else "none"
        ),
        "",
    ]
    rack_max = site.domain_load_w(site.rack_max_w())
    osub = oversubscription(site)
    rows = []
    for lv in sorted(set(site.domain_level.tolist())):
        idx = np.flatnonzero(site.domain_level == lv)
        rows.append(
            [
                LEVEL_ORDER[lv],
                f"{idx.size:,}",
                _range(site.domain_rating_w[idx], fmt_power_w),
                _range(rack_max[idx], fmt_power_w),
                _range(osub[idx], _ratio),
            ]
        )
    lines.append(table(["level", "domains", "rating", "rack maxima under each", "oversubscription"], rows, "lrrrr"))
    lines.append(
        f"  rack maximum {fmt_power_w(float(site.rack_max_w().max()))} (every active GPU at {_num(gpu.rated_w)} W); "
        f"idle rack {fmt_power_w(float(site.rack_power_w(np.full(site.n_racks, gpu.idle_w)).max()))}"
    )
    lines += ["", storage_text(site)]
    return "\n".join(lines)


def storage_text(site: SiteModel) -> str:
    st, b = site.rack_storage, site.bess
    n = site.n_racks
    tray_j, tray_w = float(st.tray_energy_j.sum()), float(st.tray_power_w.sum())
    bbu_j, bbu_w = float(st.bbu_energy_j.sum()), float(st.bbu_power_w.sum())
    rows = [
        [
            "capacitor trays",
            f"{n:,}",
            f"{st.tray_energy_j[0] / site.gpus_per_rack:g} J per GPU, {st.tray_power_w[0] / 1e3:g} kW" if n else "–",
            f"{tray_j / 1e6:,.2f} MJ, {fmt_power_w(tray_w)}",
        ],
        [
            "rack BBUs",
            f"{n:,}",
            f"{st.bbu_power_w[0] / 1e3:g} kW, {st.bbu_energy_j[0] / 3.6e6:.3g} kWh" if n else "–",
            f"{bbu_j / 3.6e6:,.1f} kWh, {fmt_power_w(bbu_w)}; SoC {_pct(st.bbu_soc_min_frac)} – "
            f"{_pct(st.bbu_soc_max_frac)} (the floor: the least peak shaving leaves)",
        ],
    ]
    if b.energy_j > 0 and b.power_w > 0:
        usable = b.energy_j * max(b.soc_init_frac - b.soc_min_frac, 0.0) / 3.6e9
        rows.append(
            [
                "campus BESS",
                "1",
                f"{fmt_power_w(b.power_w)} / {b.energy_j / 3.6e9:g} MWh",
                f"round trip {_pct(b.round_trip_eff)}, SoC {_pct(b.soc_min_frac)} – {_pct(b.soc_max_frac)}, starts at "
                f"{_pct(b.soc_init_frac)} ({usable:.2f} MWh above its floor)",
            ]
        )
    else:
        rows.append(["campus BESS", "0", "none", "–"])
    return "Storage:\n" + table(["store", "units", "each", "campus"], rows, "lrll")


def _placement(site: SiteModel, j: int) -> tuple[str, str]:
    racks = np.flatnonzero(site.rack_job == j)
    spare = int(site.rack_is_spare[racks].sum())
    run = racks.size - spare
    contiguous = racks.size and int(racks[-1] - racks[0]) + 1 == racks.size
    where = f"{racks[0]}–{racks[-1]}" if contiguous else f"{racks.size} racks from {racks[0]}"
    return f"{run} + {spare}", where


def workload_text(loaded: LoadedScenario, site: SiteModel) -> str:
    sc = loaded.scenario
    gpu = site.gpu
    rows = []
    for j, job in enumerate(sc.jobs):
        run_spare, where = _placement(site, j)
        gpus = int(site.job_gpus[j])
        peak_w = job.peak_frac * gpu.rated_w
        swing_mw = gpus * peak_w * job.swing_frac / site.rectifier_eff / 1e6
        shape = (
            f"trace {job.trace_path}"
            if job.kind == "trace"
            else f"{_num(peak_w)} W, {_pct(job.swing_frac)} ({swing_mw:.2f} MW)"
        )
        ck = job.checkpoint
        checkpoint = (
            "none" if ck.mode == "none" else f"{ck.mode} every {_num(ck.interval_s)} s ({_num(ck.duration_s)} s)"
        )
        mtbi = f"{job.mtbi_gpu_h:,.0f} GPU-h ({gpus / job.mtbi_gpu_h:.2g}/h)" if job.mtbi_gpu_h is not None else "none"
        life = _life(job)
        rows.append(
            [
                job.name,
                f"{gpus:,}",
                run_spare,
                where,
                str(job.priority),
                shape,
                f"{job.iteration_s:g} s × {_pct(job.compute_frac)}" if job.kind == "synthetic" else "–",
                checkpoint,
                mtbi,
                life,
            ]
        )
    head = ["job", "GPUs", "racks run + spare", "racks", "priority", "peak per GPU, swing (MW)",
            "iteration × compute", "checkpoints", "MTBI (interruptions)", "runs"]  # fmt: skip
    idle = int(np.sum(site.rack_job < 0))
    bg = sc.background
    if idle == 0:
        background = "every rack holds a job"
    elif bg.kind == "idle":
        idle_w = float(site.rack_power_w(np.full(1, gpu.idle_w))[0])
        background = f"{idle:,} racks hold no job: idle, {fmt_power_w(idle_w)} each"
    else:
        background = (
            f"{idle:,} racks hold no job: inference at {_pct(bg.mean_frac)} of rated ± {_pct(bg.noise_frac)} "
            f"(τ {bg.noise_tau_s:g} s)"
        )
    body = table(head, rows, "lrrlrlllll") if rows else "  no jobs"
    traces = "".join(f"\n  {job.name}: {line}" for job, line in _trace_lines(loaded, site))
    return f"Workload: {len(sc.jobs)} job(s), {int(site.job_gpus.sum()):,} GPUs\n{body}\n  {background}{traces}"


def _trace_lines(loaded: LoadedScenario, site: SiteModel) -> list[tuple[JobSpec, str]]:
    """Each trace job's file as read: format, level, failed reads and gaps filled, the map, what was clipped."""
    out = []
    for i, job in enumerate(loaded.scenario.jobs):
        if job.kind == "trace" and job.trace_path is not None:
            spec = job.model_copy(update={"trace_path": str(loaded.resolve(job.trace_path))})
            _, _, stats = trace_levels(spec, site, loaded.source, f"jobs[{i}].trace_path", {})
            out.append((job, stats_text(stats)))
    return out


def _life(job: JobSpec) -> str:
    start = "running at 0 s" if job.start_s is None else f"starts {job.start_s:g} s"
    return start + (f", stops {job.stop_s:g} s" if job.stop_s is not None else "")


def events_text(loaded: LoadedScenario) -> str:
    events = sorted(loaded.scenario.events, key=lambda e: e.at_s)
    if not events:
        return "Events: none"
    rows = []
    for ev in events:
        if isinstance(ev, CurtailEvent):
            what = f"interconnect limit to {ev.limit_mw:g} MW over {ev.over_s:g} s"
        elif isinstance(ev, JobEvent):
            what = ", ".join(ev.jobs) if ev.jobs else "every job"
        elif isinstance(ev, DerateEvent):
            what = f"{ev.domain} rating × {ev.factor:g}"
        elif isinstance(ev, FrequencyStepEvent):
            what = f"{ev.load_mw:+g} MW elsewhere in the area"
        elif isinstance(ev, FrequencyReplayEvent):
            what = f"replay {ev.path}"
        elif isinstance(ev, UtilityEventSpec):
            what = utility_text(ev)
        elif isinstance(ev, VoltageDipEvent):
            level = f"{-ev.depth_pu:+g} pu" if ev.depth_pu is not None else f"to {ev.voltage_pu:g} pu"
            what = f"source voltage {level} for {ev.duration_s:g} s"
        else:  # pragma: no cover - the Event union is closed
            what = ""
        rows.append([f"{ev.at_s:g} s", ev.kind, what])
    return "Events:\n" + table(["at", "kind", "what"], rows, "rll")


def utility_text(ev: UtilityEventSpec) -> str:
    key = "limit_mw" if ev.intervals[0].limit_mw is not None else "target_mw"
    steps = " then ".join(f"{getattr(iv, key):g} MW for {iv.duration_s:g} s" for iv in ev.intervals[:4])
    more = f" (+{len(ev.intervals) - 4} intervals)" if len(ev.intervals) > 4 else ""
    what = "interconnect limit" if key == "limit_mw" else "load target"
    return f"{ev.event_id or 'utility'}: {what} {steps}{more}, ramp-up {ev.ramp_up_s:g} s, recovery {ev.recovery_s:g} s"


def describe(loaded: LoadedScenario) -> str:
    """The whole scenario as aligned text, ending with a newline."""
    sc = loaded.scenario
    site = loaded.site()
    desc = " ".join(sc.description.split())
    head = [
        f"{sc.name}: {loaded.source}",
        *([textwrap.fill(desc, width=116)] if desc else []),
        f"{sc.duration_s:g} s simulated at {sc.engine.tick_s:g} s ticks, control every {sc.engine.control_period_s:g} "
        f"s; seed {sc.seed}; controller {sc.controller.name}",
        "",
    ]
    return "\n".join([*head, site_text(site), "", workload_text(loaded, site), "", events_text(loaded)]) + "\n"


# -- the schema ----------------------------------------------------------------------------------------------


def _finite_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _finite_defaults(v) for k, v in node.items()}
        d = out.get("default")
        if isinstance(d, float) and not math.isfinite(d):
            del out["default"]
            note = f"Default: {'inf' if d > 0 else '-inf' if d < 0 else 'nan'} (TOML), i.e. none."
            out["description"] = f"{out['description']} {note}" if "description" in out else note
        return out
    if isinstance(node, list):
        return [_finite_defaults(v) for v in node]
    return node


def scenario_schema() -> dict[str, Any]:
    """The JSON Schema of a scenario file, strict JSON (no NaN or infinity)."""
    schema = _finite_defaults(Scenario.model_json_schema())
    return {"$schema": SCHEMA_DIALECT, "title": "gridsim scenario", **{k: v for k, v in schema.items() if k != "title"}}
