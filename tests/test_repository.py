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
                                                             "real", "compile", "served") for ext in ("json", "md", "png")]
    assert set(_git("check-ignore", "--no-index", *quick).split()) == set(quick)
    assert _git("check-ignore", "--no-index", "benchmarks/results/decode.json").strip() == ""


def _text_files() -> list[Path]:
    skip = {".git", "data", "runs", "lightning_logs", "__pycache__"}
    return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
            and (p.suffix in {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt"} or p.parent.name == ".ci")]


_OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "DESIGN" + r"\.md", "STYLE" + r"\.md", "ENGINES" + r"\.md"]))


def _outside_refs(files: list[Path]) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{i}" for p in files if p.name != "test_repository.py"
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if _OUTSIDE.search(line)]


def test_nothing_points_outside_the_repository():
    """The design and style notes live in docs/; no file refers a user to notes they do not have."""
    assert _outside_refs(_text_files()) == []


def test_docs_exist_and_every_relative_link_resolves():
    assert (ROOT / "docs" / "design.md").is_file() and (ROOT / "docs" / "contributing.md").is_file()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        broken = [link for link in links if "://" not in link and not (page.parent / link).exists()]
        assert broken == [], f"{page.name}: {broken}"
        named = set(re.findall(r"\bdocs/[\w-]+\.md\b", text))
        assert all((ROOT / n).is_file() for n in named), named
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def test_docstring_references_to_the_design_name_its_sections():
    """`docs/design.md "Section"` in code names a heading that exists (the page is the reference)."""
    headings = {h.strip() for h in re.findall(r"^#+ (.+)$", (ROOT / "docs" / "design.md").read_text(), flags=re.M)}
    refs = []
    for p in _text_files():
        if p.suffix == ".py" and p.name != "test_repository.py":
            text = re.sub(r"\s*\n\s*", " ", p.read_text())
            refs += [(p.name, s) for s in re.findall(r'docs/design\.md "([^"]+)"', text)]
            refs += [(p.name, s) for s in re.findall(r'"([^"]+)" in docs/design\.md', text)]
    assert refs, "expected docstrings to point at docs/design.md sections"
    missing = [(f, s) for f, s in refs if not any(h.startswith(s) for h in headings)]
    assert missing == []


def test_readme_says_which_main_job_figures_depend_on_the_thread_count():
    """Issue 21.17: the closing table of the main job repeats only at a fixed torch thread count; the README says so."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The main job"): text.index("## Using a probe in the decoder")]
    assert "**Thread count.**" in section and "OMP_NUM_THREADS=1" in section and "torch.set_num_threads" in section
