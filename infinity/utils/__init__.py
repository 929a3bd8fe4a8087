"""Small helpers shared across layers (size parsing, formatting)."""
