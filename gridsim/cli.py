"""The `gridsim` command line. Exit status: 0 done, 2 bad input, 1 anything else."""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from dimmer.argtypes import whole
from dimmer.errors import DimmerError, InputError
from dimmer.outpath import out_dir_arg


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prints usage and exits 2; keep the status, make the message one line, the option first
        sys.stderr.write(f"gridsim: {message.removeprefix('argument ')}\n")
        raise SystemExit(2)


SEED_MAX = 2**63 - 1  # as `dimmer run --sim` and `gridsim serve`: one int64 in every output that records it
MAX_WORKERS = 4096
DASK_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?")


def dask_address(text: str) -> str:
    """argparse type of --dask: `[SCHEME://]HOST[:PORT]` as dask.distributed takes it, checked before a Client is
    made: a malformed one ('::::') hung 20 s in the Client's cleanup and printed a traceback after the error."""
    expected = (
        f"a scheduler address [SCHEME://]HOST[:PORT] (SCHEME one of {', '.join(DASK_SCHEMES)}; an IPv6 HOST in "
        f"brackets; PORT 1..65535)"
    )
    scheme, sep, rest = text.strip().partition("://")
    if not sep:
        scheme, rest = "tcp", scheme
    host, port = rest, ""
    if rest.startswith("["):
        host, _, after = rest[1:].partition("]")
        if after and not after.startswith(":"):
            raise argparse.ArgumentTypeError(expected)
        port = after[1:]
        try:
            ok = ipaddress.ip_address(host).version == 6
        except ValueError:
            ok = False
    else:
        host, _, port = rest.partition(":")
        ok = bool(_HOSTNAME.fullmatch(host))
    port_ok = not port or (port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535)
    if scheme not in DASK_SCHEMES or not ok or not port_ok or (rest.endswith(":") and not port):
        raise argparse.ArgumentTypeError(expected)
    return text.strip()


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gridsim", description="Simulate an AI training campus's power system under a controller.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run one scenario and write summary.json, time series, a figure and a report")
    run.add_argument("scenario", type=Path)
    run.add_argument("--controller", help="controller name (default: the scenario's)")
    run.add_argument("--out", type=out_dir_arg, help="output directory (default: out/<scenario>-<controller>)")
    run.add_argument("--seed", type=whole(0, SEED_MAX, what="a random seed"),
                     help="random seed, 0 to 2^63-1 (default: the scenario's)")  # fmt: skip
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a scenario key, e.g. --set duration_s=600 --set jobs[0].gpus=4096")  # fmt: skip
    run.add_argument("--quiet", action="store_true", help="print nothing but errors")

    cmp = sub.add_parser("compare", help="run every controller on one scenario and seed; write compare.json, "
                         "compare.csv, compare.png and compare.md")  # fmt: skip
    cmp.add_argument("scenario", type=Path)
    cmp.add_argument("--out", type=out_dir_arg, help="output directory (default: out/<scenario>-compare)")
    cmp.add_argument("--controllers", metavar="A,B,...", help="controllers to run, in this order (default: all)")
    cmp.add_argument("--seed", type=whole(0, SEED_MAX, what="a random seed"),
                     help="random seed, 0 to 2^63-1, the same for every controller (default: the "
                     "scenario's)")  # fmt: skip
    cmp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a scenario key, e.g. --set duration_s=600")  # fmt: skip
    cmp.add_argument("--quiet", action="store_true", help="print nothing but errors")

    swp = sub.add_parser("sweep", help="run one scenario over a grid of overrides (all cores, or a Dask cluster); "
                         "write results.csv/.parquet, a figure per metric and sweep.md")  # fmt: skip
    swp.add_argument("sweep", type=Path, help="the sweep file (TOML): scenario, set, [grid]")
    swp.add_argument("--out", type=out_dir_arg, help="output directory (default: out/<sweep>-sweep); a re-run resumes")
    swp.add_argument("--dask", metavar="ADDRESS", type=dask_address,
                     help="submit the runs to the dask.distributed scheduler at ADDRESS "
                     "([SCHEME://]HOST[:PORT])")  # fmt: skip
    swp.add_argument("--workers", type=whole(1, MAX_WORKERS, what="a number of processes"),
                     help=f"local worker processes, 1 to {MAX_WORKERS} (default: every core)")  # fmt: skip
    swp.add_argument("--quiet", action="store_true", help="print nothing but errors")

    val = sub.add_parser("validate", help="check a scenario file and say what it describes")
    val.add_argument("scenario", type=Path)
    val.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    dsc = sub.add_parser("describe", help="print the site, its ratings and oversubscription, the storage, the jobs "
                         "and the events of a scenario")  # fmt: skip
    dsc.add_argument("scenario", type=Path)
    dsc.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    sub.add_parser("schema", help="print the JSON Schema of a scenario file (for editors)")

    from gridsim.serve import add_serve_arguments  # cheap: pymodbus is imported when the server starts

    srv = sub.add_parser("serve", help="serve the simulated plant over Modbus TCP (loopback by default) in wall-clock "
                         "time x speed, for the dimmer daemon or any Modbus client")  # fmt: skip
    add_serve_arguments(srv)
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
    from dimmer.control import controller_names
    from dimmer.outpath import check_out_dir
    from gridsim.engine import run
    from gridsim.metrics import summarize
    from gridsim.output import write_run
    from gridsim.scenario import load_scenario

    # everything is checked before anything runs: the scenario, the controller and where the results go
    # (--seed as it was parsed)
    loaded = load_scenario(args.scenario, args.overrides)
    if args.controller is not None and args.controller not in controller_names():
        raise InputError("--controller", repr(args.controller), f"one of {', '.join(controller_names())}")
    name = args.controller or loaded.scenario.controller.name
    out = args.out or Path("out") / f"{loaded.scenario.name}-{name}"
    check_out_dir(out)
    res = run(loaded, controller=args.controller, seed=args.seed, progress=None if args.quiet else _progress)
    summary = summarize(res)
    written = write_run(res, out, description=loaded.scenario.description)
    if not args.quiet:
        print(json.dumps({k: summary[k] for k in ("breaker_trips", "pcc_overlimit_s", "ramp_violation_s",
                                                  "peak_grid_mw", "goodput_pct", "sim_speed_x_realtime")}))  # fmt: skip
        print(f"wrote {out}/: {', '.join(p.name for p in written)}")
    return 0


