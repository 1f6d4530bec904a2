"""The loop's parts over in-process models: the draft (:class:`DraftProposer`) and the target (:class:`TargetVerifier`),
each writing on its model's :class:`~generation.cache.BatchedCache`.

The proposer writes windows of steps and scores their first one with the draft probe (``p``); the verifier reads every
row's window in one forward and returns typed :class:`~semanticspec.scores.Scores`: the target probe's ``q`` (from the
target's hidden states at the step and its logits predicting the step's tokens, cut from this one forward), the
fast-path verdict, the judge's score after a judge turn, the acceptance coin. Both sync their caches to
what a row committed (:meth:`CachePart.sync`: roll back by length, feed the bonus token or the target's step), and the
target writes its steps token by token from the draft's proposals (:class:`~semanticspec.parts.TokenVerifier`).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch

from generation.features import probe_features
from generation.handover import Handover, decode_text
from generation.sampling import key_stream
from generation.writer import StepDraft, StepWriter
from probes.model import run_probe
from semanticspec.parts import ONE_STEP, Commit, Forced, Proposal, RoomAfter, RowState, Window, grow_windows
from semanticspec.policies import Needs, fast_path_keeps_rows, judge_score
from semanticspec.scores import Scores
from semanticspec.speculative import speculate_tokens


class CachePart:
    """A part over an in-process model's :class:`~generation.cache.BatchedCache` (its counters are the cache's)."""

    passes = property(attrgetter("cache.passes"))
    served_s = property(attrgetter("cache.served_s"))
    forward_s = property(attrgetter("cache.forward_s"))

    def __init__(self, cache, spare: int) -> None:
        self.cache, self.spare = cache, spare

    def room(self, row: int) -> int | None:
        c = self.cache
        return None if c.context is None else c.context - len(c.seq[row]) - self.spare

    def retire(self, rows: Sequence[int]) -> None:
        self.cache.retire(rows)

    def sync(self, row: int, commit: Commit) -> None:
        """Roll the row back to the new tokens of its last read it keeps (their logits after them last), then feed
        what follows them (:class:`~semanticspec.parts.Commit`)."""
        if commit.kept is not None:
            self._keep(row, commit.kept)
        self.cache.extend(row, [*commit.then, *self._taken(commit.step)])

    def _keep(self, row: int, n: int) -> None:
        """The row keeps the first ``n`` new tokens of its last read and forgets the rest."""
        raise NotImplementedError

    def _taken(self, step: Proposal | None) -> list[int]:
        """The tokens of the target's ``step`` this part feeds (none: the target wrote it in its own context)."""
        return []

    def admit(self, prompt: Sequence[int], key) -> None:
        """A new row holding ``prompt`` (:meth:`~semanticspec.loop.StepLoop.admit`; its streams are the
        verifier's to add)."""
        self.cache.add_row(prompt)


