"""The error types every package raises; the CLI prints each as one line, never a traceback.

  BadInput  a problem with an input the user gave (file, argument, config): the message names
            the file or the option
  IOFault   an I/O failure while running (an expert read that fails or comes back short): not
            the user's input, but reported the same way, naming layer, expert and file

Imports nothing of ours."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any


class BadInput(Exception):
    """A user-facing problem with an input (file, argument, config). Message names the file."""


class IOFault(Exception):
    """An I/O failure during a run (a failed or short read). Message names what failed."""


def read_json_object(path: Path, missing: str = "missing") -> dict[str, Any]:
    """The JSON object stored in `path`. Absent, unreadable, not JSON or not an object: a
    one-line BadInput naming the file (`missing` says what an absent file means)."""
    if not path.is_file():
        raise BadInput(f"{path}: {missing}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: expected a JSON object")
    return data


def read_toml_table(path: Path) -> dict[str, Any]:
    """The TOML table stored in `path`. Absent, unreadable or not TOML: a one-line BadInput
    naming the file."""
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"{path}: cannot read ({err})") from None
    except tomllib.TOMLDecodeError as err:
        raise BadInput(f"{path}: not valid TOML ({err})") from None
