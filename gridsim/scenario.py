"""The door in: a scenario TOML file -> a validated Scenario -> the site and the plant it describes.

Every key is checked here, once, with the file and the key path in the error; nothing downstream re-validates.
Paths inside a scenario (trace files, frequency replays) are relative to the scenario file, and are read here too,
as is every `[controllers.<name>]` table (by building that controller): what `gridsim validate` accepts, a run
accepts, and nothing fails minutes into a run.

Sizes are bounded so that a run cannot exhaust memory: at most MAX_TICKS plant ticks, engine.tick_s at least
MIN_TICK_S, at most MAX_RUN_BYTES of recorded series and telemetry buffers, at most dimmer.siteconfig.MAX_RACKS
racks; a scenario file is at most dimmer.inputfile.MAX_TOML_BYTES, nested at most dimmer.tomlfile.MAX_TOML_DEPTH.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, ValidationError, model_validator

from dimmer.errors import InputError, from_validation_error, key_path
from dimmer.inputfile import MAX_DATA_BYTES, check_input_file
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import PathName, SiteSpec, Strict, Text
from dimmer.tomlfile import MAX_TOML_DEPTH, toml_depth
from dimmer.tomlfile import read_toml as read_toml_file
from gridsim.plant.breakers import BreakerSpec
from gridsim.plant.gpu import GpuActuationSpec
from gridsim.plant.grid import DEFAULT_SETTLE_TAU_S, FrequencySpec, ReplayValues, load_frequency_csv
from gridsim.plant.voltage import UpsSpec, VoltageDipEvent
from gridsim.plant.workload import BackgroundSpec, JobSpec, Workload
from gridsim.utility import UtilityEventSpec

# A run keeps every campus series at every tick: 10 M ticks (11.5 days at the default 0.1 s) is ~1 GB of them.
MAX_TICKS = 10_000_000
# The plant's fastest dynamics (GPU power limit actuation, capacitor trays) are tens of ms; a finer tick models
# nothing more, and its telemetry buffers grow as 1 / tick_s.
MIN_TICK_S = 1e-3
MAX_TICK_S = 300.0  # a 5-minute PDU record's own step
MAX_CONTROL_PERIOD_S = 3600.0
MAX_DURATION_S = 366 * 86400  # a year, leap day included (a month of 5-minute PDU data is 31 days)
# What a run allocates for its recorded series and telemetry buffers, estimated before it starts.
MAX_RUN_BYTES = 4 * 1024**3


class EngineSpec(Strict):
    # up to MAX_TICK_S for trace-replay sizing runs (a month or a year of 5-minute data): such a tick resolves no
    # iteration swing, breaker short-time or sub-minute ramp, only energy, minutes-scale peaks and storage state
    tick_s: float = Field(default=0.1, ge=MIN_TICK_S, le=MAX_TICK_S)
    control_period_s: float = Field(default=1.0, gt=0, le=MAX_CONTROL_PERIOD_S)
    actuation_latency_s: float = Field(default=0.0, ge=0, le=120.0)  # network + agent, before the GPU lag
    record_racks: int = Field(default=64, ge=0, le=100_000)  # racks whose series are kept (evenly spaced)

    @model_validator(mode="after")
    def _multiple(self) -> EngineSpec:
        ratio = self.control_period_s / self.tick_s
        if abs(ratio - round(ratio)) > 1e-9:
            raise ValueError("control_period_s must be a whole number of ticks")
        return self


class TelemetrySpec(Strict):
    """What the controller sees: NVML power is a 1 s average (Ampere+), meters report with some delay."""

    window_s: float = Field(default=1.0, gt=0, le=60.0)
    delay_s: float = Field(default=0.0, ge=0, le=60.0)
    noise_frac: float = Field(default=0.0, ge=0, le=0.5)  # gaussian, relative
    dropout_prob: float = Field(default=0.0, ge=0, le=1.0)  # per rack reading per period
    # racks also report the highest sample of each window, sampled this often (NVML's power samples on the host
    # agent, a power shelf's peak register); 0: they report none, and a swing's peak between window means is unseen
    peak_sample_s: float = Field(default=0.1, ge=0, le=60.0)


class MetricsSpec(Strict):
    band_lo_hz: float = Field(default=0.1, gt=0)
    band_hi_hz: float = Field(default=20.0, gt=0)

    @model_validator(mode="after")
    def _band(self) -> MetricsSpec:
        if self.band_lo_hz >= self.band_hi_hz:
            raise ValueError("band_lo_hz must be below band_hi_hz")
        return self


class ControllerSpec(Strict):
    name: str = "none"


class _Event(Strict):
    at_s: float = Field(ge=0)


class CurtailEvent(_Event):
    """The utility lowers the interconnect limit to `limit_mw`, linearly over `over_s`."""

    kind: Literal["curtail"]
    limit_mw: float = Field(gt=0)
    over_s: float = Field(default=60.0, ge=0)


class FrequencyReplayEvent(_Event):
    """Replay a measured frequency record as the area's frequency from `at_s` (gridsim.plant.grid.FrequencyReplay;
    the accepted files: load_frequency_csv, docs/scenarios.md)."""

    kind: Literal["frequency_replay"]
    path: str
    sample_s: float = Field(default=1.0, gt=0, le=3600)  # the record's sample period (t = index x sample_s)
    values: ReplayValues = "frequency_hz"  # or "deviation_mhz": f - nominal in mHz
    # how fast the frequency leaves nominal before the record and returns after it (first order; an assumption)
    settle_tau_s: float = Field(default=DEFAULT_SETTLE_TAU_S, gt=0, le=3600)


class FrequencyStepEvent(_Event):
    """A sudden load or generation change elsewhere in the area (positive = load added / generation lost)."""

    kind: Literal["frequency_step"]
    load_mw: float


class JobEvent(_Event):
    """Start, stop or crash named jobs (all jobs when `jobs` is empty)."""

    kind: Literal["start", "stop", "crash"]
    jobs: list[str] = []


class DerateEvent(_Event):
    """A breaker derated (a hot day): the domain's rating times `factor` from `at_s` on."""

    kind: Literal["derate"]
    domain: str
    factor: float = Field(gt=0, le=1)


