"""The door in: a scenario TOML file -> a validated Scenario -> the site and the plant it describes.

Every key is checked here, once, with the file and the key path in the error; nothing downstream re-validates.
Paths inside a scenario (trace files, frequency replays) are relative to the scenario file.
"""

from __future__ import annotations

import copy
import math
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from dimmer.errors import InputError, from_validation_error
from dimmer.site import SiteModel, build_site
from dimmer.siteconfig import SiteSpec, Strict
from dimmer.tomlfile import read_toml as read_toml_file
from gridsim.plant.breakers import BreakerSpec
from gridsim.plant.gpu import GpuActuationSpec
from gridsim.plant.grid import FrequencySpec
from gridsim.plant.workload import BackgroundSpec, JobSpec


class EngineSpec(Strict):
    tick_s: float = Field(default=0.1, gt=0, le=1.0)
    control_period_s: float = Field(default=1.0, gt=0, le=60.0)
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
    """Replay a measured frequency trajectory (CSV `index,frequency_hz` at 1 s) as an external deviation."""

    kind: Literal["frequency_replay"]
    path: str


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
    | BackupTransferEvent,
    Field(discriminator="kind"),
]


class Scenario(Strict):
    name: str = Field(min_length=1)
    description: str = ""
    seed: int = Field(default=0, ge=0)
    duration_s: float = Field(gt=0, le=30 * 86400)
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
        return build_site(self.scenario.site, list(self.scenario.jobs), source=self.source)


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
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
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
    """Checks that need more than one key: jobs fit on the site, events name things that exist, files exist."""
    sc = loaded.scenario
    site = loaded.site()
    names = set(site.job_name)
    for i, ev in enumerate(sc.events):
        key = f"events[{i}]"
        if isinstance(ev, JobEvent):
            unknown = [n for n in ev.jobs if n not in names]
            if unknown:
                raise InputError(loaded.source, f"{key}.jobs", f"names of jobs in the scenario (not {unknown[0]!r})")
        elif isinstance(ev, DerateEvent | _Fault):
            if ev.domain not in site.domain_name:
                raise InputError(loaded.source, f"{key}.domain", f"a domain of the site (not {ev.domain!r})")
        elif isinstance(ev, FrequencyReplayEvent) and not loaded.resolve(ev.path).is_file():
            raise InputError(loaded.source, f"{key}.path", f"an existing file ({loaded.resolve(ev.path)})")
    for i, job in enumerate(sc.jobs):
        if job.kind == "trace":
            if job.trace_path is None:
                raise InputError(loaded.source, f"jobs[{i}].trace_path", "a trace file for kind = 'trace'")
            if not loaded.resolve(job.trace_path).is_file():
                raise InputError(
                    loaded.source,
                    f"jobs[{i}].trace_path",
                    f"an existing file ({loaded.resolve(job.trace_path)})",
                )
    if sc.controller.name not in _controller_names():
        raise InputError(loaded.source, "controller.name", f"one of {', '.join(_controller_names())}")


def _controller_names() -> list[str]:
    from dimmer.control import controller_names

    return controller_names()
