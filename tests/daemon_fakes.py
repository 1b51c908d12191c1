"""Fake equipment for the daemon tests: register images of a SunSpec meter and battery and dimmer-rack-v1 devices,
on an InMemoryBus (fast, deterministic) or served over loopback TCP by RegisterServer."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np

from dimmer.daemon import registers as R
from dimmer.daemon.agent import rack_image, rack_writable
from dimmer.daemon.bus import InMemoryBus
from dimmer.daemon.config import LoadedConfig, validate_config

SUNSPEC_BASE = 40000
METER_UNIT, BATTERY_UNIT, RACK_UNITS = 1, 2, (3, 4)
N_RACKS = 16
METER_MODELS = (R.MODEL_1, R.MODEL_213)
BATTERY_MODELS = (R.MODEL_1, R.MODEL_701, R.MODEL_704, R.MODEL_802)


def small_config(**sections: Any) -> dict[str, Any]:
    """16 GB300 racks in 2 rows, one 960-GPU job, a PCC meter, a battery, two rack devices of 8."""
    raw: dict[str, Any] = {
        "site": {
            "gpu": "gb300",
            "pcc": {"limit_mw": 2.0, "ramp_mw_per_min": 0.4},
            "levels": [
                {"level": "hall", "count": 1, "rating_mw": 2.1},
                {"level": "row", "count": 2, "rating_kw": 1100},
                {"level": "rack", "count": 8},
            ],
            "storage": {"bess": {"power_mw": 0.5, "energy_mwh": 0.25}},
        },
        "jobs": [{"name": "pretrain", "priority": 10, "gpus": 960}],
        "devices": [
            {"kind": "meter", "name": "pcc", "host": "127.0.0.1", "port": 1502, "unit": METER_UNIT},
            {"kind": "battery", "name": "bess", "host": "127.0.0.1", "port": 1502, "unit": BATTERY_UNIT},
            {
                "kind": "racks",
                "name": "row0",
                "host": "127.0.0.1",
                "port": 1502,
                "unit": RACK_UNITS[0],
                "first_rack": 0,
                "n_racks": 8,
            },
            {
                "kind": "racks",
                "name": "row1",
                "host": "127.0.0.1",
                "port": 1502,
                "unit": RACK_UNITS[1],
                "first_rack": 8,
                "n_racks": 8,
            },
        ],
        "daemon": {"metrics_address": ""},
    }
    for k, v in sections.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return copy.deepcopy(raw)


def loaded_config(tmp: Path | None = None, **sections: Any) -> LoadedConfig:
    return validate_config(small_config(**sections), "test.toml", tmp or Path("."))


def meter_image(power_w: float) -> list[int]:
    return R.sunspec_image([(R.MODEL_1, {"Mn": "test", "Md": "meter"}), (R.MODEL_213, {"W": power_w, "Hz": 60.0})])


def battery_image(soc_frac: float, power_w: float = 0.0) -> list[int]:
    return R.sunspec_image(
        [
            (R.MODEL_1, {"Mn": "test", "Md": "bess"}),
            (
                R.MODEL_701,
                {
                    "St": R.symbol(701, "St", "ON"),
                    "ConnSt": R.symbol(701, "ConnSt", "CONNECTED"),
                    "W": power_w / 1e3,
                    "W_SF": 3,
                    "Hz_SF": -2,
                },
            ),
            (R.MODEL_704, {"WSetEna": 0, "WSet_SF": 1, "WSetPct_SF": 0}),
            (
                R.MODEL_802,
                {
                    "WHRtg": 25000,
                    "WHRtg_SF": 1,
                    "WChaRteMax": 50000,
                    "WDisChaRteMax": 50000,
                    "WChaDisChaMax_SF": 1,
                    "SoC": soc_frac * 100.0,
                    "SoCMax": 90.0,
                    "SoCMin": 10.0,
                    "SoC_SF": -1,
                    "State": R.BATTERY_CONNECTED,
                    "W": power_w / 1e3,
                    "W_SF": 3,
                },
            ),
        ]
    )


def rack_status_words(power_w: np.ndarray, cap_w: float = 1400.0) -> list[int]:
    n = power_w.shape[0]
    status = {
        "power_w": power_w,
        "load_w": power_w,
        "cap_w": np.full(n, cap_w),
        "floor_w": np.zeros(n),
        "bbu_soc_frac": np.full(n, 0.9),
        "energized": np.ones(n),
    }
    return R.encode_records(R.RACK_STATUS, status, n, R.RACK_STATUS_STRIDE)


def header_words(first: int, n: int, update_count: int) -> list[int]:
    img = rack_image(first, n, 840.0, 10.0)
    vals = R.decode_block(R.RACK_HEADER, img[: R.RACK_HEADER.length], 0)
    vals = {k: v for k, v in vals.items() if v is not None}
    vals["update_count"] = update_count
    return R.encode_block(R.RACK_HEADER, vals)


class FakePlant:
    """The equipment of `small_config` in memory; `tick()` moves every update counter (fresh readings)."""

    def __init__(self, rack_w: float = 100e3, pcc_w: float = 1.5e6, soc_frac: float = 0.6) -> None:
        self.bus = InMemoryBus()
        self.rack_w = np.full(N_RACKS, rack_w)
        self.count = 0
        self.bus.set_words(METER_UNIT, SUNSPEC_BASE, meter_image(pcc_w))
        self.bus.set_words(BATTERY_UNIT, SUNSPEC_BASE, battery_image(soc_frac))
        for i, unit in enumerate(RACK_UNITS):
            self.bus.set_words(unit, 0, rack_image(8 * i, 8, 840.0, 10.0).tolist())
        self.tick()

    def factory(self, spec: Any) -> InMemoryBus:
        return self.bus

    def set_meter(self, power_w: float) -> None:
        self.bus.set_words(METER_UNIT, SUNSPEC_BASE, meter_image(power_w))

    def tick(self, move_counter: bool = True) -> None:
        if move_counter:
            self.count += 1
        for i, unit in enumerate(RACK_UNITS):
            self.bus.set_words(unit, 0, header_words(8 * i, 8, self.count))
            self.bus.set_words(unit, R.RACK_STATUS_BASE, rack_status_words(self.rack_w[8 * i : 8 * i + 8]))

    def caps_written(self) -> np.ndarray:
        """The per-GPU cap in each rack's command record (NaN where never written)."""
        out = []
        for unit in RACK_UNITS:
            words = self.bus.get_words(unit, R.rack_cmd_address(0), 8 * R.RACK_CMD_STRIDE)
            out.append(R.decode_records(R.RACK_COMMAND, words, 8, R.RACK_CMD_STRIDE)["cap_w"])
        return np.concatenate(out)

    def writes_to(self, unit: int) -> list[tuple[int, int, list[int]]]:
        return [w for w in self.bus.writes if w[0] == unit]

    def battery_setpoint_w(self) -> float:
        at = SUNSPEC_BASE + 2 + sum(b.length for b in BATTERY_MODELS[:2])  # model 704's ID register
        words = self.bus.get_words(BATTERY_UNIT, at, R.MODEL_704.length)
        value = R.decode_block(R.MODEL_704, words, 0)["WSet"]
        return float(value) if isinstance(value, float) else math.nan


