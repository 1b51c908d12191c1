"""Round trips of every register codec, and "arbitrary words never raise anything but DecodeError"."""

from __future__ import annotations

import asyncio
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.daemon import registers as R
from dimmer.daemon.bus import InMemoryBus
from dimmer.daemon.devices import RackDevice, SiteDevice, SunSpecBattery, SunSpecMeter
from tests.budget import examples

S = settings(max_examples=examples(50), deadline=None)
words_st = st.lists(st.integers(0, 0xFFFF), min_size=0, max_size=40)
even_words_st = st.lists(st.integers(0, 0xFFFF), min_size=0, max_size=20).map(lambda w: w + w[: len(w) % 2])


@S
@given(st.lists(st.integers(0, 0xFFFE), min_size=1, max_size=20))
def test_uint16_round_trip(xs: list[int]) -> None:
    assert R.decode_uint16(R.encode_uint16(xs)).tolist() == xs


@S
@given(st.lists(st.integers(-0x7FFF, 0x7FFF), min_size=1, max_size=20))
def test_int16_round_trip(xs: list[int]) -> None:
    assert R.decode_int16(R.encode_int16(xs)).tolist() == xs


@S
@given(st.lists(st.integers(0, 0xFFFFFFFE), min_size=1, max_size=20))
def test_uint32_round_trip(xs: list[int]) -> None:
    assert R.decode_uint32(R.encode_uint32(xs)).tolist() == xs


@S
@given(st.lists(st.integers(-0x7FFFFFFF, 0x7FFFFFFF), min_size=1, max_size=20))
def test_int32_round_trip(xs: list[int]) -> None:
    assert R.decode_int32(R.encode_int32(xs)).tolist() == xs


@S
@given(st.lists(st.integers(1, 0xFFFFFFFF), min_size=1, max_size=20))
def test_acc32_round_trip(xs: list[int]) -> None:
    assert R.decode_acc32(R.encode_acc32(xs)).tolist() == xs


@S
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=20))
def test_float32_round_trip(xs: list[float]) -> None:
    out = R.decode_float32(R.encode_float32(xs))
    ref = np.asarray(xs, dtype=np.float64)
    assert np.array_equal(out, ref, equal_nan=True)


@S
@given(st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127), max_size=32))
def test_string_round_trip(text: str) -> None:
    words = R.encode_string(text, 16)
    assert len(words) == 16
    assert R.decode_string(words) == (text or None)


@S
@given(st.integers(-0x7FFF, 0x7FFF), st.integers(R.SF_MIN, R.SF_MAX))
def test_scaled_value_round_trip(raw: int, sf: int) -> None:
    value = raw * 10.0**sf
    words = R.encode_block(R.MODEL_701, {"W": value, "W_SF": sf})
    assert words[10] == raw & 0xFFFF
    assert R.decode_block(R.MODEL_701, words)["W"] == value


@S
@given(
    st.integers(1, R.RACK_MAX),
    st.lists(st.floats(0.0, 1e5, width=32), min_size=R.RACK_MAX, max_size=R.RACK_MAX),
    st.lists(st.floats(0.0, 1e9, width=32), min_size=R.RACK_MAX, max_size=R.RACK_MAX),
)
def test_rack_records_round_trip(n: int, caps: list[float], thresholds: list[float]) -> None:
    thr = np.asarray(thresholds[:n])
    thr[::3] = np.inf  # backup only is a legal threshold
    vals = {
        "cap_w": np.asarray(caps[:n]),
        "floor_w": np.zeros(n),
        "bbu_threshold_w": thr,
        "bbu_recharge_w": np.zeros(n),
    }
    words = R.encode_records(R.RACK_COMMAND, vals, n, R.RACK_CMD_STRIDE)
    out = R.decode_records(R.RACK_COMMAND, words, n, R.RACK_CMD_STRIDE)
    for k, v in vals.items():
        assert np.array_equal(out[k], v), k


@S
@given(words_st)
def test_arbitrary_words_decode_or_raise_decode_error(words: list[int]) -> None:
    for fn in (R.decode_uint16, R.decode_int16, R.decode_uint32, R.decode_int32, R.decode_acc32, R.decode_float32):
        try:
            out = fn(words)
            assert out.dtype == np.float64
        except R.DecodeError:
            assert len(words) % 2 == 1 and fn not in (R.decode_uint16, R.decode_int16)
    R.decode_string(words)
    for w in words[:3]:
        sf = R.decode_sf(w)
        assert sf is None or R.SF_MIN <= sf <= R.SF_MAX


