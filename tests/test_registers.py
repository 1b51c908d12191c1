"""Register codecs and maps, against hand-computed words (the SunSpec models against pysunspec2:
tests/test_sunspec_definitions.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.daemon import registers as R

DOC = Path(__file__).resolve().parents[1] / "docs" / "registers.md"


def test_a_signalling_nan_decodes_to_nan_without_a_warning() -> None:
    """Found by the long hypothesis run: 0x7F80 0x0001 (a signalling NaN) raised numpy's 'invalid value' warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(R.decode_float32([0x7F80, 0x0001])[0])
        assert np.isnan(R.decode_float32([0xFF80, 0x0001, 0x7F80, 0x0001])).all()


def test_float32_is_ieee754_high_word_first() -> None:
    assert R.encode_float32(1.0) == [0x3F80, 0x0000]
    assert R.encode_float32(-2.5) == [0xC020, 0x0000]
    assert R.decode_float32([0x4049, 0x0FDB])[0] == pytest.approx(math.pi, rel=1e-7)
    assert R.encode_float32(math.nan) == [0x7FC0, 0x0000]
    assert math.isnan(R.decode_float32([0x7FC0, 0x0000])[0])
    assert math.isnan(R.decode_float32([0xFFC0, 0x0001])[0])  # any NaN pattern
    assert R.decode_float32(R.encode_float32(math.inf))[0] == math.inf
    with pytest.raises(R.EncodeError):
        R.encode_float32(1e39)


def test_integers_and_word_order() -> None:
    assert R.decode_uint32([0x0001, 0x0000])[0] == 65536.0  # high word first
    assert R.encode_uint32(65536) == [0x0001, 0x0000]
    assert R.decode_int16([0xFFFF])[0] == -1.0
    assert R.encode_int16(-1) == [0xFFFF]
    assert R.decode_int32([0xFFFF, 0xFFFE])[0] == -2.0
    assert R.encode_int32(-2) == [0xFFFF, 0xFFFE]
    assert R.encode_uint16([0, 65534]) == [0, 65534]
    with pytest.raises(R.EncodeError):
        R.encode_uint16(65535)  # the sentinel is not a value
    with pytest.raises(R.EncodeError):
        R.encode_int16(-32768)
    with pytest.raises(R.EncodeError):
        R.encode_uint16(-1)


def test_sentinels_are_nan_never_zero() -> None:
    assert math.isnan(R.decode_int16([0x8000])[0])
    assert math.isnan(R.decode_uint16([0xFFFF])[0])
    assert math.isnan(R.decode_int32([0x8000, 0x0000])[0])
    assert math.isnan(R.decode_uint32([0xFFFF, 0xFFFF])[0])
    assert math.isnan(R.decode_acc32([0, 0])[0])
    assert R.decode_acc32([0, 1])[0] == 1.0
    assert R.decode_sf(0x8000) is None
    assert R.decode_string([0, 0, 0]) is None
    assert R.encode_int16(math.nan) == [0x8000]
    assert R.encode_uint16(math.nan) == [0xFFFF]


def test_scale_factors() -> None:
    assert R.decode_sf(0xFFFE) == -2
    assert R.decode_sf(3) == 3
    assert R.decode_sf(11) is None  # outside [-10, 10]
    assert R.decode_sf(0xFFF5) is None  # -11
    assert R.apply_sf(np.array([1234.0]), -1)[0] == pytest.approx(123.4)
    assert math.isnan(R.apply_sf(np.array([1234.0]), None)[0])
    assert R.sf_for(72e6) == 4  # 72 MW / 10^4 = 7200 <= 32767; / 10^3 = 72000 does not fit
    assert R.sf_for(100.0) == -2
    assert R.sf_for(32767.0) == 0


def test_strings() -> None:
    assert R.encode_string("SunS", 2) == [0x5375, 0x6E53]
    assert R.decode_string([0x5375, 0x6E53]) == "SunS"
    assert R.encode_string("abc", 3) == [0x6162, 0x6300, 0]
    assert R.decode_string([0x6162, 0x6300, 0]) == "abc"
    with pytest.raises(R.EncodeError):
        R.encode_string("abcde", 2)
    with pytest.raises(R.EncodeError):
        R.encode_string("é", 2)


