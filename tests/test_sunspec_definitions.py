"""The SunSpec codecs against pysunspec2, an implementation we did not write: the same layout (lengths, offsets,
sizes, scale-factor points, access) and the same values decoded from the same registers."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.daemon import registers as R
from tests.budget import examples
from tests.sunspec_reference import points, reference_model


@pytest.mark.parametrize("mid", R.SPOKEN)
def test_layout_is_pysunspec2s(mid: int) -> None:
    block = R.model(mid)
    ref = reference_model(mid)
    assert block.length == ref.len == R.model_length(mid) + 2
    ref_points = dict(points(ref))
    assert [f.name for f in block.fields] == list(ref_points)
    for f in block.fields:
        p = ref_points[f.name]
        assert (f.offset, f.n, f.kind) == (p.offset, p.len, p.pdef["type"]), f.name
        assert f.sf == p.pdef.get("sf") and f.access == p.pdef.get("access", "R"), f.name
        assert f.mandatory == (p.pdef.get("mandatory") == "M"), f.name
        if f.sf is not None:
            assert block.field(f.sf).kind == "sunssf", f.name


def test_the_published_layouts_the_drafts_got_wrong() -> None:
    """What issue #10 measured against a conforming device, read from pysunspec2 rather than from our blocks."""
    ref = dict(points(reference_model(704)))
    assert reference_model(704).len - 2 == 65
    assert (ref["WSetPct"].pdef["type"], ref["WSetPct"].len) == ("int16", 1)
    assert (ref["WSetEnaRvrt"].offset, ref["WSetRvrtTms"].offset, ref["WSet_SF"].offset) == (30, 31, 55)
    assert ref["WSetRvrtRem"].pdef.get("access", "R") == "R"
    assert reference_model(713).len - 2 == 7 and dict(points(reference_model(713)))["SoC"].pdef["sf"] == "Pct_SF"

    def sym(mid: int, point: str, name: str) -> int:
        p = dict(points(reference_model(mid)))[point]
        return int(next(s["value"] for s in p.pdef["symbols"] if s["name"] == name))

    for mid, point, name in [(701, "ConnSt", "CONNECTED"), (701, "St", "ON"), (704, "WSetMod", "WATTS")]:
        assert R.symbol(mid, point, name) == sym(mid, point, name) == 1
    assert R.BATTERY_CONNECTED == sym(802, "State", "CONNECTED") == 3
    assert R.WSET_MOD_WATTS == 1


def test_not_implemented_sentinels_are_pysunspec2s() -> None:
    from sunspec2 import mb

    for kind in R.NA_WORDS:
        if kind == "pad":
            continue
        raw = mb.create_unimpl_value(kind)
        assert R.na_words(kind) == [int.from_bytes(raw[i : i + 2], "big") for i in range(0, len(raw), 2)], kind


def _same(ours: Any, theirs: Any, f: R.Field) -> bool:
    if isinstance(ours, float) and math.isnan(ours):
        return theirs is None
    if theirs is None:
        return False
    if f.kind in ("float32", "float64"):
        return math.isclose(float(ours), float(theirs), rel_tol=1e-6)
    return math.isclose(float(ours), float(theirs), rel_tol=1e-12, abs_tol=1e-9)


def _words(mid: int) -> st.SearchStrategy[list[int]]:
    """Register images of a model with arbitrary words, scale factors drawn from [-10, 10] or not implemented."""
    block = R.model(mid)

    def build(raw: list[int], sfs: list[int | None]) -> list[int]:
        w = list(raw)
        w[0], w[1] = mid, block.length - 2
        i = 0
        for f in block.fields:
            if f.kind == "sunssf":
                w[f.offset] = R.SF_NA if sfs[i] is None else (sfs[i] or 0) & 0xFFFF
                i += 1
        return w

    n_sf = sum(f.kind == "sunssf" for f in block.fields)
    return st.builds(
        build,
        st.lists(st.integers(0, 0xFFFF), min_size=block.length, max_size=block.length),
        st.lists(st.one_of(st.none(), st.integers(-10, 10)), min_size=n_sf, max_size=n_sf),
    )


@pytest.mark.parametrize("mid", [124, 203, 213, 701, 704, 713, 802])
def test_decoded_values_are_pysunspec2s(mid: int) -> None:
    block = R.model(mid)

    @settings(max_examples=examples(40), deadline=None)
    @given(_words(mid))
    def check(words: list[int]) -> None:
        ours = R.decode_block(block, words)
        ref = dict(points(reference_model(mid, words)))
        for f in block.fields:
            if f.kind in ("pad", "string", "eui48", "ipv6addr") or f.name in ("ID", "L"):
                continue
            p = ref[f.name]
            theirs = p.value if f.kind == "sunssf" else p.cvalue
            if f.kind == "sunssf":
                assert ours[f.name] == theirs if theirs != -32768 else ours[f.name] is None, f.name
            elif f.sf is not None and ours.get(f.sf) is None:
                assert math.isnan(float(ours[f.name])), f.name  # type: ignore[arg-type]  # no scale: unknown
            else:
                assert _same(ours[f.name], theirs, f), (f.name, ours[f.name], theirs)

    check()


@pytest.mark.parametrize("mid", [124, 203, 701, 704, 802])
def test_encoded_values_decode_in_pysunspec2(mid: int) -> None:
    """What our encoder writes for a value, pysunspec2 reads as that value (within the scale factor's step)."""
    block = R.model(mid)
    values: dict[str, float | int | str | None] = {}
    for f in block.fields:
        if f.kind == "sunssf":
            values[f.name] = -1
    for i, f in enumerate(block.fields):
        if f.kind in ("int16", "int32", "uint16", "uint32") and not f.symbols and f.name not in ("ID", "L"):
            values[f.name] = float(10 + i)
    words = R.encode_block(block, values)
    ref = dict(points(reference_model(mid, words)))
    for name, v in values.items():
        f = block.field(name)
        if f.kind == "sunssf":
            assert ref[name].value == -1
        else:
            assert ref[name].cvalue == pytest.approx(v), name
    untouched = [f for f in block.fields if f.name not in values and f.kind not in ("pad", "string")]
    assert all(ref[f.name].value is None for f in untouched if f.name not in ("ID", "L"))