class _Fault(_Event):
    """A fault from `at_s` for `duration_s` (for ever by default) on what lies under `domain`."""

    duration_s: float = Field(default=math.inf, gt=0)
    domain: str = "campus"


class TelemetryFault(_Fault):
    """Readings that lie or vanish: the PCC meter, one domain's meter, or the rack readings under a domain.

    stale: the last value, growing older; stuck: the last value, reported as fresh; nan: no value;
    spike: the true value times `factor`; drift: the true value times 1 + `factor` per hour since the fault began.
    """

    kind: Literal["telemetry"]
    target: Literal["pcc", "meter", "racks"]
    mode: Literal["stale", "stuck", "nan", "spike", "drift"]
    factor: float = 2.0


class ActuationFault(_Fault):
    """Commands that do not arrive for the racks under `domain`.

    lost: cap, floor and BBU writes never arrive; ignored: the GPUs refuse new caps and floors (firmware), BBU
    settings still arrive; delayed: every command arrives `delay_s` late; agent_down: the host agents are down, so
    writes are lost and the racks' readings vanish.
    """

    kind: Literal["actuation"]
    mode: Literal["lost", "ignored", "delayed", "agent_down"]
    delay_s: float = Field(default=10.0, ge=0)


class StorageFault(_Fault):
    """Storage that fails.

    bess_offline: the campus battery trips offline; bbu_failed: the BBUs under `domain` give no power; bbu_empty:
    they are drained to their reserve at `at_s`; trays_disabled: the capacitor trays under `domain` do nothing.
    """

    kind: Literal["storage"]
    mode: Literal["bess_offline", "bbu_failed", "bbu_empty", "trays_disabled"]