class DraftProposer(CachePart):
    """The in-process draft model writing on its :class:`~generation.cache.BatchedCache`.

    Args:
        writer: the draft writing steps (its cache, rows holding their prompts; its stopper and sampler).
        tokenizer: the draft's tokenizer.
        probe: the draft probe (reads the draft's states), or None.
        handover: hands the target's steps to the draft's tokenization.
        spare: context room each row keeps (a bonus token, a judge turn).
    """

    def __init__(self, writer: StepWriter, tokenizer, probe, handover, spare: int) -> None:
        super().__init__(writer.cache, spare)
        self.writer, self.tokenizer, self.probe, self.handover = writer, tokenizer, probe, handover
        self.spec = probe.config.features if probe is not None else None
        self.window: dict[int, list[StepDraft]] = {}  # per row: the steps of its window, in order (p reads the first)
        self.probe_s = 0.0  # seconds in the probe so far

    def _proposal(self, d: StepDraft) -> Proposal:
        return Proposal(d.tokens, d.n_forced, decode_text(self.tokenizer, d.tokens), d.logits,
                        eos=self.tokenizer.eos_token_id in d.tokens, confidence=least_logprob(d))

    def propose(self, rows: Mapping[int, RowState], *, for_p: bool, window: Window = ONE_STEP,
                room_after: RoomAfter | None = None) -> dict[int, list[Proposal]]:
        windows = {i: [d] for i, d in self._write(rows, for_p, more=False).items()}
        if room_after is not None:
            grow_windows(windows, rows, window, lambda more: self._write(more, False, more=True), room_after)
        return windows

    def _write(self, rows: Mapping[int, RowState], for_p: bool, more: bool) -> dict[int, Proposal]:
        """One step per row; ``more``: the step continues the row's window (after its last step, as if kept)."""
        for_p = for_p and self.spec is not None
        steps = self.writer.write(
            list(rows), {i: s.limit for i, s in rows.items()}, forced=_ids({i: s.forced for i, s in rows.items()}),
            collect_hidden=for_p and self.spec.needs_hidden, record_logits=True,
            record_forced_logits=[i for i, s in rows.items() if not s.rewrite] if for_p and self.spec.needs_logits
            else False,
        )
        if more:
            for i, d in steps.items():
                self.window[i].append(d)
        else:
            self.window = {i: [d] for i, d in steps.items()}
        return {i: self._proposal(d) for i, d in steps.items()}

    def write(self, rows: Sequence[int], limits: Mapping[int, int], forced: Mapping[int, Forced] | None = None,
              alone: bool = False) -> dict[int, Proposal]:
        """The draft writes one step per row, kept as it is (``alone`` changes nothing: the loop's rounds write the
        output step by step)."""
        steps = self.writer.write(list(rows), dict(limits), forced=_ids(forced))
        return {i: self._proposal(d) for i, d in steps.items()}

    def score(self, rows: Sequence[int]) -> dict[int, float]:
        drafts = [self.window[i][0] for i in rows]
        if self.spec.needs_hidden:
            # The draft reads its step's last token only now, and only for steps that need p:
            # a kept step hands that token to the draft's next forward instead.
            for i, f in self.cache.feed(list(rows), hidden=True).items():
                d = self.window[i][0]
                d.hidden.extend(f.hidden[:, max(0, d.start - f.start) :].unbind(1))
        t0 = time.perf_counter()  # a draft forward is not probe time
        hidden = [d.pooled_input() for d in drafts] if self.spec.needs_hidden else None
        logits = [torch.stack(d.token_logits()) for d in drafts] if self.spec.needs_logits else None
        with torch.inference_mode():  # features and MLP without autograd bookkeeping per op
            x = probe_features(self.spec, [d.tokens for d in drafts], hidden, logits)
            p = run_probe(self.probe, x)
        self.probe_s += time.perf_counter() - t0
        return dict(zip(rows, p))

    def _taken(self, step: Proposal | None) -> list[int]:
        return [] if step is None else self.handover.to_draft(list(step.tokens[step.n_forced :]), step.text)

    def _keep(self, row: int, n: int) -> None:
        logits = [lg for d in self.window[row] for lg in d.logits]  # per new token of the window, in order
        drop = len(logits) - n
        self.cache.rollback(row, drop, last_logits=logits[n] if drop > 0 else None)


