"""Labels from meaning groups: each sample's share of each model's samples in its group.

For one prefix with target samples and draft samples grouped by meaning (docs/design.md "Semantic
probability and labels"): ``q`` = share of the target's samples in the sample's group, ``p`` = share of
the draft's samples in it. ``per_model`` labelling (the paper's) groups each model's samples
alone, so only the writer's own share is defined; the other one is NaN.
"""

from __future__ import annotations

import numpy as np

TARGET, DRAFT = 0, 1
"""Writer codes stored in the shards' ``writer`` column."""
LABELLINGS = ("joint", "per_model")


def shares(groups: np.ndarray, writers: np.ndarray, writer: int) -> np.ndarray:
    """Share of ``writer``'s samples that fall in each sample's group (n,)."""
    mine = writers == writer
    if not mine.any():
        return np.full(len(groups), np.nan)
    counts = np.bincount(groups[mine], minlength=int(groups.max(initial=-1)) + 1)
    return counts[groups] / mine.sum()


def entropy(groups: np.ndarray) -> float:
    """Shannon entropy (nats) of the distribution of samples over groups (semantic entropy)."""
    if len(groups) == 0:
        return 0.0
    p = np.bincount(groups) / len(groups)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def joint_labels(groups: np.ndarray, writers: np.ndarray) -> dict[str, np.ndarray]:
    """Labels of one prefix's jointly grouped samples.

    Args:
        groups: (n,) group id of each sample (target and draft samples grouped together).
        writers: (n,) :data:`TARGET` or :data:`DRAFT`.

    Returns:
        ``q``, ``p`` (n,) float32 and ``entropy`` (n,): the semantic entropy of the writer's own
        samples over the groups.
    """
    groups, writers = np.asarray(groups), np.asarray(writers)
    ent = {w: entropy(groups[writers == w]) for w in (TARGET, DRAFT)}
    return {
        "q": shares(groups, writers, TARGET).astype(np.float32),
        "p": shares(groups, writers, DRAFT).astype(np.float32),
        "entropy": np.array([ent[int(w)] for w in writers], dtype=np.float32),
    }


def per_model_labels(target_groups: np.ndarray, draft_groups: np.ndarray) -> dict[str, np.ndarray]:
    """Labels when each model's samples are grouped alone (rows: target samples, then draft's).

    Group ids of the draft are offset past the target's so the returned ``groups`` stay distinct.
    """
    tg, dg = np.asarray(target_groups), np.asarray(draft_groups)
    nan_t, nan_d = np.full(len(tg), np.nan), np.full(len(dg), np.nan)
    own_t = np.bincount(tg)[tg] / max(len(tg), 1) if len(tg) else nan_t
    own_d = np.bincount(dg)[dg] / max(len(dg), 1) if len(dg) else nan_d
    return {
        "q": np.concatenate([own_t, nan_d]).astype(np.float32),
        "p": np.concatenate([nan_t, own_d]).astype(np.float32),
        "entropy": np.concatenate([np.full(len(tg), entropy(tg)), np.full(len(dg), entropy(dg))]).astype(np.float32),
        "groups": np.concatenate([tg, dg + (int(tg.max()) + 1 if len(tg) else 0)]).astype(np.int32),
    }
