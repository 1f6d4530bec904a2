"""The transformers baseline: its own generation loop, plain (``hf_target_only``) or assisted (``token_sd``).

Token-level speculative decoding (transformers' assisted generation with the same draft) is
compared with transformers' own target-only ``generate``, so both sides of that ratio run the
same loop (docs/design.md "Decoding"). :class:`TransformersLoop` is the method the method table
(:mod:`semanticspec.methods`) maps both names to; it decodes prompt by prompt.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from generation.cache import context_length
from generation.handover import decode_text, pad_id
from generation.sampling import stream_seed
from generation.specs import SamplingSpec
from semanticspec.results import DecodeResult, DecodeStats, StepEvent


@dataclass(frozen=True)
class TransformersLoop:
    """The method that runs transformers' own loop, ``target.generate``, assisted by the draft when ``assisted``
    (the in-process decoder runs it with :func:`transformers_events`; it is not a round of the step loop)."""

    assisted: bool
    policy = None
    probes_decide = False


def transformers_events(method: TransformersLoop, target, draft, tokenizer, draft_tokenizer, batch: tuple,
                        max_new_tokens: int, sampling: SamplingSpec, keys) -> Iterator[StepEvent]:
    """Decode prompt by prompt (``batch``: the target's and the draft's prompt ids), each seeding transformers from
    its own stream (``keys``: each prompt's :data:`~generation.sampling.StreamKey`); a prompt's output is one step,
    yielded with its end event. ``draft_tokenizer``: None when the models share ``tokenizer``.

    Each stops at the models' context end: with one tokenizer the draft reads the same ids; with two, transformers
    hands text over and only the target's context is known here.
    """
    shared, (ids_t, ids_d) = draft_tokenizer is None, batch
    for k, (key, it, idd) in enumerate(zip(keys, ids_t, ids_d)):
        rooms = [(context_length(target.config), len(it))]
        rooms += [(context_length(draft.config), len(idd))] if shared else []
        room = min([c - n for c, n in rooms if c is not None], default=max_new_tokens)
        r = hf_generate(target, draft, tokenizer, draft_tokenizer, it, method.assisted, max_new_tokens, sampling,
                        stream_seed(*key, "sampling"), room)
        for step in r.steps:
            yield StepEvent(k, step, r.text)
        yield StepEvent(k, None, r.text, r)


def hf_generate(target, draft, tokenizer, draft_tokenizer, ids: list[int], assisted: bool, max_new_tokens: int,
                sampling: SamplingSpec, seed: int, room: int | None = None) -> DecodeResult:
    """One prompt through ``target.generate`` (assisted by ``draft`` when ``assisted``: ``token_sd``).

    ``draft_tokenizer`` is None for a shared tokenizer, else transformers' universal assisted
    generation hands text between the two. ``room``: new tokens the context holds (None: no limit);
    the result stops there with ``stop_reason="context"``.
    """
    dev = next(target.parameters()).device
    cap = max_new_tokens if room is None else min(max_new_tokens, room)
    if cap < 1:  # nothing fits: no call
        return DecodeResult("", [], DecodeStats(), "context")
    calls = {"target": 0, "draft": 0}
    hooks = [target.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1))]
    # Plain arguments, no generation_config. (transformers' assisted loop itself calls the assistant's generate with
    # both, and its cross-tokenizer handover decodes with clean_up_tokenization_spaces=True; each warns once per
    # process from inside transformers, not from here.)
    kwargs = {"max_new_tokens": cap, "pad_token_id": pad_id(tokenizer), "eos_token_id": tokenizer.eos_token_id}
    # Sampling as the package's sampler does it: temperature and top-p, no top-k (transformers' default is 50).
    kwargs.update({"do_sample": False} if sampling.greedy else
                  {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": None})
    if assisted:
        hooks.append(draft.register_forward_hook(lambda *a: calls.__setitem__("draft", calls["draft"] + 1)))
        kwargs["assistant_model"] = draft
        if draft_tokenizer is not None:
            kwargs.update(tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)
    # transformers' universal assisted generation (two tokenizers, sampling) replaces the assistant's embeddings and
    # LM head with pruned, re-indexing wrappers and leaves them there, which breaks every later forward of the draft
    # (the decoder's own loop and the next assisted call fail with shape errors); they are put back afterwards.
    heads = (draft.get_input_embeddings(), draft.get_output_embeddings())
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    try:
        x = torch.tensor([ids], device=dev)
        out = target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    finally:
        for h in hooks:
            h.remove()
        if (draft.get_input_embeddings(), draft.get_output_embeddings()) != heads:
            draft.set_input_embeddings(heads[0])
            draft.set_output_embeddings(heads[1])
            # transformers caches the vocabulary translator that pruned them and expects the pruned head next
            # time; forget it so the next assisted call prunes (and we restore) afresh
            from transformers.generation.candidate_generator import AssistantVocabTranslatorCache

            AssistantVocabTranslatorCache._cache.get(tokenizer, {}).pop(draft_tokenizer, None)
    wall = time.perf_counter() - t0
    new = out[0, len(ids) :].tolist()
    eos = tokenizer.eos_token_id
    if eos in new:
        new = new[: new.index(eos) + 1]
    stats = DecodeStats(wall_s=wall, output_tokens=len(new), steps=0, target_passes=calls["target"],
                        draft_passes=calls["draft"])
    reason = "eos" if eos in new else ("budget" if len(new) >= max_new_tokens else "context")
    return DecodeResult(decode_text(tokenizer, new), [], stats, reason)
