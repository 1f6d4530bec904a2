"""A model reading sampled steps, prefix in context: the probes' feature groups of every step.

The prefix is prefilled once into a KV cache that every step sampled after it shares; the steps'
tokens are then fed in one batch against that cache (as the decoder reads a drafted step). The
features come from :func:`generation.features.step_features`, the function the decoder's
verification pass calls, and only they leave the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from generation.features import FeatureSpec, step_features
from generation.padding import left_pad, pad_right


@torch.no_grad()
def read_steps(
    model,
    prefixes: Sequence[Sequence[int]],
    steps: Sequence[Sequence[Sequence[int]]],
    spec: FeatureSpec,
    pad_token_id: int = 0,
    max_rows: int = 1024,
) -> dict[str, torch.Tensor]:
    """The feature groups of ``model`` reading every step after its prefix.

    Args:
        model: a transformers causal LM.
        prefixes: token lists, one per prefix (each non-empty: its last position predicts the
            step's first token).
        steps: for prefix ``i``, the token lists of the steps to read after it (each non-empty).
        spec: which feature groups to compute, and how (layers, pooling, statistics).
        pad_token_id: id used for padding (masked out).
        max_rows: most steps fed in one forward pass.

    Returns:
        ``{group: tensor}`` on CPU, rows in input order: ``hidden`` (R, len(layer_ids), D) and
        ``token_stats`` (R, K) float32, R = sum of len(steps[i]).
    """
    if len(prefixes) != len(steps):
        raise ValueError(f"{len(prefixes)} prefixes but steps for {len(steps)}")
    empty = [(i, j) for i, ss in enumerate(steps) for j, s in enumerate(ss) if len(s) == 0]
    if empty:
        raise ValueError(f"empty steps cannot be read (prefix, step) = {empty[:5]}")
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("empty prefixes cannot be read: a prefix holds at least the prompt (with BOS)")
    device = next(model.parameters()).device
    out: list[dict[str, torch.Tensor]] = []
    i = 0
    while i < len(prefixes):  # chunks of prefixes whose steps fit in max_rows
        j, rows = i, 0
        while j < len(prefixes) and (j == i or rows + len(steps[j]) <= max_rows):
            rows += len(steps[j])
            j += 1
        if rows:
            out.append(_read_chunk(model, prefixes[i:j], steps[i:j], spec, pad_token_id, device))
        i = j
    if not out:
        width = model.config.get_text_config().hidden_size
        empty_parts = {"hidden": torch.zeros(0, len(spec.layer_ids), width), "token_stats": torch.zeros(0, len(spec.token_stats))}
        return {g: empty_parts[g] for g in spec.groups}
    return {g: torch.cat([o[g] for o in out]) for g in spec.groups}


def _read_chunk(model, prefixes, steps, spec: FeatureSpec, pad_id, device) -> dict[str, torch.Tensor]:
    ids, mask = left_pad(prefixes, pad_id, device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    pre = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1).logits[:, -1]  # (P, V): left-padded, so the last column predicts each step's first token
    owner = torch.tensor([i for i, ss in enumerate(steps) for _ in ss], device=device)  # (R,) prefix of each step
    cache.batch_select_indices(owner)
    step_ids, step_mask = pad_right([s for ss in steps for s in ss], pad_id, device)  # (R, S)
    lengths = step_mask.sum(-1)
    step_pos = mask.sum(-1)[owner, None] + torch.arange(step_ids.shape[1], device=device)[None]
    full_mask = torch.cat([mask[owner], step_mask], dim=1)
    out = model(input_ids=step_ids, attention_mask=full_mask, position_ids=step_pos, past_key_values=cache,
                use_cache=True, output_hidden_states=spec.needs_hidden, logits_to_keep=0 if spec.needs_logits else 1)
    logits = None
    if spec.needs_logits:  # position t - 1 predicts step token t; the prefix's last position predicts token 0
        logits = torch.cat([pre[owner, None], out.logits[:, :-1]], dim=1)  # (R, S, V)
    parts = step_features(spec, lengths, out.hidden_states if spec.needs_hidden else None, logits, step_ids)
    return {g: v.cpu() for g, v in parts.items()}
