"""Fuzzing the two TOML doors (issue 6): the scenario loader (gridsim.scenario) and the daemon's site config
(dimmer.daemon.config), from arbitrary TOML documents, mutations of valid files, and arbitrary bytes.

What every case states: the loader either returns (and a valid file always does) or raises dimmer.errors.InputError
whose str() is ONE line beginning with the source it names; no other exception escapes. Mutations that must make a
file invalid (a misspelt key, a required key dropped, a number replaced by a non-numeric string) must raise, and a
misspelt key must be named in the message.
"""

from __future__ import annotations

import copy
import math
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dimmer.daemon.config import load_config, validate_config
from dimmer.errors import InputError, key_path
from gridsim.scenario import load_scenario, validate_scenario

REPO = Path(__file__).resolve().parents[2]
SCENARIO = REPO / "scenarios" / "curtailment.toml"
CONFIG = REPO / "examples" / "site.toml"
REQUIRED = {"scenario": ("name", "duration_s", "site"), "config": ("site", "devices")}
SUFFIX = "_zz"  # a misspelling no schema key ends with
# the function-scoped tmp_path is reused across a test's examples: each example overwrites the one file
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# -- a TOML writer (inline tables, so any nesting is one line per top-level key) ---------------------------------------


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_string(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def dumps(doc: dict[str, Any]) -> str:
    return "".join(f"{_string(k)} = {_value(v)}\n" for k, v in doc.items())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    text = dumps(doc)
    assert _same(tomllib.loads(text), doc)  # the writer is right, so a failure below is the loader's
    path = tmp_path / "fuzz.toml"
    path.write_text(text, encoding="utf-8")
    return path


# -- the loaders and the one property all of them share -------------------------------------------------------------

Loader = Callable[[Path], object]
LOADERS: dict[str, Loader] = {"scenario": load_scenario, "config": load_config}


def outcome(kind: str, path: Path) -> InputError | None:
    """None if the file loads; the InputError if not (asserted one line, naming the file). Anything else escapes."""
    try:
        LOADERS[kind](path)
    except InputError as exc:
        msg = str(exc)
        assert "\n" not in msg and "\r" not in msg, f"error is not one line: {msg!r}"
        assert msg.startswith(f"{path}: "), f"error does not name the source: {msg!r}"
        return exc
    return None


def in_memory(kind: str, doc: dict[str, Any]) -> None:
    """The validators without a file: load or a one-line InputError naming the source, nothing else."""
    try:
        if kind == "scenario":
            validate_scenario(doc, "mem.toml")
        else:
            validate_config(doc, "mem.toml", Path("."))
    except InputError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("mem.toml: ")


def base(kind: str) -> dict[str, Any]:
    with (SCENARIO if kind == "scenario" else CONFIG).open("rb") as f:
        return tomllib.load(f)


BASES = {k: base(k) for k in LOADERS}


def test_valid_files_load_through_the_writer(tmp_path: Path) -> None:
    for kind in LOADERS:
        assert outcome(kind, write(tmp_path, BASES[kind])) is None


# -- arbitrary documents ------------------------------------------------------------------------------------------

text = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)
# Keys without line breaks: a key holding one is echoed raw into the error (test_key_with_a_newline_*, xfail).
keys = st.text(st.characters(exclude_categories=["Cs", "Cc", "Zl", "Zp"]), max_size=8)
scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3), max_leaves=12
)
documents = st.dictionaries(st.one_of(keys, st.sampled_from(["site", "jobs", "devices", "name"])), values, max_size=5)


@FUZZ
@given(kind=st.sampled_from(sorted(LOADERS)), doc=documents)
def test_arbitrary_toml_gives_one_line_errors(tmp_path: Path, kind: str, doc: dict[str, Any]) -> None:
    # an arbitrary document lacks a valid [site] (a random one is never a complete power tree): it cannot load
    assert outcome(kind, write(tmp_path, doc)) is not None
    in_memory(kind, doc)


