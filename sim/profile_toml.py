"""Profile files as commented TOML: each value on its own line with how it was obtained
(`key = value  # how`), so a profile says where every number came from."""

from __future__ import annotations

from typing import Any


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(round(v, 6))
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


def toml_text(header: list[str], values: dict[str, tuple[Any, str]], order: tuple[str, ...],
              description: str) -> str:
    """A profile file: header comment lines, description, then `key = value  # how`."""
    lines = [f"# {h}" if h else "#" for h in header]
    lines.append(f"description = {_toml_value(description)}")
    width = max(len(f"{k} = {_toml_value(values[k][0])}") for k in order) + 2
    for key in order:
        value, how = values[key]
        text = f"{key} = {_toml_value(value)}"
        lines.append(f"{text:<{width}}# {how}" if how else text)
    return "\n".join(lines) + "\n"
