"""The README's commands and its programmatic decoder example stay true."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
CI = Path(__file__).resolve().parents[1] / ".ci" / "run"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_setup_and_test_commands_that_ci_runs():
    bash = _blocks("bash")
    assert "python -m probes.fit" in bash[0] and "pip install" in bash[0]
    test_command = bash[1].strip()
    assert test_command.startswith("python -m pytest")
    assert test_command in CI.read_text()  # CI runs the README's test command


@pytest.mark.slow
def test_readme_decoder_example_runs(capsys):
    example = next(b for b in _blocks("python") if "SemanticSpecDecoder" in b)
    exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "Answer:" in out and "step_acceptance" in out
