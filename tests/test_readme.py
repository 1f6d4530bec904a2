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
    """The README's command stays fast: `slow` (and `gpu`) tests run only when asked for; it runs the
    `integration` tier, which the unit-tier command leaves out."""
    import subprocess
    import sys

    root = README.parent

    def collected(*extra):
        # --noconftest: this module needs none of the shared fixtures, and collecting it then imports no torch
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "--noconftest", "tests/test_readme.py", *extra]
        out = subprocess.run(cmd,
                             cwd=root, capture_output=True, text=True, check=True).stdout
        return {line.split("::")[-1] for line in out.splitlines() if "::" in line}

    readme_command = collected()
    assert "test_readme_decoder_example_runs" not in readme_command
    assert "test_readme_decoder_example_runs" in collected("-m", "slow")
    unit_tier = collected("-m", "not slow and not integration")
    assert "test_readme_test_command_leaves_out_slow_tests" in readme_command  # the README's command runs integration
    assert "test_readme_test_command_leaves_out_slow_tests" not in unit_tier  # ... the unit tier does not
    assert "test_readme_opens_with_setup_and_test_commands_that_ci_runs" in unit_tier


@pytest.mark.slow
def test_readme_decoder_example_runs(capsys):
    example = next(b for b in _blocks("python") if "SemanticSpecDecoder" in b)
    exec(compile(example, str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "Answer:" in out and "step_acceptance" in out


# --------------------------------------------------------------------------- a README a user can follow


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start: end if end > 0 else len(text)]


def test_readme_stays_short_with_one_headline_table_linking_the_figures():
    """At most 300 lines; the figures are one generated table that links to docs/benchmarks.md."""
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    results = _section("Results in one table")
    assert "<!-- report:headline -->" in results and "(docs/benchmarks.md)" in results
    separators = [line for line in text.splitlines() if line.startswith("|---")]
    assert len(separators) <= 4  # the headline, the main job's output, the evaluation, the engines; the rest elsewhere


@pytest.mark.slow
def test_readme_serving_section_runs(tmp_path):
    """The "Serving" section's commands as written: install check, start the world's two servers with
    the one command, decode through ServedDecoder with the shipped servable pair, stop the servers."""
    import os
    import shlex
    import signal

    from arithmetic_world.serve import PORTS, server_available
    from tests.conftest import start_serving

    section = _section("Serving")
    bash = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[0]
    commands = [line.split("#")[0].strip() for line in bash.splitlines()]
    assert commands[0] == 'pip install -e ".[server]"'
    assert "llama-cpp-python[server]" in (README.parent / "pyproject.toml").read_text()  # what that extra installs
    if not server_available():
        if os.environ.get("CI"):
            pytest.fail("llama-cpp-python[server] is not installed; .ci/run installs it")
        pytest.skip("llama-cpp-python[server] not installed; see README 'Serving'")
    serve = shlex.split(commands[1])
    assert serve[:3] == ["python", "-m", "arithmetic_world.serve"]
    proc = start_serving([*serve[3:], "--log_dir", str(tmp_path)], PORTS.values(), cwd=README.parent)
    try:
        example = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
        assert "checkpoints/arithmetic/probes-topk/target" in example and "ServedDecoder" in example
        scope = {"__name__": "readme_serving"}
        cwd = os.getcwd()
        os.chdir(README.parent)  # the example's paths are relative to the clone, as for a user in it
        try:
            exec(compile(example, str(README), "exec"), scope)
        finally:
            os.chdir(cwd)
        results = scope["results"]
        assert len(results) == 4 and all(r.ok for r in results), [r.error for r in results]
        assert sum(r.stats.draft_steps_accepted for r in results) > 0  # the probes kept draft steps
        assert sum(scope["task"].check(r.text, p["answer"]) for r, p in zip(results, scope["problems"])) >= 3
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert "both servers ready" in out and "stopping both servers" in out, out
    assert proc.returncode == 0, out
