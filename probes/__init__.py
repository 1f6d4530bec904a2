"""SemanticSpec probes: the probe and its exported folder (``probes.model``: ``config.json`` + ``model.safetensors``
+ a model card, written, read and loaded checked against a model), its config (``probes.config``) and its training
(the LightningModule, the ``python -m probes.fit`` command). Decoding with probes is :mod:`semanticspec`'s.

The public surface is :data:`__all__`::

    from probes import load_probe

Each name is imported on first use (PEP 562), so ``import probes`` and the modules that need no torch
(``probes.config``, the command lines' refusals) stay free of torch until a probe is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from generation.surface import lazy_surface

_SURFACE = {"load_probe": "probes.model"}
"""Each public name and the module that defines it."""

__all__ = ["load_probe"]
assert set(__all__) == set(_SURFACE)

if TYPE_CHECKING:  # what type checkers and editors see; at run time ``__getattr__`` imports on first use
    from probes.model import load_probe


__getattr__, __dir__ = lazy_surface("probes", _SURFACE, globals())
