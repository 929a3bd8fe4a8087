"""The ``infinity`` command line: one module per command."""
