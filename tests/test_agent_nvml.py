"""The NVML backend against a fake `pynvml` module (no GPU here): milliwatts to watts, the calls made and their
order, NVML errors as GpuError, the read-only path (and bench/nvml_readonly.py) that can reach no set function,
and the agent on top of it (reports the enforced limit, restores the default one)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.daemon import registers as R
from dimmer.daemon.agent import CapAgent
from dimmer.daemon.nvml import GpuError, NvmlGpus, read_gpus

REPO = Path(__file__).resolve().parents[1]


class FakeNvml:
    """The part of nvidia-ml-py the backend uses, in milliwatts as NVML gives them; every call recorded."""

    class NVMLError(Exception):
        def __init__(self, msg: str = "", value: int = 999) -> None:  # pynvml's carries its nvmlReturn_t as .value
            super().__init__(msg)
            self.value = value

    def __init__(self, n: int = 2) -> None:
        self.n = n
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: set[str] = set()  # these functions raise NVMLError
        self.min_mw = [200_000] * n
        self.max_mw = [1_400_000] * n
        self.default_mw = [1_200_000] * n
        self.limit_mw = [1_300_001] * n  # what it finds: not the default
        self.enforced_mw = [1_000_000] * n
        self.power_mw = [456_789 + k for k in range(n)]
        # each GPU's power sample buffer, (timestamp us, mW); None: the GPU keeps none (NVML_ERROR_NOT_SUPPORTED)
        self.samples: list[list[tuple[int, int]] | None] = [[] for _ in range(n)]

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name in self.fail:
            raise self.NVMLError(f"{name}: Insufficient Permissions")

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def nvmlInit(self) -> None:
        self._call("nvmlInit")

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i: int) -> tuple[str, int]:
        self._call("nvmlDeviceGetHandleByIndex", i)
        return ("gpu", i)

    def nvmlDeviceGetName(self, h: tuple[str, int]) -> bytes:
        self._call("nvmlDeviceGetName", h)
        return b"NVIDIA GB300"

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: tuple[str, int]) -> list[int]:
        self._call("nvmlDeviceGetPowerManagementLimitConstraints", h)
        return [self.min_mw[h[1]], self.max_mw[h[1]]]

    def nvmlDeviceGetPowerManagementLimit(self, h: tuple[str, int]) -> int:
        self._call("nvmlDeviceGetPowerManagementLimit", h)
        return self.limit_mw[h[1]]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: tuple[str, int]) -> int:
        self._call("nvmlDeviceGetPowerManagementDefaultLimit", h)
        return self.default_mw[h[1]]

    def nvmlDeviceGetEnforcedPowerLimit(self, h: tuple[str, int]) -> int:
        self._call("nvmlDeviceGetEnforcedPowerLimit", h)
        return self.enforced_mw[h[1]]

    def nvmlDeviceGetPowerUsage(self, h: tuple[str, int]) -> int:
        self._call("nvmlDeviceGetPowerUsage", h)
        return self.power_mw[h[1]]

    def nvmlDeviceGetSamples(self, h: tuple[str, int], kind: int, last_seen_us: int) -> tuple[int, list[Any]]:
        """nvml.h: the samples after `last_seen_us`; NOT_FOUND (6) when there are none, NOT_SUPPORTED (3)."""
        self._call("nvmlDeviceGetSamples", h, kind, last_seen_us)
        assert kind == 0  # NVML_TOTAL_POWER_SAMPLES
        buf = self.samples[h[1]]
        if buf is None:
            raise self.NVMLError("Not Supported", 3)
        new = [(t, v) for t, v in buf if t > last_seen_us]
        if not new:
            raise self.NVMLError("Not Found", 6)
        sample = type("nvmlSample_t", (), {})
        out = []
        for t, v in new:
            x = sample()
            x.timeStamp, x.sampleValue = t, type("value", (), {"uiVal": v})()
            out.append(x)
        return 3, out  # NVML_VALUE_TYPE_UNSIGNED_INT

    def nvmlDeviceSetPowerManagementLimit(self, h: tuple[str, int], limit_mw: int) -> None:
        self._call("nvmlDeviceSetPowerManagementLimit", h, limit_mw)
        assert isinstance(limit_mw, int)
        self.limit_mw[h[1]] = limit_mw


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_milliwatts_become_watts_and_the_call_sequence(nvml: FakeNvml) -> None:
    gpus = NvmlGpus()
    assert nvml.calls == [
        ("nvmlInit", ()),
        ("nvmlDeviceGetCount", ()),
        ("nvmlDeviceGetHandleByIndex", (0,)),
        ("nvmlDeviceGetHandleByIndex", (1,)),
    ]
    lo, hi = gpus.constraints_w()
    assert lo.tolist() == [200.0, 200.0] and hi.tolist() == [1400.0, 1400.0]
    assert gpus.default_limit_w().tolist() == [1200.0, 1200.0]
    assert gpus.limit_w().tolist() == [1300.001, 1300.001]
    assert gpus.enforced_limit_w().tolist() == [1000.0, 1000.0]
    assert gpus.power_w() == pytest.approx([456.789, 456.790])
    nvml.calls.clear()
    gpus.set_limit_w(np.array([999.9996, 1000.0004]))  # to the nearest milliwatt, as ints
    assert nvml.calls == [
        ("nvmlDeviceSetPowerManagementLimit", (("gpu", 0), 1_000_000)),
        ("nvmlDeviceSetPowerManagementLimit", (("gpu", 1), 1_000_000)),
    ]
    gpus.close()
    assert nvml.names()[-1] == "nvmlShutdown"


def test_only_the_indices_asked_for(nvml: FakeNvml) -> None:
    gpus = NvmlGpus([1])
    assert gpus.n_gpus == 1 and gpus.indices == [1]
    assert ("nvmlDeviceGetHandleByIndex", (0,)) not in nvml.calls
    gpus.set_limit_w(np.array([700.0]))
    assert nvml.limit_mw == [1_300_001, 700_000]
    gpus.close()
    for bad, match in (([2], "does not exist"), ([0, 0], "repeated")):
        nvml.calls.clear()
        with pytest.raises(GpuError, match=match):
            NvmlGpus(bad)
        assert nvml.names()[-1] == "nvmlShutdown"  # NVML is shut down again on the way out


@pytest.mark.parametrize(
    ("failing", "match"),
    [
        ("nvmlInit", "NVML unavailable"),
        ("nvmlDeviceGetCount", "NVML: nvmlDeviceGetCount failed"),
        ("nvmlDeviceGetHandleByIndex", "NVML: nvmlDeviceGetHandleByIndex failed"),
    ],
)
def test_nvml_errors_at_start_are_gpu_errors(nvml: FakeNvml, failing: str, match: str) -> None:
    nvml.fail.add(failing)
    with pytest.raises(GpuError, match=match):
        NvmlGpus()
    if failing != "nvmlInit":
        assert nvml.names()[-1] == "nvmlShutdown"


def test_nvml_errors_while_running_are_gpu_errors(nvml: FakeNvml) -> None:
    gpus = NvmlGpus()
    for name, call in (
        ("nvmlDeviceGetPowerUsage", gpus.power_w),
        ("nvmlDeviceGetEnforcedPowerLimit", gpus.enforced_limit_w),
        ("nvmlDeviceGetPowerManagementDefaultLimit", gpus.default_limit_w),
        ("nvmlDeviceGetPowerManagementLimitConstraints", gpus.constraints_w),
    ):
        nvml.fail = {name}
        with pytest.raises(GpuError, match=f"NVML: {name} failed: .*Insufficient Permissions"):
            call()
    nvml.fail = {"nvmlDeviceSetPowerManagementLimit"}
    with pytest.raises(GpuError, match="needs root"):
        gpus.set_limit_w(np.array([900.0, 900.0]))
    nvml.fail = {"nvmlShutdown"}
    gpus.close()  # an error at shutdown is not worth an exception


def test_no_pynvml_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from dimmer.cli import main

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with pytest.raises(GpuError, match="nvidia-ml-py"):
        NvmlGpus()
    capsys.readouterr()
    assert main(["agent", "--nvml", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert err == "dimmer: NVML backend needs nvidia-ml-py: python3 -m pip install nvidia-ml-py\n"


def test_read_only_backend_reaches_no_set_function(nvml: FakeNvml) -> None:
    gpus = NvmlGpus(read_only=True)
    with pytest.raises(GpuError, match="read-only"):
        gpus.set_limit_w(np.array([900.0, 900.0]))
    with pytest.raises(GpuError, match="nvmlDeviceSetPowerManagementLimit refused"):
        gpus._nv.nvmlDeviceSetPowerManagementLimit(("gpu", 0), 900_000)  # not even by reaching inside
    gpus.close()
    rows = read_gpus()
    assert rows[1] == {
        "index": 1,
        "name": "NVIDIA GB300",
        "power_w": pytest.approx(456.790),
        "peak_power_w": None,  # no power samples kept (NOT_FOUND): not measured
        "limit_w": 1300.001,
        "default_limit_w": 1200.0,
        "enforced_limit_w": 1000.0,
        "min_limit_w": 200.0,
        "max_limit_w": 1400.0,
    }
    assert not [n for n in nvml.names() if "Set" in n]


def test_bench_nvml_readonly_prints_json_and_sets_nothing(
    nvml: FakeNvml, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any) -> None:
        raise AssertionError("a set function was called")

    monkeypatch.setattr(nvml, "nvmlDeviceSetPowerManagementLimit", never)
    spec = importlib.util.spec_from_file_location("nvml_readonly", REPO / "bench" / "nvml_readonly.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    nvml.samples = [[], [(100, 700_000), (200, 905_500)]]
    assert script.main(["--gpu-index", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["index"] for r in rows] == [1] and rows[0]["enforced_limit_w"] == 1000.0
    assert rows[0]["default_limit_w"] == 1200.0 and rows[0]["power_w"] == pytest.approx(456.790)
    assert rows[0]["peak_power_w"] == pytest.approx(905.5)  # the highest of the GPU's buffered power samples
    nvml.samples = [[], []]
    assert script.main(["--gpu-index", "1"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["peak_power_w"] is None  # none kept: null, not NaN (invalid JSON)
    assert not [n for n in nvml.names() if "Set" in n]
    nvml.fail.add("nvmlInit")
    assert script.main([]) == 1
    assert capsys.readouterr().err.startswith("nvml_readonly: NVML unavailable")


def test_agent_on_nvml_reports_enforced_and_restores_default(nvml: FakeNvml) -> None:
    agent = CapAgent(NvmlGpus(), safe_cap_w=840.0)
    agent.refresh()
    a = R.rack_status_address(0)
    status = R.decode_records(R.RACK_STATUS, agent.image[a : a + R.RACK_STATUS_STRIDE], 1, R.RACK_STATUS_STRIDE)
    assert float(status["cap_w"][0]) == pytest.approx(1000.0)  # enforced, not the 1300 W management limit
    assert float(status["power_w"][0]) == pytest.approx(456.789 + 456.790)
    agent.apply(np.full(2, 900.0))
    assert nvml.limit_mw == [900_000, 900_000]
    agent.restore()
    assert nvml.limit_mw == [1_200_000, 1_200_000]  # the default, not the 1300 W it found
    assert not agent.restore_failed


def test_peak_power_is_the_highest_power_sample_since_the_last_read(nvml: FakeNvml) -> None:
    """NVML's power samples (nvmlDeviceGetSamples, NVML_TOTAL_POWER_SAMPLES): each read takes those after the newest
    one seen; none new (NOT_FOUND) or none kept (NOT_SUPPORTED, then never asked again) is NaN, not 0 W."""
    gpus = NvmlGpus()
    nvml.samples = [[(100, 900_000), (200, 1_250_500), (300, 700_000)], None]
    first = gpus.peak_power_w()
    assert first[0] == pytest.approx(1250.5) and np.isnan(first[1])
    assert np.isnan(gpus.peak_power_w()).all()  # nothing newer than 300 us: no peak, and no stale one repeated
    buf = nvml.samples[0]
    assert buf is not None
    buf.append((400, 1_100_000))
    assert gpus.peak_power_w()[0] == pytest.approx(1100.0)
    asked = [c[1] for c in nvml.calls if c[0] == "nvmlDeviceGetSamples"]
    assert [a[2] for a in asked if a[0] == ("gpu", 0)] == [0, 300, 300]  # from the newest sample seen
    assert len([a for a in asked if a[0] == ("gpu", 1)]) == 1  # not supported: asked once


def test_agent_reports_the_host_peak_rounded_up_to_the_register(nvml: FakeNvml) -> None:
    agent = CapAgent(NvmlGpus(), safe_cap_w=840.0)
    nvml.samples = [[(100, 1_000_010)], [(100, 900_000)]]
    agent.refresh()
    a = R.rack_status_address(0)
    status = R.decode_records(R.RACK_STATUS, agent.image[a : a + R.RACK_STATUS_STRIDE], 1, R.RACK_STATUS_STRIDE)
    assert float(status["load_peak_hw"][0]) == 20.0  # 1,900.01 W: 20 x 100 W, never under the draw
    agent.refresh()  # no sample since: not measured this period
    status = R.decode_records(R.RACK_STATUS, agent.image[a : a + R.RACK_STATUS_STRIDE], 1, R.RACK_STATUS_STRIDE)
    assert np.isnan(status["load_peak_hw"][0])
