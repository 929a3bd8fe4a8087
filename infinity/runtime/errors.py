"""Errors the runtime raises at the user."""


class ModelChangedError(RuntimeError):
    """The model's parameters were replaced, added or converted after ``offload``."""
