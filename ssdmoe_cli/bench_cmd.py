"""Placeholder: commands are registered here by the module's owner."""

import typer


def register(app: typer.Typer) -> None:
    pass
