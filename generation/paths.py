"""Paths: portable ones for what is shared, strict JSON, and the one atomic way to write a file or a folder.

Exported probe configs (``probes.fit``) and benchmark results (``benchmarks/``) both record where a
model or a probe came from; :func:`portable_paths` makes those paths relative to the repository, or
cuts them to their last part. Every file the package writes for later (shards, manifests, exported probes,
converted models) is written through :func:`atomic_path`. Standard library only, so a benchmark imports it
without the fit CLI.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository (the folder holding ``generation/``); paths inside it are written relative to it."""
DEFAULT_CONFIG = REPO_ROOT / "configs" / "arithmetic.yaml"
"""The embedded default's fit config in a clone: what ``python -m probes.fit`` and ``python -m semanticspec.evaluate``
read without ``--config`` (a wheel ships no ``configs/``)."""
CACHE_ENV = "SEMANTICSPEC_CACHE"
"""The environment variable that moves the package's cache (converted models, the fit's option names)."""


def default_cache_dir() -> Path:
    """The package's cache root: ``$SEMANTICSPEC_CACHE``, else ``~/.cache/semanticspec``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "semanticspec")


def portable_paths(value: Any) -> Any:
    """``value`` with every absolute path string made relative to the repository, or cut to its last part.

    Args:
        value: a string, or dicts and lists of them at any depth; other values pass through.

    Returns:
        The same structure with each absolute path string replaced; relative paths are kept.

    Example:
        >>> portable_paths({"model": "/home/someone/models/draft-1.5b", "n": 3})
        {'model': 'draft-1.5b', 'n': 3}
    """
    if isinstance(value, dict):
        return {k: portable_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable_paths(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        path = Path(value)
        try:
            return path.resolve().relative_to(REPO_ROOT).as_posix()
        except ValueError:
            return path.name
    return value


def strict_json(value: Any) -> str:
    """``value`` as indented JSON text ending in a newline, every NaN or infinite float (a figure no problem measured)
    written as null: Python's ``json`` writes ``NaN``, which strict readers (JavaScript, jq) refuse."""

    def finite(v: Any) -> Any:
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        return [finite(x) for x in v] if isinstance(v, (list, tuple)) else v

    return json.dumps(finite(value), indent=2, allow_nan=False) + "\n"


def folder_problem(folder: str | os.PathLike, option: str) -> str | None:
    """Why ``folder`` (the value of ``option``) cannot be made or written into, checked before the work that writes
    there (a folder made and removed in its nearest existing parent: ``os.access`` says yes to root also where
    nothing can be made, as under /proc), or None. Empty (the working folder, by accident) and a file are refused."""
    path = Path(str(folder)).expanduser()
    if not str(folder):
        return f"{option} '': expected a folder (made if missing), not the working folder by accident"
    if path.is_file():
        return f"{option} {folder}: is a file; expected a folder (made if missing)"
    parent = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    try:
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        return f"{option} {folder}: no folder can be made in {parent} ({e.strerror or e})"
    return None


def file_mode(folder: bool = False) -> int:
    """Mode of a new plain file (or folder) under this process's umask, as ``open`` (``mkdir``) gives: 0o644
    (0o755) under umask 022."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if folder else 0o666) & ~umask


@contextmanager
def atomic_path(path: str | os.PathLike, *, folder: bool = False, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write, renamed onto ``path`` when the block exits without error.

    An interrupted write leaves the old file or folder or the new one, never half of one; on error the temporary
    is removed and ``path`` is left as it was. The result gets the modes ``open`` and ``mkdir`` give under the
    umask (not ``mkdtemp``'s 0700 or a writer's 0600), so files are shared like any other.

    Args:
        path: the file or folder to write; its parent is created.
        folder: yield a new empty folder (for writers that fill a directory) instead of a file name.
        keep_existing: a folder only: when ``path`` exists already (another process finished first), keep it
            and discard the new one; by default the new folder replaces it.

    Example:
        >>> with atomic_path(tmp / "manifest.json") as part:  # doctest: +SKIP
        ...     part.write_text("{}")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    else:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if folder:
            _place_folder(tmp, path, keep_existing)
        else:
            os.chmod(tmp, file_mode())
            os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def _place_folder(tmp: Path, path: Path, keep_existing: bool) -> None:
    """Rename the finished folder ``tmp`` onto ``path`` (see :func:`atomic_path`)."""
    os.chmod(tmp, file_mode(folder=True))
    for f in tmp.iterdir():
        if not f.is_symlink():
            os.chmod(f, file_mode(folder=f.is_dir()))  # a folder in it stays one that can be entered
    if keep_existing or not path.exists():
        try:
            os.rename(tmp, path)  # atomic; fails if path exists and is not empty
        except OSError:
            if not (keep_existing and path.is_dir()):
                raise
        return  # lost a race to an identical result: tmp is removed, the first one stays
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
