"""Batched, seeded step sampling with a KV cache, for label builds and the world's benchmarks.

The label pipeline samples steps with :func:`generate`, and the world's benchmarks time models
with it; the decoder does not call :func:`generate` (it runs its own step loop over a shared
KV cache, :mod:`probes.decoding.runner`) but draws every token with :func:`sample_next` and
:func:`top_p_filter` from here, so every figure comes from the same sampling code.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from transformers import DynamicCache

from generation.padding import left_pad
from generation.sampling import sample_next


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.6,
    top_p: float = 0.95,
    generator: Optional[torch.Generator] = None,
    stop: Optional[Callable[[list[int]], bool]] = None,
    eos_token_id: Optional[int] = None,
    pad_token_id: int = 0,
    num_samples: int = 1,
) -> list[list[int]]:
    """Sample a continuation of every prompt (token lists) in one batch with a KV cache.

    A row stops at ``eos_token_id``, when ``stop(new_tokens)`` is true, or at ``max_new_tokens``;
    the stopping token is kept. With ``num_samples > 1`` every prompt is prefilled once and its
    cache shared by ``num_samples`` rows (the label pipeline's N samples per prefix).

    Returns:
        The new tokens of each row: ``len(prompts) * num_samples`` lists, prompt ``i``'s samples
        at rows ``i * num_samples`` to ``(i + 1) * num_samples - 1``.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}; expected >= 1")
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id, device)
    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    logits, pos = out.logits[:, -1], pos[:, -1:]
    if num_samples > 1:  # one prefill per prompt, then num_samples rows share it
        cache.batch_repeat_interleave(num_samples)
        logits, pos, mask = (t.repeat_interleave(num_samples, dim=0) for t in (logits, pos, mask))
    n_rows = len(prompts) * num_samples
    new: list[list[int]] = [[] for _ in range(n_rows)]
    done = torch.zeros(n_rows, dtype=torch.bool)
    for _ in range(max_new_tokens):
        tok = sample_next(logits, temperature, top_p, generator).cpu()
        for i in (~done).nonzero().flatten().tolist():
            new[i].append(int(tok[i]))
            if (eos_token_id is not None and new[i][-1] == eos_token_id) or (stop is not None and stop(new[i])):
                done[i] = True
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos + 1
        out = model(input_ids=tok[:, None].to(device), attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
    return new
