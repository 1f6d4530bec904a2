"""How far two label builds of the same problems agree: the same steps, grouped and labelled alike?

Two builds whose steps are sampled by different random streams (an in-process build and one sampled by a
serving engine, or two in-process builds with other seeds) never hold the same samples, so they are compared
on what they share: at each prefix both built (the same problem, prefix and prefix text), the step texts both
sampled. Over those texts:

- ``ari``: the adjusted Rand index of the two builds' meaning groups, pooled over prefixes (a group is named by
  its prefix and its id, so texts of different prefixes are never in one group); 1 when every shared text is
  grouped alike, about 0 for groupings unrelated beyond chance;
- ``mean_abs_dq``: the mean of ``|q_a - q_b|``, the difference of the target-share labels the two builds gave the
  same text at the same prefix;
- ``coverage``: the share of each build's samples whose text the other build also sampled there (how much of
  each build the figures speak for).

Sampling noise alone makes two builds differ (a group's share of ``N`` samples varies by about
``sqrt(q (1 - q) / N)``), so a comparison means something beside the same figures for two builds that differ
only in their sampling seed: the noise floor.
"""

from __future__ import annotations

import os
from collections import Counter

from datamodules.labels.shards import read_step_records


def _texts_by_prefix(data_dir: str | os.PathLike) -> dict[tuple, tuple[str, dict[str, tuple[int, float, int]]]]:
    """``{(problem_id, prefix_id): (prefix text, {step text: (group, q, samples)})}``; a text sampled several
    times keeps its most frequent group (identical texts are one meaning, so a build groups them together), that
    group's ``q`` and its number of samples."""
    out = {}
    for rec in read_step_records(data_dir):
        seen: dict[str, Counter] = {}
        q_of: dict[tuple[str, int], float] = {}
        for smp in rec["samples"]:
            seen.setdefault(smp["text"], Counter())[smp["group"]] += 1
            q_of[(smp["text"], smp["group"])] = smp["q"]
        texts = {}
        for text, groups in seen.items():
            group = groups.most_common(1)[0][0]
            texts[text] = (group, q_of[(text, group)], sum(groups.values()))
        out[(rec["problem_id"], rec["prefix_id"])] = (rec["prefix"], texts)
    return out


def _coverage(build: dict, shared: dict[tuple, set[str]]) -> float:
    """The share of ``build``'s samples at the shared prefixes whose text is shared there."""
    total = sum(n for k in shared for (_, _, n) in build[k][1].values())
    return sum(build[k][1][t][2] for k in shared for t in shared[k]) / max(total, 1)


def label_agreement(a_dir: str | os.PathLike, b_dir: str | os.PathLike) -> dict:
    """The agreement of the label builds in ``a_dir`` and ``b_dir`` (see the module docstring).

    Returns:
        ``{"prefixes", "shared_texts", "ari", "mean_abs_dq", "coverage": {"a", "b"}}``; ``ari`` and
        ``mean_abs_dq`` are None when the builds share no step text.

    Raises:
        ValueError: either folder holds no finished dataset with step texts, or the builds share no prefix
            (other problems, or other prefixes of them), naming both folders.
    """
    import torch
    from torchmetrics.functional.clustering import adjusted_rand_score

    a, b = _texts_by_prefix(a_dir), _texts_by_prefix(b_dir)
    keys = {k for k in a.keys() & b.keys() if a[k][0] == b[k][0]}
    if not keys:
        raise ValueError(f"{a_dir} and {b_dir} share no prefix (the same problem, prefix id and prefix text): "
                         "they are builds of other problems")
    shared = {k: a[k][1].keys() & b[k][1].keys() for k in keys}
    names: dict[tuple, int] = {}
    groups_a, groups_b, dq = [], [], []
    for k in sorted(keys):
        for text in sorted(shared[k]):
            (ga, qa, _), (gb, qb, _) = a[k][1][text], b[k][1][text]
            groups_a.append(names.setdefault(("a", k, ga), len(names)))
            groups_b.append(names.setdefault(("b", k, gb), len(names)))
            dq.append(abs(qa - qb))
    ari = float(adjusted_rand_score(torch.tensor(groups_a), torch.tensor(groups_b))) if dq else None
    return {"prefixes": len(keys), "shared_texts": len(dq), "ari": ari,
            "mean_abs_dq": sum(dq) / len(dq) if dq else None,
            "coverage": {"a": _coverage(a, shared), "b": _coverage(b, shared)}}
