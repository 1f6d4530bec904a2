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
    assert "python -m pytest -q -m slow" in CI.read_text()  # ... and the slow set the README's command leaves out
    unit_tier = 'python -m pytest -q -m "not slow and not integration"'
    assert unit_tier in bash[2]  # the unit tier, documented next to the test command
    assert "integration:" in (README.parent / "pyproject.toml").read_text()  # a registered marker


@pytest.mark.integration
def test_readme_test_command_leaves_out_slow_tests():
    """The README's command stays fast: `slow` (and `gpu`) tests run only when asked for (issue 12); it runs the
    `integration` tier, which the unit-tier command leaves out."""
    import subprocess
    import sys

    root = README.parent

    def collected(*extra):
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "tests/test_readme.py", *extra],
                             cwd=root, capture_output=True, text=True, check=True).stdout
        return {line.split("::")[-1] for line in out.splitlines() if "::" in line}

    assert "test_readme_decoder_example_runs" not in collected()
    assert "test_readme_decoder_example_runs" in collected("-m", "slow")
    unit_tier = collected("-m", "not slow and not integration")
    assert "test_readme_test_command_leaves_out_slow_tests" in collected()  # the README's command runs integration
    assert "test_readme_test_command_leaves_out_slow_tests" not in unit_tier  # ... the unit tier does not
    assert "test_readme_opens_with_setup_and_test_commands_that_ci_runs" in unit_tier


@pytest.mark.slow
def test_readme_decoder_example_runs(capsys):
    example = next(b for b in _blocks("python") if "SemanticSpecDecoder" in b)
    exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "Answer:" in out and "step_acceptance" in out