class BackupTransferEvent(_Event):
    """The whole campus transfers to backup power and back (2024: ~1,500 MW of data-center load left the grid).

    For `duration_s` the racks run from backup and the grid sees no import; then the load returns at once.
    """

    kind: Literal["backup_transfer"]
    duration_s: float = Field(gt=0)


Event = Annotated[
    CurtailEvent
    | FrequencyReplayEvent
    | FrequencyStepEvent
    | JobEvent
    | DerateEvent
    | TelemetryFault
    | ActuationFault
    | StorageFault
    | BackupTransferEvent
    | VoltageDipEvent
    | UtilityEventSpec,
    Field(discriminator="kind"),
]


class Scenario(Strict):
    name: PathName
    description: Text = ""
    seed: int = Field(default=0, ge=0)
    duration_s: float = Field(gt=0, le=MAX_DURATION_S)
    site: SiteSpec
    jobs: list[JobSpec] = []
    background: BackgroundSpec = BackgroundSpec()
    gpu: GpuActuationSpec = GpuActuationSpec()
    breakers: BreakerSpec = BreakerSpec()
    grid: FrequencySpec = FrequencySpec()
    engine: EngineSpec = EngineSpec()
    telemetry: TelemetrySpec = TelemetrySpec()
    metrics: MetricsSpec = MetricsSpec()
    controller: ControllerSpec = ControllerSpec()
    ups: UpsSpec = UpsSpec()  # the site's UPS transfer on a voltage dip (gridsim/ridethrough.py)
    controllers: dict[str, dict[str, Any]] = {}  # parameters per controller name
    events: list[Event] = []

    @property
    def n_ticks(self) -> int:
        return math.ceil(self.duration_s / self.engine.tick_s - 1e-9)


class LoadedScenario:
    """A validated scenario with the file it came from (for relative paths and error messages)."""

    def __init__(self, scenario: Scenario, source: str, base_dir: Path) -> None:
        self.scenario = scenario
        self.source = source
        self.base_dir = base_dir

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.base_dir / p

    def site(self) -> SiteModel:
        jobs = [  # a throughput profile's path is relative to the scenario file, as a trace's is
            j.model_copy(update={"throughput_profile": str(self.resolve(j.throughput_profile))})
            if j.throughput_profile
            else j
            for j in self.scenario.jobs
        ]
        site = build_site(self.scenario.site, jobs, source=self.source)
        # (the operator knows how the caps are written, if not how long they take: the plant's [gpu] path)
        return dataclasses.replace(site, cap_path=self.scenario.gpu.path)