@FUZZ
@given(kind=st.sampled_from(sorted(LOADERS)), data=st.binary(max_size=200))
def test_arbitrary_bytes_give_one_line_errors(tmp_path: Path, kind: str, data: bytes) -> None:
    path = tmp_path / "fuzz.toml"
    path.write_bytes(data)
    assert outcome(kind, path) is not None


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_key_with_a_newline_gives_a_one_line_error(tmp_path: Path, kind: str) -> None:
    """Found by the fuzzer: TOML allows any character in a quoted key, and an unknown key is named raw, so
    `"a\\nb" = 1` gives a two-line message. key_path should render such a key quoted (repr) when it is not plain."""
    path = tmp_path / "fuzz.toml"
    path.write_text(dumps({**BASES[kind], "a\nb": 1}), encoding="utf-8")
    outcome(kind, path)


def test_not_utf8_and_not_toml(tmp_path: Path) -> None:
    path = tmp_path / "fuzz.toml"
    for data, expected in ((b"\xff\xfe\x00name", "UTF-8"), (b"name = = 1", "valid TOML"), (b"", "required")):
        path.write_bytes(data)
        for kind in LOADERS:
            err = outcome(kind, path)
            assert err is not None and expected in str(err)


# -- mutations of the valid files ---------------------------------------------------------------------------------


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a document (dict keys and list indices)."""
    out: list[tuple[Any, ...]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


PATHS = {k: _paths(BASES[k]) for k in LOADERS}
OPS = ("drop", "retype", "negate", "misspell", "extreme")
OTHER = ("not a number", True, [1, "x"], {"k": 1}, 7, 0.5)
EXTREMES = (0, -1, 0.0, -0.0, 1e308, math.inf, -math.inf, math.nan, 2**62, -(2**62))


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    node = doc
    for k in path[:-1]:
        node = node[k]
    return node


def mutate(doc: dict[str, Any], path: tuple[Any, ...], op: str, pick: int) -> tuple[dict[str, Any], str]:
    """Apply `op` at `path`; returns the new document and what the mutation must lead to ("invalid" or "either")."""
    doc = copy.deepcopy(doc)
    parent, key = _parent(doc, path), path[-1]
    old = parent[key]
    if op == "drop":
        del parent[key]
        return doc, "either"
    if op == "retype":
        new = OTHER[pick % len(OTHER)]
        if type(new) is type(old):
            new = OTHER[(pick + 1) % len(OTHER)]
        parent[key] = new
        numeric = isinstance(old, int | float) and not isinstance(old, bool)
        return doc, "invalid" if numeric and isinstance(new, str) else "either"
    if op == "negate":
        if isinstance(old, int | float) and not isinstance(old, bool):
            parent[key] = -old
        return doc, "either"
    if op == "misspell":
        if isinstance(parent, dict):
            parent[f"{key}{SUFFIX}"] = parent.pop(key)
            return doc, "invalid"
        return doc, "either"
    parent[key] = EXTREMES[pick % len(EXTREMES)]
    return doc, "either"


@FUZZ
@given(
    kind=st.sampled_from(sorted(LOADERS)),
    data=st.data(),
    ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 100)), min_size=1, max_size=3),
)
def test_mutated_valid_files(tmp_path: Path, kind: str, data: st.DataObject, ops: list[tuple[str, int]]) -> None:
    doc = BASES[kind]
    must_fail = False
    for op, pick in ops:
        paths = _paths(doc)
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        doc, expect = mutate(doc, path, op, pick)
        must_fail |= expect == "invalid" or (op == "drop" and len(path) == 1 and path[0] in REQUIRED[kind])
    err = outcome(kind, write(tmp_path, doc))
    in_memory(kind, doc)
    if must_fail and len(ops) == 1:  # (a later mutation may undo an earlier one: drop its table, retype back)
        assert err is not None, f"{ops} loaded"


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_misspelt_key_is_named(tmp_path: Path, kind: str) -> None:
    """Every key of the valid file, misspelt alone: an error that names the misspelt key (for a tagged union's
    `kind`, the table that lost its tag)."""
    for path in PATHS[kind]:
        if not isinstance(path[-1], str):
            continue
        doc, _ = mutate(BASES[kind], path, "misspell", 0)
        err = outcome(kind, write(tmp_path, doc))
        assert err is not None, f"{path} misspelt loaded"
        if path[-1] == "kind" and "discriminator" in err.expected:
            # a tagged table without its tag: the table is named, and the tag it lacks
            assert err.key == key_path(path[:-1]) and "'kind'" in err.expected, f"{path}: {err}"
        else:
            assert f"{path[-1]}{SUFFIX}" in err.key, f"{path}: {err}"
