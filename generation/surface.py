"""A package's public surface imported on first use (PEP 562), so importing the package imports no torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_surface(package: str, surface: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: each public name of ``surface`` (name -> defining module)
    is imported from its module on first use and kept in ``namespace`` (the package's globals)."""
    names = list(surface)

    def __getattr__(name: str) -> Any:
        if name not in surface:
            raise AttributeError(f"module {package!r} has no attribute {name!r}; its public names are {names}")
        namespace[name] = value = getattr(importlib.import_module(surface[name]), name)
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
