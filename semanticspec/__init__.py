"""SemanticSpec decoding: the step loop, its in-process and served parts, the acceptance policies, the results, and
the OpenAI-compatible endpoint (:mod:`semanticspec.serve`).

The public surface is :data:`__all__`: what a caller needs to decode with exported probes, in process or through
servers::

    from semanticspec import DecodeConfig, ProbePolicy, SemanticSpecDecoder, ServedDecoder, summarize

The wing's modules: the decoders, each with its two parts (``decoder``: in-process models; ``served``: two servers),
over ``base`` (the public ``generate``/``stream``, the probes loaded through ``probes.load_probe`` and their
specs resolved); ``parts`` is the loop's contract with those parts, a proposer that writes steps and a verifier that
reads them into typed ``Scores`` (``scores``); a pure
acceptance policy (``policies``) decides, and the step loop (``loop``, with ``rows`` and its observer ``meter``)
commits or rolls back; ``methods`` maps method names to round functions, ``config`` holds a call's settings, ``hf``
runs transformers' own loop as a baseline, ``speculative`` is token-level speculative sampling, ``prompts`` checks
prompts, ``timing`` reads the machine's load, ``results`` holds what a decode returns; ``evaluate`` judges exported
probes on held-out problems and picks their threshold (``python -m semanticspec.evaluate``, its tables and plot in
``evaluation_report``).

Each public name is imported on first use (PEP 562), so ``import semanticspec`` imports no torch until a decoder is
asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from generation.surface import lazy_surface

_SURFACE = {
    "SemanticSpecDecoder": "semanticspec.decoder",
    "ServedDecoder": "semanticspec.served",
    "DecodeConfig": "semanticspec.config",
    "ProbePolicy": "semanticspec.policies",
    "DecodeResult": "semanticspec.results",
    "summarize": "semanticspec.results",
}
"""Each public name and the module that defines it."""

__all__ = ["SemanticSpecDecoder", "ServedDecoder", "DecodeConfig", "ProbePolicy", "DecodeResult", "summarize"]
assert set(__all__) == set(_SURFACE)

if TYPE_CHECKING:  # what type checkers and editors see; at run time ``__getattr__`` imports on first use
    from semanticspec.config import DecodeConfig
    from semanticspec.decoder import SemanticSpecDecoder
    from semanticspec.policies import ProbePolicy
    from semanticspec.results import DecodeResult, summarize
    from semanticspec.served import ServedDecoder


__getattr__, __dir__ = lazy_surface("semanticspec", _SURFACE, globals())
