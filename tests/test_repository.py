"""The repository stands on its own and running it as the README says leaves `git status` clean."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if out.returncode != 0 and "not a git repository" in out.stderr:
        pytest.skip("not a git checkout (e.g. an unpacked sdist)")
    return out.stdout


def test_quick_benchmark_results_are_ignored_and_untracked():
    """`python -m benchmarks.<name> --quick` writes `<name>-quick.*`: kept out of git; the full results stay in."""
    tracked = _git("ls-files", "benchmarks/results").split()
    assert [p for p in tracked if "-quick." in p] == []
    assert {"benchmarks/results/decode.json", "benchmarks/results/decode.md"} <= set(tracked)
    quick = [f"benchmarks/results/{n}-quick.{ext}" for n in ("decode", "world", "labels", "train", "first-step",
                                                             "real", "compile") for ext in ("json", "md", "png")]
    assert set(_git("check-ignore", "--no-index", *quick).split()) == set(quick)
    assert _git("check-ignore", "--no-index", "benchmarks/results/decode.json").strip() == ""
