"""The step loop over one batch of prompts: propose → verify → decide → commit or roll back (EAGLE's loop).

:class:`StepLoop` holds the batch's rows and its two parts: a proposer (the draft side) and a verifier (the target
side). The parts own the models' state: in-process the batched caches (:class:`~semanticspec.decoder.DraftProposer`,
:class:`~semanticspec.decoder.TargetVerifier`, built by :meth:`semanticspec.decoder.SemanticSpecDecoder.step_loop`),
served the requests to two servers (:class:`~semanticspec.served.EngineProposer`,
:class:`~semanticspec.served.EngineVerifier`). The loop holds no cache and sends no request: it keeps the rows'
bookkeeping, asks the policy, and tells the parts what was kept. Nor does it read a clock: it tells its observer
(:class:`LoopObserver`; the decoders attach a :class:`~semanticspec.meter.Meter`) which round and phase it is in and
when rows come and end, and the observer measures.

A method (:mod:`semanticspec.methods`) names which of the loop's round functions runs each round for the active
rows: the target writes a step (:meth:`StepLoop.target_round`), the draft writes one (:meth:`StepLoop.draft_round`),
or the draft proposes and an acceptance policy decides (:meth:`StepLoop.speculative_round`, through
:meth:`StepLoop.speculate`). A refused step is rolled back in both parts and the target writes the
step instead (:meth:`StepLoop.target_steps`), with token-level speculation from the draft when ``token_sd`` (a verifier
that can: :class:`~semanticspec.parts.TokenVerifier`). After each decision both parts follow what the row committed
(:meth:`~semanticspec.parts.Part.sync`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Protocol

from generation.sampling import StreamKey
from semanticspec.policies import AcceptancePolicy, Needs
from semanticspec.parts import (ONE_STEP, Commit, Forced, Proposal, Proposer, RowState, TokenVerifier, Verifier,
                                Window)
from semanticspec.results import DecodeResult, Decision, StepEvent, StepTrace, step_events
from semanticspec.rows import Row, TargetStep, answer_complete


@dataclass(frozen=True)
class LoopSetup:
    """How the loop runs, whatever its parts: a call's :class:`~semanticspec.config.DecodeConfig` resolved for the
    decoder that runs it (the task's answer marker, what one tokenizer allows).

    Attributes:
        target_first_step: the target writes each row's first step.
        answer_marker: a row is done once a newline follows an occurrence of it
            (:func:`~semanticspec.rows.answer_complete`; None: no marker).
        bonus_token: the target's next token after a kept step opens the next step.
        token_sd: the draft helps the target write its steps (token-level speculation; in-process parts).
        token_sd_tokens: draft tokens proposed per target pass with ``token_sd``.
        rewrite_in_rounds: with ``token_sd``, a refused step is rewritten inside the rounds.
    """

    target_first_step: bool = False
    answer_marker: str | None = None
    bonus_token: bool = True
    token_sd: bool = False
    token_sd_tokens: int = 4
    rewrite_in_rounds: bool = True


class LoopObserver(Protocol):
    """What watches a loop's work (:class:`~semanticspec.meter.Meter` times it): told when a round and each phase
    of it run and for which rows, and when rows come and end; nothing the loop decides reads it."""

    def round(self, active: Sequence[int]) -> AbstractContextManager:
        """A round over the ``active`` rows runs inside this context."""

    def phase(self, fields: Mapping[int, str]) -> AbstractContextManager:
        """A phase of a round runs inside this context, for the rows of ``fields`` (each mapped to its phase)."""

    def admitted(self) -> None:
        """A row joined (the last of the loop's rows)."""

    def finished(self, rows: Sequence[int]) -> None:
        """Rows ended outside a round (closed at their limit, or cancelled)."""

    def batch_ended(self) -> None:
        """The batch is done: every row's end event follows."""

    def row_ended(self, row: int) -> None:
        """Row ``row``'s end event follows (rows that come and go)."""


class StepLoop:
    """One batch of prompts decoded together, each row with its own decisions.

    Args:
        proposer: the draft side (:class:`~semanticspec.parts.Proposer`), its rows holding their prompts.
        verifier: the target side (:class:`~semanticspec.parts.Verifier`).
        rows: one :class:`Row` per prompt.
        setup: how the loop runs (:class:`LoopSetup`).
        observer: what watches its rounds (the decoders' :class:`~semanticspec.meter.Meter`).
    """

    def __init__(self, proposer: Proposer, verifier: Verifier, rows: list[Row], setup: LoopSetup,
                 observer: LoopObserver) -> None:
        if setup.token_sd and not isinstance(verifier, TokenVerifier):
            raise TypeError(f"token_sd: {type(verifier).__name__} does not write the target's steps token by token")
        self.proposer, self.verifier, self.rows, self.setup = proposer, verifier, rows, setup
        self.meter = observer

    def limit(self, i: int, *parts) -> int:
        """Tokens the next step of row ``i`` may hold: its budget left, and the room the contexts of ``parts`` (default
        both) have left (a part's ``room(i)``, None when its context has no known end)."""
        r = self.rows[i]
        rooms = [room for part in parts or (self.verifier, self.proposer) if (room := part.room(i)) is not None]
        return min([r.budget - r.stats.output_tokens, *rooms])

    def stream(self, method) -> Iterator[StepEvent]:
        """Rounds of ``method.round`` (a :class:`~semanticspec.methods.Method`) until every row is done (EOS, answer,
        budget, context or a failed request),
        yielding each row's steps after the round that tried them, then one end event per row with its result once
        the batch is done (a row's seconds are shares of the batch's)."""
        sent = {}
        while self._round(method):
            yield from self._new_steps(sent)
        yield from self._new_steps(sent)
        self.meter.batch_ended()
        for i in range(len(self.rows)):
            yield self._end(i)

    def serve(self, method) -> Iterator[StepEvent]:
        """:meth:`stream` for rows that come and go: between rounds (while the caller holds an event) it may
        :meth:`admit` a row or :meth:`cancel` one; each row's end event comes after the round it finished in, its
        ``wall_s`` the seconds from its admission to then. Ends once every row is done."""
        sent, ended = {}, set()
        while True:
            going = self._round(method)
            yield from self._new_steps(sent)
            for i, r in enumerate(self.rows):
                if r.done and i not in ended:
                    ended.add(i)
                    self.meter.row_ended(i)
                    yield self._end(i)
            if not going and all(r.done for r in self.rows):
                return

    def admit(self, prompts: tuple, budget: int, key: StreamKey) -> int:
        """A new row, between rounds of :meth:`serve`: ``prompts`` (its prompt for the verifier and for the proposer,
        as each reads it), its output ``budget`` and its stream key; returns its index. It decodes as it would alone
        with the same key (rows do not read each other; its streams are its own)."""
        self.rows.append(Row(budget, self.setup.answer_marker, self.rows[0].decode))
        i = len(self.rows) - 1
        self.verifier.admit(prompts[0], key)
        self.proposer.admit(prompts[1], key)
        self.meter.admitted()
        return i

    def cancel(self, i: int, why: str) -> None:
        """Row ``i`` ends now (between rounds; its client left): it fails with ``why`` and leaves the forwards."""
        if not self.rows[i].done:
            self.rows[i].fail(why)
            self.meter.finished([i])
            self._retire([i])

    def target_round(self, rows: list[int], method) -> None:
        """A round in which the target writes every step (the reference)."""
        self.target_steps(rows, use_draft=False)

    def draft_round(self, rows: list[int], method) -> None:
        """A round in which the draft writes every step, all kept (the draft-only baseline; an engine proposer writes
        the row's whole output in one request)."""
        steps = self.proposer.write(rows, {i: self.limit(i, self.proposer) for i in rows}, alone=True)
        for i in self.live(rows):
            st, r = steps[i], self.rows[i]
            r.stats.draft_steps_proposed += 1
            r.stats.draft_steps_accepted += 1
            r.stats.drafted_tokens += st.n_new
            r.commit(StepTrace("draft", st.text, st.size, decision=Decision.ACCEPT), st)

    def speculative_round(self, rows: list[int], method) -> None:
        """A round in which the draft proposes each row's step (or window of steps) and ``method.policy`` decides;
        the target writes the first step when ``target_first_step``, and every refused one."""
        first = [i for i in rows if self.setup.target_first_step and self.rows[i].steps_written == 0]
        spec = [i for i in rows if i not in first]
        rejected = self.speculate(spec, method.policy, method.window) if spec else []
        if first or rejected:  # the target writes them, in one batch
            with self.meter.phase({**dict.fromkeys(first, "first_step"), **dict.fromkeys(rejected, "rewrite")}):
                self.target_steps(first + rejected, use_draft=True)

    def _round(self, method) -> bool:
        """One round over the rows that can go on (the others are closed at their limit); False when none could."""
        rows, using = self.rows, [{"target": self.verifier, "draft": self.proposer}[n] for n in method.uses]
        active = [i for i, r in enumerate(rows)
                  if not r.done and (r.rewriting is not None or self.limit(i, *using) > 0)]
        closing = [i for i, r in enumerate(rows) if not r.done and i not in active]
        for i in closing:
            rows[i].close()  # budget or context exhausted
        self.meter.finished(closing)
        self._retire(closing)
        if active:
            with self.meter.round(active):
                method.round(self, active, method)
            self._retire([i for i in active if rows[i].done])
        return bool(active)

    def _end(self, i: int) -> StepEvent:
        """Row ``i``'s end event, with its result."""
        r = self.rows[i]
        r.stats.target_passes, r.stats.draft_passes = self.verifier.passes[i], self.proposer.passes[i]
        return StepEvent(i, None, "" if r.error else r.text,  # a failed row's output counts for nothing
                         DecodeResult(r.output(), r.trace, r.stats, r.stop_reason, r.error))

    def _sync(self, i: int, commit: Commit) -> None:
        """Both parts follow what row ``i`` committed."""
        for part in (self.verifier, self.proposer):
            part.sync(i, commit)

    def _retire(self, rows_i: list[int]) -> None:
        for part in (self.verifier, self.proposer):  # later forwards compute only the unfinished rows
            part.retire(rows_i)

    def _new_steps(self, sent: dict[int, int]) -> Iterator[StepEvent]:
        """An event for each trace entry a row added since the last call (``sent``: entries yielded per row)."""
        for i, r in enumerate(self.rows):
            yield from step_events(i, r.trace, r.pieces, sent.get(i, 0))
            sent[i] = len(r.trace)

    def live(self, rows_i: Sequence[int]) -> list[int]:
        """The rows not done (a part failed the others' requests)."""
        return [i for i in rows_i if not self.rows[i].done]

    def speculate(self, rows_i: list[int], policy: AcceptancePolicy, window: Window = ONE_STEP) -> list[int]:
        """Propose, verify, decide, then commit or roll back every row's step (or window of steps).

        With a :class:`Window` above one step the draft writes up to that many steps per row, one after another, the
        target reads them in one forward, and each row keeps its steps up to the first refused one
        (:func:`~semanticspec.parts.grow_windows`);
        an adaptive window stops after a step the draft was unsure of; with ``overlap`` the proposer starts each
        row's next window before the target reads this one.
        Rows rewriting a refused step (``rewrite_in_rounds``) ride the same draft and target forwards: their
        proposal continues the target's step and is kept token by token (:meth:`_rewrite_tokens`).

        Returns:
            The refused rows the target still has to rewrite in a phase of its own (none when refused steps
            are rewritten in the rounds).
        """
        needs, rows = policy.needs, self.rows
        states = {i: self._row_state(i) for i in rows_i}
        going = [i for i in rows_i if rows[i].rewriting is not None]
        with self.meter.phase({i: "rewrite" if i in going else "draft" for i in rows_i}):
            windows = self.proposer.propose(states, for_p=needs.p, window=window, room_after=self._room_after)
        rows_i, going = self.live(rows_i), self.live(going)
        judged = [i for i in rows_i if i not in going]
        with self.meter.phase({**dict.fromkeys(judged, "verify"), **dict.fromkeys(going, "rewrite")}):
            scores = self.verifier.verify({i: windows[i] for i in rows_i}, {i: rows[i].text for i in rows_i}, needs,
                                          rewrites=going)
        with self.meter.phase(dict.fromkeys(judged, "draft")):  # the draft probe's p, and the draft's read for it
            scores = {**scores, **self._with_p({i: s for i, s in scores.items() if i in judged}, policy)}
        decisions = self._decide(scores, policy)
        after = {}  # rows going on whose rewrite the target finished as drafted: their window after it is settled
        for i in self.live(going):
            if self._rewrite_tokens(i, windows[i][0], drawn=True, hold=len(windows[i]) > 1):
                after[i] = windows[i][0].n_new
            else:  # the window after the continuation (if any) is thrown away unjudged
                rows[i].stats.drafted_tokens += sum(d.n_new for d in windows[i][1:])
        return self._settle(self.live(judged), windows, scores, decisions, states, after)

    def _room_after(self, i: int, window: list[Proposal], state: RowState) -> int:
        """Tokens a next step of row ``i``'s window may hold (0: the row would stop after the window)."""
        r, last = self.rows[i], window[-1]
        if r.done or last.eos or last.n_new == 0:
            return 0
        if answer_complete(r.text + "".join(d.text for d in window), r.answer_marker):
            return 0
        if r.rewriting is None:
            return state.limit - sum(d.size for d in window)
        rw, first = r.rewriting, window[0]  # the continuation (its text the whole step), then the steps after it
        if not self.rides or not self.verifier.finished([*rw.tokens, *first.tokens[first.n_forced :]], 0, rw.limit):
            return 0
        return self.limit(i) - len(rw.tokens) - sum(d.n_new for d in window)

    def _with_p(self, scores: dict[int, list], policy: AcceptancePolicy) -> dict[int, list]:
        """The scores with the draft probe's ``p`` of the rows whose first step the policy wants it for (``p`` is read
        for one-step windows only)."""
        rows = self.rows
        want_p = [i for i, s in scores.items() if policy.wants_p(s[0]) and not rows[i].done] if policy.needs.p else []
        p = self.proposer.score(want_p) if want_p else {}
        return {i: [replace(s[0], p=p[i]), *s[1:]] if i in p else s for i, s in scores.items()}

    def _decide(self, scores: dict[int, list], policy: AcceptancePolicy) -> dict[int, list[Decision]]:
        """Each row's decisions, step by step through its window up to its first refused step, every step judged as
        if the ones before it were kept (the verifier read it after them)."""
        going = {i: s for i, s in scores.items() if not self.rows[i].done}
        out: dict[int, list[Decision]] = {i: [] for i in going}
        for j in range(max((len(s) for s in going.values()), default=0)):
            at = {i: s[j] for i, s in going.items() if len(s) > j and (j == 0 or out[i][-1].kept)}
            for i, d in policy.decide(at).items():
                out[i].append(d)
        return out

    def _settle(self, judged: list[int], windows, scores, decisions, states,
                rewritten: dict[int, int] | None = None) -> list[int]:
        """Count, trace and commit each judged row's kept steps, and roll back from its first refused one (the steps
        after it are thrown away); the bonus token after a window kept whole. A step the target read nothing of is
        refused. ``rewritten``: ``{row: new tokens of its rewrite}`` for rows whose rewrite the target just finished
        as drafted; their window after the rewrite is settled the same way."""
        rows, rejected, bonus, rewritten = self.rows, [], [], rewritten or {}
        for i in [*judged, *rewritten]:
            r, w, s, ds = rows[i], windows[i], scores.get(i, []), decisions.get(i, [])
            if i in rewritten:
                w, kept, limit = w[1:], rewritten[i], self.limit(i)
            else:
                kept, limit = 0, states[i].limit
            r.stats.drafted_tokens += sum(d.n_new for d in w)
            r.stats.windows += 1
            for j, d in enumerate(w):
                decision, sj = ds[j] if j < len(ds) else Decision.REJECT, s[j] if j < len(s) else None
                r.stats.draft_steps_proposed += 1
                trace = StepTrace("draft", d.text, d.size, sj and sj.q, sj and sj.p, decision, score=sj and sj.judge,
                                  confidence=d.confidence)
                if decision == Decision.REJECT:
                    r.trace.append(trace)
                    if self._refused(i, d, kept, limit - sum(x.size for x in w[:j])):
                        rejected.append(i)
                    break
                r.stats.draft_steps_accepted += 1
                r.commit(trace, d)
                kept += d.n_new
            else:
                if self.setup.bonus_token and not r.done and self.limit(i) > 0:
                    bonus.append(i)
        if bonus:
            self._bonus(bonus)
        return rejected

    def _refused(self, i: int, d: Proposal, kept: int, limit: int) -> bool:
        """Roll row ``i`` back to the start of its refused step ``d`` (after ``kept`` new tokens of its window's
        kept steps); True when the target still has to rewrite it in a phase of its own."""
        r = self.rows[i]
        if self.rides:  # the target redraws the step from the forward that just read it
            r.rewriting = TargetStep(list(d.forced.ids), d.n_forced, limit)
            self._rewritten(i)  # forced tokens may finish the step already (a delimiter, the cap)
            if r.rewriting is None:
                self._sync(i, Commit(kept))
            else:
                self._rewrite_tokens(i, d, drawn=False, offset=kept)
            return False
        self._sync(i, Commit(kept))  # both models forget the step and the ones after it
        r.forced = d.forced
        return True

    @property
    def rides(self) -> bool:
        """Refused steps are rewritten inside the rounds (``rewrite_in_rounds`` with ``token_sd``)."""
        return bool(self.setup.token_sd and self.setup.rewrite_in_rounds)

    def _row_state(self, i: int) -> RowState:
        """What the proposer is told of row ``i``: a new step after its forced tokens, or the rewrite's continuation."""
        r = self.rows[i]
        if r.rewriting is not None:
            return RowState(Forced(tuple(r.rewriting.tokens)), r.rewriting.room(), rewrite=True)
        return RowState(r.forced, self.limit(i) + len(r.forced))

    def _rewrite_tokens(self, i: int, proposal: Proposal, drawn: bool, offset: int = 0, hold: bool = False) -> bool:
        """The target keeps a prefix of the proposal's new tokens and draws the token after it
        (:func:`~semanticspec.speculative.speculate_tokens` on the verification forward's logits); the
        rewrite is committed once the step is finished. ``offset``: new tokens of the row's window before the
        proposal (the kept steps before a refused one). ``hold``: a window was drafted after the proposal; when the
        target keeps the proposal whole and it ends the step, both parts keep that window too, to be settled.

        Returns:
            True when the window after the proposal is held (the step committed, the row going on)."""
        rw, new = self.rows[i].rewriting, list(proposal.tokens[proposal.n_forced :])
        read = self.verifier.rewrite(i, rw.tokens, rw.limit, proposal, drawn, offset)
        kept, extra = read or (0, None)
        rw.tokens.extend(new[:kept])
        if hold and extra is None and kept == len(new) and read is not None:
            self._rewritten(i)
            return not self.rows[i].done
        self._sync(i, Commit(offset + kept, () if extra is None else (extra,)))
        if extra is not None:
            rw.tokens.append(extra)
        self._rewritten(i)
        return False

    def _rewritten(self, i: int) -> None:
        """Commit row ``i``'s target step once it is finished (its stopper, or its limit)."""
        r, rw = self.rows[i], self.rows[i].rewriting
        step = self.verifier.finished(rw.tokens, rw.n_forced, rw.limit)
        if step is not None:
            r.rewriting = None
            r.commit(StepTrace("target", step.text, step.size, decision=Decision.TARGET), step)

    def _token_rounds(self, rows_i: list[int], limits: dict[int, int]) -> None:
        """The target writes one step per row with token-level speculation, both parts in turn: the proposer drafts
        up to ``token_sd_tokens`` tokens, the verifier reads them in one forward, the target keeps a prefix and
        draws the token after it (:meth:`_rewrite_tokens`), until every row's step is finished and committed."""
        rows, chunk = self.rows, self.setup.token_sd_tokens
        for i in rows_i:
            rows[i].rewriting = TargetStep(list(rows[i].forced.ids), len(rows[i].forced), limits[i], chunk=chunk)
            self._rewritten(i)  # forced tokens may finish the step already
        while writing := [i for i in self.live(rows_i) if rows[i].rewriting is not None]:
            proposals = {i: w[0] for i, w in self.proposer.propose({i: self._row_state(i) for i in writing},
                                                                     for_p=False).items()}
            self.verifier.verify({i: [proposals[i]] for i in writing}, {}, Needs(), rewrites=writing)
            for i in self.live(writing):
                self._rewrite_tokens(i, proposals[i], drawn=True)

    def _bonus(self, rows_i: list[int]) -> None:
        """The target's next token (after each kept step) opens the row's next step."""
        drawn = self.verifier.bonus(rows_i)
        for i in self.live(rows_i):
            r, bonus = self.rows[i], drawn[i]
            self._sync(i, Commit(then=bonus.ids))
            r.out.extend(bonus.ids)
            r.stats.output_tokens += 1
            r.forced = bonus
            if bonus.eos:  # traced as a one-token step, as every other output token is
                r.finish("eos")
                r.last_forced_step()

    def target_steps(self, rows_i: list[int], use_draft: bool) -> None:
        """The target writes one step for each row; the draft is handed the step (``use_draft``), or helps write it
        (``token_sd``: :meth:`_token_rounds`). Without the draft (the target-only baseline) an engine verifier
        writes the row's whole output in one request."""
        rows = self.rows
        using = (self.verifier, self.proposer) if use_draft else (self.verifier,)
        limits = {i: self.limit(i, *using) + len(rows[i].forced) for i in rows_i}
        if use_draft and self.setup.token_sd:
            return self._token_rounds(rows_i, limits)
        forced = {i: rows[i].forced for i in rows_i}
        steps = self.verifier.write(rows_i, limits, forced, alone=not use_draft)
        for i in self.live(rows_i):
            st = steps[i]
            if use_draft:  # the draft reads the target's step on its next forward
                self._sync(i, Commit(step=st))
            rows[i].commit(StepTrace("target", st.text, st.size, decision=Decision.TARGET), st)
