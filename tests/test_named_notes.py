"""Named notes (docs/NOTES.md) and their citations in the code stay in step.

Every ``NOTE [name]`` cited in ``infinity/``, ``cpp/`` or ``bench/`` must be a
``## NOTE [name]`` heading of docs/NOTES.md, written on one line (so grepping
the name finds every citation), and every note must be cited from at least
two files: a reason only one place needs belongs in that place.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTES = ROOT / "docs" / "NOTES.md"
SOURCES = [("infinity", "*.py"), ("cpp", "*.cpp"), ("cpp", "*.hpp"), ("bench", "*.py")]
CITATION = re.compile(r"NOTE(\s*(?:#\s*)?)\[([^\]\n]*)(\]?)")


def _headings() -> list[str]:
    return re.findall(r"^## NOTE \[([^\]\n]+)\]$", NOTES.read_text(), flags=re.MULTILINE)


def _citations() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = defaultdict(set)
    for folder, pattern in SOURCES:
        for path in sorted((ROOT / folder).rglob(pattern)):
            for gap, name, closed in CITATION.findall(path.read_text(errors="replace")):
                where = str(path.relative_to(ROOT))
                whole = closed and "\n" not in gap
                assert whole, f"{where}: 'NOTE [{name}' is split across lines; keep it on one"
                cited[name].add(where)
    return cited


def test_every_citation_names_a_note():
    headings = set(_headings())
    unknown = {name: sorted(files) for name, files in _citations().items() if name not in headings}
    assert not unknown, f"cited but not in docs/NOTES.md: {unknown}"


def test_every_note_is_relied_on_by_several_files():
    headings = _headings()
    assert headings and len(headings) == len(set(headings)), headings
    cited = _citations()
    lonely = {name: sorted(cited.get(name, ())) for name in headings if len(cited[name]) < 2}
    assert not lonely, f"notes cited from fewer than two files: {lonely}"
