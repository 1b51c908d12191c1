"""nvidia-smi power-trace parser: the measured 2-GPU training log, gap filling, and malformed files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dimmer.errors import InputError
from gridsim.plant.trace import load_nvsmi_trace

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TITANX = DATA / "gpu_titanx_2gpu_ddp_gpt_train_nvsmi100ms_noburn_2025-12-10.csv"
HEADER = "timestamp, power.draw [W], utilization.gpu [%], memory.used [MiB]"


def _write(tmp_path: Path, rows: list[str], name: str = "t.csv", newline: str = "\n") -> Path:
    p = tmp_path / name
    p.write_bytes(newline.join(rows).encode() + newline.encode())
    return p


def _rows(powers: list[str], gpus: int = 1, t0: float = 10.0, step_s: float = 0.1) -> list[str]:
    rows = [HEADER]
    for i, pw in enumerate(powers):
        t = t0 + (i // gpus) * step_s
        rows.append(f"2025/12/10 17:40:{t:06.3f}, {pw}, 80 %, 100 MiB")
    return rows


@pytest.fixture
def titanx() -> tuple[np.ndarray, np.ndarray]:
    if not TITANX.is_file():
        pytest.skip(f"measured trace {TITANX} is absent")
    return load_nvsmi_trace(TITANX, 2, "test", "jobs[0].trace_path")


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) index ranges where mask is True."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def test_titanx_trace_level_swing_and_dips(titanx: tuple[np.ndarray, np.ndarray]) -> None:
    t_s, power_w = titanx
    assert power_w.shape == (3285, 2)  # 6570 rows alternating 2 GPUs
    assert t_s[0] == 0.0 and np.all(np.diff(t_s) >= 0)
    assert 0.09 < float(np.median(np.diff(t_s))) < 0.12  # logged every ~100 ms
    assert 340 < t_s[-1] < 347
    total = power_w.sum(axis=1)
    busy = t_s > 24.0  # the first ~24 s are the GPUs idling (~35 W for both) before training starts
    assert 30 < float(np.median(total[t_s < 18])) < 40
    # README: the two-GPU total swings ~140 <-> 430 W
    assert 415 < float(total[busy].max()) < 440
    assert 135 < float(total[busy].min()) < 150
    # within training phases the iteration swing is a third of the peak or more
    train = busy & (total > 230)
    assert 360 < float(np.median(total[train])) < 395
    lo, hi = np.percentile(total[train], [2, 98])
    assert (hi - lo) / hi > 0.25
    # ~10-16 s dips to 140-190 W at every evaluation/checkpoint, about every 36 s
    dips = [(a, b) for a, b in _runs(busy & (total < 200)) if t_s[b - 1] - t_s[a] > 5.0]
    assert len(dips) >= 8
    lengths = [t_s[b - 1] - t_s[a] for a, b in dips[:-1]]  # the last one runs to the end of the log
    assert all(8.0 < x < 20.0 for x in lengths)
    starts = np.asarray([t_s[a] for a, _ in dips])
    assert 30 < float(np.median(np.diff(starts))) < 42


def test_titanx_iteration_is_sub_second(titanx: tuple[np.ndarray, np.ndarray]) -> None:
    t_s, power_w = titanx
    seg = (t_s > 64) & (t_s < 80)  # one training phase
    x = power_w[seg].sum(axis=1)
    x = x - x.mean()
    dt = float(np.median(np.diff(t_s[seg])))
    f = np.fft.rfftfreq(x.size, dt)
    f_peak = f[np.argmax(np.abs(np.fft.rfft(x)))]
    assert 0.3 < 1.0 / f_peak < 0.6  # ~0.41 s per iteration (within the 0.3-5 s of Choukse et al.)


def test_gaps_are_interpolated_and_formats_agree(tmp_path: Path) -> None:
    vals = ["100.00 W", "[N/A]", "300.00 W", "0.00 W", "[Unknown Error]", "600.00 W"]
    t, p = load_nvsmi_trace(_write(tmp_path, _rows(vals)), 1, "s", "k")
    np.testing.assert_allclose(p[:, 0], [100, 200, 300, 400, 500, 600])
    np.testing.assert_allclose(t, np.arange(6) * 0.1, atol=1e-6)
    # CRLF, no units, and 2 GPUs interleaved
    vals2 = ["10", "20", "[N/A]", "[N/A]", "30", "40"]
    t2, p2 = load_nvsmi_trace(_write(tmp_path, _rows(vals2, gpus=2), "u.csv", "\r\n"), 2, "s", "k")
    np.testing.assert_allclose(p2, [[10, 20], [20, 30], [30, 40]])
    np.testing.assert_allclose(t2, [0.0, 0.1, 0.2], atol=1e-6)
    # a trailing incomplete sample (log cut mid-sample) is dropped
    _, p3 = load_nvsmi_trace(_write(tmp_path, _rows([*vals2, "50"], gpus=2), "v.csv"), 2, "s", "k")
    assert p3.shape == (3, 2)
    # leading and trailing gaps take the nearest reading
    _, p4 = load_nvsmi_trace(_write(tmp_path, _rows(["[N/A]", "5 W", "7 W", "0 W"]), "w.csv"), 1, "s", "k")
    np.testing.assert_allclose(p4[:, 0], [5, 5, 7, 7])


def _expect_error(path: Path, gpus: int, *parts: str) -> None:
    with pytest.raises(InputError) as info:
        load_nvsmi_trace(path, gpus, "scn.toml", "jobs[2].trace_path")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("scn.toml: jobs[2].trace_path: ")
    for part in parts:
        assert part in msg, msg


def test_malformed_files(tmp_path: Path) -> None:
    good = _rows(["100 W", "110 W", "120 W", "130 W"])
    _expect_error(tmp_path / "nope.csv", 1, "nope.csv", "an existing")
    _expect_error(_write(tmp_path, ["time, watts", "1, 2"], "h.csv"), 1, "h.csv:1:", "header")
    _expect_error(_write(tmp_path, [], "e.csv"), 1, "e.csv:1:")
    bad = list(good)
    bad[3] = "2025/12/10 17:40:10.200, abc W, 80 %, 100 MiB"
    _expect_error(_write(tmp_path, bad, "b.csv"), 1, "b.csv:4:", "power like", "column 2")
    neg = list(good)
    neg[2] = "2025/12/10 17:40:10.100, -5 W, 80 %, 100 MiB"
    _expect_error(_write(tmp_path, neg, "n.csv"), 1, "n.csv:3:")
    trunc = [*good, "2025/12/10 17:40:10.4"]
    _expect_error(_write(tmp_path, trunc, "tr.csv"), 1, "tr.csv:6:", "fields")
    stamp = list(good)
    stamp[2] = "yesterday, 100 W, 80 %, 100 MiB"
    _expect_error(_write(tmp_path, stamp, "ts.csv"), 1, "ts.csv:3:", "timestamp")
    back = list(good)
    back[4] = "2025/12/10 17:39:00.000, 100 W, 80 %, 100 MiB"
    _expect_error(_write(tmp_path, back, "bk.csv"), 1, "bk.csv:5:", "backwards")
    _expect_error(_write(tmp_path, _rows(["[N/A]", "0 W", "[N/A]"]), "g.csv"), 1, "g.csv", "GPU 0")
    _expect_error(_write(tmp_path, _rows(["100 W"]), "one.csv"), 1, "one.csv", "at least 2 samples")
    _expect_error(_write(tmp_path, good, "z.csv"), 0, "trace_gpus")
