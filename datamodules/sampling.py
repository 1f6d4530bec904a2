"""The one sampler: temperature / top-p sampling with a KV cache, batched, seeded.

The label pipeline samples steps with :func:`generate`, and the world's benchmarks time models
with it; the decoder does not call :func:`generate` (it runs its own step loop over a shared
KV cache, :mod:`probes.decoding.runner`) but draws every token with :func:`sample_next` and
:func:`top_p_filter` from here, so every figure comes from the same sampling code.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from transformers import DynamicCache


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Draw one token per row of ``logits`` (B, V); temperature 0 is greedy. Returns (B,)."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature={temperature} (need >= 0), top_p={top_p} (need in (0, 1])")
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(top_p_filter(probs, top_p), 1, generator=generator).squeeze(-1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row of ``probs`` (B, V) outside the nucleus of mass ``top_p``."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the token that crosses top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(input_ids, attention_mask)``, both (B, T)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r) :] = torch.as_tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


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
