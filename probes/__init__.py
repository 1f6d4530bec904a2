"""SemanticSpec probes: the probe (``probes.model``) and its config, its training (the LightningModule, the
``python -m probes.fit`` command) and its export (``probes.export``: ``config.json`` + ``model.safetensors`` + a
model card). Decoding with probes is :mod:`semanticspec`'s.

The public surface is :data:`__all__`::

    from probes import load_probe

Each name is imported on first use (PEP 562), so ``import probes`` and the modules that need no torch
(``probes.config``, the command lines' refusals) stay free of torch until a probe is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_SURFACE = {"load_probe": "probes.export"}
"""Each public name and the module that defines it."""

__all__ = ["load_probe"]
assert set(__all__) == set(_SURFACE)

if TYPE_CHECKING:  # what type checkers and editors see; at run time ``__getattr__`` imports on first use
    from probes.export import load_probe


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use, and keep it here."""
    if name not in _SURFACE:
        raise AttributeError(f"module 'probes' has no attribute {name!r}; its public names are {__all__}")
    value = getattr(importlib.import_module(_SURFACE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
