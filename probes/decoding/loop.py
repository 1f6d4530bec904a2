"""The step loop over one batch of prompts: propose → verify → decide → commit or roll back (EAGLE's loop).

:class:`StepLoop` holds the batch's two caches, its rows, the proposer and the verifier. A runner
(:mod:`probes.decoding.methods`) says what one round does for the active rows: the target writes
a step, the draft writes one, or the draft proposes and an acceptance policy decides
(:meth:`StepLoop.speculate`). A refused step is rolled back by length in both caches and the
target writes the step instead (:meth:`StepLoop.rewrite`), with token-level speculation from the
draft when ``token_sd``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from generation.cache import BatchedCache
from generation.handover import decode_text, pad_id
from generation.sampling import Sampler, StreamKey, stream_seed
from generation.specs import SamplingSpec
from generation.writer import StepWriter
from probes.decoding.policies import AcceptancePolicy
from probes.decoding.proposer import DraftProposer, Proposal, RowState
from probes.decoding.results import DecodeResult, Decision, StepEvent, StepTrace, step_events
from probes.decoding.rows import Row, TargetStep
from probes.decoding.speculative import speculate_tokens, token_sd_steps
from probes.decoding.verify import TargetVerifier


class StepLoop:
    """One batch of prompts decoded together, each row with its own decisions.

    Args:
        dec: the decoder (models, tokenizers, probes, step stoppers, options).
        ids_t: the prompts in the target's tokenization.
        ids_d: the prompts in the draft's.
        max_new_tokens: output token budget per prompt.
        sampling: temperature and top-p of both models (validated once, where the spec was built).
        keys: each prompt's :data:`~generation.sampling.StreamKey`: it samples and flips its acceptance coins
            from its own streams, seeded from its key (:func:`~generation.sampling.stream_keys`), so it decodes
            the same in any batch.
    """

    def __init__(self, dec, ids_t: Sequence[list[int]], ids_d: Sequence[list[int]], max_new_tokens: int,
                 sampling: SamplingSpec, keys: Sequence[StreamKey]) -> None:
        B = len(ids_t)
        def layers(probe):
            return probe.config.layer_ids if probe is not None else [-1]
        streams = {s: [torch.Generator().manual_seed(stream_seed(*key, s)) for key in keys]
                   for s in ("sampling", "coins")}
        self.dec, self.opt, self.sampler = dec, dec.options, Sampler(sampling, streams["sampling"])
        self.tgt = BatchedCache(dec.target, B, pad_id(dec.tokenizer), layers(dec.target_probe))
        self.drf = BatchedCache(dec.draft, B, pad_id(dec.draft_tokenizer), layers(dec.draft_probe))
        for i in range(B):
            self.tgt.extend(i, ids_t[i])
            self.drf.extend(i, ids_d[i])
        self.rows = [Row(max_new_tokens, dec.shared, self.opt.answer_marker) for _ in range(B)]
        self.target_writer = StepWriter(self.tgt, dec.target_stop, self.sampler)
        self.draft_writer = StepWriter(self.drf, dec.draft_stop, self.sampler)
        self.proposer = DraftProposer(self.draft_writer, dec.draft_tokenizer, dec.draft_probe)
        self.verifier = TargetVerifier(self.tgt, dec.handover, dec.target_probe, dec.judge, streams["coins"])
        self.t_done: dict[int, float] = {}  # when each finished row was seen finished (end of its round)

    def caches(self, names: Sequence[str]) -> tuple[BatchedCache, ...]:
        return tuple({"target": self.tgt, "draft": self.drf}[n] for n in names)

    def limit(self, i: int, *caches: BatchedCache) -> int:
        return self.rows[i].limit(i, self.dec.spare, *caches)

    def stream(self, runner) -> Iterator[StepEvent]:
        """Rounds of ``runner.step`` until every row is done (EOS, answer, budget or context), yielding each row's
        steps after the round that tried them, then one end event per row with its result once the batch is done
        (a row's seconds are shares of the batch's)."""
        B, rows, t_start = len(self.rows), self.rows, time.perf_counter()
        using = self.caches(runner.caches)
        sent = [0] * B  # trace entries of each row already yielded
        while True:
            active = [i for i in range(B) if not rows[i].done
                      and (rows[i].rewriting is not None or self.limit(i, *using) > 0)]
            closing = [i for i in range(B) if not rows[i].done and i not in active]
            for i in closing:
                rows[i].close(self.dec.tokenizer)  # budget or context exhausted
                self.t_done.setdefault(i, time.perf_counter())
            for c in (self.tgt, self.drf):
                c.retire(closing)
            if active:
                self._timed_round(runner, active)
            yield from self._new_steps(sent)
            if not active:
                break
        t_end = time.perf_counter()
        wall = t_end - t_start
        for i, r in enumerate(rows):
            r.stats.wall_s = wall / B
            r.stats.done_idle_row_s = t_end - self.t_done.get(i, t_end)
            r.stats.target_passes, r.stats.draft_passes = self.tgt.passes[i], self.drf.passes[i]
            text = self.dec.tokenizer.decode(r.out, skip_special_tokens=True) if self.dec.shared else r.text
            yield StepEvent(i, None, r.text, DecodeResult(text, r.trace, r.stats, r.stop_reason))

    def _new_steps(self, sent: list[int]) -> Iterator[StepEvent]:
        """An event for each trace entry a row added since the last call (``sent``: entries yielded per row)."""
        for i, r in enumerate(self.rows):
            yield from step_events(i, r.trace, r.pieces, sent[i])
            sent[i] = len(r.trace)

    def _timed_round(self, runner, active: list[int]) -> None:
        """``runner.step`` on the active rows; counts each row's idle seconds (forwards that ran without feeding
        it) and notes when rows finish. Timing only: nothing a row decides depends on it."""
        caches = (self.tgt, self.drf)
        total0 = sum(c.forward_s for c in caches)
        served0 = {i: sum(c.served_s[i] for c in caches) for i in active}
        runner.step(self, active)
        total, now = sum(c.forward_s for c in caches) - total0, time.perf_counter()
        finished = []
        for i in active:
            self.rows[i].stats.idle_row_s += total - (sum(c.served_s[i] for c in caches) - served0[i])
            if self.rows[i].done:
                self.t_done[i] = now
                finished.append(i)
        for c in caches:  # later forwards compute only the unfinished rows
            c.retire(finished)

    def speculate(self, rows_i: list[int], policy: AcceptancePolicy) -> list[int]:
        """Propose, verify, decide, then commit or roll back every row's step.

        Rows rewriting a refused step (``rewrite_in_rounds``) ride the same draft and target forwards: their
        proposal continues the target's step and is kept token by token (:meth:`_rewrite_tokens`).

        Returns:
            The refused rows the target still has to rewrite in a phase of its own (none when refused steps
            are rewritten in the rounds).
        """
        needs, rows = policy.needs, self.rows
        t0 = time.perf_counter()
        going = [i for i in rows_i if rows[i].rewriting is not None]
        judged = [i for i in rows_i if rows[i].rewriting is None]
        states = {i: self._row_state(i) for i in rows_i}
        proposals = self.proposer.propose(states, for_p=needs.p)
        t_verify = time.perf_counter()
        scores = self.verifier.verify(proposals, {i: rows[i].text for i in judged}, needs, rewrites=going)
        t_scored = time.perf_counter()
        want_p = [i for i, s in scores.items() if policy.wants_p(s)] if needs.p else []
        p = self.proposer.score(want_p) if want_p else {}
        scores = {i: replace(s, p=p[i]) if i in p else s for i, s in scores.items()}
        decisions = policy.decide(scores)
        dt = (time.perf_counter() - t0) / len(rows_i)
        probe_s = self.verifier.probe_s + (self.proposer.probe_s if want_p else 0.0)
        draft_s = (t_verify - t0) + (self.proposer.feed_s if want_p else 0.0)
        verify_s = (t_scored - t_verify) - self.verifier.probe_s
        for i in going:
            rows[i].stats.rewrite_s += (draft_s + verify_s) / len(rows_i)
            rows[i].rewriting.seconds += dt
            self._rewrite_tokens(i, proposals[i], drawn=True)
        rejected, bonus = [], []
        for i in judged:
            d, r, s = proposals[i], rows[i], scores.get(i)
            decision = decisions.get(i, Decision.REJECT)  # a row the target read nothing of cannot be kept
            self.verifier.close_judge_turn(i, s)
            r.stats.draft_steps_proposed += 1
            r.stats.probe_s += probe_s / len(judged)
            r.stats.draft_s += draft_s / len(rows_i)
            r.stats.verify_s += verify_s / len(rows_i)
            r.stats.drafted_tokens += len(d.tokens) - d.n_forced
            trace = StepTrace("draft", d.text, len(d.tokens), s and s.q, s and s.p, decision, dt, s and s.judge)
            if decision == Decision.REJECT:
                r.trace.append(trace)
                if self.rides:  # the target redraws the step from the forward that just read it
                    r.rewriting = TargetStep(list(d.tokens[: d.n_forced]), d.n_forced, states[i].limit)
                    self._rewrite_tokens(i, d, drawn=False)
                    continue
                self.verifier.roll_back(i)  # roll back by length: both models forget the step
                self.proposer.roll_back(i)
                r.forced = list(d.tokens[: d.n_forced])
                rejected.append(i)
                continue
            r.stats.draft_steps_accepted += 1
            r.commit(trace, d.tokens, d.n_forced, self.dec.draft_tokenizer.eos_token_id, True)
            if self.dec.bonus_token and not r.done and self.limit(i, self.tgt, self.drf) > 0:
                bonus.append(i)
        if bonus:
            self._bonus(bonus)
        return rejected

    @property
    def rides(self) -> bool:
        """Refused steps are rewritten inside the rounds (``rewrite_in_rounds`` with ``token_sd``)."""
        return bool(self.dec.token_sd and self.opt.rewrite_in_rounds)

    def _row_state(self, i: int) -> RowState:
        """What the proposer is told of row ``i``: a new step after its forced tokens, or the rewrite's continuation."""
        r = self.rows[i]
        if r.rewriting is not None:
            return RowState(tuple(r.rewriting.tokens), r.rewriting.limit, rewrite=True)
        return RowState(tuple(r.forced), self.limit(i, self.tgt, self.drf) + len(r.forced))

    def _rewrite_tokens(self, i: int, proposal: Proposal, drawn: bool) -> None:
        """The target keeps a prefix of the proposal's new tokens and draws the token after it
        (:func:`~probes.decoding.speculative.speculate_tokens` on the verification forward's logits); the
        rewrite is committed once the step is finished."""
        r, rw = self.rows[i], self.rows[i].rewriting
        new = list(proposal.tokens[proposal.n_forced :])
        logits = self.verifier.token_logits.get(i)
        kept, extra = 0, None
        if logits is not None:
            base = list(rw.tokens)
            kept, extra = speculate_tokens(self.sampler, i, new, logits, proposal.logits, drawn=drawn,
                                           ends_after=lambda j: self._finished(rw, base + new[:j]))
        rw.tokens.extend(new[:kept])
        self.verifier.keep(i, kept)
        self.proposer.keep(i, kept)
        if extra is not None:
            rw.tokens.append(extra)
            self.tgt.extend(i, [extra])
            self.proposer.extend(i, [extra])
        if self._finished(rw, rw.tokens):
            text = decode_text(self.dec.tokenizer, rw.tokens)
            trace = StepTrace("target", text, len(rw.tokens), decision=Decision.TARGET, seconds=rw.seconds)
            r.rewriting = None
            r.commit(trace, rw.tokens, rw.n_forced, self.dec.tokenizer.eos_token_id, False)

    def _finished(self, rw: TargetStep, tokens: list[int]) -> bool:
        return bool(tokens) and (self.dec.target_stop(tokens) or len(tokens) >= rw.limit)

    def _bonus(self, rows_i: list[int]) -> None:
        """The target's next token (after each kept step) opens the row's next step."""
        logits = torch.stack([self.tgt.last_logits[i] for i in rows_i]).float()
        drawn = self.sampler.draw(logits, rows_i).tolist()
        for i, t in zip(rows_i, drawn):
            r = self.rows[i]
            self.tgt.extend(i, [t])
            self.proposer.extend(i, [t])
            r.out.append(t)
            r.stats.output_tokens += 1
            if t == self.dec.tokenizer.eos_token_id:
                r.finish("eos")
            else:
                r.forced = [t]

    def rewrite(self, first: list[int], rejected: list[int]) -> None:
        """The target writes the first step of ``first`` and the refused step of ``rejected`` (one batch)."""
        t0 = time.perf_counter()
        self.target_steps(first + rejected, use_draft=True)
        dt = (time.perf_counter() - t0) / len(first + rejected)  # one batch; its time is shared per row
        for i in first:
            self.rows[i].stats.first_step_s += dt
        for i in rejected:
            self.rows[i].stats.rewrite_s += dt

    def target_steps(self, rows_i: list[int], use_draft: bool) -> None:
        """The target writes one step for each row; the draft is handed the step."""
        t0, rows, dec = time.perf_counter(), self.rows, self.dec
        using = (self.tgt, self.drf) if use_draft else (self.tgt,)
        limits = {i: self.limit(i, *using) + len(rows[i].forced) for i in rows_i}
        forced = {i: rows[i].forced for i in rows_i}
        token_sd = use_draft and dec.token_sd
        if token_sd:
            steps = token_sd_steps(self.target_writer, self.draft_writer, rows_i, limits=limits, forced=forced,
                                   n_propose=self.opt.token_sd_tokens)
        else:
            steps = self.target_writer.write(rows_i, limits, forced=forced)
        dt = (time.perf_counter() - t0) / len(rows_i)
        for i in rows_i:
            st = steps[i]
            text = decode_text(dec.tokenizer, st.tokens)
            if use_draft and not token_sd:  # the draft reads the target's step on its next forward
                self.proposer.extend(i, dec.handover.to_draft(st.tokens[st.n_forced :], text))
            trace = StepTrace("target", text, len(st.tokens), decision=Decision.TARGET, seconds=dt)
            rows[i].commit(trace, st.tokens, st.n_forced, dec.tokenizer.eos_token_id, False)

    def draft_steps(self, rows_i: list[int]) -> None:
        """The draft writes one step for each row, kept as it is (the draft-only baseline)."""
        t0 = time.perf_counter()
        limits = {i: self.limit(i, self.drf) for i in rows_i}
        steps = self.draft_writer.write(rows_i, limits)
        dt = (time.perf_counter() - t0) / len(rows_i)
        for i in rows_i:
            st, r = steps[i], self.rows[i]
            r.stats.draft_steps_proposed += 1
            r.stats.draft_steps_accepted += 1
            trace = StepTrace("draft", decode_text(self.dec.draft_tokenizer, st.tokens), len(st.tokens),
                              decision=Decision.ACCEPT, seconds=dt)
            r.commit(trace, st.tokens, 0, self.dec.draft_tokenizer.eos_token_id, True)