def test_bad_words_are_decode_errors() -> None:
    with pytest.raises(R.DecodeError):
        R.decode_uint16([70000])
    with pytest.raises(R.DecodeError):
        R.decode_uint16([-1])
    with pytest.raises(R.DecodeError):
        R.decode_float32([1, 2, 3])  # odd count
    with pytest.raises(R.DecodeError):
        R.as_words([1, 2], count=3)
    with pytest.raises(R.DecodeError):
        R.check_suns([0x5375, 0x6E54])


def test_sunspec_image_walk() -> None:
    models = [R.MODEL_1, R.MODEL_701, R.MODEL_704, R.MODEL_802]
    img = R.sunspec_image([(m, {}) for m in models])
    R.check_suns(img[:2])
    offsets = R.model_offsets(models)
    at, seen = 2, []
    while (hdr := R.model_header(img[at : at + 2])) is not None:
        seen.append(hdr[0])
        assert offsets[hdr[0]] == at
        at += 2 + hdr[1]
    assert seen == [1, 701, 704, 802]
    assert at + 2 == len(img)


def test_partial_block_decode() -> None:
    words = R.encode_block(R.MODEL_704, {"WSetRvrtRem": 7})
    stop = R.MODEL_704.offset("WSetRvrtRem") + 2
    with pytest.raises(R.DecodeError):
        R.decode_block(R.MODEL_704, words[:stop])
    v = R.decode_block(R.MODEL_704, words[:stop], partial=True)
    assert v["WSetRvrtRem"] == 7.0 and "WSet_SF" not in v
    assert math.isnan(v["WSet"])  # type: ignore[arg-type]  # its scale factor was not read
    assert R.MODEL_704.stop("WSet") == R.MODEL_704.offset("WSet_SF") + 1  # a read for WSet covers its scale factor


def test_a_missing_scale_factor_makes_the_value_unknown() -> None:
    words = R.encode_block(R.MODEL_203, {"W": 15_103_000.0, "W_SF": 3, "Hz": 50.02, "Hz_SF": -2})
    assert R.decode_block(R.MODEL_203, words)["W"] == 15_103_000.0
    words[R.MODEL_203.offset("W_SF")] = R.SF_NA
    assert math.isnan(R.decode_block(R.MODEL_203, words)["W"])  # type: ignore[arg-type]
    words[R.MODEL_203.offset("W_SF")] = 11  # outside [-10, 10]
    assert math.isnan(R.decode_block(R.MODEL_203, words)["W"])  # type: ignore[arg-type]


def test_rack_map_layout() -> None:
    assert R.RACK_STATUS_BASE == 16 + 8 * 64
    assert R.rack_cmd_address(3) == 16 + 24 and R.rack_status_address(2) == 528 + 24
    # header and commands are one writable span from lease_s: the daemon writes them in one go
    assert R.RACK_HEADER.field("lease_s").offset == 12 and R.RACK_HEADER.field("heartbeat").offset == 14
    assert R.RACK_HEADER.length == R.RACK_CMD_BASE
    hdr = R.encode_block(
        R.RACK_HEADER, {"magic": "DMRK", "version": 1, "n_racks": 64, "first_rack": 70000, "safe_cap_w": 900.0}
    )
    v = R.decode_block(R.RACK_HEADER, hdr)
    assert (v["magic"], v["version"], v["n_racks"], v["first_rack"], v["safe_cap_w"]) == ("DMRK", 1, 64, 70000, 900)
    assert math.isnan(v["lease_s"])  # type: ignore[arg-type]


