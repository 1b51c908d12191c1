"""Every controller on every site in scenarios/sites/ (sites dimmer was not tuned on; issue #11), judged by the goals.

    python3 bench/site_suite.py                      # every site, every controller, on all cores
    python3 bench/site_suite.py --only bare-racks    # one site (a comma list, or --only repeated)
    python3 bench/site_suite.py --jobs 1 --out out/site-suite   # serially; also write site_suite.md / .json
    python3 bench/site_suite.py --dir scenarios --seed 1        # the library, at another seed than its own

Each (site, controller) pair is one `gridsim.compare.compare` run (the scenario's own seed, so every controller sees
the same jobs, jitter and events), summarised with the summary.json contract; pairs run in parallel processes.
Prints, per site, a markdown table (one row per controller) and a verdict line for `dimmer` against the issue's goals:

  1. no breaker trips;
  2. 0 s over the interconnect limit;
  3. ramp violations no worse than any baseline (the least `ramp_violation_s` of the baselines);
  4. goodput lost to power management (`goodput_loss_power_pct`) no more than the best baseline that holds every
     limit (0 trips, 0 s over the interconnect limit, and ramp violations no worse than the best baseline's);
  5. energy overhead no more than max(1 %, the least a limit-holding baseline burns);
  6. where the summary has them: rack BBUs within 1 depth-weighted cycle a day (`bbu_cycles_per_day`) and
     >= 60 s of ride-through left (`min_bbu_ride_through_s`), or, where the BBUs as the site sized them hold less
     than 60 s with no controller at all (`none`: backup only), no less than they hold there: what is "left" is
     what the controller has not spent, and no controller can leave more than the storage holds (slow-rl's
     12 kW / 0.2 kWh shelves carry its ~110 kW racks for 6.5 s when full).

A benchmark: it reports, it never passes or fails (exit status 0 unless a site cannot be loaded or run: 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

# one process per core; keep numpy's own threads from competing with them (numpy is imported later, in the runs)
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

REPO = Path(__file__).resolve().parents[1]
SITES = REPO / "scenarios" / "sites"

EPS = 1e-9  # float noise; everything else is compared exactly
BBU_CYCLES_PER_DAY_GOAL = 1.0
BBU_RIDE_THROUGH_GOAL_S = 60.0

# (summary key, column heading, format); the keys after the first block are printed only where the summary has them
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("breaker_trips", "trips", "{:.0f}"),
    ("pcc_overlimit_s", "s over limit", "{:,.1f}"),
    ("ramp_violation_s", "s over ramp", "{:,.1f}"),
    ("max_ramp_mw_per_min", "max ramp MW/min", "{:.3g}"),
    ("goodput_pct", "goodput %", "{:.2f}"),
    ("goodput_loss_power_pct", "lost to power mgmt %", "{:.3g}"),
    ("energy_overhead_pct", "energy overhead %", "{:.3g}"),
    ("band_rms_mw", "band RMS MW", "{:.3g}"),
    ("demand_band_rms_mw", "demand band RMS MW", "{:.3g}"),
    ("peak_grid_mw", "peak grid MW", "{:.4g}"),
    ("min_bess_soc_frac", "min BESS SoC", "{:.3f}"),
    ("min_bbu_soc_frac", "min BBU SoC", "{:.3f}"),
)
OPTIONAL_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("max_grid_step_mw", "max grid step MW", "{:.3g}"),
    ("bbu_cycles_per_day", "BBU cycles/day", "{:.3g}"),
    ("bbu_throughput_cycles_per_day", "BBU throughput cycles/day", "{:.3g}"),
    ("min_bbu_ride_through_s", "min BBU ride-through s", "{:.3g}"),
    ("breaker_overload_s", "s a breaker above its rating's heat", "{:,.0f}"),
)


# -- running -------------------------------------------------------------------------------------------------


def site_paths(only: list[str], folder: Path = SITES) -> list[Path]:
    paths = sorted(folder.glob("*.toml"))
    if not paths:
        raise SystemExit(f"site_suite: --dir: no scenario (*.toml) in {folder}")
    if not only:
        return paths
    by_name = {p.stem: p for p in paths}
    unknown = [n for n in only if n not in by_name]
    if unknown:
        raise SystemExit(f"site_suite: --only: no site {unknown[0]!r} in {folder} (have: {', '.join(by_name)})")
    return [by_name[n] for n in only]


def run_pair(path: str, controller: str, seed: int | None) -> dict[str, Any]:
    """One controller on one site: its summary dict, the wall time, or the error that stopped it."""
    from gridsim.compare import compare, summaries
    from gridsim.scenario import load_scenario

    t0 = time.perf_counter()
    try:
        loaded = load_scenario(path)
        summary = summaries(compare(loaded, [controller], seed=seed))[0]
    except Exception as exc:  # reported in the table; one broken site must not hide the others
        return {"path": path, "controller": controller, "error": f"{type(exc).__name__}: {exc}"}
    return {"path": path, "controller": controller, "summary": summary, "wall_s": time.perf_counter() - t0}


def cost_hint(path: Path) -> float:
    """Simulated ticks x racks, roughly: the longest runs are started first so the pool ends together."""
    import tomllib

    with path.open("rb") as f:
        raw = tomllib.load(f)
    tick = float(raw.get("engine", {}).get("tick_s", 0.1))
    racks = 1
    for level in raw.get("site", {}).get("levels", []):
        racks *= int(level.get("count", 1))
    return float(raw.get("duration_s", 0.0)) / tick * (1.0 + racks / 200.0)


def run_all(paths: list[Path], controllers: list[str], jobs: int, seed: int | None) -> list[dict[str, Any]]:
    pairs = sorted(((p, c) for p in paths for c in controllers), key=lambda pc: -cost_hint(pc[0]))
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def note(r: dict[str, Any]) -> None:
        what = r.get("error") or f"{r['wall_s']:.1f} s"
        print(
            f"[{time.perf_counter() - t0:6.1f} s] {Path(r['path']).stem} / {r['controller']}: {what}", file=sys.stderr
        )
        out.append(r)

    if jobs <= 1:
        for p, c in pairs:
            note(run_pair(str(p), c, seed))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(run_pair, str(p), c, seed) for p, c in pairs]
            for fut in as_completed(futures):
                note(fut.result())
    return out


# -- judging -------------------------------------------------------------------------------------------------


def is_dimmer(name: str) -> bool:
    return name == "dimmer" or name.startswith("dimmer-")


def holds_limits(s: dict[str, Any], best_ramp_s: float) -> bool:
    """0 trips, 0 s over the interconnect limit, ramp violations no worse than the best baseline's."""
    return s["breaker_trips"] == 0 and s["pcc_overlimit_s"] <= EPS and s["ramp_violation_s"] <= best_ramp_s + EPS


