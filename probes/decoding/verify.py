"""The verifier: the target reads every row's proposal in one forward and returns typed :class:`Scores`.

What a policy decides from is all here, per row: the target probe's ``q`` (from the target's
hidden states at the step and its logits predicting the step's tokens, cut from this one
forward), the fast-path verdict, the judge's score after a judge turn, the acceptance coin, and
the target's logits after the step (the bonus token is drawn from them). The draft probe's ``p``
is the proposer's to add (:meth:`~probes.decoding.proposer.Proposer.score`). A verifier that
calls a server returns the same :class:`Scores`; :class:`TargetVerifier` is the in-process one.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from generation.features import FeatureSpec
from generation.handover import Handover, decode_text
from generation.writer import StepWriter
from probes.decoding.policies import Needs, fast_path_keeps_rows, judge_score
from probes.decoding.proposer import CachePart, Proposal, probe_rows
from probes.decoding.scores import Scores
from probes.decoding.speculative import token_sd_steps


@dataclass(frozen=True)
class JudgeTurn:
    """The judge turn the target reads after a step (SpecReason): its tokens and the ten digit tokens."""

    suffix: list[int]
    digits: list[int]


@dataclass(frozen=True)
class StepRead:
    """What one verification forward read of one row's step (the probe, the fast path and the judge score it).

    Attributes:
        tokens: the step's target tokens (forced ones first).
        n_forced: how many of them were forced (the bonus token that opened the step).
        step_logits: (k, V) the target's logits predicting each step token, when the policy reads them.
        hidden: (L, k, D) the target's hidden rows of the step, when the probe reads them.
        judge_logits: (V,) the target's logits after the judge turn (SpecReason), when read.
    """

    tokens: list[int]
    n_forced: int
    step_logits: torch.Tensor | None
    hidden: torch.Tensor | None
    judge_logits: torch.Tensor | None


class TargetVerifier(CachePart):
    """The in-process target on its :class:`BatchedCache`, with the target probe and the judge turn.

    Args:
        writer: the target writing steps (its cache, rows holding their prompts; its stopper and the decode's
            sampler).
        tokenizer: the target's tokenizer.
        handover: turns the draft's steps into target tokens.
        probe: the target probe, or None.
        judge: the judge turn.
        coins: per cache row, the generator of its acceptance coins.
        spare: context room each row keeps (a bonus token, a judge turn).
        token_sd_tokens: tokens the draft proposes per target forward when it helps the target write a step.
    """

    def __init__(self, writer: StepWriter, tokenizer, handover: Handover, probe, judge: JudgeTurn, coins,
                 spare: int, token_sd_tokens: int = 0) -> None:
        super().__init__(writer.cache, spare)
        self.writer, self.sampler, self.tokenizer = writer, writer.sampler, tokenizer
        self.handover, self.probe, self.judge, self.coins = handover, probe, judge, coins
        self.token_sd_tokens = token_sd_tokens
        self.spec = FeatureSpec.of(probe.config) if probe is not None else None
        self.probe_s = 0.0  # seconds in the probe during the last verify()
        self._new: dict[int, int] = {}  # per row read by the last verify(): new tokens
        self.token_logits: dict[int, torch.Tensor] = {}  # per row read: logits predicting its new tokens, then after
        self._suffix = 0

    def text(self, tokens) -> str:
        """The text of target tokens (special tokens dropped)."""
        return decode_text(self.tokenizer, tokens)

    def step(self, tokens: list[int], n_forced: int) -> Proposal:
        """A target step (forced tokens first) as the loop commits it."""
        return Proposal(tokens, n_forced, self.text(tokens), eos=self.tokenizer.eos_token_id in tokens)

    def ends_step(self, tokens: list[int], limit: int) -> bool:
        """A target step of ``tokens`` is finished: its stopper says so, or it holds ``limit`` tokens."""
        return bool(tokens) and (self.writer.stop(tokens) or len(tokens) >= limit)

    def write(self, rows: list[int], limits: dict[int, int], forced: dict[int, list], assist=None,
              alone: bool = False) -> dict[int, Proposal]:
        """The target writes one step per row (after its forced tokens), with token-level speculation from the
        ``assist`` proposer's draft when given (both caches end holding the step). ``alone`` (the target-only
        baseline) changes nothing here: the loop's rounds write the output step by step."""
        if assist is not None:
            steps = token_sd_steps(self.writer, assist.writer, rows, limits=limits, forced=forced,
                                   n_propose=self.token_sd_tokens)
        else:
            steps = self.writer.write(rows, limits, forced=forced)
        return {i: self.step(st.tokens, st.n_forced) for i, st in steps.items()}

    def bonus(self, rows: list[int], scores: Mapping[int, Scores]) -> dict[int, list[int]]:
        """The target's next token after each row's kept step, drawn from the forward that read it; it enters the
        target's context."""
        logits = torch.stack([self.cache.last_logits[i] for i in rows]).float()
        drawn = self.sampler.draw(logits, rows).tolist()
        for i, t in zip(rows, drawn):
            self.cache.extend(i, [t])
        return {i: [t] for i, t in zip(rows, drawn)}

    def is_eos(self, tokens: list) -> bool:
        return self.tokenizer.eos_token_id in tokens

    def verify(self, proposals: Mapping[int, Proposal], outputs: Mapping[int, str], needs: Needs,
               rewrites: Collection[int] = ()) -> dict[int, Scores]:
        """Read every proposal (plus the judge turn when needed) in one forward and score it.

        Rows in ``rewrites`` continue a target step the target is rewriting: read in the same forward, without
        the judge turn, and not scored. For every row read, :attr:`token_logits` holds the target's logits
        predicting each new (not forced) token of its proposal, then the token after it: what token-level
        speculation keeps from (:meth:`keep`).

        Returns:
            ``{row: Scores}`` for the rows it read and scores (an empty step reads nothing, cannot be kept).
        """
        tgt, hand = self.cache, self.handover
        suffix = list(self.judge.suffix) if needs.judge else []
        self._suffix, self._new, self.token_logits = len(suffix), {}, {}
        starts, n0, pre = {}, {}, {}
        for i, d in proposals.items():
            new, tail = hand.to_target(d, d.text), [] if i in rewrites else suffix
            starts[i], n0[i], pre[i] = len(tgt.seq[i]) - hand.forced_in_target(d), len(tgt.seq[i]), tgt.last_logits[i]
            self._new[i] = len(new)
            tgt.extend(i, new + tail)
        fed = tgt.feed(list(proposals), hidden=needs.q and self.spec.needs_hidden, all_logits=True)
        read, after = {}, {}
        for i, f in fed.items():
            end = n0[i] + self._new[i] - f.start  # one past the step's last token among the fed tokens
            first_new = n0[i] - f.start  # fed index of the first new token
            self.token_logits[i] = f.predicting(first_new, end + 1, pre[i])
            if i in rewrites:
                continue
            off = starts[i] - f.start  # index of the step's first token among the fed tokens
            step_logits = None
            if needs.q or needs.fast_path is not None:  # (k, V) the target's logits predicting every step token
                step_logits = f.predicting(off, end, pre[i])
            after[i] = f.logits[end - 1]
            read[i] = StepRead(tgt.seq[i][starts[i] : f.start + end], hand.forced_in_target(proposals[i]),
                               step_logits, f.hidden[:, off:end] if needs.q and self.spec.needs_hidden else None,
                               f.logits[-1] if suffix else None)
        return self._score(proposals, outputs, read, after, needs)

    def _score(self, proposals, outputs, read: dict[int, StepRead], after, needs: Needs) -> dict[int, Scores]:
        """Fast path, then ``q`` and one coin per row it did not keep (in row order), and the judge's score."""
        self.probe_s = 0.0
        fast, fp = {}, needs.fast_path
        if fp is not None:  # every row's drafted tokens (a bonus token excluded) scored in one pass
            steps = [(r.step_logits[r.n_forced :], r.tokens[r.n_forced :]) for r in read.values()]
            fast = dict(zip(read, fast_path_keeps_rows(steps, fp.top_k, fp.min_logprob)))
        slow = [i for i in read if not fast.get(i)]
        q, x = {}, {}
        if needs.q and slow:
            t0 = time.perf_counter()
            feats, out = probe_rows(self.probe, self.spec, [read[i].tokens for i in slow],
                                    [read[i].hidden for i in slow] if self.spec.needs_hidden else None,
                                    [read[i].step_logits for i in slow])
            x, q = dict(zip(slow, feats)), dict(zip(slow, out))
            self.probe_s = time.perf_counter() - t0
        coin = {i: float(torch.rand((), generator=self.coins[i])) for i in slow} if needs.coin else {}
        return {i: Scores(text=proposals[i].text, output=outputs[i], features=x.get(i), fast=fast.get(i, False),
                          q=q.get(i), coin=coin.get(i), after=after[i],
                          judge=judge_score(read[i].judge_logits, self.judge.digits) if needs.judge else None)
                for i in read}

    def close_judge_turn(self, row: int, scores: Scores | None) -> None:
        """The target forgets the judge turn it read after the row's step."""
        if self._suffix:
            self.cache.rollback(row, self._suffix, last_logits=scores.after if scores is not None else None)

    def roll_back(self, row: int) -> None:
        """The target forgets the row's step (by length)."""
        self.keep(row, 0)

    def keep(self, row: int, n: int) -> None:
        """The target keeps the first ``n`` new tokens of the row's proposal and forgets the rest (the judge turn
        closed first)."""
        drop = self._new.get(row, 0) - n
        if drop > 0:
            self.cache.rollback(row, drop, last_logits=self.token_logits[row][n])
