"""The transformers baseline: its own generation loop, plain (``hf_target_only``) or assisted (``token_sd``).

Token-level speculative decoding (transformers' assisted generation with the same draft) is
compared with transformers' own target-only ``generate``, so both sides of that ratio run the
same loop (docs/design.md "Decoding"). :class:`TransformersLoop` is the method the method table
(:mod:`semanticspec.methods`) maps both names to; it decodes prompt by prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from generation.handover import decode_text, pad_id
from generation.specs import SamplingSpec
from semanticspec.results import DecodeResult, DecodeStats
from semanticspec.rows import answer_complete


@dataclass(frozen=True)
class TransformersLoop:
    """The method that runs transformers' own loop, ``target.generate``, assisted by the draft when ``assisted``
    (the in-process decoder runs it with :func:`hf_generate`, prompt by prompt; it is not a round of the step loop)."""

    assisted: bool
    policy = None
    probes_decide = False


def hf_generate(target, draft, tokenizer, draft_tokenizer, ids: list[int], assisted: bool, max_new_tokens: int,
                sampling: SamplingSpec, seed: int, room: int | None = None, marker: str | None = None
                ) -> DecodeResult:
    """One prompt through ``target.generate`` (assisted by ``draft`` when ``assisted``: ``token_sd``).

    ``draft_tokenizer`` is None for a shared tokenizer, else transformers' universal assisted
    generation hands text between the two. ``room``: new tokens the context holds (None: no limit);
    the result stops there with ``stop_reason="context"``. ``marker``: the output ends once a newline follows the
    answer marker (``stop_reason="answer"``, :func:`~semanticspec.rows.answer_complete` read token by token), as
    the step loop's does. transformers samples from torch's global generator, seeded with ``seed`` here and
    restored afterwards (the caller's draws go on as if this call had not run).
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
    if marker:
        kwargs["stopping_criteria"] = StoppingCriteriaList([_AnswerDone(tokenizer, len(ids), marker)])
    # Sampling as the package's sampler does it: temperature and top-p, no top-k (transformers' default is 50).
    kwargs.update({"do_sample": False} if sampling.greedy else
                  {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": None})
    if assisted:
        hooks.append(draft.register_forward_hook(lambda *a: calls.__setitem__("draft", calls["draft"] + 1)))
        kwargs["assistant_model"] = draft
        if draft_tokenizer is not None:
            draft_tokenizer = IdOrderedVocab(draft_tokenizer)
            kwargs.update(tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)
    # transformers' universal assisted generation (two tokenizers, sampling) replaces the assistant's embeddings and
    # LM head with pruned, re-indexing wrappers and leaves them there, which breaks every later forward of the draft
    # (the decoder's own loop and the next assisted call fail with shape errors); they are put back afterwards.
    heads = (draft.get_input_embeddings(), draft.get_output_embeddings())
    t0 = time.perf_counter()
    try:
        x = torch.tensor([ids], device=dev)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
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
    answered = _answer_end(tokenizer, new, marker)  # assisted generation may accept tokens past it in one chunk
    new = new[:answered] if answered is not None else new
    stats = DecodeStats(wall_s=wall, output_tokens=len(new), steps=0, target_passes=calls["target"],
                        draft_passes=calls["draft"])
    reason = "eos" if eos in new else "answer" if answered is not None else \
        "budget" if len(new) >= max_new_tokens else "context"
    return DecodeResult(decode_text(tokenizer, new), [], stats, reason)


class IdOrderedVocab:
    """A draft tokenizer whose ``get_vocab()`` lists its tokens by id, as given to transformers' universal assisted
    generation. With sampling it prunes the draft's LM head to the tokens both vocabularies share, in the order
    ``get_vocab()`` lists them (``AssistantToTargetTranslator``), and a fast tokenizer lists them in a new order on
    every call (a Rust hash map's): the same seed drew other tokens from the reordered logits, call after call.
    Everything else is the tokenizer's."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def get_vocab(self) -> dict[str, int]:
        return dict(sorted(self._tokenizer.get_vocab().items(), key=lambda item: item[1]))

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


class _AnswerDone(StoppingCriteria):
    """transformers' stopping criterion of the answer marker: the new tokens' text holds its line, complete."""

    def __init__(self, tokenizer, start: int, marker: str) -> None:
        self.tokenizer, self.start, self.marker = tokenizer, start, marker

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = [answer_complete(decode_text(self.tokenizer, row[self.start :].tolist()), self.marker)
                for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _answer_end(tokenizer, new: list[int], marker: str | None) -> int | None:
    """How many of ``new`` end the output at the answer marker's completed line (None: they do not)."""
    if not marker or not answer_complete(decode_text(tokenizer, new), marker):
        return None
    return next(j for j in range(1, len(new) + 1) if answer_complete(decode_text(tokenizer, new[:j]), marker))
