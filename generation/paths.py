"""Portable paths: figures and exports that are shared carry no machine's folders.

Exported probe configs (``probes.fit``) and benchmark results (``benchmarks/``) both record where a
model or a probe came from; :func:`portable_paths` makes those paths relative to the repository, or
cuts them to their last part. Standard library only, so a benchmark imports it without the fit CLI.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository (the folder holding ``generation/``); paths inside it are written relative to it."""


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
