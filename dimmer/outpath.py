"""Output paths: checked before anything runs, written through a staging directory, write errors in one line.

    out_dir_arg(text)           argparse type of an --out option: a path, not an empty string
    check_out_dir(path)         an output directory that can be made and written, or InputError (exit status 2)
    check_out_file(path, ...)   a file (audit log, state file) that can be created or appended to, or InputError
    staging(where, label)       a fresh staging directory, `.<label>.staging-<pid>-<random>`, removed on exit;
                                stages left by a killed process (its pid no longer runs) are removed first
    writing(path)               OSError while writing (ENOSPC, EACCES, EROFS) -> OutputError, one line, exit status 1

check_out_file uses os.access on the nearest directory that exists and creates nothing, so `dimmer check` may run
it on a production path (root passes it wherever the file system is not read-only, as root's writes do);
check_out_dir also makes and removes a directory there, which catches what os.access cannot tell.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from dimmer.errors import DimmerError, InputError

STAGING_MARK = ".staging-"


class OutputError(DimmerError):
    """An output could not be written (a full disk, a permission taken away while running); exit status 1.

    str() is one line: "<path>: cannot write: <reason>". Not an InputError: the paths were checked before the run.
    """

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: cannot write: {reason}")

    def __reduce__(self) -> tuple[type[OutputError], tuple[str, str]]:
        return (type(self), (self.path, self.reason))


def out_dir_arg(text: str) -> Path:
    """argparse `type` of an `--out` option: an empty path would write into the working directory unasked."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an output directory path, not an empty string")
    return Path(text)


def _nearest_existing(path: Path, source: str, key: str) -> Path:
    """The nearest of `path`'s parents that exists; InputError if one of them is not a directory."""
    for p in path.parents:
        if p.exists():
            if not p.is_dir():
                raise InputError(source, key, f"a path below directories only ({p} is a file)")
            return p
    return Path(".")


def _writable_dir(d: Path, source: str, key: str, what: str) -> None:
    if not os.access(d, os.W_OK | os.X_OK):
        raise InputError(source, key, f"{what} ({d} is not writable by this user)")


def _probe_dir(d: Path, source: str, key: str, what: str) -> None:
    """Make and remove a directory in `d`: what os.access cannot tell (root on /proc, a read-only bind mount, an
    ACL) the attempt does. Named as a stage, so that even a kill right here leaves nothing the next run keeps."""
    try:
        Path(tempfile.mkdtemp(dir=d, prefix=f".probe{STAGING_MARK}{os.getpid()}-")).rmdir()
    except OSError as exc:
        raise InputError(source, key, f"{what} ({d}: {exc.strerror or type(exc).__name__})") from None


def check_out_dir(out_dir: Path, source: str = "--out") -> None:
    """Refuse, before anything runs, an output directory that cannot be made or written: an existing file, a file
    among its parents, a directory (it, or the one it is to be made in) this user cannot write. It leaves nothing
    behind: a directory made in each place to test it is removed at once."""
    key = str(out_dir)
    if out_dir.exists():
        if not out_dir.is_dir():
            raise InputError(source, key, f"a directory ({out_dir} is a file)")
        _writable_dir(out_dir, source, key, "a directory this user can write")
        _probe_dir(out_dir, source, key, "a directory this user can write")
        # the results are staged beside it, in its parent, and moved in at the end
        parent = out_dir.resolve().parent
        _writable_dir(parent, source, key, "a directory whose parent this user can write")
        _probe_dir(parent, source, key, "a directory whose parent this user can write")
    else:
        base = _nearest_existing(out_dir, source, key)
        _writable_dir(base, source, key, "a directory this user can create")
        _probe_dir(base, source, key, "a directory this user can create")


def check_out_file(path: Path, source: str, key: str) -> None:
    """Refuse a file that cannot be created, appended to or replaced where it is (a directory, below a file, in a
    directory this user cannot write), as the daemon would open it. Creates nothing."""
    if path.is_dir():
        raise InputError(source, key, f"a file, not a directory ({path})")
    parent = _nearest_existing(path, source, key)
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(source, key, f"a file this user can write ({path} is not writable)")
    # appending needs only the file; an atomic replace (state file) and creating it need the directory
    _writable_dir(parent, source, key, f"a file in a directory this user can write ({path})")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def remove_stale_stages(where: Path, label: str) -> list[Path]:
    """Remove `.<label>.staging-<pid>-*` directories in `where` whose process no longer runs (a kill); return them."""
    removed: list[Path] = []
    prefix = f".{label}{STAGING_MARK}"
    try:
        entries = list(where.iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not name.startswith(prefix):
            continue
        pid_text = name[len(prefix) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or _pid_alive(int(pid_text)):
            continue  # a live run's stage, or not one of ours
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


@contextlib.contextmanager
def staging(where: Path, label: str) -> Iterator[Path]:
    """A new staging directory in `where`, named `.<label>.staging-<pid>-<random>` so that the next run can tell
    (by the pid) one a killed run left behind and remove it; removed when the block ends, whatever happens."""
    where.mkdir(parents=True, exist_ok=True)
    remove_stale_stages(where, label)
    stage = Path(tempfile.mkdtemp(dir=where, prefix=f".{label}{STAGING_MARK}{os.getpid()}-"))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def writing(path: Path | str) -> Iterator[None]:
    """Turn an OSError inside the block into one OutputError line naming `path` and the reason."""
    try:
        yield
    except OSError as exc:
        where = exc.filename if isinstance(exc.filename, str) else path
        raise OutputError(where, exc.strerror or type(exc).__name__) from None
