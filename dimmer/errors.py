"""The project's exceptions.

DimmerError
 └── InputError        bad user input (scenario, site config, register value, argument): exit status 2.
      │                str() is one line: "<source>: <key path>: <what was expected>".
      └── ListenError  a listener that cannot listen (port in use, no such host, a port that needs root):
                       "cannot listen on <host>:<port>: <reason>", exit status 2 like any bad address given.
 └── OutputError       (dimmer.outpath) an output that could not be written though its path was checked (a full
                       disk): "<path>: cannot write: <reason>", exit status 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class DimmerError(Exception):
    """Base of every error this project raises on purpose."""


class InputError(DimmerError):
    """Bad input from a user; the message names the source, the key path and what was expected."""

    def __init__(self, source: str, key: str, expected: str) -> None:
        self.source = source
        self.key = key
        self.expected = expected
        super().__init__(f"{source}: {key}: {expected}")

    def __reduce__(self) -> tuple[type[InputError], tuple[str, str, str]]:
        # rebuilt from its three parts, so it crosses a process pool whole (rebuilt from its message alone, it
        # broke the pool, and a bad scenario in a parallel compare or sweep ended in a traceback, not one line)
        return (type(self), (self.source, self.key, self.expected))


def key_path(loc: Sequence[Any]) -> str:
    """Render a pydantic/TOML location such as ("jobs", 0, "gpus") as "jobs[0].gpus"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = str(part)
            # TOML allows any character in a quoted key: show one that is not plain text quoted, so a key holding a
            # line break cannot break the one-line error
            out += ("." if out else "") + (name if name.isprintable() else repr(name))
    return out or "(top level)"


def from_validation_error(source: str, exc: Any, prefix: Sequence[Any] = ()) -> InputError:
    """Turn the first error of a pydantic ValidationError into a one-line InputError."""
    errors = exc.errors()
    # A misspelt key shows up twice, as an unknown key and as a missing one: name the key the user wrote.
    err = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    # pydantic puts the union/tag name in loc for tagged unions; those parts are not keys a user wrote.
    loc = [p for p in err.get("loc", ()) if not (isinstance(p, str) and p.startswith("function-"))]
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        msg = "unknown key (check the spelling and the unit in the key name)"
    got = err.get("input")
    if err.get("type") not in ("missing", "extra_forbidden") and not isinstance(got, dict | list):
        msg = f"{msg} (got {got!r})"
    return InputError(source, key_path([*prefix, *loc]), msg)


class ListenError(InputError):
    """A server could not listen on the address it was given; str() is "cannot listen on HOST:PORT: REASON"."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(address, "listen", reason)
        self.address = address
        self.reason = reason
        self.args = (f"cannot listen on {address}: {reason}",)

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[type[ListenError], tuple[str, str]]:  # type: ignore[override]
        return (type(self), (self.address, self.reason))
