"""Token-level speculative sampling (Leviathan et al., 2023): the pure rule, and its use on logits both models computed.

:func:`speculative_step` decides, from the target's and the draft's sampling distributions over
a proposal, how many draft tokens to keep and which token follows: each is kept with
probability ``min(1, p_target / p_draft)``, the first refused one is replaced by a draw from
the residual ``max(0, p_target - p_draft)``, and when all are kept the target adds one more.
The distributions are :func:`generation.sampling.sampling_probs`, what the one sampler draws from.
The output is distributed as the target's own sampling (tests/semanticspec/test_decoding_parts.py checks it
with a chi-square test on a scripted vocabulary). The step loop runs it between its two parts
(:meth:`~semanticspec.loop.StepLoop.target_steps`): the proposer drafts tokens, the verifier reads them in
one forward, :func:`speculate_tokens` keeps a prefix and draws the token after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def speculative_step(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    proposal: Sequence[int],
    generator: torch.Generator | None = None,
    ends_after: Callable[[int], bool] | None = None,
) -> tuple[int, int | None]:
    """Keep a prefix of ``proposal`` and choose the token after it.

    Args:
        target_probs: (k + 1, V) the target's distribution before each proposed token and after the last.
        draft_probs: (k, V) the draft's distribution each proposed token was drawn from.
        proposal: the k drafted tokens.
        generator: random source (CPU).
        ends_after: ``ends_after(j)`` is true when the step is finished once ``j`` tokens are kept
            (delimiter, cap, budget); then nothing more is kept or added.

    Returns:
        ``(kept, extra)``: the number of proposed tokens kept and the token that follows them
        (a residual draw, or the target's own when all are kept), None when the step ended.
    """
    k = len(proposal)
    if target_probs.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError(f"{k} proposed tokens need {k + 1} target and {k} draft distributions, "
                         f"got {target_probs.shape[0]} and {draft_probs.shape[0]}")
    for j, x in enumerate(proposal):
        pt, pd = target_probs[j], draft_probs[j]
        if float(torch.rand((), generator=generator)) * float(pd[x]) <= float(pt[x]) and float(pt[x]) > 0:
            if ends_after is not None and ends_after(j + 1):
                return j + 1, None
            continue
        residual = (pt - pd).clamp(min=0)
        residual = residual if float(residual.sum()) > 0 else pt
        return j, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


def speculate_tokens(
    sampler,
    row: int,
    proposal: Sequence[int],
    target_logits: torch.Tensor,
    draft_logits: Sequence[torch.Tensor],
    *,
    drawn: bool,
    ends_after: Callable[[int], bool],
) -> tuple[int, int | None]:
    """:func:`speculative_step` on one row's proposal, from the logits both models computed for it.

    Args:
        sampler: the decode's one sampler (its distributions, and row ``row``'s sampling stream).
        proposal: the proposed tokens (forced ones excluded).
        target_logits: at least ``len(proposal) + 1`` rows: the target's logits predicting each proposed token,
            then the one after the last.
        draft_logits: the draft's logits each proposed token was drawn from.
        drawn: the proposal was drawn from ``draft_logits`` (speculative sampling). False: the proposal is a
            given sequence, such as a step the probes refused; it is then treated as a point mass, so each
            kept token is kept with the target's probability of it and the first one not kept is replaced by
            a draw from the target without it: what comes out is exactly a draw from the target, whatever
            selected the proposal.
        ends_after: true once ``j`` kept tokens finish the step.
    """
    k = len(proposal)
    t_probs = sampler.probs(target_logits[: k + 1].cpu())
    if drawn:
        d_probs = sampler.probs(torch.stack(list(draft_logits)).cpu())
    else:
        d_probs = torch.nn.functional.one_hot(torch.as_tensor(list(proposal), dtype=torch.long),
                                              t_probs.shape[-1]).float()
    return speculative_step(t_probs, d_probs, proposal, sampler.stream(row), ends_after)
