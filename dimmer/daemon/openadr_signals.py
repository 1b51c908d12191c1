"""An OpenADR 2.0b event (as openleadr parses it: a dict) -> the `UtilityEvent`s the daemon plans on, and its answer.

Pure: the VEN (utility_ven.py) calls it for every event the VTN distributes. The signals it plans on (docs/utility.md):

    SIMPLE (level 0..3)                  an import limit: [utility] simple_levels[level] x the interconnect limit
    LOAD_CONTROL x-loadControlCapacity   an import limit: the payload (a share, 0..1] x the interconnect limit
    LOAD_CONTROL x-loadControlSetpoint   an import limit: the payload, in power
    LOAD_DISPATCH setpoint               a load target: the payload, in power (planned on as a ceiling)
    x-rampLimit setpoint                 the utility's ramp limit: the payload, in power per minute

A payload in power is in its signal's item base when that is real power in W with an SI scale (kW, MW), otherwise in
[utility] payload_unit. Any other signal (prices, bids, ...) is not planned on: an event with none of the above is
opted out of. Times are UTC epoch seconds; an interval without its own start follows the one before it, from the
event's active period; a zero duration lasts until the event is cancelled (OpenADR's open-ended event).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from dimmer.daemon.utility_config import UtilitySpec
from dimmer.utility_events import EventKind, Interval, UtilityEvent

SI_SCALE = {"none": 1.0, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}
RAMP_SIGNAL = "x-rampLimit"


@dataclass(frozen=True)
class Answer:
    """What the VEN does with one distributed event: opt in or out, why, and what it then plans on."""

    event_id: str
    opt: str  # "optIn" or "optOut"
    why: str
    events: tuple[UtilityEvent, ...] = ()  # what is planned on when opted in (one per signal understood)
    cancelled: bool = False


def answer(event: Mapping[str, Any], spec: UtilitySpec, limit_w: float) -> Answer:
    """Opt in to `event` (and plan on its signals) or out of it, under `spec`'s policy and an interconnect limit of
    `limit_w` (the configured one: what shares and the floor of `min_limit_frac` are of)."""
    desc = event.get("event_descriptor") or {}
    event_id = str(desc.get("event_id", ""))
    if desc.get("event_status") == "cancelled":
        return Answer(event_id, "optIn", "cancelled by the utility", cancelled=True)
    if spec.opt == "out":
        return Answer(event_id, "optOut", "[utility] opt = 'out'")
    try:
        events = translate(event, spec, limit_w)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        return Answer(event_id, "optOut", f"not understood ({type(exc).__name__}: {exc})")
    if not events:
        return Answer(event_id, "optOut", "no signal the daemon plans on")
    floor_w = spec.min_limit_frac * limit_w
    lowest = min((e.lowest for e in events if e.kind != "ramp"), default=math.inf)
    if lowest < floor_w:
        return Answer(event_id, "optOut", f"asks for {lowest / 1e3:g} kW, below min_limit_frac's {floor_w / 1e3:g} kW")
    kinds = ", ".join(f"{e.kind} {_describe(e)}" for e in events)
    return Answer(event_id, "optIn", kinds, events)


def translate(event: Mapping[str, Any], spec: UtilitySpec, limit_w: float) -> tuple[UtilityEvent, ...]:
    """The `UtilityEvent` of every signal of `event` the daemon plans on (see the module's table)."""
    desc = event["event_descriptor"]
    event_id = str(desc["event_id"])
    period = event.get("active_period") or {}
    ramp_up_s = _seconds(period.get("ramp_up", period.get("ramp_up_period")))
    recovery_s = _seconds(period.get("recovery", period.get("recovery_period")))
    signals = event.get("event_signals") or []
    if isinstance(signals, Mapping):
        signals = signals.get("event_signals") or []
    out = []
    for sig in signals:
        kind, value_of = _planned_as(sig, spec, limit_w)
        if kind is None:
            continue
        intervals = _intervals(sig.get("intervals") or [], period, value_of)
        out.append(UtilityEvent(event_id, kind, intervals, ramp_up_s=ramp_up_s, recovery_s=recovery_s))
    return tuple(out)


def _planned_as(
    sig: Mapping[str, Any], spec: UtilitySpec, limit_w: float
) -> tuple[EventKind | None, Callable[[float], float]]:
    """What a signal is planned on as, and its payload -> W (or W/min); None: not planned on."""
    name, stype = str(sig.get("signal_name", "")), str(sig.get("signal_type", ""))
    power = _power_scale(sig.get("measurement"), spec)
    levels = spec.simple_levels
    if name.upper() == "SIMPLE":
        return "limit", lambda level: levels[min(max(int(level), 0), len(levels) - 1)] * limit_w
    if name == "LOAD_CONTROL" and stype == "x-loadControlCapacity":
        return "limit", lambda share: share * limit_w
    if name == "LOAD_CONTROL" and stype == "x-loadControlSetpoint":
        return "limit", lambda x: x * power
    if name == "LOAD_DISPATCH" and stype == "setpoint":
        return "target", lambda x: x * power
    if name == RAMP_SIGNAL and stype == "setpoint":
        return "ramp", lambda x: x * power
    return None, float


def _power_scale(measurement: Any, spec: UtilitySpec) -> float:
    if isinstance(measurement, Mapping) and str(measurement.get("unit", "")) == "W":
        scale = str(measurement.get("scale") or "none")
        if scale in SI_SCALE:
            return SI_SCALE[scale]
    return spec.payload_scale_w


def _intervals(
    raw: Sequence[Mapping[str, Any]], period: Mapping[str, Any], value_of: Callable[[float], float]
) -> tuple[Interval, ...]:
    cursor = _epoch(period["dtstart"]) if period.get("dtstart") is not None else math.nan
    out = []
    for iv in raw:
        start = _epoch(iv["dtstart"]) if iv.get("dtstart") is not None else cursor
        duration = _seconds(iv.get("duration"))
        duration = math.inf if duration == 0 else duration
        payload = float(iv["signal_payload"])
        if not math.isfinite(payload):
            raise ValueError(f"a payload that is a number (got {payload})")
        out.append(Interval(start, duration, value_of(payload)))
        cursor = start + duration
    return tuple(out)


def _epoch(value: Any) -> float:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("a date-time with its time zone")
        return value.timestamp()
    raise TypeError(f"a date-time (got {type(value).__name__})")


def _seconds(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, int | float):
        return float(value)
    raise TypeError(f"a duration (got {type(value).__name__})")


def _describe(e: UtilityEvent) -> str:
    unit = "kW/min" if e.kind == "ramp" else "kW"
    return f"{e.lowest / 1e3:g} {unit} from {e.start_s:.0f}"
