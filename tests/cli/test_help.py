"""``infinity --help`` and each command's ``--help``: what a new user sees first."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from infinity.cli.main import main

COMMANDS = ["train", "plan", "bench nvme", "bench optim", "bench adam", "bench train"]


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_names_the_tool_its_commands_and_an_example():
    out = subprocess.run(
        [sys.executable, "-m", "infinity", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.startswith("usage: infinity [-h] COMMAND ...")
    assert "larger than GPU and host memory" in out
    for command in COMMANDS:
        assert f"\n  {command} " in out, command
    assert "examples:\n  infinity train" in out
    assert "dispatches" not in out and "``" not in out


def test_bare_command_or_group_prints_its_help(capsys):
    assert main([]) == 2
    assert "bench optim" in capsys.readouterr().out
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: infinity bench [-h] BENCHMARK ...")
    assert "bench nvme" in out and "infinity bench optim --optimizers" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_has_usage_description_and_example(capsys, command):
    out = _help(capsys, *command.split())
    assert out.startswith(f"usage: infinity {command} [-h]")
    assert re.search(r"^  --\w", out, re.MULTILINE), "no flag of the command's own is listed"
    assert f"\n  infinity {command}" in out  # an example
