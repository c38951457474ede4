"""Placeholder: this sub-app's commands are defined here."""

import typer

app = typer.Typer(no_args_is_help=True)
