"""A model reading sampled steps: pooled hidden states over each step's tokens, prefix in context.

The prefix is prefilled once into a KV cache that every step sampled after it shares; the steps'
tokens are then fed in one batch against that cache (as the decoder reads a drafted step), and
only their pooled vectors leave the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from datamodules.hidden import pool_hidden_states
from datamodules.sampling import left_pad


def pad_right(rows: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists into ``(input_ids, attention_mask)``, both (B, T)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def read_steps(
    model,
    prefixes: Sequence[Sequence[int]],
    steps: Sequence[Sequence[Sequence[int]]],
    layer_ids: Sequence[int] = (-1,),
    pooling: str = "mean",
    pad_token_id: int = 0,
    max_rows: int = 1024,
) -> torch.Tensor:
    """Pooled hidden states of ``model`` reading every step after its prefix.

    Args:
        model: a transformers causal LM.
        prefixes: token lists, one per prefix.
        steps: for prefix ``i``, the token lists of the steps to read after it (each non-empty).
        layer_ids: HF ``hidden_states`` indices (0 = embeddings, -1 = last layer).
        pooling: ``mean`` over the step's tokens or ``last``.
        pad_token_id: id used for padding (masked out).
        max_rows: most steps fed in one forward pass.

    Returns:
        (sum of len(steps[i]), len(layer_ids), D) float32 on CPU, rows in input order.
    """
    if len(prefixes) != len(steps):
        raise ValueError(f"{len(prefixes)} prefixes but steps for {len(steps)}")
    empty = [(i, j) for i, ss in enumerate(steps) for j, s in enumerate(ss) if len(s) == 0]
    if empty:
        raise ValueError(f"empty steps cannot be read (prefix, step) = {empty[:5]}")
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    i = 0
    while i < len(prefixes):  # chunks of prefixes whose steps fit in max_rows
        j, rows = i, 0
        while j < len(prefixes) and (j == i or rows + len(steps[j]) <= max_rows):
            rows += len(steps[j])
            j += 1
        if rows:
            out.append(_read_chunk(model, prefixes[i:j], steps[i:j], layer_ids, pooling, pad_token_id, device))
        i = j
    if not out:
        return torch.zeros(0, len(layer_ids), model.config.get_text_config().hidden_size)
    return torch.cat(out)


def _read_chunk(model, prefixes, steps, layer_ids, pooling, pad_id, device) -> torch.Tensor:
    ids, mask = left_pad(prefixes, pad_id, device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    owner = torch.tensor([i for i, ss in enumerate(steps) for _ in ss], device=device)  # (R,) prefix of each step
    cache.batch_select_indices(owner)
    step_ids, step_mask = pad_right([s for ss in steps for s in ss], pad_id, device)  # (R, S)
    lengths = step_mask.sum(-1)
    step_pos = mask.sum(-1)[owner, None] + torch.arange(step_ids.shape[1], device=device)[None]
    full_mask = torch.cat([mask[owner], step_mask], dim=1)
    hs = model(input_ids=step_ids, attention_mask=full_mask, position_ids=step_pos, past_key_values=cache,
               use_cache=True, output_hidden_states=True).hidden_states
    pooled = pool_hidden_states(hs, layer_ids, torch.zeros_like(lengths), lengths, pooling)  # (R, L, D)
    return pooled.cpu()
