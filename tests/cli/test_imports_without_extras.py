"""Every module of the package imports without the optional extras.

A plain ``pip install .`` has no ``transformers``, ``accelerate``, ``peft`` or
``trl`` (they are the ``hf``/``dev`` extras). A module that imports one at its
top fails the whole install check, so this test imports each module in a fresh
interpreter in which those packages cannot be found.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

# The packages a user may not have (pyproject.toml: optional-dependencies).
OPTIONAL = ("transformers", "accelerate", "peft", "trl", "datasets")

SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, sys

    BLOCKED = set(sys.argv[1].split(","))

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    import infinity
    failed = []
    for module in pkgutil.walk_packages(infinity.__path__, "infinity."):
        if module.name.endswith("__main__"):  # that one runs the command
            continue
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as error:
            failed.append(f"{module.name}: {error}")
    print("\\n".join(failed))
    sys.exit(1 if failed else 0)
    """
)


def test_every_module_imports_without_the_optional_extras() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(OPTIONAL)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        "these modules import an optional extra at their top (import it where it is "
        f"used):\n{result.stdout}{result.stderr[-2000:]}"
    )


def test_the_blocker_sees_a_top_level_import() -> None:
    """The check can fail: a module importing a blocked package is reported."""
    probe = SCRIPT.replace("import infinity\n", "import infinity\nimport transformers\n", 1)
    result = subprocess.run(
        [sys.executable, "-c", probe, ",".join(OPTIONAL)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and "transformers" in result.stderr
