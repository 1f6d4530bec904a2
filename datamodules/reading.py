"""A model reading sampled steps, prefix in context: the probes' feature groups of every step.

The prefix is prefilled once into the core's KV cache (:class:`generation.cache.BatchedCache`),
which gives every step sampled after it a copy; the steps' tokens are then fed in one batch (as
the decoder reads a drafted step). The features come from :func:`generation.features.rows_features`,
the function the decoder's verification pass calls, and only they leave the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from generation.cache import BatchedCache
from generation.features import FeatureSpec, rows_features


@torch.no_grad()
def read_steps(
    model,
    prefixes: Sequence[Sequence[int]],
    steps: Sequence[Sequence[Sequence[int]]],
    spec: FeatureSpec,
    pad_token_id: int = 0,
    max_rows: int = 1024,
    max_logit_bytes: int = 1 << 30,
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
        max_logit_bytes: ``token_stats`` keeps the (rows, step length, vocabulary) logits of a forward;
            fewer rows go into one forward when they would exceed this (a 262k vocabulary at 32
            tokens a step takes 34 MB a row). A prefix's steps always go together.

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
    if spec.needs_logits:
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        longest = max((len(s) for ss in steps for s in ss), default=1)
        max_rows = max(1, min(max_rows, max_logit_bytes // (4 * longest * cfg.vocab_size)))
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
    # One cache: prefill the prefixes, give every step its own copy of its prefix, read all steps in one forward.
    cache = BatchedCache(model, len(prefixes), pad_id, spec.layer_ids, compact_at=1.0)  # one read: never compact
    cache.prefill(prefixes)
    cache.select([i for i, ss in enumerate(steps) for _ in ss])
    flat = [list(s) for ss in steps for s in ss]
    before = list(cache.last_logits)  # (V,) per row: the prefix's last position predicts the step's first token
    for r, s in enumerate(flat):
        cache.seq[r].extend(s)
    fed = cache.feed(range(len(flat)), hidden=spec.needs_hidden, all_logits=spec.needs_logits)
    hidden = [fed[r].hidden for r in range(len(flat))] if spec.needs_hidden else None
    # the logits predicting row r's step: the prefix's last, then the step's own but its last (views, no copy)
    logits = [(before[r][None], fed[r].logits[:-1]) for r in range(len(flat))] if spec.needs_logits else None
    parts = rows_features(spec, flat, hidden, logits)
    return {g: v.cpu() for g, v in parts.items()}
