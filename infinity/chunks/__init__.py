"""Chunks: layout, tensor states, slab pools and the manager that owns placement."""
