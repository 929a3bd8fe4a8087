"""Native errors keep the Python type and message they always had and name the C++ line
that threw (see NOTE [errors name their source line], docs/NOTES.md).

The expected line is looked up in the source itself, so the tests say which check
must be named without pinning line numbers that any edit above would move.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import pytest

from infinity import _C

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4096
needs_notes = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="exception notes (PEP 678) need Python 3.11"
)


def _line_of(source: str, text: str) -> str:
    """``source:line`` of the one line of ``source`` (under the repository) holding ``text``."""
    lines = (ROOT / source).read_text().splitlines()
    found = [n for n, line in enumerate(lines, start=1) if text in line]
    assert len(found) == 1, f"{text!r} is on lines {found} of {source}"
    return f"{source}:{found[0]}"


def _notes(exc: BaseException) -> list[str]:
    return list(getattr(exc, "__notes__", []))


@needs_notes
def test_a_value_error_keeps_its_message_and_names_the_check():
    with pytest.raises(ValueError) as info:
        _C.io.Engine("threads", PAGE, 0, 1)
    assert str(info.value) == "queue_depth=0 must be in 1..4096"
    where = _line_of("cpp/io/engine.cpp", '("queue_depth=" +')
    assert _notes(info.value) == [f"raised at {where}"]


@needs_notes
def test_a_runtime_error_keeps_its_type():
    engine = _C.io.Engine("threads", PAGE, 1, 1)
    engine.close()
    with pytest.raises(RuntimeError) as info:
        engine.register_buffers([])
    assert str(info.value) == "this I/O engine is closed"
    where = _line_of("cpp/io/engine.cpp", '("this I/O engine is closed")')
    assert _notes(info.value) == [f"raised at {where}"]


@needs_notes
def test_an_os_error_keeps_its_errno_subclass_and_text(tmp_path):
    with pytest.raises(OSError) as info:
        _C.io.preallocate(-1, PAGE, str(tmp_path / "f"))
    assert info.value.errno == errno.EBADF
    assert str(info.value).startswith(f"[Errno {errno.EBADF}] fallocate of 4096 bytes for '")
    assert str(info.value).endswith(f" (errno {errno.EBADF})")
    where = _line_of("cpp/io/file_ops.cpp", 'throw SystemError("fallocate of "')
    assert _notes(info.value) == [f"raised at {where}"]


@needs_notes
def test_a_helper_that_passes_the_location_on_names_its_caller():
    # adam_step validates through require(); the note names the failed
    # require(...) call, not the line inside the helper that throws.
    with pytest.raises(ValueError) as info:
        _C.adam.step(0, 0, 0, 0, 0, 0, 0, -1, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0)
    assert str(info.value) == "adam_step: n must be >= 0"
    where = _line_of("cpp/adam/adam_step.cpp", "require(b.n >= 0,")
    assert _notes(info.value) == [f"raised at {where}"]


def test_other_exceptions_go_through_pybind11_unchanged():
    # pybind11's own argument conversion error: not ours, no note.
    with pytest.raises(TypeError) as info:
        _C.io.Engine("threads", "not a number", 1, 1)
    assert _notes(info.value) == []
