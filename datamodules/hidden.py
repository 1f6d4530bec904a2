"""Hidden states of a model reading steps, and the one pooling function.

The label pipeline and the decoder both pool through :func:`pool_hidden_states`, so a probe sees
the same kind of vector at training and decode time.
"""

from __future__ import annotations

from typing import Sequence

import torch


def pool_hidden_states(
    hidden_states: Sequence[torch.Tensor],
    layer_ids: Sequence[int],
    start: torch.Tensor,
    end: torch.Tensor,
    pooling: str = "mean",
) -> torch.Tensor:
    """Pool each row's positions ``[start, end)`` at the given layers.

    Args:
        hidden_states: HF ``output.hidden_states``: one (B, T, D) tensor per layer plus embeddings
            (index 0 = embeddings, -1 = last layer).
        layer_ids: which entries of ``hidden_states`` to read.
        start: (B,) first position of each row's step (inclusive).
        end: (B,) end of each row's step (exclusive); ``end > start``.
        pooling: ``mean`` over the span or ``last`` (position ``end - 1``).

    Returns:
        (B, len(layer_ids), D) float32 pooled states.
    """
    if pooling not in ("mean", "last"):
        raise ValueError(f"pooling={pooling!r}; expected 'mean' or 'last'")
    n = len(hidden_states)
    bad = [i for i in layer_ids if not -n <= i < n]
    if bad:
        raise ValueError(
            f"layer_ids {bad} out of range for a model with {n - 1} layers: hidden_states has {n} entries "
            f"(0 = embeddings, 1..{n - 1} = layers, -1 = last); choose ids every reading model has"
        )
    h = torch.stack([hidden_states[i] for i in layer_ids], dim=1).float()  # (B, L, T, D)
    T = h.shape[2]
    start, end = start.to(h.device).long(), end.to(h.device).long()
    if bool((end <= start).any()) or bool((end > T).any()) or bool((start < 0).any()):
        raise ValueError(f"empty or out-of-range spans: start={start.tolist()}, end={end.tolist()}, length {T}")
    if pooling == "last":
        idx = (end - 1)[:, None, None, None].expand(-1, h.shape[1], 1, h.shape[-1])
        return h.gather(2, idx).squeeze(2)
    pos = torch.arange(T, device=h.device)
    w = ((pos[None] >= start[:, None]) & (pos[None] < end[:, None])).float()  # (B, T)
    return torch.einsum("blTd,bT->bld", h, w) / (end - start)[:, None, None].float()
