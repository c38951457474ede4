"""The one error type for bad input: the CLI prints it as a single line, never a traceback."""


class BadInput(Exception):
    """A user-facing problem with an input (file, argument, config). Message names the file."""
