"""The probes' feature groups: what a model computes while reading a step, turned into probe inputs.

Three groups (docs/design.md "Probes and their features"), all taken from the one forward pass that reads the step:

- ``hidden``: chosen layers' hidden states, mean-pooled (or last token) over the step's tokens
  (the paper's probe input);
- ``token_stats``: the reading model's statistics of the step's own tokens, from the logits that
  predicted them (position ``t - 1`` predicts token ``t``; the prefix's last position predicts the
  first): mean and min log-probability, mean and max entropy, the share of tokens that are not the
  model's top-1 or not in its top-5, and the mean log rank. They are the model's own judgement of
  the drafted tokens, which separate right from wrong draft steps far better than pooled states
  do (docs/design.md "Probes and their features");
- ``topk_stats``: statistics that are exact from the token's log-prob and the model's ``top_k`` largest
  log-probs, so a server's top-k answer gives the same numbers as full logits in-process:
  :func:`topk_scores` computes them from ``(logprobs, top)`` either way (:func:`topk_of_logits` makes
  that pair from logits).

The label build (:mod:`datamodules.labels.reading`) and the decoder's verification pass both call
:func:`rows_features` (statistics through :func:`per_token_scores` and :func:`topk_scores`, every row's tokens
scored and reduced together), so a probe sees the same numbers at training and at decode time. Statistics
use the model's raw distribution (temperature 1), whatever temperature decoding samples at.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from generation.specs import FeatureSpec

LOGPROB_FLOOR = -30.0
"""Log-probabilities are clamped here, so a token the model gives (numerically) zero stays finite."""


def token_scores(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How a model scored given tokens: its log-probabilities, each token's log-probability and rank.

    Args:
        logits: (..., V) logits; ``logits[..., :]`` predicts ``tokens[...]``.
        tokens: (...) token ids.

    Returns:
        ``logp`` (..., V) float32 log-softmax, ``token_logp`` (...) the tokens' log-probabilities
        (unclamped) and ``rank`` (...) how many tokens scored higher (0 = the model's top-1).
    """
    x = logits.float()
    tok = tokens.to(x.device).long()[..., None]
    logp = torch.log_softmax(x, dim=-1)
    rank = (x > x.gather(-1, tok)).sum(-1)
    return logp, logp.gather(-1, tok).squeeze(-1), rank


