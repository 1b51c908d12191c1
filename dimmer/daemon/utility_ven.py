"""The daemon as an OpenADR 2.0b VEN of the utility's VTN (openleadr's OpenADRClient), on the daemon's event loop.

It registers with the VTN (retrying, with a backoff of up to a minute, while the VTN cannot be reached), polls it,
answers every event it is sent (openadr_signals.answer: opt in to the signals it plans on, under [utility]'s policy)
and keeps the events it opted in to. Each cycle the daemon asks `observe`: the Observation with the interconnect
limit in force at most what those events ask now (dimmer.utility_events: the utility's start time and ramp-up, the
lowest event wins), and the ramp limit at most theirs.

Accepted events are the VEN's own copy. A VTN that vanishes (no answer to a poll) changes nothing of them: the last
accepted events stay in force until they end (their recovery included), never a higher limit meanwhile. Only the VTN
itself, answering, lifts one early: a cancellation, or a modification the VEN opts out of.

Reports (when [utility] report is on): two TELEMETRY_USAGE data points of real power in W, offered at registration
and sent at the interval the VTN asks for: `import` (the campus's import at the interconnect, measured) and
`flexibility` (x-availableFlexibility: what the campus could shed now, see `available_flexibility_w`). A value not
measured this cycle is not sent.

Utility events are stamped on the wall clock (UTC): the schedule is asked at `wall_clock()`, not the daemon's
monotonic clock (which --sim may speed up).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np

from dimmer.daemon.openadr_signals import Answer, answer
from dimmer.daemon.utility_config import key_is_rsa
from dimmer.observation import Observation
from dimmer.site import SiteModel
from dimmer.utility_events import InForce, UtilityEvent, UtilitySchedule

if TYPE_CHECKING:
    from dimmer.daemon.audit import AuditLog
    from dimmer.daemon.config import LoadedConfig
    from dimmer.daemon.utility_config import UtilitySpec

log = logging.getLogger("dimmer.utility")

RETRY_MAX_S = 60.0  # the longest wait between two registration attempts


def available_flexibility_w(site: SiteModel, obs: Observation) -> float:
    """What the campus could shed from its import now: the racks' draw above their draw with every GPU at its least
    cap (energized racks with a reading), plus the campus battery's discharge headroom (its rated power less what it
    gives now) while it is online and above its SoC floor. NaN when no rack reading arrived."""
    floor_w = site.rack_power_w(np.full(site.n_racks, site.gpu.min_cap_w))
    seen = np.isfinite(obs.rack_power_w) & obs.rack_energized
    if not seen.any():
        return math.nan
    shed = float(np.sum(np.maximum(obs.rack_power_w[seen] - floor_w[seen], 0.0)))
    return shed + bess_headroom_w(site, obs)


def bess_headroom_w(site: SiteModel, obs: Observation) -> float:
    """The campus battery's discharge headroom: its rated power less what it gives now, while it is online and above
    its SoC floor (0 otherwise)."""
    if obs.bess_online and math.isfinite(obs.bess_soc_frac) and obs.bess_soc_frac > site.bess.soc_min_frac:
        now = obs.bess_power_w if math.isfinite(obs.bess_power_w) else 0.0
        return max(site.bess.power_w - max(now, 0.0), 0.0)
    return 0.0


class UtilityVen:
    """The VEN and the events it accepted. `start()` on the daemon's loop, `observe()` each cycle, `stop()` at the
    end. `client_factory` makes the openleadr client (a test may wrap it); `wall_clock` is UTC epoch seconds."""

    def __init__(
        self,
        loaded: LoadedConfig,
        wall_clock: Callable[[], float] = time.time,
        client_factory: Callable[..., Any] | None = None,
        audit: AuditLog | None = None,
    ) -> None:
        spec = loaded.config.utility
        assert spec is not None
        self.spec: UtilitySpec = spec
        self.site = loaded.site
        self.limit_w = float(loaded.limit_w[0])  # the configured interconnect limit: what shares are of
        self.wall_clock = wall_clock
        self.paths = {k: loaded.resolve(getattr(spec, k)) for k in ("cert", "key", "ca_file")}
        self._client_factory = client_factory or _openleadr_client
        self.accepted: dict[str, tuple[UtilityEvent, ...]] = {}
        self.answers: list[Answer] = []  # every answer given, in order (for the audit and tests)
        self.schedule = UtilitySchedule()
        self.in_force: InForce | None = None
        self.import_w = math.nan  # the latest measured values the reports send
        self.flexibility_w = math.nan
        self.audit = audit
        self.client: Any = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        key = self.paths["key"]
        if key is not None and key_is_rsa(key):
            log.warning(
                "utility: %s is an RSA key: openleadr loads it twice for every message it signs, ~0.2 s of the "
                "daemon's loop each (an EC P-256 key costs microseconds; docs/utility.md)",
                key,
            )
        self._task = asyncio.get_running_loop().create_task(self._register())

    @property
    def registered(self) -> bool:
        return self.client is not None and bool(self.client.registration_id)

    async def _register(self) -> None:
        """Register (and from then on poll, on openleadr's scheduler); retry with a backoff while the VTN is away."""
        wait_s = 1.0
        while True:
            client = self._make_client()
            self.client = client
            await client.run()  # registers, offers the reports, polls once, schedules the polls; stops if it failed
            if client.registration_id:
                log.info("utility: registered with %s as %s", self.spec.vtn_url, client.ven_id)
                return
            log.warning("utility: no registration with %s; trying again in %g s", self.spec.vtn_url, wait_s)
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, RETRY_MAX_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        client = self.client
        if client is not None:
            if client.scheduler.running:
                client.scheduler.shutdown(wait=False)
            if client.report_queue_task is not None:
                client.report_queue_task.cancel()
            if client.client_session is not None:
                await client.client_session.close()

    def rebind(self, loaded: LoadedConfig) -> None:
        """A reloaded config's site and interconnect limit (the VTN, the VEN and its policy change on a restart)."""
        self.site = loaded.site
        self.limit_w = float(loaded.limit_w[0])

    def _make_client(self) -> Any:
        spec, paths = self.spec, self.paths
        client = self._client_factory(
            ven_name=spec.ven_name,
            vtn_url=spec.vtn_url,
            ven_id=spec.ven_id,
            cert=None if paths["cert"] is None else str(paths["cert"]),
            key=None if paths["key"] is None else str(paths["key"]),
            ca_file=None if paths["ca_file"] is None else str(paths["ca_file"]),
            vtn_fingerprint=spec.vtn_fingerprint,
            show_fingerprint=False,
            disable_signature=paths["cert"] is None,
            poll_interval_s=spec.poll_interval_s,
        )
        client.add_handler("on_event", self.on_event)
        client.add_handler("on_update_event", self.on_event)
        if spec.report:
            every = timedelta(seconds=spec.report_interval_s)
            for resource, kind, read in (
                ("import", "usage", lambda: self.import_w),
                ("flexibility", "x-availableFlexibility", lambda: self.flexibility_w),
            ):
                client.add_report(
                    callback=_reading(read),
                    resource_id=resource,
                    measurement="real_power",
                    report_name="TELEMETRY_USAGE",
                    report_type=kind,
                    reading_type="Direct Read" if resource == "import" else "Projected",
                    sampling_rate=every,
                    report_duration=timedelta(seconds=max(3600.0, spec.report_interval_s)),
                    unit="W",
                )
        return client

    # -- events --------------------------------------------------------------------------------------------------------

    async def on_event(self, event: dict[str, Any]) -> str:
        """openleadr's on_event and on_update_event: answer, and keep (or drop) what is planned on."""
        ans = answer(event, self.spec, self.limit_w)
        self.answers.append(ans)
        had = ans.event_id in self.accepted
        if ans.opt == "optIn" and not ans.cancelled:
            self.accepted[ans.event_id] = ans.events
        elif had:
            del self.accepted[ans.event_id]  # cancelled, or a modification opted out of: the VTN said so
        self.schedule = UtilitySchedule(e for evs in self.accepted.values() for e in evs)
        level = logging.INFO if ans.opt == "optIn" else logging.WARNING
        log.log(level, "utility: event %s: %s (%s)", ans.event_id, ans.opt, ans.why)
        if self.audit is not None:
            self.audit.write({"event": "utility", "event_id": ans.event_id, "opt": ans.opt, "why": ans.why})
        return ans.opt

    def observe(self, obs: Observation) -> Observation:
        """`obs` with the interconnect limit and ramp limit at most what the accepted events ask now; the measured
        import and flexibility kept for the reports."""
        self.import_w = obs.pcc_power_w if math.isfinite(obs.pcc_age_s) else math.nan
        self.flexibility_w = available_flexibility_w(self.site, obs)
        now = self.wall_clock()
        if self.schedule:
            live = self.schedule.without_ended(now)
            if len(live.events) != len(self.schedule.events):  # ended (recovery included): forget them
                ids = {e.event_id for e in live.events}
                self.accepted = {k: v for k, v in self.accepted.items() if k in ids}
                self.schedule = live
        in_force = self.schedule.in_force(now, obs.pcc_limit_w, obs.ramp_limit_w_per_min)
        self.in_force = in_force
        if not in_force.event_ids and in_force.ramp_limit_w_per_min == obs.ramp_limit_w_per_min:
            return obs
        return dataclasses.replace(
            obs,
            pcc_limit_w=min(obs.pcc_limit_w, in_force.limit_w),
            ramp_limit_w_per_min=min(obs.ramp_limit_w_per_min, in_force.ramp_limit_w_per_min),
        )


def _reading(read: Callable[[], float]) -> Callable[[], list[tuple[Any, float]] | float]:
    """A report callback: the value now, or nothing (an empty list: openleadr sends no point) when not measured."""

    def value() -> list[tuple[Any, float]] | float:
        v = read()
        return float(v) if math.isfinite(v) else []

    return value


def _openleadr_client(poll_interval_s: float | None = None, **kwargs: Any) -> Any:
    """openleadr's OpenADRClient, polling every `poll_interval_s` when given (else as the VTN asks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DSA is deprecated")  # signxml, as it loads (pyproject.toml)
        from openleadr import OpenADRClient
    # openleadr sets its logger to INFO as it loads and says so at every report sample and poll: its warnings and
    # errors (a VTN that does not answer) are what the daemon's log wants
    logging.getLogger("openleadr").setLevel(logging.WARNING)

    class Client(OpenADRClient):
        async def create_party_registration(self, *args: Any, **kw: Any) -> Any:
            result = await super().create_party_registration(*args, **kw)
            if poll_interval_s is not None and self.registration_id:
                self.poll_frequency = timedelta(seconds=poll_interval_s)
            return result

    return Client(**kwargs)
