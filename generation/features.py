"""The probes' feature groups: what a model computes while reading a step, turned into probe inputs.

Three groups (docs/design.md "Probes and their features"), all taken from the one forward pass that reads the step:

- ``hidden``: chosen layers' hidden states, mean-pooled (or last token) over the step's tokens
  (the paper's probe input);
- ``token_stats``: the reading model's statistics of the step's own tokens, from the logits that
  predicted them (position ``t - 1`` predicts token ``t``; the prefix's last position predicts the
  first): mean and min log-probability, mean and max entropy, the share of tokens that are not the
  model's top-1 or not in its top-5, and the mean log rank. They are the model's own judgement of
  the drafted tokens (issue 9: min log-prob separates right from wrong draft steps at AUROC ~0.98
  where pooled states reach ~0.85);
- ``topk_stats``: statistics that are exact from the token's log-prob and the model's ``top_k`` largest
  log-probs, so a server's top-k answer gives the same numbers as full logits in-process:
  :func:`topk_scores` computes them from ``(logprobs, top)`` either way (:func:`topk_of_logits` makes
  that pair from logits).

The label build (:mod:`datamodules.labels.reading`) and the decoder's verification pass both call
:func:`rows_features` (pooling through :func:`step_features`, statistics through :func:`per_token_scores`), so a probe sees the same numbers at training and at decode time. Statistics
use the model's raw distribution (temperature 1), whatever temperature decoding samples at.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from generation.groups import TOKEN_STATS, TOPK_STATS
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


def _step_mask(scores: torch.Tensor, lengths: torch.Tensor, names: Sequence[str], known: Sequence[str],
               what: str) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The (B, T) mask of real step positions of right-padded (B, T, C) scores, and the masked mean over them.

    Raises:
        ValueError: a length outside ``1..T``, or a name not in ``known``.
    """
    T = scores.shape[1]
    lengths = lengths.to(scores.device).long()
    if bool((lengths < 1).any()) or bool((lengths > T).any()):
        raise ValueError(f"step lengths {lengths.tolist()} must lie in 1..{T}")
    bad = [k for k in names if k not in known]
    if bad:
        raise ValueError(f"unknown {what} statistics {bad}; this version computes {list(known)}")
    mask = torch.arange(T, device=scores.device)[None] < lengths[:, None]  # (B, T)
    return mask, lambda v: (v * mask).sum(1) / lengths.float()


