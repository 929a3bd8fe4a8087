"""The leaf of the package: names and data types every layer may import.

Tier, kind and phase names (:mod:`.names`), the chunk layout's data types
(:mod:`.layout`) and the plan's (:mod:`.plan`). Nothing here imports another
package of ``infinity`` except :mod:`infinity.utils`; the import-linter
contracts in ``pyproject.toml`` keep it that way.
"""