def test_records_round_trip_and_ranges() -> None:
    vals = {
        "power_w": np.array([120e3, 0.0, 5.5e4]),
        "load_w": np.array([118e3, 1.0, np.nan]),
        "cap_w": np.array([1400.0, 600.0, 200.0]),
        "floor_w": np.zeros(3),
        "bbu_soc_frac": np.array([1.0, 0.25, 2.0]),  # 2.0 is out of range
        "energized": np.array([1.0, 0.0, 1.0]),
    }
    words = R.encode_records(R.RACK_STATUS, vals, 3, R.RACK_STATUS_STRIDE)
    assert len(words) == 36
    out = R.decode_records(R.RACK_STATUS, words, 3, R.RACK_STATUS_STRIDE)
    np.testing.assert_allclose(out["power_w"], vals["power_w"], rtol=1e-7)
    assert math.isnan(out["load_w"][2])
    np.testing.assert_array_equal(out["bbu_soc_frac"][:2], [1.0, 0.25])
    assert math.isnan(out["bbu_soc_frac"][2])
    np.testing.assert_array_equal(out["energized"], [1.0, 0.0, 1.0])
    assert np.isnan(out["load_peak_hw"]).all()  # not given: not measured


def test_the_peak_register_is_the_record_s_last_word_and_0_reads_as_not_measured() -> None:
    """load_peak_hw took the status record's reserved last word: a device written to map version 1 before it left
    that word at 0, which must read as no peak (a 0 W peak would be a rack that draws nothing)."""
    assert R.RACK_STATUS_STRIDE == 12 and max(f.offset + f.n for f in R.RACK_STATUS) == 12
    words = R.encode_records(R.RACK_STATUS, {"load_peak_hw": np.array([1265.0, np.nan, 1.0])}, 3, 12)
    assert words[11] == 1265 and words[23] == 0xFFFF and words[35] == 1
    words[35] = 0
    out = R.decode_records(R.RACK_STATUS, words, 3, 12)["load_peak_hw"]
    assert out[0] == 1265.0 and np.isnan(out[1]) and np.isnan(out[2])


def test_docs_tables_match_the_code() -> None:
    text = DOC.read_text()
    begin, end = "<!-- tables:begin -->\n", "<!-- tables:end -->"
    assert text[text.index(begin) + len(begin) : text.index(end)] == R.registers_markdown()


def test_write_error_is_one_vetting_path_for_every_map() -> None:
    """Issue 12, item 13: the project's rack map and a SunSpec model vetted by the same function."""
    rack = R.rack_block(2)
    img = np.zeros(rack.length, dtype=np.uint16)
    img[12:14] = R.encode_float32(10.0)
    for i in range(2):
        img[R.rack_cmd_address(i) : R.rack_cmd_address(i + 1)] = R.encode_float32([800.0, 0.0, math.inf, 0.0])
    assert R.rack_write_error(img, 12, 4, 2) is None and R.rack_write_error(img, 16, 16, 2) is None
    for at, value, code in ((12, 1e30, 3), (12, 0.0, 3), (16, math.nan, 3), (26, -1.0, 3), (20, math.inf, None)):
        cand = img.copy()
        cand[at : at + 2] = R.encode_float32(value)
        got = R.rack_write_error(cand, at, 2, 2)
        assert (got and got[0]) == code, (at, value, got)
    assert R.rack_write_error(img, 13, 1, 2) == (2, "lease_s is 2 registers at 12: written in part")
    assert R.rack_write_error(img, 17, 2, 2) is not None  # across the end of one value and into the next
    # a SunSpec model: enums among their symbols, scaled int32 points whole, "not implemented" left to the model
    m704 = R.MODEL_704
    words = np.asarray(R.encode_block(m704, {"WSet_SF": 0, "WSetMod": R.WSET_MOD_WATTS}), dtype=np.uint16)
    wset, mod = m704.field("WSet"), m704.field("WSetMod")
    half = R.write_error(m704, wset.offset, 1, words, na_ok=True)
    assert half is not None and half[0] == R.ILLEGAL_ADDRESS
    assert R.write_error(m704, wset.offset, 2, words, na_ok=True) is None  # not implemented: the model's call
    refused = R.write_error(m704, wset.offset, 2, words)
    assert refused is not None and refused[0] == R.ILLEGAL_VALUE and refused[1].startswith("WSet nan")
    bad = words.copy()
    bad[mod.offset] = 7
    assert R.write_error(m704, mod.offset, 1, bad, na_ok=True) == (R.ILLEGAL_VALUE, "WSetMod 7: not one of its symbols")


