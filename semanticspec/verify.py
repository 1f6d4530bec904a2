"""The verifier: the target reads every row's proposal in one forward and returns typed :class:`Scores`.

What a policy decides from is all here, per row: the target probe's ``q`` (from the target's
hidden states at the step and its logits predicting the step's tokens, cut from this one
forward), the fast-path verdict, the judge's score after a judge turn, the acceptance coin, and
the target's logits after the step (the bonus token is drawn from them). The draft probe's ``p``
is the proposer's to add (:meth:`~semanticspec.proposer.Proposer.score`). A verifier that
calls a server returns the same :class:`Scores`; :class:`TargetVerifier` is the in-process one.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from generation.features import FeatureSpec, probe_input, rows_features
from generation.handover import Handover, decode_text
from generation.sampling import key_stream
from generation.writer import StepWriter
from semanticspec.policies import Needs, fast_path_keeps_rows, judge_score
from semanticspec.proposer import CachePart, Proposal, run_probe
from semanticspec.scores import Scores


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
    """

    def __init__(self, writer: StepWriter, tokenizer, handover: Handover, probe, judge: JudgeTurn, coins,
                 spare: int) -> None:
        super().__init__(writer.cache, spare)
        self.writer, self.sampler, self.tokenizer = writer, writer.sampler, tokenizer
        self.handover, self.probe, self.judge, self.coins = handover, probe, judge, coins
        self.spec = FeatureSpec.of(probe.config) if probe is not None else None
        self.probe_s = 0.0  # seconds in the probe so far
        self._new: dict[int, int] = {}  # per row read by the last verify(): new tokens
        self.token_logits: dict[int, torch.Tensor] = {}  # per row read: logits predicting its new tokens, then after
        self._suffix = 0

    def admit(self, prompt: Sequence[int], key) -> None:
        """A new row holding ``prompt`` with its own sampling and coin streams (the proposer's writer shares the
        sampler, so the row's sampling stream serves both models)."""
        super().admit(prompt, key)
        self.coins.append(key_stream(key, "coins"))
        self.sampler.generator.append(key_stream(key, "sampling"))
        self.sampler._twins.clear()  # twins on other devices are made again, with the new row's

    def text(self, tokens) -> str:
        """The text of target tokens (special tokens dropped)."""
        return decode_text(self.tokenizer, tokens)

    def step(self, tokens: list[int], n_forced: int) -> Proposal:
        """A target step (forced tokens first) as the loop commits it."""
        return Proposal(tokens, n_forced, self.text(tokens), eos=self.tokenizer.eos_token_id in tokens)

    def ends_step(self, tokens: list[int], limit: int) -> bool:
        """A target step of ``tokens`` is finished: its stopper says so, or it holds ``limit`` tokens."""
        return bool(tokens) and (self.writer.stop(tokens) or len(tokens) >= limit)

    def write(self, rows: list[int], limits: dict[int, int], forced: dict[int, list],
              alone: bool = False) -> dict[int, Proposal]:
        """The target writes one step per row (after its forced tokens). ``alone`` (the target-only baseline)
        changes nothing here: the loop's rounds write the output step by step."""
        steps = self.writer.write(rows, limits, forced=forced)
        return {i: self.step(st.tokens, st.n_forced) for i, st in steps.items()}

    def bonus(self, rows: list[int]) -> dict[int, list[int]]:
        """The target's next token after each row's kept step, drawn from the forward that read it; it enters the
        target's context."""
        logits = torch.stack([self.cache.last_logits[i] for i in rows]).float()
        drawn = self.sampler.draw(logits, rows).tolist()
        for i, t in zip(rows, drawn):
            self.cache.extend(i, [t])
        return {i: [t] for i, t in zip(rows, drawn)}

    def is_eos(self, tokens: list) -> bool:
        return self.tokenizer.eos_token_id in tokens

    def verify(self, windows: Mapping[int, Sequence[Proposal]], outputs: Mapping[int, str], needs: Needs,
               rewrites: Collection[int] = ()) -> dict[int, list[Scores]]:
        """Read every row's proposals (a window of steps, one after another; plus the judge turn when needed) in one
        forward and score each step as the step-by-step loop would after the steps before it were kept.

        Rows in ``rewrites`` continue a target step the target is rewriting: read in the same forward, without
        the judge turn, and not scored. For every row read, :attr:`token_logits` holds the target's logits
        predicting each new (not forced) token of its window, then the token after it: what token-level
        speculation keeps from (:meth:`keep`).

        Returns:
            ``{row: [Scores per step]}`` for the rows it read and scores (an empty step reads nothing, cannot be
            kept).
        """
        tgt, hand = self.cache, self.handover
        suffix = list(self.judge.suffix) if needs.judge else []
        self._suffix, self._new, self.token_logits = len(suffix), {}, {}
        bounds, n0, pre = {}, {}, {}
        for i, window in windows.items():
            n0[i], pre[i] = len(tgt.seq[i]), tgt.last_logits[i]
            bounds[i] = []  # per step: (start, end) in the row's sequence, forced tokens included
            for d in window:
                new = hand.to_target(d, d.text)
                start = len(tgt.seq[i]) - hand.forced_in_target(d)
                tgt.extend(i, new)
                bounds[i].append((start, len(tgt.seq[i])))
            self._new[i] = len(tgt.seq[i]) - n0[i]
            tgt.extend(i, [] if i in rewrites else suffix)
        fed = tgt.feed(list(windows), hidden=needs.q and self.spec.needs_hidden, all_logits=True)
        read, after = {}, {}
        for i, f in fed.items():
            end = n0[i] + self._new[i] - f.start  # one past the window's last token among the fed tokens
            self.token_logits[i] = f.predicting(n0[i] - f.start, end + 1, pre[i])
            for j, (d, (a, b)) in enumerate(zip(windows[i], bounds[i])):
                if i in rewrites and j == 0:
                    continue
                read[i, j] = self._read(i, f, a, b, hand.forced_in_target(d), pre[i], needs,
                                        f.logits[-1] if suffix else None)
                after[i, j] = f.logits[b - f.start - 1]
        steps = {(i, j): d for i, w in windows.items() for j, d in enumerate(w)}
        outs = {(i, j): outputs.get(i, "") + "".join(d.text for d in windows[i][:j]) for i, j in read}
        scored = self._score(steps, outs, read, after, needs)
        out: dict[int, list[Scores]] = {}
        for (i, _), s in scored.items():
            out.setdefault(i, []).append(s)
        return out

    def _read(self, i: int, f, a: int, b: int, n_forced: int, pre, needs: Needs, judge_logits) -> StepRead:
        """What the forward ``f`` read of row ``i``'s step at sequence indices ``a`` to ``b - 1``."""
        off, end = a - f.start, b - f.start
        step_logits = None
        if needs.q or needs.fast_path is not None:  # (k, V) the target's logits predicting every step token
            step_logits = f.predicting(off, end, pre)
        hidden = f.hidden[:, off:end] if needs.q and self.spec.needs_hidden else None
        return StepRead(self.cache.seq[i][a:b], n_forced, step_logits, hidden, judge_logits)

    def _score(self, steps, outputs, read: dict[tuple, StepRead], after, needs: Needs) -> dict[tuple, Scores]:
        """Fast path, then ``q`` and one coin per step it did not keep (in order, from its row's stream), and the
        judge's score; every mapping is keyed by ``(row, step in window)``."""
        fast, fp = {}, needs.fast_path
        if fp is not None:  # every step's drafted tokens (a bonus token excluded) scored in one pass
            rs = [(r.step_logits[r.n_forced :], r.tokens[r.n_forced :]) for r in read.values()]
            fast = dict(zip(read, fast_path_keeps_rows(rs, fp.top_k, fp.min_logprob)))
        slow = [k for k in read if not fast.get(k)]
        q, x = {}, {}
        if needs.q and slow:
            t0 = time.perf_counter()
            with torch.inference_mode():  # features and MLP without autograd bookkeeping per op
                feats = probe_input(rows_features(self.spec, [read[k].tokens for k in slow],
                                                  [read[k].hidden for k in slow] if self.spec.needs_hidden else None,
                                                  [read[k].step_logits for k in slow]), self.spec.groups)
                x, q = dict(zip(slow, feats)), dict(zip(slow, run_probe(self.probe, feats)))
            self.probe_s += time.perf_counter() - t0
        coin = {k: float(torch.rand((), generator=self.coins[k[0]])) for k in slow} if needs.coin else {}
        return {k: Scores(text=steps[k].text, output=outputs[k], features=x.get(k), fast=fast.get(k, False),
                          q=q.get(k), coin=coin.get(k), after=after[k],
                          judge=judge_score(read[k].judge_logits, self.judge.digits) if needs.judge else None)
                for k in read}

    def close_judge_turn(self, row: int, scores: Scores | None) -> None:
        """The target forgets the judge turn it read after the row's step."""
        if self._suffix:
            self.cache.rollback(row, self._suffix, last_logits=scores.after if scores is not None else None)

    def keep(self, row: int, n: int) -> None:
        """The target keeps the first ``n`` new tokens of the row's proposal and forgets the rest (the judge turn
        closed first)."""
        drop = self._new.get(row, 0) - n
        if drop > 0:
            self.cache.rollback(row, drop, last_logits=self.token_logits[row][n])
