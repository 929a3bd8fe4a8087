"""Benchmark helpers behind the ``infinity bench`` commands (measurement, no CLI)."""
