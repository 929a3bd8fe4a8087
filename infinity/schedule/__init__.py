"""Schedule: which chunk goes where, and when (planner, trace, prefetch, eviction)."""
