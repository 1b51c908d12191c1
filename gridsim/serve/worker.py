"""The engine of a served plant in its worker thread, in step with wall time, with `PlantWorker` in the
controller's seat (`gridsim.serve.plant.PlantServer` owns one)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from dimmer.observation import Actions, Observation
from gridsim.engine import Simulation

if TYPE_CHECKING:
    from gridsim.serve.plant import PlantServer

log = logging.getLogger("gridsim.serve")

# hold_until_first_write: after the first accepted write, how long (wall seconds) the rest of that cycle's writes
# may take to land before the plant starts anyway (it starts at once when every rack device and the battery are in)
HOLD_GRACE_WALL_S = 0.25


class _Stopped(Exception):
    pass


class PlantWorker:
    """Runs `server`'s scenario in a thread (`start`), sitting in the engine's controller seat: every control
    period `step` waits until wall time reaches t / speed, then has the server publish the observation and decode
    the Actions on the event loop's thread. Plant time is wall time since the start x speed, frozen while
    `holding` (hold_until_first_write: at the first control point, until the server's first accepted write)."""

    def __init__(self, server: PlantServer, speed: float, hold: bool) -> None:
        self.server = server
        self.name = server.controller_label  # the controller's name in the run's summary
        self.speed = speed
        self.holding = hold
        self.sim: Simulation | None = None
        self.pending_bess_online: bool | None = None  # applied at the next control period
        self._hold_t_s = 0.0
        self._t0 = math.nan
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def plant_time_s(self) -> float:
        """Plant (simulated) time now: wall time since the start x speed; NaN before start; frozen while holding."""
        if self.holding:
            return self._hold_t_s
        return (time.monotonic() - self._t0) * self.speed

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="gridsim-serve", daemon=True)
        self._thread.start()

    def abandon(self) -> None:
        """Stop the run without outputs, from any thread (the daemon that drove it is gone: what it would report is
        not a controlled run). Checked at every control period and once more before the outputs are written."""
        self._stop.set()

    async def stop(self) -> None:
        """Stop the run (abandoned: no outputs) and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    def _run(self) -> None:
        srv = self.server
        try:
            sim = Simulation(srv.loaded, srv.site, self, srv.seed)
            self.sim = sim
            res = sim.run()
            # the run's end, said at once: writing the outputs takes seconds in which nothing is published, and a
            # daemon left polling would take the frozen registers for dead devices (`dimmer run --sim` stops on it)
            self._call_on_loop(srv.ended.set)
            if self._stop.is_set():  # abandoned at the last moment: still no report of a controlled run
                raise _Stopped
            from gridsim.metrics import summarize

            srv.summary = summarize(res)
            srv.result = res
            if srv.out_dir is not None:
                srv._write_outputs(res)
        except _Stopped:
            srv.error = srv.abandon_reason or "stopped before the end of the run"
        except Exception as exc:  # the server must report, not die silently
            log.exception("served plant failed")
            srv.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._call_on_loop(srv.done.set)

    def _call_on_loop(self, fn: Callable[[], Any]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
                loop.call_soon_threadsafe(fn)

    def step(self, obs: Observation) -> Actions:
        """The controller's seat: called by the engine every control period, in the worker thread."""
        if self.holding:
            self._hold(obs)
        target = self._t0 + obs.t_s / self.speed
        while True:
            left = target - time.monotonic()
            if self._stop.is_set():
                raise _Stopped
            if left <= 0:
                break
            self._stop.wait(min(left, 0.25))
        if self.pending_bess_online is not None and self.sim is not None:
            self.sim.bess.online = self.pending_bess_online
            self.pending_bess_online = None
        actions: Actions = self._on_loop(self.server._exchange(obs))
        return actions

    def _on_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the event loop's thread and wait for its result (from the worker thread)."""
        loop = self._loop
        assert loop is not None
        fut = asyncio.run_coroutine_threadsafe(coro, loop)
        while True:
            try:
                return fut.result(timeout=0.25)
            except TimeoutError:
                if self._stop.is_set():
                    fut.cancel()
                    raise _Stopped from None

    def _hold(self, obs: Observation) -> None:
        """hold_until_first_write, at the first control point: publish `obs` with plant time frozen at its time,
        wait for the first accepted write (then for the rest of that cycle's), restart the clock from there."""
        srv = self.server
        self._hold_t_s = obs.t_s
        self._on_loop(srv._publish_async(obs))
        log.info("holding the plant at t = %g s until the first write", obs.t_s)
        while True:
            if self._stop.is_set():
                raise _Stopped
            first = srv.first_write_wall_s
            if first is not None and (srv.all_written() or time.monotonic() - first >= HOLD_GRACE_WALL_S):
                break
            self._stop.wait(0.005)
        self._t0 = time.monotonic() - obs.t_s / self.speed  # before holding goes False: plant_time_s stays monotone
        self.holding = False
        log.info("first write: the plant runs from t = %g s", obs.t_s)
