"""The fit command line before torch loads: its name, one-line refusals and a first pass over the option names.

Importing torch and Lightning takes seconds, so `python -m probes.fit` looks at what it was given before it
imports them: the YAML syntax of each ``--config`` file, and every option name on the command line and every key of
those files against the names the real parser knew the last time it was built. The LightningCLI keeps those names in
the user's cache (:func:`options_cache`), under a key of the installed Lightning and jsonargparse and of this
package's files: after an upgrade or an edit the first run has no names to look at and leaves every check to the real
parser (seconds, still one line), and writes them for the next. Values, and the keys a class chosen in a file takes
(``class_path``, ``init_args``), are checked by the real parser and the classes, after the imports.
"""

from __future__ import annotations

import hashlib
import json
import sys
from importlib.metadata import version
from pathlib import Path
from typing import NoReturn

from generation.cli import check_yaml_files, did_you_mean
from generation.paths import default_cache_dir
from generation.cli import fail as cli_fail

PROG = "python -m probes.fit"
DESCRIPTION = (
    "Build SemanticSpec label data if it is missing, train the target and draft probes, test the best "
    "checkpoint on held-out problems and export it (model.safetensors + config.json per role)."
)
PACKAGES = ("probes", "datamodules", "generation", "callbacks", "arithmetic_world", "semanticspec")
"""This package's folders whose classes the fit parser reads (their files are part of the cache key)."""


def fail(message: str) -> NoReturn:
    """Report bad input as one line on stderr and exit 2 (:func:`generation.cli.fail`)."""
    cli_fail(PROG, message)


def first_pass(args: list[str]) -> None:
    """Refuse, through :func:`fail`, a ``--config`` file that is not YAML and an option name the fit parser does
    not know (when its names are cached), without importing torch. ``args`` are normalised (``--key value``)."""
    try:
        files = check_yaml_files(args)
    except ValueError as e:
        fail(str(e))
    try:
        known = set(json.loads(options_cache().read_text()))
    except (OSError, ValueError):
        return  # not cached yet: the real parser checks the names (check_names, with the names it knows)
    check_names(args, known, files)


def check_names(args: list[str], known: set[str], files: list[tuple[str, dict]] | None = None) -> None:
    """Refuse, through :func:`fail`, a key of the ``--config`` files (``files``: their names and mappings; None: read
    from ``args``) or an option of ``args`` that is not among ``known`` names, with the closest one. The real parser
    runs it too: jsonargparse matches a prefix of a nested option (``--data.build.sampling.top``) without a word."""
    if files is None:
        files = check_yaml_files(args)
    for path, loaded in files:
        if key := next((k for k in config_keys(loaded) if not is_known(f"--{k}", known)), None):
            fail(did_you_mean(f"--config {path}: unknown key '{key}'", sorted(known)))
    for i, a in enumerate(args):
        if a == "--":
            break
        if a.startswith("--") and not is_known(a.rstrip("+").split("=", 1)[0], known):  # --print_config=skip_null
            value = args[i + 1 : i + 2] if i + 1 < len(args) and not args[i + 1].startswith("--") else []
            fail(did_you_mean(f"unrecognized arguments: {' '.join([a] + value)}", sorted(known)))


def config_keys(mapping: dict, prefix: str = ""):
    """The dotted keys of a ``--config`` file's mapping, down to its values; a class's arguments (a mapping with
    ``class_path`` or ``init_args``) and lists are values, left to the real parser."""
    for k, v in mapping.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not {"class_path", "init_args", "dict_kwargs"} & set(v):
            yield from config_keys(v, key + ".")
        else:
            yield key


def is_known(option: str, known: set[str]) -> bool:
    """Whether ``option`` (``--a.b.c``) is known, or lies under a known option whose keys depend on a class
    chosen at parse time (``--trainer.logger``, ``--model.optimizer``: such options know only ``.help``)."""
    parts = option.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in known:
            return n == len(parts) or all(k == f"{prefix}.help" for k in known if k.startswith(prefix + "."))
    return False


def options_cache() -> Path:
    """Where the fit parser's option names are kept: ``fit-options-<checkout>-<state>.json``, one file per state of
    Lightning, jsonargparse and this package's files (any edit or upgrade makes a new key), named by the checkout it
    belongs to (another checkout or environment keeps its own)."""
    root = Path(__file__).resolve().parents[1]
    stamps = [(str(p), p.stat().st_mtime_ns, p.stat().st_size) for name in PACKAGES
              for p in sorted((root / name).rglob("*.py"))]
    key = json.dumps([sys.version, version("lightning"), version("jsonargparse"), stamps])
    place = hashlib.sha256(f"{sys.prefix}\0{root}".encode()).hexdigest()[:8]
    return default_cache_dir() / f"fit-options-{place}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
