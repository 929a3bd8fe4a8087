"""``transformers`` is an optional extra: ``import infinity`` never imports it, and
the functions that need it say how to install it (checked in fresh interpreters)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_import_infinity_does_not_import_transformers():
    out = _python(
        """
        import sys, infinity
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "accelerate")))
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_transformers_names_the_extra(tmp_path):
    out = _python(
        f"""
        import sys
        sys.modules["transformers"] = None  # as if not installed
        import infinity
        try:
            infinity.from_pretrained({str(tmp_path)!r})
        except ImportError as exc:
            print(exc)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "pip install 'infinity-offload[hf]'" in out.stdout
