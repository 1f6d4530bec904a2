"""Token-level speculative sampling (Leviathan et al., 2023): the pure rule and the target's step loop on it.

:func:`speculative_step` decides, from the target's and the draft's sampling distributions over
a proposal, how many draft tokens to keep and which token follows: each is kept with
probability ``min(1, p_target / p_draft)``, the first refused one is replaced by a draw from
the residual ``max(0, p_target - p_draft)``, and when all are kept the target adds one more.
The distributions are :func:`generation.sampling.sampling_probs`, what the one sampler draws from.
The output is distributed as the target's own sampling (tests/test_decoding_parts.py checks it
with a chi-square test on a scripted vocabulary). :func:`token_sd_steps` writes target steps
with it on the core caches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from generation.writer import StepDraft, StepWriter


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


def token_sd_steps(
    target: StepWriter,
    draft: StepWriter,
    rows: Sequence[int],
    *,
    limits: dict[int, int],
    forced: dict[int, list[int]],
    n_propose: int,
) -> dict[int, StepDraft]:
    """The target writes one step per row with :func:`speculative_step` (shared tokenizer).

    The draft proposes up to ``n_propose`` tokens, the target scores them in one forward. Both
    caches end holding the step (its last token pending). Both writers share the decode's one sampler.
    """
    tgt, drf, sampler, stop = target.cache, draft.cache, target.sampler, target.stop
    steps = {i: StepDraft(len(tgt.seq[i]) - len(forced[i]), list(forced[i]), len(forced[i])) for i in rows}

    def finished(i: int, toks: list[int]) -> bool:
        return bool(toks) and (stop(toks) or len(toks) >= limits[i])

    writing = [i for i in rows if not finished(i, steps[i].tokens)]
    while writing:
        lim = {i: min(len(steps[i].tokens) + n_propose, limits[i]) for i in writing}
        props = draft.write(writing, lim, record_logits=True, forced={i: steps[i].tokens for i in writing})
        before = {i: tgt.last_logits[i] for i in writing}
        n0 = {i: len(tgt.seq[i]) for i in writing}
        for i in writing:
            tgt.extend(i, props[i].tokens[props[i].n_forced :])
        fed = tgt.feed(writing, all_logits=True)
        for i in writing:
            d, f = props[i], fed[i]
            proposal = d.tokens[d.n_forced :]
            first = n0[i] - f.start  # fed index of the first proposed token
            t_logits = f.predicting(first, first + len(proposal) + 1, before[i])
            base = list(steps[i].tokens)
            kept, extra = speculate_tokens(sampler, i, proposal, t_logits, d.logits, drawn=True,
                                           ends_after=lambda j: finished(i, base + proposal[:j]))  # noqa: B023
            steps[i].tokens.extend(proposal[:kept])
            drop = len(proposal) - kept
            tgt.rollback(i, drop, last_logits=t_logits[kept] if drop else tgt.last_logits[i])
            drf.rollback(i, drop, last_logits=d.logits[kept] if drop else None)
            if extra is not None:
                steps[i].tokens.append(extra)
                tgt.extend(i, [extra])
                drf.extend(i, [extra])
        writing = [i for i in writing if not finished(i, steps[i].tokens)]
    return steps
