"""The documentation renders and its examples at least parse.

Checked for README.md, CHANGELOG.md and every Markdown file under docs/: every code
fence closes, and every relative link names a file (and heading) that exists. The
README's ```bash / ```sh blocks must pass ``bash -n`` and its ```python blocks
``ast.parse`` (compiled, never run). README.md and docs/ARCHITECTURE.md stay short
enough to guide: at most 200 and 300 lines.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
FENCE = re.compile(r"^\s*(`{3,})(.*)$")
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^)\s]+)\)")  # one level of [] inside


def _docs() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks(path: Path) -> tuple[list[tuple[str, int, str]], list[str]]:
    """The code blocks of ``path`` (info string, first line number, body) and the
    fence errors found: a fence left open, or a fence with an info string met while
    another is open (its writer forgot to close the one before)."""
    blocks: list[tuple[str, int, str]] = []
    errors: list[str] = []
    opened: tuple[str, str, int] | None = None  # (backticks, info, line number)
    body: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if opened is None:
            if match:
                opened = (match.group(1), match.group(2).strip(), number)
                body = []
            continue
        ticks, info, start = opened
        if match and len(match.group(1)) >= len(ticks) and not match.group(2).strip():
            blocks.append((info, start, "\n".join(body)))
            opened = None
        elif match and match.group(2).strip():
            errors.append(f"{path.name}:{number}: a fence opens inside the one of line {start}")
            body.append(line)
        else:
            body.append(line)
    if opened is not None:
        errors.append(f"{path.name}:{opened[2]}: the fence opened here never closes")
    return blocks, errors


def _fence_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.lstrip().startswith("```"))


@pytest.mark.parametrize("path", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_fence_closes(path: Path):
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    _, errors = _blocks(path)
    assert not errors, errors
    assert _fence_lines(path) % 2 == 0, f"{path.name}: an odd number of fence lines"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = path.read_text()
    outside = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.MULTILINE | re.DOTALL)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", outside, flags=re.MULTILINE)}


@pytest.mark.parametrize("path", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            broken.append(target)
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: links to nothing: {broken}"


def _readme_blocks(*infos: str) -> list[tuple[int, str]]:
    blocks, _ = _blocks(README)
    return [(start, body) for info, start, body in blocks if info.split(" ")[0] in infos]


def test_readme_shell_blocks_parse():
    bash = shutil.which("bash")
    assert bash, "bash is needed to check the README's shell blocks"
    blocks = _readme_blocks("bash", "sh", "shell")
    assert blocks, "the README shows no shell commands"
    for start, body in blocks:
        done = subprocess.run([bash, "-n"], input=body, capture_output=True, text=True)
        assert done.returncode == 0, f"README.md:{start}: bash -n: {done.stderr}"


def test_readme_python_blocks_parse():
    blocks = _readme_blocks("python", "py")
    assert blocks, "the README shows no Python"
    for start, body in blocks:
        try:
            ast.parse(body, filename=f"README.md:{start}")
        except SyntaxError as exc:
            pytest.fail(f"README.md:{start + (exc.lineno or 0)}: {exc.msg}")


def test_readme_names_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines (at most 200)"


def test_architecture_is_short_and_narrow():
    lines = ARCHITECTURE.read_text().splitlines()
    assert len(lines) <= 300, f"docs/ARCHITECTURE.md has {len(lines)} lines (at most 300)"
    wide = [n for n, line in enumerate(lines, start=1) if len(line) > 120]
    assert not wide, f"docs/ARCHITECTURE.md: lines over 120 characters: {wide}"