def verdict(rows: dict[str, dict[str, Any]], judged: str = "dimmer") -> list[str]:
    """The goals `judged` meets and misses on one site, each with its numbers; one string per goal."""
    if judged not in rows:
        return [f"`{judged}` was not run"]
    d = rows[judged]
    # (dimmer's own hierarchy, dimmer-campus, is dimmer run another way, not a baseline it is judged against)
    baselines = {n: s for n, s in rows.items() if not is_dimmer(n)}
    lines: list[str] = []

    def goal(ok: bool, text: str) -> None:
        lines.append(f"{'PASS' if ok else 'MISS'} {text}")

    goal(d["breaker_trips"] == 0, f"trips: {d['breaker_trips']} (goal 0)")
    goal(d["pcc_overlimit_s"] <= EPS, f"over the interconnect limit: {d['pcc_overlimit_s']:,.1f} s (goal 0)")
    if not baselines:
        return lines
    best_ramp_name, best_ramp = min(((n, s["ramp_violation_s"]) for n, s in baselines.items()), key=lambda x: x[1])
    goal(
        d["ramp_violation_s"] <= best_ramp + EPS,
        f"ramp: {d['ramp_violation_s']:,.1f} s over (best baseline `{best_ramp_name}` {best_ramp:,.1f} s; "
        f"{d['ramp_violation_s'] - best_ramp:+,.1f} s)",
    )
    holding = {n: s for n, s in baselines.items() if holds_limits(s, best_ramp)}
    if holding:
        gp_name, gp = min(((n, s["goodput_loss_power_pct"]) for n, s in holding.items()), key=lambda x: x[1])
        goal(
            d["goodput_loss_power_pct"] <= gp + EPS,
            f"goodput lost: {d['goodput_loss_power_pct']:.3g} % (best limit-holding baseline `{gp_name}` {gp:.3g} %; "
            f"{d['goodput_loss_power_pct'] - gp:+.3g} pp)",
        )
        # (not a goal, the limits being trips, import and ramp: the heat a baseline's goodput was bought with)
        hot_s = holding[gp_name].get("breaker_overload_s")
        if hot_s is not None and hot_s > d.get("breaker_overload_s", 0.0) + EPS:
            lines.append(
                f"note `{gp_name}` ran a breaker above its rating's steady heat for {hot_s:,.0f} s (hottest "
                f"{holding[gp_name].get('max_breaker_heat_frac', float('nan')):.3g}; dimmer "
                f"{d.get('breaker_overload_s', 0.0):,.0f} s): it tripped nothing within the run"
            )
        en_name, en = min(((n, s["energy_overhead_pct"]) for n, s in holding.items()), key=lambda x: x[1])
        allowed = max(1.0, en)
        goal(
            d["energy_overhead_pct"] <= allowed + EPS,
            f"energy overhead: {d['energy_overhead_pct']:.3g} % (allowed max(1 %, `{en_name}` {en:.3g} %) = "
            f"{allowed:.3g} %; {d['energy_overhead_pct'] - allowed:+.3g} pp)",
        )
    else:
        lines.append(
            "n/a  goodput and energy: no baseline holds every limit (0 trips, 0 s over the interconnect limit, ramp "
            f"no worse than {best_ramp:,.1f} s); dimmer loses {d['goodput_loss_power_pct']:.3g} % and burns "
            f"{d['energy_overhead_pct']:.3g} %"
        )
    ref = rows.get("none", {})
    cycles = d.get("bbu_cycles_per_day")
    if cycles is not None:
        goal(
            cycles <= BBU_CYCLES_PER_DAY_GOAL + EPS,
            f"BBU wear: {cycles:.3g} depth-weighted cycles a day (goal <= {BBU_CYCLES_PER_DAY_GOAL:g}; "
            f"`none` {_fmt(ref.get('bbu_cycles_per_day'), '{:.3g}')})",
        )
    ride = d.get("min_bbu_ride_through_s")
    if ride is not None:
        sized_s = ref.get("min_bbu_ride_through_s")
        goal_s = BBU_RIDE_THROUGH_GOAL_S if sized_s is None else min(BBU_RIDE_THROUGH_GOAL_S, sized_s)
        goal(
            ride >= goal_s - EPS,
            f"BBU ride-through: {ride:.3g} s at least (goal >= {goal_s:.3g} s; "
            f"`none` {_fmt(ref.get('min_bbu_ride_through_s'), '{:.3g}')} s)",
        )
    return lines