def _aggregate(scores: torch.Tensor, lengths: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """(B, len(names)) statistics from right-padded per-token scores (B, T, 3) of :func:`per_token_scores`."""
    mask, mean = _step_mask(scores, lengths, names, TOKEN_STATS, "token")
    tok_lp, ent, rank = scores.unbind(-1)
    compute = {
        "mean_logprob": lambda: mean(tok_lp),
        "min_logprob": lambda: tok_lp.masked_fill(~mask, float("inf")).amin(1),
        "mean_entropy": lambda: mean(ent),
        "max_entropy": lambda: ent.masked_fill(~mask, float("-inf")).amax(1),
        "not_top1_share": lambda: mean((rank >= 1).float()),
        "not_top5_share": lambda: mean((rank >= 5).float()),
        "mean_log_rank": lambda: mean(torch.log1p(rank)),
    }
    return torch.stack([compute[k]() for k in names], dim=1)


@torch.no_grad()
def token_stats(
    logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, names: Sequence[str] = TOKEN_STATS
) -> torch.Tensor:
    """Statistics of each row's step tokens under the logits that predicted them.

    Args:
        logits: (B, T, V) logits; ``logits[b, t]`` predicts ``tokens[b, t]``.
        tokens: (B, T) step tokens, right-padded.
        lengths: (B,) tokens in each row's step (>= 1).
        names: statistics to return, from :data:`TOKEN_STATS`.

    Returns:
        (B, len(names)) float32, columns in ``names`` order.
    """
    return _aggregate(per_token_scores(logits, tokens), lengths, names)


@torch.no_grad()
def rows_token_stats(logits: Sequence[torch.Tensor | Sequence[torch.Tensor]], tokens: Sequence[Sequence[int]],
                     names: Sequence[str] = TOKEN_STATS) -> torch.Tensor:
    """:func:`token_stats` of rows given one by one: row ``i``'s (k_i, V) logits, or consecutive parts of them.

    Scores each row where its logits lie (a view of a forward's output needs no copy) and pads only
    the (k_i, 3) scores, so a 262k vocabulary costs no padded (B, T, V) tensor.
    """
    scores = [_row_scores(parts, toks, per_token_scores) for parts, toks in zip(logits, tokens)]
    return _aggregate(pad_steps(scores), torch.tensor([len(t) for t in tokens]), names)


def _row_scores(parts: torch.Tensor | Sequence[torch.Tensor], tokens: Sequence[int],
                score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``score(logits, ids)`` of one row's step, its (k, V) logits given whole or as consecutive parts."""
    parts = [parts] if isinstance(parts, torch.Tensor) else list(parts)
    ids, at, row = torch.as_tensor(list(tokens), dtype=torch.long), 0, []
    for part in parts:
        row.append(score(part, ids[at : at + len(part)]))
        at += len(part)
    if at != len(ids):
        raise ValueError(f"{at} logits for a step of {len(ids)} tokens")
    return torch.cat(row)


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


def _topk_of_parts(parts: torch.Tensor | Sequence[torch.Tensor], tokens: Sequence[int],
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_of_logits` of one row's step, its (k_i, V) logits given whole or as consecutive parts."""

    def pair(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logprobs, top = topk_of_logits(x, ids, k)
        return torch.cat([logprobs[:, None], top], dim=1)

    row = _row_scores(parts, tokens, pair)  # (k_i, 1 + min(k, V))
    return row[:, 0], row[:, 1:]


def _rows_topk(spec: FeatureSpec, tokens: Sequence[Sequence[int]], logits: Sequence | None,
               topk: Sequence[tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
    """``topk_stats`` of rows from an engine's ``topk`` pairs, or (None) from the pairs of their ``logits``."""
    k = spec.top_k
    if topk is None:  # in-process: the pair a server would answer, from the full logits
        topk = [_topk_of_parts(parts, toks, k) for parts, toks in zip(logits, tokens)]
        k = min(k, topk[0][1].shape[1]) if topk else k  # a vocabulary below top_k gives all of it
    lengths = [len(lp) for lp, _ in topk]
    if lengths != [len(t) for t in tokens]:
        raise ValueError(f"top-k answers for {len(topk)} rows of {lengths} tokens, but the steps have "
                         f"{[len(t) for t in tokens]} tokens; an answer must cover every step token")
    return rows_topk_stats(topk, k, spec.topk_stats)


def _aggregate_topk(scores: torch.Tensor, lengths: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """(B, len(names)) :data:`TOPK_STATS` from right-padded (B, T, 5) scores of :func:`topk_scores`."""
    mask, mean = _step_mask(scores, lengths, names, TOPK_STATS, "top-k")
    lp, rank, outside, ent, mass = scores.unbind(-1)
    compute = {
        "mean_logprob": lambda: mean(lp),
        "min_logprob": lambda: lp.masked_fill(~mask, float("inf")).amin(1),
        "not_top1_share": lambda: mean((rank >= 1).float()),
        "not_top5_share": lambda: mean((rank >= 5).float()),
        "not_topk_share": lambda: mean(outside),
        "mean_log_rank": lambda: mean(torch.log1p(rank)),  # rank is at most k
        "mean_topk_entropy": lambda: mean(ent),
        "max_topk_entropy": lambda: ent.masked_fill(~mask, float("-inf")).amax(1),
        "mean_topk_mass": lambda: mean(mass),
        "min_topk_mass": lambda: mass.masked_fill(~mask, float("inf")).amin(1),
    }
    return torch.stack([compute[k]() for k in names], dim=1)


@torch.no_grad()
def rows_topk_stats(topk: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int,
                    names: Sequence[str] = TOPK_STATS) -> torch.Tensor:
    """:data:`TOPK_STATS` of rows given one by one as ``(logprobs (k_i,), top (k_i, K))`` pairs, K >= ``k``.

    The ``k`` largest entries of ``top`` are used (an engine may answer more than asked, in any order).

    Raises:
        ValueError: a row whose ``top`` has fewer than ``k`` columns or another number of rows than
            ``logprobs`` (an answer is never padded).
    """
    scores = []
    for i, (lp, top) in enumerate(topk):
        if top.ndim != 2 or top.shape[0] != len(lp) or top.shape[1] < k:
            raise ValueError(f"row {i}: top-k answer of shape {tuple(top.shape)} for {len(lp)} tokens; expected "
                             f"({len(lp)}, >= {k}) log-probs (top_k={k}); ask the reader for at least {k} per token")
        scores.append(topk_scores(lp, top.float().topk(k, dim=1).values))
    return _aggregate_topk(pad_steps(scores), torch.tensor([len(lp) for lp, _ in topk]), names)


def step_features(
    spec: FeatureSpec,
    lengths: torch.Tensor,
    hidden_states: Sequence[torch.Tensor] | None = None,
    logits: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The feature groups of ``spec`` for a batch of steps, position 0 of each row being its first token.

    Args:
        spec: what to compute.
        lengths: (B,) tokens in each row's step.
        hidden_states: ``hidden``: HF ``output.hidden_states`` (one (B, T, D) per layer plus
            embeddings) at the step's positions, right-padded.
        logits: ``token_stats``, ``topk_stats``: (B, T, V) logits predicting each step token.
        tokens: ``token_stats``, ``topk_stats``: (B, T) the step tokens.

    Returns:
        ``{"hidden": (B, L, D), "token_stats": (B, K), "topk_stats": (B, K')}`` float32, the groups of ``spec`` only.
    """
    out: dict[str, torch.Tensor] = {}
    if spec.needs_hidden:
        if hidden_states is None:
            raise ValueError("the hidden feature group needs the reading forward's hidden_states")
        ends = lengths.to(hidden_states[0].device)
        out["hidden"] = pool_hidden_states(hidden_states, spec.layer_ids, torch.zeros_like(ends), ends, spec.pooling)
    if spec.needs_logits and (logits is None or tokens is None):
        raise ValueError(f"{_stat_groups(spec)} needs the logits that predicted the step's tokens")
    if "token_stats" in spec.groups:
        out["token_stats"] = token_stats(logits, tokens, lengths, spec.token_stats)
    if spec.needs_topk:
        n = lengths.tolist()
        out["topk_stats"] = _rows_topk(spec, [t[:k].tolist() for t, k in zip(tokens, n)],
                                       [x[:k] for x, k in zip(logits, n)], None)
    return out


def rows_features(
    spec: FeatureSpec,
    tokens: Sequence[Sequence[int]],
    hidden: Sequence[torch.Tensor] | None = None,
    logits: Sequence[torch.Tensor | Sequence[torch.Tensor]] | None = None,
    topk: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`step_features` of several rows' steps given per row, as a cache's feeds or an engine return them.

    The label build's reading and the decoder's verification both call this.

    Args:
        spec: the feature spec; ``spec.layer_ids`` name the layers ``hidden`` holds, in order.
        tokens: per row, the step's tokens.
        hidden: ``hidden`` group: per row (L, k_i, D) states of the step's tokens at the layers
            of ``spec.layer_ids``, in that order (an engine gives (1, k_i, D), the last layer).
        logits: ``token_stats`` group, and ``topk_stats`` when ``topk`` is None: per row (k_i, V) logits
            predicting each step token, or consecutive parts of them (:func:`rows_token_stats`).
        topk: ``topk_stats`` group: per row an engine's ``(logprobs (k_i,), top (k_i, K))``
            (``TokenLogprobs.logprobs``, ``.top``), K >= ``spec.top_k``; None = from ``logits``
            with :func:`topk_of_logits`.
    """
    out: dict[str, torch.Tensor] = {}
    if spec.needs_hidden:
        if hidden is None:
            raise ValueError("the hidden feature group needs the reading forward's hidden_states")
        padded = pad_steps([h.transpose(0, 1) for h in hidden])  # (B, k, L, D)
        hs = list(padded.unbind(2))  # L x (B, k, D), as HF hands out hidden_states
        pooled = FeatureSpec(["hidden"], list(range(len(hs))), spec.pooling, [])
        out = step_features(pooled, torch.tensor([len(t) for t in tokens]), hs)
    if "token_stats" in spec.groups or (spec.needs_topk and topk is None):
        if logits is None:
            raise ValueError(f"{_stat_groups(spec)} needs the logits that predicted the step's tokens"
                             + (" (or an engine's top-k answer: topk)" if spec.needs_topk else ""))
    if "token_stats" in spec.groups:
        out["token_stats"] = rows_token_stats(logits, tokens, spec.token_stats)
    if spec.needs_topk:
        out["topk_stats"] = _rows_topk(spec, tokens, logits, topk)
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


def pad_steps(rows: Sequence[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    """Right-pad per-row tensors (k_i, ...) into one (B, max k_i, ...) tensor."""
    width = max(r.shape[0] for r in rows)
    out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), value)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out

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
