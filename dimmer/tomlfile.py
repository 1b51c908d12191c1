"""Reading a TOML input file: the one door for scenarios, sweeps and site configs, with the one-line errors.

A file is read only if it is a regular file of at most `MAX_TOML_BYTES` (dimmer.inputfile), and its tables and
arrays may nest at most `MAX_TOML_DEPTH` deep: every later step (overrides, validation, copies) recurses over the
document, and a deeper one ended in a RecursionError traceback.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from dimmer.errors import InputError
from dimmer.inputfile import MAX_TOML_BYTES, read_input_bytes

# The deepest real key is about five levels (controllers.<name>.<table>.<key>); 32 leaves room and no recursion risk.
MAX_TOML_DEPTH = 32


def toml_depth(value: Any) -> int:
    """How deep tables and arrays nest in `value` (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth + 1)
        if depth + 1 > MAX_TOML_DEPTH:
            break  # deep enough to refuse: no need to walk the rest
        stack.extend((c, depth + 1) for c in children)
    return deepest


def loads_toml(text: str, source: str, key: str = "(syntax)") -> dict[str, Any]:
    """Parse TOML text; InputError for bad syntax or nesting deeper than MAX_TOML_DEPTH."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(source, key, f"valid TOML ({exc})") from None
    except ValueError:  # an integer past Python's digit limit: tomllib raises a bare ValueError, not its own
        raise InputError(source, key, f"numbers of at most {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:  # the parser itself recurses per nesting level
        raise InputError(source, key, f"TOML nested at most {MAX_TOML_DEPTH} tables or arrays deep") from None
    if toml_depth(doc) > MAX_TOML_DEPTH:
        raise InputError(source, key, f"TOML nested at most {MAX_TOML_DEPTH} tables or arrays deep")
    return doc


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The file's tables, or InputError naming the file and what was expected (`what`: "scenario file", ...)."""
    source = str(path)
    data = read_input_bytes(path, source, "(file)", what, MAX_TOML_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(source, "(file)", "UTF-8 text") from None
    return loads_toml(text, source)
