"""The `gridsim` command line. Exit status: 0 done, 2 bad input, 1 anything else."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dimmer.errors import InputError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prints usage and exits 2; keep the status, make the message one line.
        sys.stderr.write(f"gridsim: {message}\n")
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gridsim", description="Simulate an AI training campus's power system under a controller.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run one scenario and write summary.json, time series, a figure and a report")
    run.add_argument("scenario", type=Path)
    run.add_argument("--controller", help="controller name (default: the scenario's)")
    run.add_argument("--out", type=Path, help="output directory (default: out/<scenario>-<controller>)")
    run.add_argument("--seed", type=int, help="random seed (default: the scenario's)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a scenario key, e.g. --set duration_s=600 --set jobs[0].gpus=4096")  # fmt: skip
    run.add_argument("--quiet", action="store_true", help="print nothing but errors")

    cmp = sub.add_parser("compare", help="run every controller on one scenario and seed; write compare.json, "
                         "compare.csv, compare.png and compare.md")  # fmt: skip
    cmp.add_argument("scenario", type=Path)
    cmp.add_argument("--out", type=Path, help="output directory (default: out/<scenario>-compare)")
    cmp.add_argument("--controllers", metavar="A,B,...", help="controllers to run, in this order (default: all)")
    cmp.add_argument("--seed", type=int, help="random seed, the same for every controller (default: the scenario's)")
    cmp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a scenario key, e.g. --set duration_s=600")  # fmt: skip
    cmp.add_argument("--quiet", action="store_true", help="print nothing but errors")

    val = sub.add_parser("validate", help="check a scenario file and say what it describes")
    val.add_argument("scenario", type=Path)
    val.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return p


def _progress(frac: float) -> None:
    bar = "#" * int(frac * 40)
    sys.stderr.write(f"\r[{bar:<40}] {frac * 100:5.1f} %")
    if frac >= 1.0:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _cmd_validate(args: argparse.Namespace) -> int:
    from gridsim.scenario import load_scenario

    loaded = load_scenario(args.scenario, args.overrides)
    site = loaded.site()
    sc = loaded.scenario
    print(
        f"{args.scenario}: ok — {sc.name}: {site.n_gpus} GPUs in {site.n_racks} racks, {site.n_domains} domains, "
        f"{site.n_jobs} jobs, {sc.duration_s:g} s, interconnect {site.pcc_limit_w / 1e6:g} MW"
    )
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from gridsim.engine import run
    from gridsim.metrics import summarize
    from gridsim.output import write_run
    from gridsim.scenario import load_scenario

    if args.seed is not None and args.seed < 0:
        raise InputError("--seed", "seed", "a non-negative integer")
    loaded = load_scenario(args.scenario, args.overrides)
    name = args.controller or loaded.scenario.controller.name
    out = args.out or Path("out") / f"{loaded.scenario.name}-{name}"
    res = run(loaded, controller=args.controller, seed=args.seed, progress=None if args.quiet else _progress)
    summary = summarize(res)
    write_run(res, out)
    if not args.quiet:
        print(json.dumps({k: summary[k] for k in ("breaker_trips", "pcc_overlimit_s", "ramp_violation_s",
                                                  "peak_grid_mw", "goodput_pct", "sim_speed_x_realtime")}))  # fmt: skip
        print(f"wrote {out}/summary.json, timeseries.csv, jobs.csv, overview.png, report.md")
    return 0


def _compare_progress(name: str, index: int, count: int, frac: float) -> None:
    bar = "#" * int(frac * 40)
    sys.stderr.write(f"\r{index + 1}/{count} {name:<12} [{bar:<40}] {frac * 100:5.1f} %")
    if frac >= 1.0:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _cmd_compare(args: argparse.Namespace) -> int:
    from gridsim.compare import (
        FILES,
        check_out_dir,
        compare,
        compare_table,
        parse_controllers,
        summaries,
        write_compare,
    )
    from gridsim.scenario import load_scenario

    # everything is checked before anything runs
    if args.seed is not None and args.seed < 0:
        raise InputError("--seed", "seed", "a non-negative integer")
    loaded = load_scenario(args.scenario, args.overrides)
    names = parse_controllers(args.controllers)
    out = args.out or Path("out") / f"{loaded.scenario.name}-compare"
    check_out_dir(out)
    results = compare(loaded, names, seed=args.seed, progress=None if args.quiet else _compare_progress)
    write_compare(results, out)
    if not args.quiet:
        print(compare_table(summaries(results)))
        print(f"wrote {out}/{', '.join(FILES)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "validate":
            return _cmd_validate(args)
        if args.command == "compare":
            return _cmd_compare(args)
        return _cmd_run(args)
    except InputError as exc:
        sys.stderr.write(f"gridsim: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("gridsim: interrupted\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
