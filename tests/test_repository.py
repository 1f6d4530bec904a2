"""The repository stands on its own and running it as the README says leaves `git status` clean."""

import ast
import importlib.util
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
                                                             "real", "compile", "served") for ext in ("json", "md",
                                                                                                      "png")]
    assert set(_git("check-ignore", "--no-index", *quick).split()) == set(quick)
    assert _git("check-ignore", "--no-index", "benchmarks/results/decode.json").strip() == ""


def _repository_files() -> list[Path]:
    """The files git would commit: tracked ones and untracked ones that ``.gitignore`` does not hide.

    Never a walk of the whole folder: a clone holds a ``.venv/``, ``data/`` and ``runs/`` that are not the
    repository's (a dependency's Big5-encoded source in ``.venv/`` broke ``read_text``). A virtual environment is
    left out even where ``.gitignore`` does not name it (any folder holding a ``pyvenv.cfg``), and so are
    dot-folders other than ``.ci/``. Outside a git checkout (an unpacked sdist) the folder is walked with the same
    exclusions.
    """
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, timeout=60)
        names = out.stdout.split("\0") if out.returncode == 0 else None
    except FileNotFoundError:
        names = None
    if names is None:
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")]
    venvs = {p.parent.relative_to(ROOT).parts for p in ROOT.glob("*/pyvenv.cfg")}
    skip = {"data", "runs", "lightning_logs", "__pycache__"}

    def kept(name: str) -> bool:
        parts = Path(name).parts
        return (not skip & set(parts[:-1]) and parts[:1] not in venvs
                and not any(part.startswith(".") and part != ".ci" for part in parts[:-1]))

    return [ROOT / name for name in names if name and kept(name) and (ROOT / name).is_file()]


def _text_files() -> list[Path]:
    return [p for p in _repository_files()
            if p.suffix in {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt"} or p.parent.name == ".ci"]


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


def test_a_virtual_environment_inside_the_clone_is_ignored_and_never_read(tmp_path):
    """`python -m venv .venv` inside the clone leaves `git status` clean and the repository walks skip
    it, even a venv `.gitignore` does not name (a dependency's file in another encoding broke `read_text`)."""
    names = [".venv/lib/site-packages/x.py", "venv/lib/site-packages/x.py"]
    assert set(_git("check-ignore", "--no-index", *names).split()) == set(names)
    walked = {p.relative_to(ROOT).parts[0] for p in _repository_files()}
    assert not walked & {".venv", "venv", ".git", "data", "runs"}, walked


def test_code_names_no_internal_issue_numbers():
    """A reader of the package or its tests cannot follow the numbers of the project's own tracker: comments say why
    in words (upstream references such as vLLM's "RFC #24288" stay, a reader can follow those)."""
    found = [f"README.md:{k}" for k, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
             if re.search(r"\b[Ii]ssues? \d+\b", line)]
    for part in ("generation", "probes", "datamodules", "callbacks", "semanticspec", "arithmetic_world", "benchmarks",
                 "configs", "docs", "tests"):
        for p in sorted(q for q in (ROOT / part).rglob("*") if q.suffix in (".py", ".yaml", ".md")):
            found += [f"{p.relative_to(ROOT)}:{k}" for k, line in enumerate(p.read_text().splitlines(), 1)
                      if re.search(r"\b[Ii]ssues? \d+\b", line)]
    assert found == [], found


_REFERENCE = re.compile(r":(?:func|class|meth|data|mod|attr|exc):`~?\.?([\w.]+)`")


def _bound(node) -> set[str]:
    """The names (and ``self.`` attributes) an assignment binds; none for another statement."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {n.id if isinstance(n, ast.Name) else n.attr for t in targets for n in ast.walk(t)
            if isinstance(n, ast.Name) or isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "self"}


def _names(tree) -> dict:
    """A module's top-level names: a class's members as a set, a function or a variable as None, an import as
    ``"import:dotted.path"``."""
    defs, top = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            top[node.name] = set().union(*({n.name} if isinstance(n, defs) else _bound(n) for n in ast.walk(node)))
        elif isinstance(node, defs):
            top[node.name] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                name = a.asname or a.name.split(".")[0]
                path = f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom) else a.name if a.asname else name
                top[name] = f"import:{path}"
        else:
            top.update(dict.fromkeys(_bound(node)))
    return top


def test_docstring_cross_references_name_what_exists():
    """Every ``:func:``/``:class:``/``:meth:``/``:data:``/``:attr:``/``:mod:`` reference to the package's own code
    names a module, function, class or member that exists (a moved or renamed one leaves the reference stale)."""
    files = [p for p in _repository_files() if p.suffix == ".py" and p.relative_to(ROOT).parts[0] != "tests"]
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}
    texts = {m: p.read_text() for m, p in modules.items()}
    index = {m: _names(ast.parse(t)) for m, t in texts.items()}
    ours = {m.split(".")[0] for m in modules}

    def found(module: str, parts: list[str]) -> bool:
        names = index[module]
        if not parts:
            return True
        got = names.get(parts[0], False)
        if isinstance(got, str):  # an imported name: look where it comes from
            return resolves(got.removeprefix("import:").split(".") + parts[1:])
        if got is False:
            if f"{module}.{parts[0]}" in modules:
                return found(f"{module}.{parts[0]}", parts[1:])
            return len(parts) == 1 and "__getattr__" in names and f'"{parts[0]}"' in texts[module]  # a lazy name
        return len(parts) == 1 or (isinstance(got, set) and len(parts) == 2 and parts[1] in got)

    def resolves(parts: list[str]) -> bool:
        if parts[0] not in ours:
            return importlib.util.find_spec(parts[0]) is not None  # another library's name
        return any(found(".".join(parts[:i]), parts[i:]) for i in range(len(parts), 0, -1)
                   if ".".join(parts[:i]) in modules)

    stale = []
    for module, text in texts.items():
        package = module if modules[module].name == "__init__.py" else module.rpartition(".")[0]
        members = set().union(*(m for m in index[module].values() if isinstance(m, set)))
        for ref in _REFERENCE.findall(text):
            parts = ref.split(".")
            if not (found(module, parts) or (len(parts) == 1 and parts[0] in members)
                    or (parts[0] in ours or importlib.util.find_spec(parts[0]) is not None) and resolves(parts)
                    or parts[0] not in ours and resolves(f"{package}.{ref}".split("."))):
                stale.append(f"{modules[module].relative_to(ROOT)}: {ref}")
    assert stale == []
