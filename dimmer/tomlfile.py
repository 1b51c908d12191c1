"""Reading a TOML input file: the one door for scenarios, sweeps and site configs, with the one-line errors."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from dimmer.errors import InputError


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The file's tables, or InputError naming the file and what was expected (`what`: "scenario file", ...)."""
    source = str(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InputError(source, "(file)", f"an existing {what}") from None
    except IsADirectoryError:
        raise InputError(source, "(file)", "a file, not a directory") from None
    except PermissionError:
        raise InputError(source, "(file)", "a readable file") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(source, "(syntax)", f"valid TOML ({exc})") from None
    except UnicodeDecodeError:
        raise InputError(source, "(file)", "UTF-8 text") from None
