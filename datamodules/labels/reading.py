"""A model reading sampled steps, prefix in context: the probes' feature groups of every step.

The prefix is prefilled once into the core's KV cache (:class:`generation.cache.BatchedCache`),
which gives every step sampled after it a copy; the steps' tokens are then fed in batched waves
(as the decoder reads a drafted step), finished rows leaving the batch. The features come from
:func:`generation.features.rows_features`, the function the decoder's verification pass calls, and only they leave the
device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from generation.cache import BatchedCache
from generation.features import rows_features
from generation.specs import FeatureSpec


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
        max_logit_bytes: ``token_stats`` and ``topk_stats`` keep the (rows, step length, vocabulary) logits of a
            forward; fewer rows go into one forward when they would exceed this (a 262k vocabulary at 32
            tokens a step takes 34 MB a row). A prefix's steps always go together.

    Identical steps of one prefix are read once (their features are the same).

    Returns:
        ``{group: tensor}`` on CPU, rows in input order: ``hidden`` (R, len(layer_ids), D) and
        ``token_stats`` (R, K) and ``topk_stats`` (R, K') float32, R = sum of len(steps[i]).
    """
    check_read_inputs(prefixes, steps)
    # Samples often repeat (a confident model writes the same step several times): read each distinct
    # step of a prefix once and give its features to every copy.
    unique, where = distinct_steps(steps)
    if len(where) > sum(len(ss) for ss in unique):
        got = read_steps(model, prefixes, unique, spec, pad_token_id, max_rows, max_logit_bytes)
        index = torch.tensor(where, dtype=torch.long)
        return {g: v[index] for g, v in got.items()}
    device = next(model.parameters()).device
    if spec.needs_logits:
        max_rows = _rows_within(model, steps, max_rows, max_logit_bytes)
    out = [_read_chunk(model, prefixes[i:j], steps[i:j], spec, pad_token_id, device)
           for i, j in _chunks(steps, max_rows)]
    if not out:
        width = model.config.get_text_config().hidden_size
        empty_parts = {"hidden": torch.zeros(0, len(spec.layer_ids), width),
                       "token_stats": torch.zeros(0, len(spec.token_stats)),
                       "topk_stats": torch.zeros(0, len(spec.topk_stats))}
        return {g: empty_parts[g] for g in spec.groups}
    return {g: torch.cat([o[g] for o in out]) for g in spec.groups}


def check_read_inputs(prefixes: Sequence[Sequence[int]], steps: Sequence[Sequence[Sequence[int]]]) -> None:
    """Refuse steps for another number of prefixes, empty steps and empty prefixes."""
    if len(prefixes) != len(steps):
        raise ValueError(f"{len(prefixes)} prefixes but steps for {len(steps)}")
    empty = [(i, j) for i, ss in enumerate(steps) for j, s in enumerate(ss) if len(s) == 0]
    if empty:
        raise ValueError(f"empty steps cannot be read (prefix, step) = {empty[:5]}")
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("empty prefixes cannot be read: a prefix holds at least the prompt (with BOS)")


def distinct_steps(steps: Sequence[Sequence[Sequence[int]]]) -> tuple[list[list[list[int]]], list[int]]:
    """Per prefix its distinct steps (in order of first appearance), and per flat row its row among them."""
    unique: list[list[list[int]]] = []
    where: list[int] = []  # flat row -> row among the distinct steps
    distinct = 0
    for ss in steps:
        seen: dict[tuple[int, ...], int] = {}  # a new step takes the next row
        where += [seen.setdefault(tuple(s), distinct + len(seen)) for s in ss]
        distinct += len(seen)
        unique.append([list(k) for k in seen])
    return unique, where


def _rows_within(model, steps: Sequence[Sequence[Sequence[int]]], max_rows: int, max_logit_bytes: int) -> int:
    """``max_rows``, lowered so that one forward's float32 logits of the longest step fit in ``max_logit_bytes``."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    longest = max((len(s) for ss in steps for s in ss), default=1)
    return max(1, min(max_rows, max_logit_bytes // (4 * longest * cfg.vocab_size)))


def _chunks(steps: Sequence[Sequence[Sequence[int]]], max_rows: int) -> Iterator[tuple[int, int]]:
    """Ranges ``[i, j)`` of consecutive prefixes whose steps fit in ``max_rows`` (a prefix's steps always go
    together, so one prefix may exceed it); ranges without steps are left out."""
    i = 0
    while i < len(steps):
        j, rows = i, 0
        while j < len(steps) and (j == i or rows + len(steps[j]) <= max_rows):
            rows += len(steps[j])
            j += 1
        if rows:
            yield i, j
        i = j

def _read_chunk(model, prefixes, steps, spec: FeatureSpec, pad_id, device) -> dict[str, torch.Tensor]:
    # One cache: prefill the prefixes, give every step its own copy of its prefix, then read the steps in
    # waves: each wave feeds every unfinished row up to the median of their remaining lengths, and rows that
    # are done leave the cache. One forward would pad every row to the longest step; the full-vocabulary
    # logits of those padded positions cost as much as real ones (a 262k vocabulary: most of the read).
    cache = BatchedCache(model, len(prefixes), pad_id, spec.layer_ids, compact_at=1.0)  # few reads: never compact
    cache.prefill(prefixes)
    cache.select([i for i, ss in enumerate(steps) for _ in ss])
    flat = [list(s) for ss in steps for s in ss]
    # the logits predicting row r's step: the prefix's last position, then the step's own (views, no copy)
    logits: list[list[torch.Tensor]] = [[cache.last_logits[r][None]] for r in range(len(flat))]
    hidden: list[list[torch.Tensor]] = [[] for _ in flat]
    done = [0] * len(flat)
    rows = list(range(len(flat)))  # cache row k holds flat row rows[k]
    while rows:
        left = sorted(len(flat[r]) - done[r] for r in rows)
        width = left[(len(left) - 1) // 2]  # the median row finishes in this wave
        for k, r in enumerate(rows):
            n = min(width, len(flat[r]) - done[r])
            cache.extend(k, flat[r][done[r] : done[r] + n])
            done[r] += n
        fed = cache.feed(range(len(rows)), hidden=spec.needs_hidden, all_logits=spec.needs_logits)
        for k, r in enumerate(rows):
            if spec.needs_logits:
                logits[r].append(fed[k].logits)
            if spec.needs_hidden:
                hidden[r].append(fed[k].hidden)
        keep = [k for k, r in enumerate(rows) if done[r] < len(flat[r])]
        if keep and len(keep) < len(rows):
            cache.select(keep)
        rows = [rows[k] for k in keep]
    parts = rows_features(spec, flat, [torch.cat(h, dim=1) for h in hidden] if spec.needs_hidden else None,
                          [_first(ls, len(t)) for ls, t in zip(logits, flat)] if spec.needs_logits else None)
    return {g: v.cpu() for g, v in parts.items()}


def _first(parts: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The leading ``n`` rows of consecutive (k_i, V) parts (the logits after a step's last token are not its)."""
    out, have = [], 0
    for part in parts:
        take = min(len(part), n - have)
        if take > 0:
            out.append(part[:take])
            have += take
    return out