def parse_override(text: str, source: str = "--set") -> tuple[list[str | int], Any]:
    """`jobs[0].gpus=4096` -> (["jobs", 0, "gpus"], 4096). The value is read as TOML, else as a bare string."""
    if "=" not in text:
        raise InputError(source, text, "KEY=VALUE")
    key, raw = text.split("=", 1)
    path: list[str | int] = []
    for part in key.strip().split("."):
        name, _, rest = part.partition("[")
        if not name:
            raise InputError(source, key, "a dotted key such as engine.tick_s or jobs[0].gpus")
        path.append(name)
        while rest:
            idx, _, rest = rest.partition("]")
            if not idx.isdigit():
                raise InputError(source, key, "a list index in brackets, e.g. jobs[0]")
            path.append(int(idx))
            rest = rest.removeprefix("[")
    if len(path) > MAX_TOML_DEPTH:
        raise InputError(source, key[:60], f"a key at most {MAX_TOML_DEPTH} levels deep")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except ValueError:  # an integer past Python's digit limit: tomllib raises a bare ValueError, a traceback here
        raise InputError(source, key, f"a number of at most {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:  # the parser recurses per nesting level
        raise InputError(source, key, f"a value nested at most {MAX_TOML_DEPTH} tables or arrays deep") from None
    if toml_depth(value) + len(path) > MAX_TOML_DEPTH:
        raise InputError(source, key, f"a value nested at most {MAX_TOML_DEPTH} tables or arrays deep")
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node: Any = out
        for i, part in enumerate(path[:-1]):
            nxt = path[i + 1]
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    raise InputError("--set", text, f"an existing list item at {part}")
                node = node[part]
            else:
                if not isinstance(node, dict):
                    raise InputError("--set", text, f"a table at {part!r}")
                node = node.setdefault(part, [] if isinstance(nxt, int) else {})
        last = path[-1]
        if isinstance(last, int):
            if not isinstance(node, list) or last >= len(node):
                raise InputError("--set", text, f"an existing list item at {last}")
            node[last] = value
        else:
            if not isinstance(node, dict):
                raise InputError("--set", text, "a table to set the key in")
            node[last] = value
    return out


def read_toml(path: Path) -> dict[str, Any]:
    return read_toml_file(path, "scenario file")


def validate_scenario(raw: dict[str, Any], source: str) -> Scenario:
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        raise from_validation_error(source, exc) from None


def load_scenario(path: str | Path, overrides: list[str] | None = None) -> LoadedScenario:
    """Read, override and validate a scenario; build its site once to check placements and overrides."""
    p = Path(path)
    raw = apply_overrides(read_toml(p), overrides or [])
    loaded = LoadedScenario(validate_scenario(raw, str(p)), str(p), p.resolve().parent)
    check_references(loaded)
    return loaded


def check_references(loaded: LoadedScenario) -> None:
    """Checks that need more than one key: the run fits in memory, jobs fit on the site, events name things that
    exist, trace and frequency files parse, every controller accepts its parameters."""
    sc = loaded.scenario
    _check_ticks(loaded)
    site = loaded.site()
    _check_run_size(loaded, site)
    names = set(site.job_name)
    _check_ups(loaded, site)
    for i, ev in enumerate(sc.events):
        key = f"events[{i}]"
        if isinstance(ev, JobEvent):
            unknown = [n for n in ev.jobs if n not in names]
            if unknown:
                raise InputError(loaded.source, f"{key}.jobs", f"names of jobs in the scenario (not {unknown[0]!r})")
        elif isinstance(ev, DerateEvent | _Fault):
            if ev.domain not in site.domain_name:
                raise InputError(loaded.source, f"{key}.domain", f"a domain of the site (not {ev.domain!r})")
        elif isinstance(ev, FrequencyReplayEvent):
            _check_replay(loaded, ev, f"{key}.path")
    for i, job in enumerate(sc.jobs):
        if job.kind == "trace":
            if job.trace_path is None:
                raise InputError(loaded.source, f"jobs[{i}].trace_path", "a trace file for kind = 'trace'")
            path = loaded.resolve(job.trace_path)
            check_input_file(path, loaded.source, f"jobs[{i}].trace_path", "power trace")
    # the workload as the engine builds it: every trace file is read and parsed, as a run would
    jobs = [j.model_copy(update={"trace_path": str(loaded.resolve(j.trace_path))}) if j.trace_path else j
            for j in sc.jobs]  # fmt: skip
    Workload(site, jobs, sc.background, np.random.default_rng(0), loaded.source)
    check_controllers(loaded, site)


def _check_ups(loaded: LoadedScenario, site: SiteModel) -> None:
    shares = loaded.scenario.ups.share_frac
    if isinstance(shares, list):
        from gridsim.ridethrough import unit_racks  # (it imports the site model only)

        n_units = unit_racks(site)[1]
        if len(shares) != n_units:
            raise InputError(
                loaded.source,
                "ups.share_frac",
                f"one share per building ({n_units}), or one number (got {len(shares)})",
            )


def _check_replay(loaded: LoadedScenario, ev: FrequencyReplayEvent, key: str) -> None:
    """Read and parse the replay file as the run will (gridsim.plant.grid's parser), so a bad one fails now."""
    path = loaded.resolve(ev.path)
    check_input_file(path, loaded.source, key, "frequency record (CSV)", MAX_DATA_BYTES)
    load_frequency_csv(path, loaded.source, key, ev.sample_s, ev.values, loaded.scenario.grid.nominal_hz)


def _check_ticks(loaded: LoadedScenario) -> None:
    sc = loaded.scenario
    n = sc.n_ticks
    if n > MAX_TICKS:
        # name the key the user moved: a tick set finer than the default, else the duration
        key = "engine.tick_s" if "tick_s" in sc.engine.model_fields_set else "duration_s"
        raise InputError(
            loaded.source,
            key,
            f"at most {MAX_TICKS:,} ticks per run (duration_s / engine.tick_s = {sc.duration_s:g} / "
            f"{sc.engine.tick_s:g} = {n:,}): a longer tick or a shorter run",
        )


def _check_run_size(loaded: LoadedScenario, site: SiteModel) -> None:
    """Refuse a run whose recorded series and telemetry buffers (as gridsim.engine allocates them) would pass
    MAX_RUN_BYTES, naming the key that makes most of it."""
    from gridsim.engine import TICK_SERIES  # here: the engine imports this module

    sc = loaded.scenario
    eng, tel = sc.engine, sc.telemetry
    n_ticks = sc.n_ticks
    tpp = max(1, round(eng.control_period_s / eng.tick_s))
    n_periods = (n_ticks + tpp - 1) // tpp
    rec_r = min(eng.record_racks, site.n_racks)
    rec_d = min(site.n_domains, 1 + rec_r * len(sc.site.levels))  # each recorded rack adds a domain per level
    ring_rows = max(1, round(tel.window_s / eng.tick_s)) + round(tel.delay_s / eng.tick_s)
    parts = {
        "duration_s": 8 * n_ticks * len(TICK_SERIES),
        "engine.record_racks": 8 * n_periods * (3 * rec_d + 4 * site.n_jobs + 2 * rec_r + 3),
        "telemetry.window_s" if tel.window_s >= tel.delay_s else "telemetry.delay_s": 8 * 3 * ring_rows * site.n_racks,
    }
    total = sum(parts.values())
    if total > MAX_RUN_BYTES:
        key = max(parts, key=lambda k: parts[k])
        raise InputError(
            loaded.source,
            key,
            f"a run of at most {MAX_RUN_BYTES / 1024**3:g} GiB of recorded series and buffers (this one needs "
            f"{total / 1024**3:.1f} GiB, most of it from {key}): a shorter run, a longer tick or fewer racks",
        )


def check_controllers(loaded: LoadedScenario, site: SiteModel | None = None) -> None:
    """Build every controller the scenario has a `[controllers.<name>]` table for, and the scenario's own, with
    its parameters: an unknown name or a bad parameter is an InputError naming the scenario file and the key."""
    from dimmer.control import make_controller

    sc = loaded.scenario
    known = _controller_names()
    if sc.controller.name not in known:
        raise InputError(loaded.source, "controller.name", f"one of {', '.join(known)} (got {sc.controller.name!r})")
    for name in sc.controllers:
        if name not in known:
            raise InputError(
                loaded.source,
                key_path(["controllers", name]),
                f"a table named for a controller, one of {', '.join(known)}",
            )
    site = site or loaded.site()
    names = [*sc.controllers, *([] if sc.controller.name in sc.controllers else [sc.controller.name])]
    for name in names:
        try:
            make_controller(name, site, sc.controllers.get(name, {}), source=loaded.source)
        except InputError as exc:
            # the controller names its key as "params.<key>" (it does not know the file): say where it is here
            rest = exc.key.removeprefix("params")
            raise InputError(loaded.source, key_path(["controllers", name]) + rest, exc.expected) from None


def _controller_names() -> list[str]:
    from dimmer.control import controller_names

    return controller_names()