def least_logprob(d: StepDraft) -> float | None:
    """The least raw log-probability of a token the writer drew in step ``d`` (``record_logits``), or None."""
    new = d.tokens[d.n_forced :]
    if not new or len(d.logits) != len(new):
        return None
    logp = torch.log_softmax(torch.stack(d.logits).float(), dim=-1)
    return float(logp.gather(-1, torch.tensor(new, device=logp.device)[:, None]).min())


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
    """The in-process target on its :class:`~generation.cache.BatchedCache`, with the target probe and the judge turn.

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
        self.spec = probe.config.features if probe is not None else None
        self.probe_s = 0.0  # seconds in the probe so far
        self._new: dict[int, int] = {}  # per row read by the last verify(): new tokens
        self.token_logits: dict[int, torch.Tensor] = {}  # per row read: logits predicting its new tokens, then after

    def admit(self, prompt: Sequence[int], key) -> None:
        """A new row holding ``prompt`` with its own sampling and coin streams (the proposer's writer shares the
        sampler, so the row's sampling stream serves both models)."""
        super().admit(prompt, key)
        self.coins.append(key_stream(key, "coins"))
        self.sampler.add_stream(key_stream(key, "sampling"))

    def step(self, tokens: Sequence[int], n_forced: int) -> Proposal:
        """A target step (forced tokens first) as the loop commits it."""
        tok = self.tokenizer
        return Proposal(tokens, n_forced, decode_text(tok, tokens), eos=tok.eos_token_id in tokens)

    def ends_step(self, tokens: Sequence[int], limit: int) -> bool:
        """A target step of ``tokens`` is finished: its stopper says so, or it holds ``limit`` tokens."""
        return bool(tokens) and (self.writer.stop(tokens) or len(tokens) >= limit)

    def finished(self, tokens: Sequence[int], n_forced: int, limit: int) -> Proposal | None:
        return self.step(list(tokens), n_forced) if self.ends_step(tokens, limit) else None

    def rewrite(self, row: int, tokens: Sequence[int], limit: int, proposal: Proposal, drawn: bool,
                offset: int = 0) -> tuple[int, int | None] | None:
        """Token-level speculation (:func:`~semanticspec.speculative.speculate_tokens`) on the logits of the last
        :meth:`verify` (:attr:`token_logits`), the step ending at the stopper or ``limit``."""
        logits = self.token_logits.get(row)
        if logits is None:
            return None
        base, new = list(tokens), list(proposal.tokens[proposal.n_forced :])
        return speculate_tokens(self.sampler, row, new, logits[offset:], proposal.logits, drawn=drawn,
                                ends_after=lambda j: self.ends_step(base + new[:j], limit))

    def write(self, rows: Sequence[int], limits: Mapping[int, int], forced: Mapping[int, Forced] | None = None,
              alone: bool = False) -> dict[int, Proposal]:
        """The target writes one step per row (after its forced tokens). ``alone`` (the target-only baseline)
        changes nothing here: the loop's rounds write the output step by step."""
        steps = self.writer.write(list(rows), dict(limits), forced=_ids(forced))
        return {i: self.step(st.tokens, st.n_forced) for i, st in steps.items()}

    def bonus(self, rows: list[int]) -> dict[int, Forced]:
        """The target's next token after each row's kept step, drawn from the forward that read it (it enters the
        contexts with :meth:`sync`)."""
        logits = torch.stack([self.cache.last_logits[i] for i in rows]).float()
        drawn = self.sampler.draw(logits, rows).tolist()
        return {i: Forced((t,), eos=t == self.tokenizer.eos_token_id) for i, t in zip(rows, drawn)}

    def verify(self, windows: Mapping[int, Sequence[Proposal]], outputs: Mapping[int, str], needs: Needs,
               rewrites: Collection[int] = ()) -> dict[int, list[Scores]]:
        """Read every row's proposals (a window of steps, one after another; plus the judge turn when needed) in one
        forward and score each step as the step-by-step loop would after the steps before it were kept.

        Rows in ``rewrites`` continue a target step the target is rewriting: read in the same forward, without
        the judge turn, and not scored. For every row read, :attr:`token_logits` holds the target's logits
        predicting each new (not forced) token of its window, then the token after it: what token-level
        speculation keeps from (:meth:`rewrite`).

        Returns:
            ``{row: [Scores per step]}`` for the rows it read and scores (an empty step reads nothing, cannot be
            kept).
        """
        tgt, hand = self.cache, self.handover
        suffix = list(self.judge.suffix) if needs.judge else []
        self._new, self.token_logits = {}, {}
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
        read = {}
        for i, f in fed.items():
            end = n0[i] + self._new[i] - f.start  # one past the window's last token among the fed tokens
            self.token_logits[i] = f.predicting(n0[i] - f.start, end + 1, pre[i])
            for j, (d, (a, b)) in enumerate(zip(windows[i], bounds[i])):
                if i in rewrites and j == 0:
                    continue
                read[i, j] = self._read(i, f, a, b, hand.forced_in_target(d), pre[i], needs,
                                        f.logits[-1] if suffix else None)
        steps = {(i, j): d for i, w in windows.items() for j, d in enumerate(w)}
        outs = {(i, j): outputs.get(i, "") + "".join(d.text for d in windows[i][:j]) for i, j in read}
        scored = self._score(steps, outs, read, needs)
        if suffix:  # the judge turn is read: the target forgets it, its logits after the window last again
            for i in windows:
                if i not in rewrites:
                    tgt.rollback(i, len(suffix), last_logits=self.token_logits[i][self._new[i]])
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

    def _score(self, steps, outputs, read: dict[tuple, StepRead], needs: Needs) -> dict[tuple, Scores]:
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
                feats = probe_features(self.spec, [read[k].tokens for k in slow],
                                       [read[k].hidden for k in slow] if self.spec.needs_hidden else None,
                                       [read[k].step_logits for k in slow])
                x, q = dict(zip(slow, feats)), dict(zip(slow, run_probe(self.probe, feats)))
            self.probe_s += time.perf_counter() - t0
        coin = {k: float(torch.rand((), generator=self.coins[k[0]])) for k in slow} if needs.coin else {}
        return {k: Scores(text=steps[k].text, output=outputs[k], features=x.get(k), fast=fast.get(k, False),
                          q=q.get(k), coin=coin.get(k),
                          judge=judge_score(read[k].judge_logits, self.judge.digits) if needs.judge else None)
                for k in read}

    def _keep(self, row: int, n: int) -> None:
        drop = self._new.get(row, 0) - n
        if drop > 0:
            self.cache.rollback(row, drop, last_logits=self.token_logits[row][n])


def _ids(forced: Mapping[int, Forced] | None) -> dict[int, list[int]] | None:
    """Each row's forced token ids, as a writer takes them."""
    return None if forced is None else {i: list(f.ids) for i, f in forced.items()}
