"""argparse `type=` helpers for the numeric options of both command lines: refused at parse time, one line.

    real(lo, hi, ...)   a finite number in [lo, hi] (or (lo, hi] with lo_open): NaN, inf and out-of-range refused
    whole(lo, hi, ...)  a whole number in lo..hi, written in decimal digits (never a float, never 5,000 digits)

argparse puts the option's name in front of the message ("argument --period-s: ..."); both CLIs' parsers print it
as one line ("dimmer: --period-s: a number of seconds in [0.01, 3600] (got 'nan')") and exit with status 2, before
anything is read, started or written. Range checks that involve two options (a lease of at least one period) stay
with the command, which raises InputError naming one of them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# what of a refused value is echoed: enough to recognise it, never a 5,000-digit line
ECHO_CHARS = 24


def _got(text: str) -> str:
    return repr(text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "...")


def _g(x: float) -> str:
    return f"{x:g}" if abs(x) < 1e6 or x != int(x) else f"{int(x)}"


def real(lo: float, hi: float, *, lo_open: bool = False, what: str = "a number") -> Callable[[str], float]:
    """A type for an option taking a finite number in [lo, hi] ((lo, hi] if `lo_open`), e.g. `what="a number of
    seconds"`; the message says the range."""
    span = f"{'(' if lo_open else '['}{_g(lo)}, {_g(hi)}]"

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = math.nan
        if not (math.isfinite(x) and (lo < x if lo_open else lo <= x) and x <= hi):
            raise argparse.ArgumentTypeError(f"{what} in {span} (got {_got(text)})")
        return x

    parse.__name__ = "number"  # argparse's own messages name the type by it
    return parse


def whole(lo: int, hi: int, *, what: str = "a whole number") -> Callable[[str], int]:
    """A type for an option taking a whole number in lo..hi, in decimal digits."""
    span = f"{lo}..{hi}"

    def parse(text: str) -> int:
        t = text.strip()
        digits = t[1:] if t[:1] in "+-" else t
        # the length first: int() of thousands of digits is slow, or refused past sys.get_int_max_str_digits()
        if not (digits.isdigit() and digits.isascii() and len(digits) <= len(str(max(abs(lo), abs(hi))))):
            raise argparse.ArgumentTypeError(f"{what} in {span} (got {_got(text)})")
        n = int(t)
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{what} in {span} (got {_got(text)})")
        return n

    parse.__name__ = "whole number"
    return parse
