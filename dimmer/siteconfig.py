"""The site schema: the power tree, its ratings, the storage installed and the jobs placed on it.

Shared by gridsim scenarios and the daemon's site config. Keys carry engineer units (`limit_mw`, `rating_kw`,
`energy_mwh`); `dimmer.site.build_site` converts them to SI once. Every model forbids unknown keys so that a
misspelt key or a wrong unit suffix is an error, not a silent default.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from dimmer.gpus import GPU_PRESETS
from dimmer.throughput import THROUGHPUT_PRESETS, curve_problem

LevelName = Literal["building", "hall", "row", "rack"]
LEVEL_ORDER: tuple[str, ...] = ("campus", "building", "hall", "row", "rack")

# The largest site a scenario or site config may describe: ~7 M GPUs, far beyond any campus planned, and small
# enough that the per-rack arrays (and a simulation's per-rack buffers) fit in memory.
MAX_RACKS = 100_000
MAX_GPUS_PER_RACK = 576  # NVL576, the densest rack announced; also the most GPUs one `dimmer agent` serves


def _printable(name: str) -> str:
    # names go raw into CSV headers, Prometheus labels, logs and the terminal: a line break, NUL or ESC there
    # forges rows and lines or drives the terminal
    if not name.isprintable():
        raise ValueError("a name without control characters (line breaks, tabs, NUL, ESC)")
    return name


def _path_safe(name: str) -> str:
    # a scenario or sweep name becomes a directory name (out/<name>-<controller>): a separator in it wrote
    # outside out/, and `dimmer run --sim` deleted files there
    if "/" in name or "\\" in name:
        raise ValueError("a name without / or \\ (it names the output directory out/<name>-...)")
    return name


def _text(text: str) -> str:
    # free text (a description) may break lines, but an ESC or NUL printed by `gridsim describe` drives the terminal
    if any(not c.isprintable() and c not in "\n\t" for c in text):
        raise ValueError("text without control characters other than line breaks and tabs (no NUL, ESC, CR)")
    return text


# Free text a user gives (a description): printable, lines and tabs allowed.
Text = Annotated[str, AfterValidator(_text)]
# A name a user gives (a job, a device): printable, at most 200 characters.
Name = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_printable)]
# A name that also names a directory: no path separator, short enough for a file name with its suffix.
PathName = Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_printable), AfterValidator(_path_safe)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _one_rating(rating_kw: float | None, rating_mw: float | None, required: bool) -> None:
    if rating_kw is not None and rating_mw is not None:
        raise ValueError("give rating_kw or rating_mw, not both")
    if required and rating_kw is None and rating_mw is None:
        raise ValueError("a rating is required: rating_kw or rating_mw")


class LevelSpec(Strict):
    """One level of the tree: `count` children under each domain of the level above, each with one rating."""

    level: LevelName
    count: int = Field(ge=1, le=100_000)
    rating_kw: float | None = Field(default=None, gt=0)
    rating_mw: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _rating(self) -> LevelSpec:
        _one_rating(self.rating_kw, self.rating_mw, required=self.level != "rack")
        return self

    def rating_w(self) -> float | None:
        if self.rating_kw is not None:
            return self.rating_kw * 1e3
        if self.rating_mw is not None:
            return self.rating_mw * 1e6
        return None


class RatingOverride(Strict):
    """A different rating for one named domain, e.g. `b0/h1/r3` (a derated row)."""

    domain: str
    rating_kw: float | None = Field(default=None, gt=0)
    rating_mw: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _rating(self) -> RatingOverride:
        _one_rating(self.rating_kw, self.rating_mw, required=True)
        return self

    def rating_w(self) -> float:
        return self.rating_kw * 1e3 if self.rating_kw is not None else float(self.rating_mw or 0.0) * 1e6


class PccSpec(Strict):
    """The utility interconnect: import limit and the ramp the utility allows."""

    limit_mw: float = Field(gt=0)
    ramp_mw_per_min: float = Field(default=math.inf, gt=0)
    ramp_window_s: float = Field(default=60.0, gt=0, le=3600)


class TraySpec(Strict):
    """Capacitor trays in each rack's power shelves (NVIDIA GB300: ~65 J per GPU).

    `kw_per_rack` left out is sized from the rack: 30 % of its GPUs at rated power, the iteration swing a tray
    smooths (30-40 % at campus level); a GB300 NVL72 gets 30.2 kW.
    """

    j_per_gpu: float = Field(default=65.0, ge=0)
    kw_per_rack: float | None = Field(default=None, ge=0)
    # how fast a tray's charge is brought back to half after a swing moved it (a time constant): while it refills
    # the rack's supply carries up to half its energy over this time above the rack's own load, at a swing's peak
    # too (assumption: no public figure; a swing's phases are 1-2 s)
    refill_s: float = Field(default=2.0, gt=0, le=600)


class BbuSpec(Strict):
    """Rack battery backup units (OCP ORv3 HPR: shelves of 12 kW BBU modules, the rack carried at full draw for its
    rated hold-up of 90 s).

    Left out, the ratings are sized from the rack preset (dimmer.site.size_bbu): power in whole 12 kW modules to
    carry the rack's full draw, energy for 90 s of it after discharge losses, recharge at the 33 kW shelf's ratio of
    3 kW. A GB300 NVL72 (132.5 kW at full draw) gets 144 kW, 3.45 kWh and a 13.1 kW recharge.
    """

    kw_per_rack: float | None = Field(default=None, ge=0)
    kwh_per_rack: float | None = Field(default=None, ge=0)
    hold_up_s: float = Field(default=90.0, gt=0, le=3600)  # rated ride-through at full rack draw (ORv3: 90 s)
    round_trip_eff: float = Field(default=0.92, gt=0, le=1)
    soc_min_frac: float = Field(default=0.5, ge=0, lt=1)  # the least SoC peak shaving may leave; an outage uses all
    soc_max_frac: float = Field(default=1.0, gt=0, le=1)
    recharge_kw_per_rack: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _window(self) -> BbuSpec:
        if self.soc_min_frac >= self.soc_max_frac:
            raise ValueError("soc_min_frac must be below soc_max_frac")
        return self


class BessSpec(Strict):
    """The campus battery.

    NREL ATB round trip 85 %, Megapack 91 %; ERCOT fast frequency response: full power within 0.25 s; SoC 10-90 %.
    """

    power_mw: float = Field(default=0.0, ge=0)
    energy_mwh: float = Field(default=0.0, ge=0)
    round_trip_eff: float = Field(default=0.88, gt=0, le=1)
    soc_min_frac: float = Field(default=0.1, ge=0, lt=1)
    soc_max_frac: float = Field(default=0.9, gt=0, le=1)
    soc_init_frac: float = Field(default=0.5, ge=0, le=1)
    response_tau_s: float = Field(default=0.08, ge=0)  # first order: 95 % of a step within 0.25 s (3 tau)

    @model_validator(mode="after")
    def _window(self) -> BessSpec:
        if self.soc_min_frac >= self.soc_max_frac:
            raise ValueError("soc_min_frac must be below soc_max_frac")
        if not self.soc_min_frac <= self.soc_init_frac <= self.soc_max_frac:
            raise ValueError("soc_init_frac must lie within [soc_min_frac, soc_max_frac]")
        return self


class StorageSpec(Strict):
    tray: TraySpec = TraySpec()
    bbu: BbuSpec = BbuSpec()
    bess: BessSpec = BessSpec()


class JobPlacementSpec(Strict):
    """Where a synchronous job runs and how much it matters. Exactly one of gpus, racks or building."""

    name: Name
    priority: int = Field(default=0, ge=0, le=1000)  # higher keeps power longer
    gpus: int | None = Field(default=None, ge=1)
    racks: tuple[int, int] | None = None  # [first, last) rack index
    building: str | None = None  # every free rack of that building (e.g. "b1")
    # throughput under a cap (default: the GPU preset's): [[relative power, relative throughput], ...] ending at
    # [1, 1], or a measured preset's name (dimmer.throughput.THROUGHPUT_PRESETS) ...
    throughput_curve: list[tuple[float, float]] | str | None = None
    # ... or a Perseus / ML.ENERGY per-clock profile (CSV: stage,instruction,frequency,time,energy), fitted on load
    throughput_profile: str | None = None

    @field_validator("throughput_curve")
    @classmethod
    def _a_curve(cls, v: list[tuple[float, float]] | str | None) -> list[tuple[float, float]] | str | None:
        if isinstance(v, str):
            if v not in THROUGHPUT_PRESETS:
                raise ValueError(f"a throughput curve preset, one of {sorted(THROUGHPUT_PRESETS)}, or a list of points")
        elif v is not None and (problem := curve_problem(v)):
            raise ValueError(f"a throughput curve: {problem}")
        return v

    @model_validator(mode="after")
    def _one_placement(self) -> JobPlacementSpec:
        if self.throughput_curve is not None and self.throughput_profile is not None:
            raise ValueError("give at most one of throughput_curve or throughput_profile")
        given = [k for k in ("gpus", "racks", "building") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of gpus, racks or building")
        if self.racks is not None and not 0 <= self.racks[0] < self.racks[1]:
            raise ValueError("racks must be [first, last) with 0 <= first < last")
        return self


class SiteSpec(Strict):
    gpu: str = "gb300"
    gpus_per_rack: int = Field(default=72, ge=1, le=MAX_GPUS_PER_RACK)
    active_gpus_per_rack: int = Field(default=64, ge=1, le=MAX_GPUS_PER_RACK)
    spare_rack_frac: float = Field(default=0.02, ge=0, le=1)
    rectifier_eff: float = Field(default=0.97, gt=0.5, le=1)  # OCP ORv3: 96.5-97.5 %
    pcc: PccSpec
    levels: list[LevelSpec] = Field(min_length=1)
    overrides: list[RatingOverride] = []
    storage: StorageSpec = StorageSpec()

    @model_validator(mode="after")
    def _check(self) -> SiteSpec:
        if self.gpu not in GPU_PRESETS:
            raise ValueError(f"gpu must be one of {sorted(GPU_PRESETS)}")
        if self.active_gpus_per_rack > self.gpus_per_rack:
            raise ValueError("active_gpus_per_rack cannot exceed gpus_per_rack")
        names = [lv.level for lv in self.levels]
        if names[-1] != "rack":
            raise ValueError("levels must end with the rack level (it gives the racks per parent)")
        order = [LEVEL_ORDER.index(n) for n in names]
        if order != sorted(set(order)):
            raise ValueError("levels must be distinct and ordered building, hall, row, rack")
        return self

    @field_validator("levels")
    @classmethod
    def _bounded(cls, levels: list[LevelSpec]) -> list[LevelSpec]:
        racks = math.prod(lv.count for lv in levels)
        if racks > MAX_RACKS:
            raise ValueError(f"at most {MAX_RACKS:,} racks in all (the level counts multiply to {racks:,})")
        return levels
