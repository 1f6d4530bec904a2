"""Transformers' own generation loop: the ``hf_target_only`` and ``token_sd`` (assisted generation) methods.

Token-level speculative decoding is compared with transformers' own target-only ``generate`` so
both sides of that ratio run the same loop (docs/design.md "Decoding").
"""

from __future__ import annotations

import time

import torch

from probes.decoding.results import DecodeResult, DecodeStats


def pad_id(tok) -> int:
    """The id fed in unused slots: the pad token, else EOS, else 0."""
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def decode_text(tok, tokens) -> str:
    """Text of ``tokens`` up to EOS, special tokens dropped."""
    eos = tok.eos_token_id
    tokens = list(tokens)
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tok.decode(tokens, skip_special_tokens=True)


def hf_generate(target, draft, tokenizer, draft_tokenizer, ids: list[int], method: str, max_new_tokens: int,
                temperature: float, top_p: float, seed: int) -> DecodeResult:
    """One prompt through ``target.generate`` (assisted by ``draft`` for ``token_sd``).

    ``draft_tokenizer`` is None for a shared tokenizer, else transformers' universal assisted
    generation hands text between the two.
    """
    dev = next(target.parameters()).device
    calls = {"target": 0, "draft": 0}
    hooks = [target.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1))]
    # Plain arguments, no generation_config. (transformers' assisted loop itself calls the assistant's generate with
    # both, and its cross-tokenizer handover decodes with clean_up_tokenization_spaces=True; each warns once per
    # process from inside transformers, not from here.)
    kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": pad_id(tokenizer), "eos_token_id": tokenizer.eos_token_id}
    # Sampling as the package's sampler does it: temperature and top-p, no top-k (transformers' default is 50).
    kwargs.update({"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": None} if temperature > 0
                  else {"do_sample": False})
    if method == "token_sd":
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
    return DecodeResult(decode_text(tokenizer, new), [], stats)
