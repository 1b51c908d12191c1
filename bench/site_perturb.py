"""Each site a little harder than it was written: does `dimmer` still hold the limits the uncontrolled site holds?

    python3 bench/site_perturb.py                          # scenarios/sites, dimmer and none, on all cores
    python3 bench/site_perturb.py --dir scenarios/faults   # the fault library
    python3 bench/site_perturb.py --only oob-curtail --variants half-battery

A site's figures on its own terms say little of the next site, which is never quite the one written down. Each site
runs in variants a facilities engineer would meet: its interconnect limit 3 % lower (`limit-3pct`), its ramp limit
30 % lower (`ramp-30pct`, where it has one), half its battery (`half-battery`, power and energy, where it has one)
and another seed (`seed`: the scenario's + 1000). For each it prints `dimmer`'s and `none`'s trips, seconds over
the interconnect limit (and those after the first control period, which no controller can act before: a site
that starts over its lowered limit is over until then), seconds over the ramp limit and goodput lost, and flags a
row where `dimmer` trips a breaker, is over the limit after its first period, or is over the ramp limit for longer
than `none`. A benchmark: it reports, it never passes or fails (exit status 0 unless a site cannot be run: 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from site_suite import SITES, site_paths  # (its import keeps numpy to one thread a process, as runs here want)

VARIANTS = ("limit-3pct", "ramp-30pct", "half-battery", "seed")


def variant_overrides(raw: dict[str, Any], variant: str) -> tuple[list[str], int | None] | None:
    """The `--set` overrides and seed of one variant of a scenario (None: the variant does not apply to it)."""
    site = raw.get("site", {})
    pcc = site.get("pcc", {})
    bess = site.get("storage", {}).get("bess", {})
    if variant == "limit-3pct":
        return [f"site.pcc.limit_mw={float(pcc['limit_mw']) * 0.97!r}"], None
    if variant == "ramp-30pct":
        ramp = pcc.get("ramp_mw_per_min")
        return ([f"site.pcc.ramp_mw_per_min={float(ramp) * 0.7!r}"], None) if ramp else None
    if variant == "half-battery":
        if not float(bess.get("power_mw", 0.0)):
            return None
        power, energy = float(bess["power_mw"]) * 0.5, float(bess.get("energy_mwh", 0.0)) * 0.5
        return [f"site.storage.bess.power_mw={power!r}", f"site.storage.bess.energy_mwh={energy!r}"], None
    if variant == "seed":
        return [], int(raw.get("seed", 0)) + 1000
    raise ValueError(variant)


def run_one(path: str, variant: str, controller: str, overrides: list[str], seed: int | None) -> dict[str, Any]:
    """One controller on one variant of one site: the figures the table prints, or the error that stopped it."""
    import numpy as np

    from gridsim.compare import compare, summaries
    from gridsim.scenario import load_scenario

    row: dict[str, Any] = {"site": Path(path).stem, "variant": variant, "controller": controller}
    try:
        res = compare(load_scenario(path, overrides), [controller], seed=seed)[0]
    except Exception as exc:  # reported in the table; one broken site must not hide the others
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    s = summaries([res])[0]
    # (the first control period: the first action answers the first readings, and takes effect only then)
    after = res.t_s >= (res.period_t_s[1] if res.period_t_s.size > 1 else 0.0)
    over = res.tick["grid_w"][after] > res.tick["pcc_limit_w"][after]
    return {
        **row,
        "trips": int(s["breaker_trips"]),
        "over_s": float(s["pcc_overlimit_s"]),
        "over_after_first_s": float(np.count_nonzero(over)) * res.tick_s,
        "ramp_s": float(s["ramp_violation_s"]),
        "lost_pct": float(s["goodput_loss_power_pct"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=SITES, help="a folder of scenarios (default: scenarios/sites)")
    ap.add_argument("--only", action="append", default=[], help="a site (the file's stem); a comma list or repeated")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"a comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel processes (default: all cores)")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"--variants: no variant {unknown[0]!r} (have: {', '.join(VARIANTS)})")
    runs = []  # (path, variant, controller, overrides, seed)
    for p in site_paths([n for item in args.only for n in item.split(",") if n], args.dir):
        with p.open("rb") as f:
            raw = tomllib.load(f)
        for v in variants:
            if (how := variant_overrides(raw, v)) is not None:
                runs += [(str(p), v, c, *how) for c in ("dimmer", "none")]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        rows = list(pool.map(run_one, *zip(*runs, strict=True)))
    by = {(r["site"], r["variant"], r["controller"]): r for r in rows}
    print(
        "| site | variant | dimmer: trips / s over limit (after 1st period) / s over ramp / lost % | none: trips / "
        "s over limit / s over ramp | flag |"
    )
    print("|---|---|---|---|---|")
    failed = False
    for site, variant in [(Path(path).stem, v) for path, v, c, *_ in runs if c == "dimmer"]:
        d, n = by[(site, variant, "dimmer")], by[(site, variant, "none")]
        if "error" in d or "error" in n:
            failed = True
            print(f"| {site} | {variant} | {d.get('error', '')} | {n.get('error', '')} | error |")
            continue
        flags = [
            f for f, bad in (
                ("trips", d["trips"] > 0), ("over the limit", d["over_after_first_s"] > 0),
                ("ramp worse than none", d["ramp_s"] > n["ramp_s"]),
            ) if bad
        ]  # fmt: skip
        print(
            f"| {site} | {variant} | {d['trips']} / {d['over_s']:.1f} ({d['over_after_first_s']:.1f}) / "
            f"{d['ramp_s']:.1f} / {d['lost_pct']:.2f} | {n['trips']} / {n['over_s']:.1f} / {n['ramp_s']:.1f} | "
            f"{', '.join(flags) or 'ok'} |"
        )
    print(f"\n{len(runs)} runs in {time.perf_counter() - t0:.0f} s on {args.jobs} process(es)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
