"""The padding helper: token lists of different lengths into ``(input_ids, attention_mask)`` batches.

The core cache (:mod:`generation.cache`) right-pads its own feeds; a one-shot scoring forward
(the judge) left-pads with :func:`left_pad` so the last column predicts every row's next token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