@S
@given(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=10))
def test_out_of_range_words_are_decode_errors(words: list[int]) -> None:
    bad = any(not 0 <= w <= 0xFFFF for w in words)
    try:
        R.decode_uint16(words)
        assert not bad
    except R.DecodeError:
        assert bad


@S
@given(st.sampled_from(sorted(R.SUNSPEC_MODELS)), st.data())
def test_arbitrary_words_decode_every_block(mid: int, data: st.DataObject) -> None:
    block = R.SUNSPEC_MODELS[mid]
    words = data.draw(st.lists(st.integers(0, 0xFFFF), min_size=block.length, max_size=block.length))
    out = R.decode_block(block, words)
    for f in block.fields:
        v = out.get(f.name)  # pad points carry nothing
        if isinstance(v, float) and not math.isnan(v):
            assert f.lo <= v <= f.hi  # never out of the declared range: NaN instead
    for blk in (R.RACK_HEADER, R.SITE_HEADER):
        R.decode_block(blk, words[: blk.length] + [0] * max(0, blk.length - len(words)))


@S
@given(st.integers(1, 8), st.data())
def test_arbitrary_words_decode_records(n: int, data: st.DataObject) -> None:
    words = data.draw(st.lists(st.integers(0, 0xFFFF), min_size=n * 12, max_size=n * 12))
    out = R.decode_records(R.RACK_STATUS, words, n, R.RACK_STATUS_STRIDE)
    for f in R.RACK_STATUS:
        v = out[f.name]
        ok = ~np.isnan(v)
        assert np.all((v[ok] >= f.lo) & (v[ok] <= f.hi))


@settings(max_examples=examples(25), deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), min_size=700, max_size=700), st.sampled_from([0, 40000]))
def test_devices_on_arbitrary_registers_never_raise(words: list[int], base: int) -> None:
    """Whatever a device holds, read() returns a Reading (ok or not), never an exception."""

    async def go() -> None:
        bus = InMemoryBus()
        bus.set_words(1, base, words)
        bus.set_words(1, 40000, words)
        devices = [
            SunSpecMeter(bus, 1, base),
            SunSpecMeter(bus, 1, None),
            SunSpecBattery(bus, 1, base),
            RackDevice(bus, 1, 0, 8),
            SiteDevice(bus, 1, 10, 2),
        ]
        for dev in devices:
            r = await dev.read()
            assert r.ok == (r.error is None)
            if not r.ok:
                for v in r.values.values():
                    assert np.all(np.isnan(v))

    asyncio.run(go())


def _valid_images() -> dict[int, list[int]]:
    battery = R.sunspec_image(
        [
            (R.MODEL_1, {"Mn": "x"}),
            (R.MODEL_701, {"W": 1000.0, "W_SF": 0, "ConnSt": 2}),
            (R.MODEL_704, {"WSet_SF": 0}),
            (R.MODEL_802, {"SoC": 50.0, "SoC_SF": 0, "State": 3}),
        ]
    )
    meter = R.sunspec_image([(R.MODEL_1, {}), (R.MODEL_203, {"W": 5.0, "W_SF": 0})])
    rack = R.encode_block(R.RACK_HEADER, {"magic": "DMRK", "version": 1, "n_racks": 4, "first_rack": 0})
    rack += [0] * (R.rack_status_address(4) - len(rack))
    site = R.encode_block(R.SITE_HEADER, {"magic": "DMST", "version": 1, "n_domains": 3, "n_jobs": 1})
    site += [0] * (R.site_domain_address(3) - len(site))
    return {2: battery, 1: meter, 10: rack, 3: site}


@settings(max_examples=examples(50), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 0xFFFF)), min_size=1, max_size=6))
def test_devices_on_corrupted_valid_images_never_raise(edits: list[tuple[int, int]]) -> None:
    """Valid layouts with a few registers overwritten: deeper paths (model chain, headers, records)."""

    async def go() -> None:
        bus = InMemoryBus()
        images = _valid_images()
        for unit, img in images.items():
            img = list(img)
            for i, w in edits:
                img[i % len(img)] = w
            bus.set_words(unit, 40000 if unit in (1, 2) else 0, img)
        devices = [SunSpecMeter(bus, 1), SunSpecBattery(bus, 2), RackDevice(bus, 10, 0, 4), SiteDevice(bus, 3, 3, 1)]
        for dev in devices:
            r = await dev.read()
            assert r.ok == (r.error is None)
            if r.ok:
                assert set(r.values) == set(dev.nan_values())

    asyncio.run(go())