def per_token_scores(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each token's (clamped log-probability, entropy of its distribution, rank), as (..., 3) float32.

    Works on the logits as given (no padded copy of the (..., V) tensor): the full-vocabulary work
    is one log-softmax, one exp and one comparison per position.
    """
    logp, tok_lp, rank = token_scores(logits, tokens)
    plogp = logp.exp().mul_(logp).nan_to_num_(0.0)  # p log p; 0 where p is 0 (a -inf logit)
    return torch.stack([tok_lp.clamp(min=LOGPROB_FLOOR), -plogp.sum(-1), rank.float()], dim=-1)


# ---------------------------------------------------------------------------------------------
# Statistics of a step: per-token columns, reduced over each row's tokens in one pass for the batch.

_STATISTICS: dict[str, dict[str, tuple[str, int, float | str | None]]] = {
    # group -> statistic -> (reduction over the step's tokens, the column of the group's per-token scores it
    # reads, and what it takes of the column: None = the value, a number t = 1.0 where the value >= t else 0.0,
    # "log1p" = log(1 + value)). Scores: token_stats (log-prob, entropy, rank) of :func:`per_token_scores`;
    # topk_stats (log-prob, rank within k, outside the top-k, top-k entropy, top-k mass) of :func:`topk_scores`.
    "token_stats": {
        "mean_logprob": ("mean", 0, None),
        "min_logprob": ("min", 0, None),
        "mean_entropy": ("mean", 1, None),
        "max_entropy": ("max", 1, None),
        "not_top1_share": ("mean", 2, 1.0),
        "not_top5_share": ("mean", 2, 5.0),
        "mean_log_rank": ("mean", 2, "log1p"),
    },
    "topk_stats": {
        "mean_logprob": ("mean", 0, None),
        "min_logprob": ("min", 0, None),
        "not_top1_share": ("mean", 1, 1.0),
        "not_top5_share": ("mean", 1, 5.0),
        "not_topk_share": ("mean", 2, None),
        "mean_log_rank": ("mean", 1, "log1p"),  # rank is at most k
        "mean_topk_entropy": ("mean", 3, None),
        "max_topk_entropy": ("max", 3, None),
        "mean_topk_mass": ("mean", 4, None),
        "min_topk_mass": ("min", 4, None),
    },
}
_WIDTH = {"token_stats": 3, "topk_stats": 5}
"""Columns of each group's per-token scores."""


@dataclass(frozen=True)
class _Plan:
    """How to turn the groups' per-token scores (C, B, T), stacked in group order, into (B, m) statistics.

    Every tensor has one entry per statistic, in output order (m, 1, 1) or (m, 1): a constant number of ops
    computes all of them.
    """

    source: torch.Tensor  # (m,) the score column each statistic reads
    scale: torch.Tensor  # -1 for a max (the negated min of the negated column), else 1
    threshold: torch.Tensor  # t of a share (value >= t), NaN for the others
    is_share: torch.Tensor
    is_log: torch.Tensor
    is_mean: torch.Tensor  # (m, 1)
    sign: torch.Tensor  # (m, 1) a view of ``scale`` for the reduced statistics


@functools.lru_cache(maxsize=64)
@torch.inference_mode(False)
def _plan(groups: tuple[tuple[str, tuple[str, ...]], ...], device: torch.device) -> _Plan:
    """The :class:`_Plan` of ``((group, names), ...)``; cached, so made outside inference mode: a plan a decode made
    first (in inference mode) would otherwise stop every later computation autograd records ("Inference tensors
    cannot be saved for backward").

    Raises:
        ValueError: a name the group does not compute.
    """
    rows, offset = [], 0
    for group, names in groups:
        table = _STATISTICS[group]
        bad = [k for k in names if k not in table]
        if bad:
            what = "token" if group == "token_stats" else "top-k"
            raise ValueError(f"unknown {what} statistics {bad}; this version computes {list(table)}")
        rows += [(how, offset + col, take) for how, col, take in (table[k] for k in names)]
        offset += _WIDTH[group]

    def column(values, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)[:, None, None]

    share = [isinstance(t, float) for _, _, t in rows]
    scale = column([-1.0 if how == "max" else 1.0 for how, _, _ in rows])
    return _Plan(source=torch.tensor([c for _, c, _ in rows], device=device), scale=scale,
                 threshold=column([t if s else float("nan") for (_, _, t), s in zip(rows, share)]),
                 is_share=column(share, torch.bool), is_log=column([t == "log1p" for _, _, t in rows], torch.bool),
                 is_mean=column([how == "mean" for how, _, _ in rows], torch.bool)[:, :, 0],
                 sign=scale[:, :, 0])


def _statistics(scores: torch.Tensor, plan: _Plan, lengths: torch.Tensor | float,
                mask: torch.Tensor | None) -> torch.Tensor:
    """(B, m) statistics from the groups' per-token scores (C, B, T), right-padded along T.

    Args:
        scores: the scores, stacked along C in the plan's group order.
        plan: which statistics.
        lengths: (B,) float32 tokens per row (a Python number for one row).
        mask: (B, T) real positions, or None when every position is real.
    """
    cols = scores.index_select(0, plan.source)  # (m, B, T)
    cols = torch.where(plan.is_share, cols >= plan.threshold, torch.where(plan.is_log, cols.log1p(), cols * plan.scale))
    if mask is None:
        means, mins = cols.sum(-1), cols.amin(-1)
    else:
        means, mins = (cols * mask).sum(-1), cols.masked_fill(~mask, float("inf")).amin(-1)
    return torch.where(plan.is_mean, means / lengths, mins * plan.sign).T.contiguous()


# ---------------------------------------------------------------------------------------------
# Top-k statistics: one function from (token log-probs, top-k log-probs), whoever computed them.


@torch.no_grad()
def topk_of_logits(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a server's top-k answer holds, from full logits: each token's log-prob and the k largest log-probs.

    Args:
        logits: (n, V) logits; ``logits[t]`` predicts ``tokens[t]``.
        tokens: (n,) token ids.
        k: how many log-probs per position (a vocabulary smaller than ``k`` gives all of its ``V``).

    Returns:
        ``logprobs`` (n,) float32 log-softmax of each token and ``top`` (n, min(k, V)), descending.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    tok = logp.gather(-1, tokens.to(logp.device).long()[..., None]).squeeze(-1)
    return tok, logp.topk(min(k, logp.shape[-1]), dim=-1).values


def topk_scores(logprobs: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Each token's top-k scores from its log-prob and the k largest log-probs of its position, as (n, 5) float32.

    Columns: the log-prob clamped at :data:`LOGPROB_FLOOR`; the rank within k (top-k entries strictly above
    the token's log-prob: its full-vocabulary rank when that is below k, else k); outside the top-k
    (rank == k, 1.0 or 0.0); the top-k entropy ``-sum p log p`` and the top-k mass ``sum p`` over the k entries.
    The order of ``top``'s entries does not matter.
    """
    lp, top = logprobs.float(), top.float().to(logprobs.device)
    rank = (top > lp[:, None]).sum(-1).float()
    p = top.exp()
    entropy = -(p * top).nan_to_num(0.0).sum(-1)  # an entry of -inf (p = 0) adds nothing
    return torch.stack([lp.clamp(min=LOGPROB_FLOOR), rank, (rank >= top.shape[-1]).float(), entropy, p.sum(-1)], -1)


def _answer_scores(topk: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int) -> torch.Tensor:
    """(N, 5) :func:`topk_scores` of every row's tokens in row order, from engine answers (checked per row)."""
    for i, (lp, top) in enumerate(topk):
        if top.ndim != 2 or top.shape[0] != len(lp) or top.shape[1] < k:
            raise ValueError(f"row {i}: top-k answer of shape {tuple(top.shape)} for {len(lp)} tokens; expected "
                             f"({len(lp)}, >= {k}) log-probs (top_k={k}); ask the reader for at least {k} per token")
    lps, tops = [lp for lp, _ in topk], [top for _, top in topk]
    if len({t.shape[1] for t in tops}) > 1:  # answers of several widths: cut each to its k largest first
        tops = [t.float().topk(k, dim=1).values for t in tops]
    lp = lps[0] if len(lps) == 1 else torch.cat(lps)
    top = tops[0] if len(tops) == 1 else torch.cat(tops)
    if top.shape[1] > k:
        top = top.float().topk(k, dim=1).values
    return topk_scores(lp, top)


# ---------------------------------------------------------------------------------------------
# Rows given one by one (a cache's feeds, an engine's answers): every row's tokens scored together.

_CHUNK_ELEMENTS = 1 << 24
"""At most this many logits are scored in one tensor (64 MiB float32): rows' logits are concatenated up to it."""


def _logit_chunks(logits: Sequence[torch.Tensor | Sequence[torch.Tensor]],
                  lengths: Sequence[int]) -> list[torch.Tensor]:
    """Every row's (k_i, V) logits (whole, or as consecutive parts) as few (n, V) tensors of consecutive tokens.

    Raises:
        ValueError: a row whose parts hold another number of positions than its step has tokens.
    """
    if len(logits) == 1 and isinstance(logits[0], torch.Tensor) and logits[0].shape[0] == lengths[0]:
        return [logits[0]]  # the decoder's one row: nothing to check or join
    parts: list[torch.Tensor] = []
    for i, (row, n) in enumerate(zip(logits, lengths)):
        row = [row] if isinstance(row, torch.Tensor) else list(row)
        at = sum(p.shape[0] for p in row)
        if at != n:
            raise ValueError(f"row {i}: {at} logits for a step of {n} tokens; give one (V,) row of logits per token")
        parts += row
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in parts:
        if chunks[-1] and (size + p.shape[0]) * p.shape[-1] > _CHUNK_ELEMENTS:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += p.shape[0]
    return [c[0] if len(c) == 1 else torch.cat(c) for c in chunks]


def _logit_scores(groups: Sequence[str], top_k: int, tokens: Sequence[Sequence[int]], lengths: Sequence[int],
                  logits: Sequence) -> dict[str, torch.Tensor]:
    """Per-token scores of every row's tokens in row order, from logits: ``{group: (N, C)}`` for ``groups``."""
    ids = torch.tensor([t for row in tokens for t in row], dtype=torch.long)
    out: dict[str, list[torch.Tensor]] = {g: [] for g in groups}
    at = 0
    for x in _logit_chunks(logits, lengths):
        n = x.shape[0]
        tok = ids[at : at + n].to(x.device)
        at += n
        if "token_stats" in out:
            out["token_stats"].append(per_token_scores(x, tok))
        if "topk_stats" in out:
            out["topk_stats"].append(topk_scores(*topk_of_logits(x, tok, top_k)))
    return {g: s[0] if len(s) == 1 else torch.cat(s) for g, s in out.items()}


def _rows_stats(scores: Mapping[str, torch.Tensor], names: Mapping[str, Sequence[str]],
                lengths: Sequence[int]) -> dict[str, torch.Tensor]:
    """``{group: (B, len(names[group]))}`` from each group's (N, C) per-token scores, reduced in one pass.

    Raises:
        ValueError: a step of no tokens, or a name its group does not compute.
    """
    if min(lengths, default=0) < 1:
        raise ValueError(f"step lengths {list(lengths)} must be >= 1: a step holds at least one token")
    parts = list(scores.values())
    flat = parts[0] if len(parts) == 1 else torch.cat([p.to(parts[0].device) for p in parts], dim=1)
    plan = _plan(tuple((g, tuple(names[g])) for g in scores), flat.device)
    if len(lengths) == 1:
        agg = _statistics(flat.T[:, None], plan, float(lengths[0]), None)
    else:
        n = torch.tensor(lengths, dtype=torch.float32, device=flat.device)
        mask = torch.arange(max(lengths), device=flat.device) < n[:, None]  # (B, T) real positions
        padded = flat.new_zeros(flat.shape[1], *mask.shape)
        padded[:, mask] = flat.T
        agg = _statistics(padded, plan, n, mask)
    if len(scores) == 1:
        return {g: agg for g in scores}
    parts = agg.split([len(names[g]) for g in scores], dim=1)
    return {g: part.contiguous() for g, part in zip(scores, parts)}


def _rows_pooled(hidden: Sequence[torch.Tensor], lengths: Sequence[int], pooling: str) -> torch.Tensor:
    """(B, L, D) float32 per-row pooled states from per-row (L, k_i, D) states, in one pass for the batch."""
    if pooling not in ("mean", "last"):
        raise ValueError(f"pooling={pooling!r}; expected 'mean' or 'last'")
    if [h.shape[1] for h in hidden] != list(lengths):
        raise ValueError(f"hidden states of {[h.shape[1] for h in hidden]} positions for steps of "
                         f"{list(lengths)} tokens; give each row's (L, k_i, D) states of its step tokens")
    h = (hidden[0] if len(hidden) == 1 else torch.cat(list(hidden), dim=1)).float()  # (L, N, D)
    if pooling == "last":
        ends = torch.tensor(lengths, device=h.device).cumsum(0) - 1
        return h[:, ends].transpose(0, 1).contiguous()
    if len(lengths) == 1:
        return h.sum(1)[None] / lengths[0]  # a Python number: no tensor to build for one row
    n = torch.tensor(lengths, dtype=torch.float32, device=h.device)[:, None, None]
    mask = torch.arange(max(lengths), device=h.device) < n[:, 0]  # (B, T)
    padded = h.new_zeros(h.shape[0], *mask.shape, h.shape[-1])  # (L, B, T, D)
    padded[:, mask] = h
    return (padded.sum(2).transpose(0, 1) / n).contiguous()


def rows_features(
    spec: FeatureSpec,
    tokens: Sequence[Sequence[int]],
    hidden: Sequence[torch.Tensor] | None = None,
    logits: Sequence[torch.Tensor | Sequence[torch.Tensor]] | None = None,
    topk: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The feature groups of ``spec`` for several rows' steps, given per row as a cache's feeds or an engine's answers.

    The label build's reading and the decoder's verification both call this. Every row's tokens are
    scored together (their logits concatenated, at most :data:`_CHUNK_ELEMENTS` at once, never padded
    to (B, T, V)) and reduced in one pass over a padded (m, B, T) tensor of per-token columns, so the
    number of tensor ops does not grow with the batch.

    Args:
        spec: the feature spec; ``spec.layer_ids`` name the layers ``hidden`` holds, in order.
        tokens: per row, the step's tokens.
        hidden: ``hidden`` group: per row (L, k_i, D) states of the step's tokens at the layers
            of ``spec.layer_ids``, in that order (an engine gives (1, k_i, D), the last layer).
        logits: ``token_stats`` group, and ``topk_stats`` when ``topk`` is None: per row (k_i, V) logits
            predicting each step token, or consecutive parts of them.
        topk: ``topk_stats`` group: per row an engine's ``(logprobs (k_i,), top (k_i, K))``
            (``TokenLogprobs.logprobs``, ``.top``), K >= ``spec.top_k``; None = from ``logits``
            with :func:`topk_of_logits`.

    Returns:
        ``{"hidden": (B, L, D), "token_stats": (B, K), "topk_stats": (B, K')}`` float32, the groups of ``spec`` only.
    """
    lengths = [len(t) for t in tokens]
    out: dict[str, torch.Tensor] = {}
    if spec.needs_hidden:
        if hidden is None:
            raise ValueError("the hidden feature group needs the reading forward's hidden_states")
        out["hidden"] = _rows_pooled(hidden, lengths, spec.pooling)
    from_logits = [g for g in spec.groups if g == "token_stats" or (g == "topk_stats" and topk is None)]
    if from_logits and logits is None:
        raise ValueError(f"{_stat_groups(spec)} needs the logits that predicted the step's tokens"
                         + (" (or an engine's top-k answer: topk)" if spec.needs_topk else ""))
    scores = _logit_scores(from_logits, spec.top_k, tokens, lengths, logits) if from_logits else {}
    if spec.needs_topk and topk is not None:
        got = [len(lp) for lp, _ in topk]
        if got != lengths:
            raise ValueError(f"top-k answers for {len(topk)} rows of {got} tokens, but the steps have "
                             f"{lengths} tokens; an answer must cover every step token")
        scores["topk_stats"] = _answer_scores(topk, spec.top_k)
    if scores:
        names = {"token_stats": spec.token_stats, "topk_stats": spec.topk_stats}
        out.update(_rows_stats({g: scores[g] for g in spec.groups if g in scores}, names, lengths))
    return out


def _stat_groups(spec: FeatureSpec) -> str:
    """``the token_stats feature group`` (the statistics groups ``spec`` reads), for errors."""
    return "the " + " and ".join(g for g in spec.groups if g != "hidden") + " feature group"


def probe_input(parts: Mapping[str, torch.Tensor], groups: Sequence[str]) -> torch.Tensor:
    """One flat (B, W) float32 probe input: the groups' features flattened and concatenated in ``groups`` order."""
    missing = [g for g in groups if g not in parts]
    if missing:
        raise ValueError(f"probe reads feature groups {list(groups)} but only {sorted(parts)} were computed")
    return torch.cat([parts[g].float().flatten(1) for g in groups], dim=1)


def probe_features(spec: FeatureSpec, tokens: Sequence[Sequence[int]], hidden=None, logits=None,
                   topk=None) -> torch.Tensor:
    """A probe's (B, W) float32 input for several rows' steps: :func:`rows_features`, flattened by
    :func:`probe_input` in ``spec.groups`` order (the arguments are :func:`rows_features`')."""
    return probe_input(rows_features(spec, tokens, hidden, logits, topk), spec.groups)
