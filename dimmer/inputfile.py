"""Reading a file the user named: a regular file of bounded size, or one InputError naming it.

Every input file (scenario, sweep, site config, GPU power trace, frequency replay) comes through here, so that a
device (`/dev/zero`), a FIFO or a huge file is refused with what was expected, before it is read into memory, and
so that no error echoes what the file holds (a path may point anywhere, `/etc/shadow` included).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dimmer.errors import InputError

MIB = 1024 * 1024
# A scenario, sweep or site config is a few kB; 4 MiB is far above any real one and far below what hurts to parse.
MAX_TOML_BYTES = 4 * MIB
# A measured trace or frequency record: a day of nvidia-smi at 1 Hz for 8 GPUs is ~40 MB, a day of 1 s frequency
# ~2 MB. Parsing is per line in Python, so a larger file is better cut to the event first.
MAX_DATA_BYTES = 256 * MIB


def _size_text(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n} bytes"


def _refuse_kind(mode: int, source: str, key: str) -> None:
    if stat.S_ISDIR(mode):
        raise InputError(source, key, "a file, not a directory")
    if not stat.S_ISREG(mode):
        raise InputError(source, key, "a regular file (not a device, FIFO or socket)")


def check_input_file(path: Path, source: str, key: str, what: str, max_bytes: int = MAX_DATA_BYTES) -> None:
    """Refuse, without opening it, a path that is missing, not a regular file, or larger than `max_bytes`."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise InputError(source, key, f"an existing {what} (there is no {path})") from None
    except OSError as exc:
        raise InputError(source, key, f"a readable {what} ({path}: {exc.strerror or type(exc).__name__})") from None
    _refuse_kind(st.st_mode, source, key)
    if st.st_size > max_bytes:
        raise InputError(
            source, key, f"a {what} of at most {_size_text(max_bytes)} ({path} is {_size_text(st.st_size)})"
        )


def read_input_bytes(path: Path, source: str, key: str, what: str, max_bytes: int) -> bytes:
    """The bytes of `path`, a regular file of at most `max_bytes`; InputError (source, key, what was expected)."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it changes nothing for a regular file
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(source, key, f"an existing {what}") from None
    except IsADirectoryError:
        raise InputError(source, key, "a file, not a directory") from None
    except PermissionError:
        raise InputError(source, key, "a readable file") from None
    except OSError as exc:
        raise InputError(source, key, f"a readable {what} ({exc.strerror or type(exc).__name__})") from None
    try:
        st = os.fstat(fd)  # the file opened, not whatever the path names by now
        _refuse_kind(st.st_mode, source, key)
        if st.st_size > max_bytes:
            size = _size_text(st.st_size)
            raise InputError(source, key, f"a {what} of at most {_size_text(max_bytes)} (this one is {size})")
        chunks: list[bytes] = []
        left = max_bytes + 1  # one byte more: a file that grew since fstat is still caught
        while left > 0:
            chunk = os.read(fd, min(left, MIB))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise InputError(source, key, f"a readable {what} ({exc.strerror or type(exc).__name__})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise InputError(source, key, f"a {what} of at most {_size_text(max_bytes)} (this one grew while read)")
    return data


def read_input_text(path: Path, source: str, key: str, what: str, max_bytes: int) -> str:
    """`read_input_bytes` decoded as UTF-8 (a BOM is dropped); a file that is not text is refused, unquoted."""
    data = read_input_bytes(path, source, key, what, max_bytes)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InputError(source, key, f"a {what} in UTF-8 text") from None