def server_images(rack_w: float = 100e3, pcc_w: float = 1.5e6) -> tuple[dict[int, np.ndarray], dict[int, Any]]:
    """The same equipment as register images for RegisterServer (TCP): images by unit and writable ranges."""
    size = SUNSPEC_BASE + 400
    meter = np.zeros(size, dtype=np.uint16)
    m = meter_image(pcc_w)
    meter[SUNSPEC_BASE : SUNSPEC_BASE + len(m)] = m
    bess = np.zeros(size, dtype=np.uint16)
    b = battery_image(0.6)
    bess[SUNSPEC_BASE : SUNSPEC_BASE + len(b)] = b
    images: dict[int, np.ndarray] = {METER_UNIT: meter, BATTERY_UNIT: bess}
    writable: dict[int, Any] = {METER_UNIT: [], BATTERY_UNIT: [(SUNSPEC_BASE, size)]}
    for i, unit in enumerate(RACK_UNITS):
        img = rack_image(8 * i, 8, 840.0, 10.0)
        img[: R.RACK_HEADER.length] = header_words(8 * i, 8, 1)  # published once (a static image: it never moves)
        img[R.RACK_STATUS_BASE : R.RACK_STATUS_BASE + 8 * R.RACK_STATUS_STRIDE] = rack_status_words(np.full(8, rack_w))
        images[unit] = img
        writable[unit] = rack_writable()
    return images, writable


def decode_caps(image: np.ndarray, n: int = 8) -> np.ndarray:
    words = image[R.rack_cmd_address(0) : R.rack_cmd_address(n)]
    return R.decode_records(R.RACK_COMMAND, words, n, R.RACK_CMD_STRIDE)["cap_w"]
