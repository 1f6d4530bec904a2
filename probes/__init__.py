"""SemanticSpec probes: the probe (`probes.model`), its config, LightningModule, fit CLI, export/load and the decoder.

The public surface is :data:`__all__`: what a caller needs to load a probe and decode with it, in process or
through servers::

    from probes import LoopOptions, ProbePolicy, SemanticSpecDecoder, summarize

Each name is imported on first use (PEP 562), so ``import probes`` and the modules that need no torch
(``probes.config``, the command lines' refusals) stay free of torch until a decoder or a probe is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_SURFACE = {
    "load_probe": "probes.export",
    "SemanticSpecDecoder": "probes.decoder",
    "ServedDecoder": "probes.decoding.served",
    "DecodeConfig": "probes.decoding.config",
    "LoopOptions": "probes.decoding.options",
    "ProbePolicy": "probes.decoding.policies",
    "DecodeResult": "probes.decoding.results",
    "summarize": "probes.decoding.results",
}
"""Each public name and the module that defines it."""

__all__ = ["load_probe", "SemanticSpecDecoder", "ServedDecoder", "DecodeConfig", "LoopOptions", "ProbePolicy",
           "DecodeResult", "summarize"]
assert set(__all__) == set(_SURFACE)

if TYPE_CHECKING:  # what type checkers and editors see; at run time ``__getattr__`` imports on first use
    from probes.decoder import SemanticSpecDecoder
    from probes.decoding.config import DecodeConfig
    from probes.decoding.options import LoopOptions
    from probes.decoding.policies import ProbePolicy
    from probes.decoding.results import DecodeResult, summarize
    from probes.decoding.served import ServedDecoder
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
