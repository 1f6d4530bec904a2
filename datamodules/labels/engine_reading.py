"""Reading sampled steps through a model's server (``reading.backend: engine``): no in-process copy of the model.

Each step is read in one request, context + step (:meth:`generation.engines.base.Engine.read`): the
server returns the step tokens' log-probabilities with their top-k, and on SGLang the last layer's
hidden rows. A prefix's steps are read one after another, so an engine that keeps the prefix
(llama.cpp's slot, SGLang's radix cache) prefills only each step; prefixes run concurrently, at most
``concurrency`` requests in flight, for an engine that batches them. The features come from
:func:`generation.features.rows_features`, the function in-process reading and the decoder call, so
the top-k statistics equal the in-process ones (they are exact from the top-k alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from datamodules.labels.reading import check_read_inputs, distinct_steps
from generation.engines.base import Engine, Reading
from generation.features import rows_features
from generation.handover import prompt_text
from generation.specs import FeatureSpec, SamplingSpec

GREEDY = SamplingSpec(temperature=0.0)
"""Reading draws no token that matters; the one the server writes after the step is greedy."""


def read_steps_served(engine: Engine, tokenizer, prefixes: Sequence[Sequence[int]],
                      steps: Sequence[Sequence[Sequence[int]]], spec: FeatureSpec, *, concurrency: int = 1,
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """The feature groups of ``engine``'s model reading every step after its prefix.

    Args:
        engine: the role's server.
        tokenizer: the role's tokenizer (prefix and steps go to the server as its text).
        prefixes, steps: as :func:`datamodules.labels.reading.read_steps` (token ids).
        spec: the groups to compute; only groups an engine serves (``topk_stats``; ``hidden`` on SGLang).
        concurrency: prefixes read at once (requests in flight).
        seed: request seed (the server's next token is not used).

    Returns:
        ``{group: tensor}`` on CPU, rows in input order, as ``read_steps``.

    Raises:
        ValueError: bad inputs, or a step the server read as no token.
    """
    check_read_inputs(prefixes, steps)
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: expected >= 1")
    unique, where = distinct_steps(steps)
    contexts = [prompt_text(tokenizer, p) for p in prefixes]
    texts = [[step_text(tokenizer, s) for s in ss] for ss in unique]

    def one_prefix(i: int) -> list[Reading]:
        return [engine.read(contexts[i], t, top_k=spec.top_k, hidden=spec.needs_hidden, sampling=GREEDY, seed=seed)
                for t in texts[i]]

    with ThreadPoolExecutor(concurrency) as pool:
        readings = [r for rs in pool.map(one_prefix, range(len(prefixes))) for r in rs]
    if not readings:
        return {g: torch.zeros(0, 0) for g in spec.groups}
    short = [k for k, r in enumerate(readings) if not r.step.tokens]
    if short:
        raise ValueError(f"{engine.url} read {len(short)} step(s) as no token (first: row {short[0]})")
    parts = rows_features(spec, [r.step.tokens for r in readings],
                          hidden=[r.hidden[None] for r in readings] if spec.needs_hidden else None,
                          topk=[(r.step.logprobs, r.step.top) for r in readings])
    index = torch.tensor(where, dtype=torch.long)
    return {g: v.cpu()[index] for g, v in parts.items()}


def step_text(tokenizer, step: Sequence[int]) -> str:
    """A step's text as a server reads it: without a closing EOS, which text cannot carry (the server would read
    ``"<eos>"`` as characters), as the served decoder reads a step its draft ended with EOS.

    Raises:
        ValueError: a step that is EOS alone (it has no text a server could read).
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = list(step[:-1]) if len(step) and eos is not None and step[-1] == eos else list(step)
    if not ids:
        raise ValueError(f"a step of token ids {list(step)} is EOS alone: a server reads text, and EOS has none")
    return tokenizer.decode(ids, skip_special_tokens=False)
