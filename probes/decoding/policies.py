"""Acceptance policies: who decides whether a drafted step is kept, one object per rule.

The decoder drafts a step, lets the target read it, and hands every row's :class:`Verified`
step to its policy, which answers ``accept``, ``accept_fast`` or ``reject`` per row. The rules
themselves are pure functions of numbers and logits (:func:`threshold_keeps`, :func:`ratio_keeps`,
:func:`fast_path_keeps`, :func:`judge_score`), tested on scripted values.

- :class:`ProbePolicy`: SemanticSpec, the target probe's ``q`` against a threshold, or the paper's
  ratio rule ``min(1, s * q / p)`` with the draft probe's ``p``; optional top-k fast path;
- :class:`RandomPolicy`: keep with a fixed probability (the control);
- :class:`OraclePolicy`: keep exactly what an oracle calls right (the ceiling);
- :class:`SpecReasonPolicy`: the target scores the step 0-9 after a judge turn (SpecReason-style).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from generation.cache import BatchedCache
from generation.features import probe_input, rows_features, token_scores
from generation.specs import FeatureSpec
from generation.writer import StepDraft


@dataclass
class Verified:
    """One row's drafted step as the target read it.

    Attributes:
        text: the step's text.
        output: the row's output text before the step.
        tokens: the step's tokens in the target's tokenization (forced tokens first).
        n_forced: leading tokens the target wrote (its bonus token), not drafted.
        step_logits: (k, V) the target's logits predicting each step token.
        hidden: (L, k, D) the target's states at the step's tokens, at the target probe's layers.
        judge_logits: (V,) the target's logits after the judge turn (SpecReason), else None.
        draft: the draft's step (its tokens, logits and, when collected, hidden states).
    """

    text: str
    output: str
    tokens: list[int]
    n_forced: int
    step_logits: torch.Tensor
    hidden: torch.Tensor | None
    judge_logits: torch.Tensor | None
    draft: StepDraft
    q: float | None = None
    p: float | None = None
    score: float | None = None


def threshold_keeps(q: float, tau: float) -> bool:
    """The threshold rule: keep when the target probe's q reaches tau."""
    return q >= tau


def ratio_keeps(q: float, p: float | None, u: float, scale: float = 1.0) -> bool:
    """The paper's ratio rule with coin ``u``: keep when ``u < min(1, scale * q / p)``, i.e. ``u * p < scale * q``.

    ``p`` None means it was not computed because ``scale * q >= u`` keeps whatever ``p`` is.
    """
    return p is None or u * p < scale * q


def fast_path_keeps(logits: torch.Tensor, tokens: torch.Tensor, top_k: int, min_logprob: float) -> bool:
    """Keep without the probe: every token is in the target's top-k and has log-prob >= ``min_logprob``.

    Args:
        logits: (k, V) the target's logits predicting each drafted token.
        tokens: (k,) the drafted tokens (a bonus token, which the target wrote, excluded).
    """
    if len(tokens) == 0 or top_k < 1:
        return False
    _, logp, rank = token_scores(logits, tokens)  # as the token statistics score them
    return bool(((rank < top_k) & (logp >= min_logprob)).all())


def judge_score(logits: torch.Tensor, digit_ids: list[int]) -> float:
    """Expected 0-9 score from the logits of the ten digit tokens (SpecReason-style judge)."""
    probs = torch.softmax(logits.float()[digit_ids], dim=-1).cpu()
    return float((probs * torch.arange(10, dtype=torch.float32)).sum())


class AcceptancePolicy:
    """Decides per row whether a drafted step is kept.

    Attributes:
        needs_logits: the target's logits predicting the step's tokens are needed.
        needs_hidden: the target's hidden states at the step's tokens are needed.
        draft_needs_hidden: the draft's hidden states at its step's tokens are needed (while drafting).
        draft_needs_logits: the draft's logits predicting its step's forced tokens are needed too.
        suffix: tokens the target reads right after the step (and forgets again).
        probe_s: seconds spent in probes by the last :meth:`decide`.
        draft_s: seconds of draft forwards the last :meth:`decide` ran.
    """

    needs_logits = False
    needs_hidden = False
    draft_needs_hidden = False
    draft_needs_logits = False
    suffix: list[int] = []

    def __init__(self) -> None:
        self.probe_s = self.draft_s = 0.0

    def decide(self, steps: dict[int, Verified], drf: BatchedCache) -> dict[int, str]:
        raise NotImplementedError


class RandomPolicy(AcceptancePolicy):
    """Keep each step with probability ``rate`` (one coin per step, in row order)."""

    def __init__(self, rate: float, coins: torch.Generator) -> None:
        super().__init__()
        if not 0 <= rate <= 1:
            raise ValueError(f"accept_rate={rate}: expected in [0, 1]")
        self.rate, self.coins = rate, coins

    def decide(self, steps, drf):
        return {i: "accept" if float(torch.rand((), generator=self.coins)) < self.rate else "reject" for i in steps}