# any word, and often one a sentinel or a float's edge is made of (NaN, infinity, sign bit, zero)
WORDS = st.one_of(st.integers(0, 0xFFFF), st.sampled_from([0, 1, 0x7FFF, 0x8000, 0xFFFF, 0x7F80, 0x7FC0, 0xFF80]))


def _same(fast: dict[str, object], slow: dict[str, object]) -> None:
    assert fast.keys() == slow.keys()
    for key, v in slow.items():
        if isinstance(v, float) and math.isnan(v):
            assert isinstance(fast[key], float) and math.isnan(fast[key]), key
        else:
            assert fast[key] == v, key


@settings(max_examples=300)
@given(st.lists(WORDS, min_size=48, max_size=48), st.sampled_from(["building", "rack", "site"]))
def test_the_numeric_decoder_reads_every_block_as_decode_block_does(words: list[int], which: str) -> None:
    """The struct decoder the coordinator uses on every building, against the one every map is read with: the
    same value (NaN where not implemented or out of range) for any register contents."""
    block = {"building": R.BUILDING_HEADER, "rack": R.RACK_HEADER, "site": R.SITE_HEADER}[which]
    w = words[: block.length] + [0] * max(block.length - len(words), 0)
    _same(R.NumericDecoder(block).decode(w), R.decode_block(block, w))


@settings(max_examples=200)
@given(st.lists(WORDS, min_size=8 * 6, max_size=8 * 6), st.integers(1, 8))
def test_the_record_decoder_reads_a_buildings_groups_as_decode_records_does(words: list[int], n: int) -> None:
    fields, stride = R.BUILDING_GROUP, R.BUILDING_GROUP_STRIDE
    fast, slow = R.RecordDecoder(fields, stride).decode(words, n), R.decode_records(fields, words, n, stride)
    assert fast.keys() == slow.keys()
    for key, v in slow.items():
        assert fast[key].shape == (n,)
        np.testing.assert_array_equal(fast[key], v, err_msg=key)  # NaN where NaN


@settings(max_examples=200)
@given(
    st.floats(0.0, 86400.0, exclude_min=True),
    st.integers(0, 0xFFFFFFFE),
    st.floats(0.0, R.BUILDING_HEADER.field("ceiling_w").hi),
    st.floats(0.0, R.BUILDING_HEADER.field("floor_w").hi),
)
def test_a_budget_write_packed_by_struct_is_the_maps_encoding(
    lease: float, beat: int, ceil: float, floor: float
) -> None:
    from dimmer.daemon.building_device import BUDGET_STRUCT, BUDGET_WORDS

    packed = list(BUDGET_WORDS.unpack(BUDGET_STRUCT.pack(lease, beat, ceil, floor)))
    assert packed == R.encode_float32(lease) + R.encode_uint32(beat) + R.encode_float32([ceil, floor])
    got = R.NumericDecoder(R.BUILDING_HEADER).decode([0] * R.BUDGET_AT + packed + [0] * 8)
    assert got["heartbeat"] == beat and got["lease_s"] == float(np.float32(lease))


def test_the_struct_decoders_refuse_what_is_not_a_register_word() -> None:
    dec = R.NumericDecoder(R.BUILDING_HEADER)
    good = [0] * dec.length
    for bad, why in (([*good[:-1], 0x10000], "0..65535"), ([*good[:-1], -1], "0..65535"), (good[:-1], "cover")):
        with pytest.raises(R.DecodeError, match=why):
            dec.decode(bad)
    with pytest.raises(R.DecodeError, match="cover"):
        R.RecordDecoder(R.BUILDING_GROUP, R.BUILDING_GROUP_STRIDE).decode([0] * 11, 2)
    with pytest.raises(ValueError, match="scaled"):
        R.NumericDecoder(R.MODEL_704)
