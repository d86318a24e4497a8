"""The README stays true: its two commands are what CI and users run, and it documents every
setting."""

from __future__ import annotations

import re
from pathlib import Path

from shared.config import Settings

REPO = Path(__file__).resolve().parents[2]


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```sh\n(make run.*?)\n```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["make run", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^run: .*\n\t\$\(VENV\)/bin/pdserve up", makefile, re.M)
    assert re.search(r"^test: .*\n\t\$\(PY\) -m pytest", makefile, re.M)


def test_readme_documents_every_setting_with_its_default():
    readme = (REPO / "README.md").read_text()
    for name, default, _ in Settings.table():
        assert f"| `{name}` | `{default}` |" in readme, name
