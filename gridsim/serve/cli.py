"""`gridsim serve`: the command line of the served plant."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from dimmer.argtypes import real, whole
from dimmer.daemon.netguard import IDLE_TIMEOUT_S, MAX_CONNECTIONS, ConnectionLimits
from dimmer.errors import InputError
from dimmer.outpath import check_out_dir, out_dir_arg
from gridsim.serve.plant import PlantServer

# --speed: below 0.001x a minute's scenario takes most of a day; above 10000x one wall millisecond is ten plant
# seconds, past anything a client can follow
SERVE_SPEED_RANGE = (0.001, 10_000.0)
SEED_MAX = 2**63 - 1
GONE = "the daemon that started this plant is gone (its stdin closed): stopped, no outputs written"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `gridsim serve` (for gridsim/cli.py)."""
    p.add_argument("scenario", type=Path)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=whole(0, 65535, what="a TCP port"), default=5020,
                   help="TCP port (0: a free one; default 5020)")  # fmt: skip
    lo, hi = SERVE_SPEED_RANGE
    p.add_argument("--speed", type=real(lo, hi, what="plant seconds per wall second"), default=1.0,
                   help=f"plant seconds per wall second, {lo:g} to {hi:g} (default 1)")  # fmt: skip
    p.add_argument("--out", type=out_dir_arg, help="output directory (default: out/<scenario>-served)")
    p.add_argument("--seed", type=whole(0, SEED_MAX, what="a random seed"),
                   help="random seed, 0 to 2^63-1 (default: the scenario's)")  # fmt: skip
    p.add_argument("--hold-until-first-write", action="store_true",
                   help="stop the plant at its first control point until a client writes (a served run then starts "
                   "like the in-process one)")  # fmt: skip
    p.add_argument("--max-connections", type=whole(1, 10_000, what="a number of connections"), default=MAX_CONNECTIONS,
                   help=f"connections served at once; one more closes the longest-silent connection of the client "
                   f"holding the most (default {MAX_CONNECTIONS})")  # fmt: skip
    p.add_argument("--idle-timeout-s", type=real(0.0, 86_400.0, lo_open=True, what="a number of seconds"),
                   default=IDLE_TIMEOUT_S,
                   help=f"close a connection silent this long (default {IDLE_TIMEOUT_S:g} s)")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario key, e.g. --set duration_s=600")  # fmt: skip


def run_serve(args: argparse.Namespace) -> int:
    """`gridsim serve`: raises InputError on bad input (the caller maps it to exit status 2)."""
    from gridsim.scenario import load_scenario

    # (--seed and --speed are checked as they are parsed: add_serve_arguments)
    limits = _limits(args)
    loaded = load_scenario(args.scenario, args.overrides)
    out = args.out or Path("out") / f"{loaded.scenario.name}-served"
    check_out_dir(out)  # before serving: an unusable one lost every output after the whole served run
    server = PlantServer(
        loaded,
        host=args.host,
        port=args.port,
        speed=args.speed,
        out_dir=out,
        seed=args.seed,
        hold_until_first_write=bool(getattr(args, "hold_until_first_write", False)),
        limits=limits,
    )
    return asyncio.run(_serve_until_done(server, bool(getattr(args, "stop_when_stdin_closes", False))))


def _limits(args: argparse.Namespace) -> ConnectionLimits:
    """--max-connections and --idle-timeout-s, vetted (InputError naming the option)."""
    n = getattr(args, "max_connections", MAX_CONNECTIONS)
    idle = getattr(args, "idle_timeout_s", IDLE_TIMEOUT_S)
    try:
        ConnectionLimits(max_connections=n)
    except ValueError as exc:
        raise InputError("--max-connections", "max_connections", str(exc).split(": ", 1)[1]) from None
    try:
        return ConnectionLimits(n, idle)
    except ValueError as exc:
        raise InputError("--idle-timeout-s", "idle_timeout_s", str(exc).split(": ", 1)[1]) from None


def _watch_stdin(server: PlantServer) -> None:
    """Abandon the run when stdin reads end-of-file: the parent that holds its write end has died (however it
    died: the kernel closes a dead process's pipes). A thread, as a blocking read of fd 0 is the whole job."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass  # nothing is ever written; anything that is, is not a reason to stop
        server.abandon(GONE)

    threading.Thread(target=watch, name="gridsim-serve-lifeline", daemon=True).start()


async def _say_ended(server: PlantServer) -> None:
    """One JSON line on stdout when the run reaches its end, before the outputs are written (`dimmer run --sim`
    stops its daemon on it)."""
    await server.ended.wait()
    t_s = server.loaded.scenario.duration_s
    sys.stdout.write(json.dumps({"event": "ended", "t_s": t_s}) + "\n")
    sys.stdout.flush()


async def _serve_until_done(server: PlantServer, stop_when_stdin_closes: bool = False) -> int:
    try:
        await server.start()
    except OSError as exc:
        raise InputError("--port", "port", f"a port we can listen on ({exc})") from None
    sys.stdout.write(json.dumps(server.device_map()) + "\n")
    sys.stdout.flush()
    if stop_when_stdin_closes:
        _watch_stdin(server)
    ended = asyncio.create_task(_say_ended(server))
    dur = server.loaded.scenario.duration_s
    sys.stderr.write(
        f"gridsim: serving {server.loaded.scenario.name} on {server.host}:{server.port} at {server.speed:g}x "
        f"({dur / server.speed:.0f} s of wall time"
        f"{', held at the first control point until a client writes' if server.holding else ''})\n"
    )
    try:
        await server.done.wait()
    finally:
        ended.cancel()
        await server.stop()
    if server.error:
        sys.stderr.write(f"gridsim: {server.error}\n")
        return 1
    sys.stderr.write(f"gridsim: wrote {server.out_dir}/summary.json\n")
    return 0


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse prints its usage and the message (two lines); the project's rule is one line, the option first
        sys.stderr.write(f"gridsim: {message.removeprefix('argument ')}\n")
        raise SystemExit(2)


def main_serve(argv: Sequence[str] | None = None) -> int:
    """`gridsim serve SCENARIO [--host H] [--port N] [--speed X] [--out DIR] [--hold-until-first-write]`; exit 0 done,
    2 bad input, 1 else."""
    p = _OneLineParser(prog="gridsim serve", description="Serve the simulated plant over Modbus TCP.")
    add_serve_arguments(p)
    p.add_argument("--stop-when-stdin-closes", action="store_true", help=argparse.SUPPRESS)  # `dimmer run --sim`
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # bad arguments (one line, above) or --help: the status, not an exception
        return int(exc.code or 0)
    try:
        return run_serve(args)
    except InputError as exc:
        sys.stderr.write(f"gridsim: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("gridsim: interrupted\n")
        return 1
