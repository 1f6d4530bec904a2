"""The fit command line before torch loads: its name, one-line refusals and a first pass over the arguments.

Importing torch and Lightning takes seconds, so `python -m probes.fit` looks at what it was given
before it imports them: YAML syntax, ``--ckpt_path``, and every option name, on
the command line and in each ``--config`` file, against the options the real parser knows. Those are
recorded in ``probes/fit_options.json``, written from the parser itself
(:func:`probes.fit_cli.known_options`; tests/probes/test_fit.py checks that the record is current). With
another version of Lightning or jsonargparse than the record names, option names are left to the
real parser. Values are checked where they are used, by the real parser and the classes (after the imports),
except ``--threads`` (the package's own, checked here in full) and the values of options whose type is int,
float, bool or None alone (recorded with the names: a value none of them can take is refused here).
"""

from __future__ import annotations

import difflib
import json
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, NoReturn

import yaml

from generation.cli import check_yaml_files, did_you_mean, option_value
from generation.cli import fail as cli_fail
from generation.threads import check_threads

PROG = "python -m probes.fit"
DESCRIPTION = (
    "Build SemanticSpec label data if it is missing, train the target and draft probes, test the best "
    "checkpoint on held-out problems and export it (model.safetensors + config.json per role)."
)
KNOWN_OPTIONS = Path(__file__).resolve().parent / "fit_options.json"
"""The option names of the fit parser, and the versions of the libraries they were read with."""
RECORDED_WITH = ("lightning", "jsonargparse")


def fail(message: str) -> NoReturn:
    """Report bad input as one line on stderr and exit 2 (:func:`generation.cli.fail`)."""
    cli_fail(PROG, message)


def first_pass(args: list[str]) -> None:
    """Refuse, through :func:`fail`, what is wrong in (normalised) ``args`` without importing torch.

    Checks the YAML syntax of each ``--config`` file, that ``--ckpt_path`` is a checkpoint, the ``--threads``
    value, and that every option given on the command line or as a key of a ``--config`` file exists.
    """
    try:
        check_yaml_files(args)
    except ValueError as e:
        fail(str(e))
    ckpt = option_value(args, "--ckpt_path")
    if ckpt is not None and checkpoint_problem(ckpt):
        fail(checkpoint_problem(ckpt))
    threads = option_value(args, "--threads")
    if threads is not None and threads.lower() not in ("null", "none"):
        try:
            check_threads(threads)
        except ValueError as e:
            fail(str(e))
    record = recorded()
    if record:
        problem = unknown_option(args, set(record["options"])) or bad_value(args, record.get("kinds", {}))
        if problem:
            fail(problem)


def checkpoint_problem(path: str) -> str | None:
    """Why ``path`` cannot be resumed from (missing, a folder, not a ``torch.save`` archive), or None.

    A Lightning checkpoint is a zip archive holding ``<name>/data.pkl``, the pickled dict with a
    ``pytorch-lightning_version`` key; the weights are read by Lightning when training resumes.
    """
    p = Path(path)
    expected = "give the last.ckpt of an interrupted run (<run folder>/checkpoints/last.ckpt)"
    if not p.exists():
        return f"--ckpt_path {path}: no such file; {expected}"
    if p.is_dir():
        return f"--ckpt_path {path} is a folder; {expected}"
    try:
        with zipfile.ZipFile(p) as z:
            pickles = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not pickles:
                raise zipfile.BadZipFile
            if LIGHTNING_KEY not in z.read(pickles[0]):  # the pickle of the dict: its keys, not the tensors
                return (f"--ckpt_path {path} is a torch.save archive but not a Lightning checkpoint (it has no "
                        f"{LIGHTNING_KEY.decode()}); {expected}")
    except (zipfile.BadZipFile, OSError):
        return f"--ckpt_path {path} is not a Lightning checkpoint (not a torch.save archive); {expected}"
    return None


LIGHTNING_KEY = b"pytorch-lightning_version"
"""A key every Lightning checkpoint holds."""


