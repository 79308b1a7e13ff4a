"""The ``fedsub`` command: its parser and commands (``cli/commands.py``) and the listings of what
fedsub offers (``cli/catalog.py``). Light to import: heavy modules load inside commands."""

from fedsub.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