class OraclePolicy(AcceptancePolicy):
    """Keep exactly the steps ``oracle(step_text, output_so_far)`` calls right."""

    def __init__(self, oracle: Callable[[str, str], bool]) -> None:
        super().__init__()
        self.oracle = oracle

    def decide(self, steps, drf):
        return {i: "accept" if self.oracle(v.text, v.output) else "reject" for i, v in steps.items()}


class SpecReasonPolicy(AcceptancePolicy):
    """The target reads a judge turn after the step and scores it 0-9; keep at ``threshold`` or above."""

    def __init__(self, suffix: list[int], digit_ids: list[int], threshold: float) -> None:
        super().__init__()
        self.suffix, self.digit_ids, self.threshold = list(suffix), digit_ids, threshold

    def decide(self, steps, drf):
        out = {}
        for i, v in steps.items():
            v.score = judge_score(v.judge_logits, self.digit_ids)
            out[i] = "accept" if v.score >= self.threshold else "reject"
        return out


class ProbePolicy(AcceptancePolicy):
    """SemanticSpec: the probes decide (threshold or ratio rule), after the optional top-k fast path.

    Both probes' inputs come from :func:`~generation.features.rows_features`, the feature function
    the label build uses: the target's from the verification forward (hidden states at the step's
    positions, logits predicting its tokens), the draft's from its drafting forwards. With
    ``lazy_p`` the ratio rule computes ``p`` (and the draft's read of the step's last token) only
    where ``scale * q`` alone does not keep the step; those steps then have ``p=None``.
    """

    needs_logits = True

    def __init__(self, target_probe, draft_probe, rule: str, tau: float, ratio_scale: float, lazy_p: bool,
                 top_k: int, fast_path_min_logprob: float, coins: torch.Generator) -> None:
        super().__init__()
        self.target_probe, self.draft_probe = target_probe, draft_probe
        self.rule, self.tau, self.ratio_scale, self.lazy_p = rule, tau, ratio_scale, lazy_p
        self.top_k, self.min_logprob, self.coins = top_k, fast_path_min_logprob, coins
        self.tspec = FeatureSpec.of(target_probe.config)
        self.dspec = FeatureSpec.of(draft_probe.config) if rule == "ratio" else None
        self.needs_hidden = self.tspec.needs_hidden
        self.draft_needs_hidden = self.dspec is not None and self.dspec.needs_hidden
        self.draft_needs_logits = self.dspec is not None and self.dspec.needs_logits

    def decide(self, steps, drf):
        self.probe_s = self.draft_s = 0.0
        out = {}
        if self.top_k:
            for i, v in steps.items():
                drafted = torch.as_tensor(v.tokens[v.n_forced :])
                if fast_path_keeps(v.step_logits[v.n_forced :], drafted, self.top_k, self.min_logprob):
                    out[i] = "accept_fast"
        slow = [i for i in steps if i not in out]
        if not slow:
            return out
        t0 = time.perf_counter()
        q = self._run(self.target_probe, self.tspec, [steps[i].tokens for i in slow],
                      [steps[i].hidden for i in slow] if self.tspec.needs_hidden else None,
                      [steps[i].step_logits for i in slow])
        for i, qi in zip(slow, q):
            steps[i].q = qi
        if self.rule == "threshold":
            out.update({i: "accept" if threshold_keeps(steps[i].q, self.tau) else "reject" for i in slow})
            self.probe_s = time.perf_counter() - t0
            return out
        u = {i: float(torch.rand((), generator=self.coins)) for i in slow}
        need = [i for i in slow if not (self.lazy_p and self.ratio_scale * steps[i].q >= u[i])]
        if need:
            drafts = [steps[i].draft for i in need]
            if self.dspec.needs_hidden:
                # The draft reads its step's last token only now, and only for steps that need p:
                # a kept step hands that token to the draft's next forward instead.
                t_feed = time.perf_counter()
                for i, f in drf.feed(need, hidden=True).items():
                    steps[i].draft.hidden.extend(f.hidden[:, max(0, steps[i].draft.start - f.start) :].unbind(1))
                self.draft_s = time.perf_counter() - t_feed
            p = self._run(self.draft_probe, self.dspec, [d.tokens for d in drafts],
                          [d.pooled_input() for d in drafts] if self.dspec.needs_hidden else None,
                          [torch.stack(d.token_logits()) for d in drafts] if self.dspec.needs_logits else None)
            for i, pi in zip(need, p):
                steps[i].p = pi
        out.update({i: "accept" if ratio_keeps(steps[i].q, steps[i].p, u[i], self.ratio_scale) else "reject"
                    for i in slow})
        self.probe_s = time.perf_counter() - t0 - self.draft_s  # a draft forward is not probe time
        return out

    @staticmethod
    def _run(probe, spec: FeatureSpec, tokens, hidden, logits) -> list[float]:
        x = probe_input(rows_features(spec, tokens, hidden, logits), spec.groups)
        device = next(probe.parameters(), torch.empty(0)).device
        return probe(x.to(device)).float().cpu().tolist()