def recorded() -> dict | None:
    """The record in :data:`KNOWN_OPTIONS` (``options``, and ``kinds``), or None when it does not apply: missing,
    unreadable, without options, or read with other versions of Lightning or jsonargparse than those installed."""
    try:
        record = json.loads(KNOWN_OPTIONS.read_text())
    except (OSError, ValueError):
        return None
    applies = isinstance(record, dict) and "options" in record and record.get("versions") == library_versions()
    return record if applies else None


def bad_value(args: list[str], kinds: dict[str, str]) -> str | None:
    """The refusal of the first command-line value in (normalised) ``args`` that its option's kind cannot take
    (``--trainer.max_epochs abc``), or None. Lenient: a value the real parser might take passes (it checks again)."""
    for i, a in enumerate(args[:-1]):
        if a == "--":
            break
        kind = kinds.get(a)
        if kind and not any(_takes(k, args[i + 1]) for k in kind.split("|")):
            return f"{a} {args[i + 1]!r}: expected {kind.replace('|', ' or ')}"
    return None


def _takes(kind: str, value: str) -> bool:
    """Whether a scalar of ``kind`` (int, float, bool, null) may be read from the command-line ``value`` (as YAML,
    as jsonargparse reads it)."""
    try:
        v = yaml.safe_load(value)
    except yaml.YAMLError:
        v = value
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "float" and not number:
        try:
            float(value)
            return True
        except ValueError:
            return False
    return {"int": isinstance(v, int) and not isinstance(v, bool), "float": number, "bool": isinstance(v, bool),
            "null": v is None}.get(kind, True)


def library_versions() -> dict[str, str | None]:
    """The installed versions of the libraries that make the fit parser's options."""
    out: dict[str, str | None] = {}
    for name in RECORDED_WITH:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def unknown_option(args: list[str], known: set[str]) -> str | None:
    """The refusal of the first option in ``args`` (or key of a ``--config`` file) that ``known`` lacks, or None."""
    for i, a in enumerate(args):
        if a == "--":
            break
        if a.startswith("--") and not is_known(a.rstrip("+"), known):
            value = args[i + 1 : i + 2] if i + 1 < len(args) and not args[i + 1].startswith("--") else []
            return did_you_mean(f"unrecognized arguments: {' '.join([a] + value)}", sorted(known))
        if a == "--config" and i + 1 < len(args) and Path(args[i + 1]).is_file():
            for key in _yaml_keys(yaml.safe_load(Path(args[i + 1]).read_text()), "", known):
                close = difflib.get_close_matches(f"--{key}", sorted(known), n=1, cutoff=0.75)
                hint = f"; did you mean {close[0][2:]}?" if close else ""
                return f"--config {args[i + 1]}: {key} is not an option{hint}"
    return None


def is_known(option: str, known: set[str]) -> bool:
    """Whether ``option`` (``--a.b.c``) is known, or lies under a known option whose keys depend on a class
    chosen at parse time (``--trainer.logger``, ``--model.optimizer``: such options know only ``.help``)."""
    if option in known:
        return True
    parts = option.split(".")
    for n in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in known:
            return _is_open(prefix, known)
    return False


def _is_open(option: str, known: set[str]) -> bool:
    return all(k == f"{option}.help" for k in known if k.startswith(option + "."))


def _yaml_keys(data: Any, prefix: str, known: set[str]) -> list[str]:
    """The dotted keys of YAML ``data`` that are not options (a known option's value is not looked into,
    unless it is a group of options)."""
    if not isinstance(data, dict):
        return []
    bad = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        option = f"--{key}"
        if option in known and not (isinstance(v, dict) and not _is_open(option, known)):
            continue  # a value, or a class chosen at parse time: the real parser reads it
        if option not in known and not any(o.startswith(option + ".") for o in known):
            if not is_known(option, known):
                bad.append(key)
            continue
        bad += _yaml_keys(v, key + ".", known)
    return bad