# -- printing ------------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "–"
    try:
        return spec.format(value)
    except (TypeError, ValueError):
        return str(value)


def site_markdown(
    name: str, description: str, rows: dict[str, dict[str, Any]], errors: list[str], wall: dict[str, float]
) -> str:
    present = [c for c in OPTIONAL_COLUMNS if any(c[0] in s for s in rows.values())]
    cols = [*COLUMNS, *present]
    best_ramp = min((s["ramp_violation_s"] for n, s in rows.items() if not is_dimmer(n)), default=0.0)
    out = [f"### `{name}`", ""]
    if description:
        out += [" ".join(description.split()), ""]
    header = ["controller", "holds limits", *(c[1] for c in cols), "run s"]
    out.append("| " + " | ".join(header) + " |")
    out.append("|---|---|" + "---:|" * (len(cols) + 1))
    for ctrl, s in rows.items():
        cells = [f"`{ctrl}`", "yes" if holds_limits(s, best_ramp) else "no"]
        cells += [_fmt(s.get(key), spec) for key, _, spec in cols]
        cells.append(f"{wall.get(ctrl, float('nan')):.1f}")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    for err in errors:
        out.append(f"- ERROR {err}")
    v = verdict(rows)
    misses = sum(line.startswith("MISS") for line in v)
    out.append(f"**Verdict (`dimmer`)**: {'meets every goal' if not misses else f'misses {misses} goal(s)'}")
    out.append("")
    out += [f"- {line}" for line in v]
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from dimmer.control import controller_names

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="a site (file stem in scenarios/sites/); a comma list, or repeat the option",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel processes (default: all cores)")
    ap.add_argument("--controllers", default=None, help="a comma list (default: every registered controller)")
    ap.add_argument("--seed", type=int, default=None, help="the same seed for every run (default: each site's)")
    ap.add_argument(
        "--dir",
        type=Path,
        default=SITES,
        help="judge the scenarios of this folder instead (scenarios/ for the library, scenarios/faults/ ...)",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write site_suite.md and site_suite.json here")
    args = ap.parse_args(argv)

    only = [n.strip() for part in args.only for n in part.split(",") if n.strip()]
    paths = site_paths(only, args.dir)
    known = controller_names()
    controllers = sorted(known, key=lambda n: (n != "none", n != "dimmer", n))
    if args.controllers:
        controllers = [c.strip() for c in args.controllers.split(",") if c.strip()]
        bad = [c for c in controllers if c not in known]
        if bad:
            raise SystemExit(f"site_suite: --controllers: unknown {bad[0]!r} (have: {', '.join(known)})")

    t0 = time.perf_counter()
    results = run_all(paths, controllers, max(1, args.jobs), args.seed)
    total_s = time.perf_counter() - t0

    import tomllib

    sections = []
    everything: dict[str, list[dict[str, Any]]] = {}
    failed = False
    for p in paths:
        mine = [r for r in results if Path(r["path"]) == p]
        by_ctrl = {r["controller"]: r for r in mine}
        rows = {c: by_ctrl[c]["summary"] for c in controllers if c in by_ctrl and "summary" in by_ctrl[c]}
        wall = {c: by_ctrl[c]["wall_s"] for c in rows}
        errors = [f"`{c}`: {by_ctrl[c]['error']}" for c in controllers if c in by_ctrl and "error" in by_ctrl[c]]
        failed |= bool(errors)
        with p.open("rb") as f:
            description = str(tomllib.load(f).get("description", ""))
        sections.append(site_markdown(p.stem, description, rows, errors, wall))
        everything[p.stem] = list(rows.values())

    head = (
        f"# Site suite: {len(paths)} site(s) x {len(controllers)} controller(s), "
        f"{total_s:.0f} s wall on {max(1, args.jobs)} process(es)\n"
    )
    text = head + "\n" + "\n".join(sections)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "site_suite.md").write_text(text)
        (args.out / "site_suite.json").write_text(json.dumps(everything, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