def _compare_progress(name: str, index: int, count: int, frac: float) -> None:
    bar = "#" * int(frac * 40)
    sys.stderr.write(f"\r{index + 1}/{count} {name:<12} [{bar:<40}] {frac * 100:5.1f} %")
    if frac >= 1.0:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _cmd_compare(args: argparse.Namespace) -> int:
    from dimmer.outpath import check_out_dir
    from gridsim.compare import (
        FILES,
        compare,
        compare_table,
        parse_controllers,
        summaries,
        write_compare,
    )
    from gridsim.scenario import load_scenario

    # everything is checked before anything runs (--seed as it was parsed)
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


def _sweep_progress(done: int, total: int) -> None:
    frac = done / total if total else 1.0
    bar = "#" * int(frac * 40)
    sys.stderr.write(f"\r{done}/{total} runs [{bar:<40}] {frac * 100:5.1f} %")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _cmd_sweep(args: argparse.Namespace) -> int:
    from dimmer.outpath import check_out_dir
    from gridsim.sweep import (
        FIGURE_METRICS,
        answers,
        connect,
        parquet_available,
        plan_sweep,
        result_rows,
        run_sweep,
        write_sweep,
    )

    # everything is checked, and the cluster reached, before anything runs or is written
    if args.workers is not None and args.workers < 1:
        raise InputError("--workers", str(args.workers), "a whole number of processes, at least 1")
    if args.workers is not None and args.dask is not None:
        raise InputError("--workers", str(args.workers), "not with --dask (the cluster has its own workers)")
    plan = plan_sweep(args.sweep)
    out = args.out or Path("out") / f"{plan.name}-sweep"
    check_out_dir(out)
    client = connect(args.dask)
    try:
        outcome = run_sweep(
            plan, out, workers=args.workers, client=client, progress=None if args.quiet else _sweep_progress
        )
    finally:
        if client is not None:
            client.close()
    n = len(plan.points)
    if outcome.failed:
        run, err = outcome.failed[0]
        sys.stderr.write(
            f"gridsim: {len(outcome.failed)} of {n} runs failed; the {len(outcome.summaries)} that finished are in "
            f"{out}/runs and a re-run resumes (first: run {run}, {err})\n"
        )
        return 1
    write_sweep(plan, outcome, out)
    if not args.quiet:
        for line in answers(plan, result_rows(plan, outcome.summaries)):
            print(line)
        print(
            f"{n} runs: {len(outcome.ran)} ran, {len(outcome.reused)} reused, {outcome.wall_s:.1f} s wall on "
            f"{outcome.where}"
        )
        parquet = (
            "results.parquet (pyarrow)" if parquet_available() else "no results.parquet (pyarrow is not installed)"
        )
        print(
            f"wrote {out}/results.csv, {parquet}, sweep.md, figures/ ({len(FIGURE_METRICS)} PNG), "
            f"runs/<id>/summary.json ({n})"
        )
    return 0


def _cmd_describe(args: argparse.Namespace) -> int:
    from gridsim.describe import describe
    from gridsim.scenario import load_scenario

    sys.stdout.write(describe(load_scenario(args.scenario, args.overrides)))
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from gridsim.describe import scenario_schema

    print(json.dumps(scenario_schema(), indent=2, allow_nan=False))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from gridsim.serve import run_serve

    return run_serve(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {
        "validate": _cmd_validate,
        "compare": _cmd_compare,
        "sweep": _cmd_sweep,
        "describe": _cmd_describe,
        "schema": _cmd_schema,
        "run": _cmd_run,
        "serve": _cmd_serve,
    }
    try:
        return commands[args.command](args)
    except InputError as exc:
        sys.stderr.write(f"gridsim: {exc}\n")
        return 2
    except DimmerError as exc:  # one line, e.g. an output that could not be written (dimmer.outpath.OutputError)
        sys.stderr.write(f"gridsim: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("gridsim: interrupted\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
