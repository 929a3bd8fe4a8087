"""Errors the runtime raises at the user."""


class ModelChangedError(RuntimeError):
    """The model's parameters were replaced, added or converted after ``offload``."""


class UnsetParameterError(RuntimeError):
    """A parameter offloaded with ``init="load"`` was used before anything loaded it."""
