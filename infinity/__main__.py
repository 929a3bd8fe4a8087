"""``python -m infinity``: the command line."""

from infinity.cli.main import entry

entry()
