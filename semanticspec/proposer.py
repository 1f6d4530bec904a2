"""The proposer: writes one step per row for the target to verify (transformers' ``CandidateGenerator``).

The loop tells a proposer each row's state (:class:`RowState`: the tokens that open the step, how
long it may be) and gets typed :class:`Proposal` objects back; it also asks it for the draft
probe's ``p`` of the rows a policy wants it for, hands it the target's tokens, and rolls a
refused step back. Nothing of a cache crosses this interface, so a proposer that calls a server
(which keeps the draft's KV cache and probe on its side) plugs in where :class:`DraftProposer`,
the in-process draft on its :class:`~generation.cache.BatchedCache`, is used today.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

import torch

from generation.features import FeatureSpec, probe_input, rows_features
from generation.handover import decode_text
from generation.writer import StepDraft, StepWriter


@dataclass(frozen=True)
class RowState:
    """What a proposer is told about one row.

    Attributes:
        forced: tokens that open the step, already in the row's context (the target's bonus token, or the
            part of a target step written so far).
        limit: the most tokens the step may hold, forced ones included.
        rewrite: the step is the target's (a refused step being rewritten): the proposal continues it for
            token-level speculation, and no probe reads it.
    """

    forced: tuple[int, ...]
    limit: int
    rewrite: bool = False


@dataclass(frozen=True)
class Proposal:
    """One row's step: drafted for the target to verify, or written by one side and kept as it is.

    Attributes:
        tokens: the step in its writer's tokenization, forced tokens first (an engine part knows the forced
            tokens only: a server answers with text).
        n_forced: leading tokens that were given (the target's bonus token), not drafted.
        text: the step's text (up to EOS, special tokens dropped).
        logits: per new (not forced) token, the proposer's logits it was drawn from, when it has them
            (token-level speculation reads them).
        n_new: tokens written after the forced ones (None: ``len(tokens) - n_forced``).
        eos: the step ends the sequence.
        end: a reason the row ends after this step though it holds no EOS (a server that wrote a whole output
            and stopped at its budget or context end), else None.
        confidence: the least log-probability (raw, temperature 1) the writer gave a token it drew in the step, when
            known (None for a step with no new token).
    """

    tokens: Sequence
    n_forced: int
    text: str
    logits: Sequence[torch.Tensor] = ()
    n_new: int | None = None
    eos: bool = False
    end: str | None = None
    confidence: float | None = None

    def __post_init__(self) -> None:
        if self.n_new is None:
            object.__setattr__(self, "n_new", len(self.tokens) - self.n_forced)

    @property
    def size(self) -> int:
        """Tokens in the step, forced ones included."""
        return self.n_forced + self.n_new

    @property
    def forced(self) -> list:
        """The forced tokens that opened the step (they open the target's step when it is refused)."""
        return list(self.tokens[: self.n_forced])


class Part(Protocol):
    """What the loop asks of both of its parts (the proposer and the verifier), whatever model they drive."""

    passes: Sequence[int]
    """Per row: forwards (or requests) that fed it something."""
    served_s: Sequence[float]
    """Per row: seconds of the forwards (or requests) that fed it something."""
    forward_s: float
    """Seconds of all forwards (or requests) so far."""
    probe_s: float
    """Seconds in the part's probe so far (inside its calls: the loop's meter moves them out of its phases)."""

    def room(self, row: int) -> int | None:
        """Tokens the row's context still holds (less the spare it keeps), or None when it has no known end."""

    def retire(self, rows: Sequence[int]) -> None:
        """The rows are finished: later work skips them."""


class Proposer(Part, Protocol):
    """Writes steps for rows, scores them with the draft probe, and follows what the target kept."""

    def propose(self, rows: Mapping[int, RowState], *, for_p: bool, more: bool = False,
                window: int = 1) -> dict[int, Proposal]:
        """One step per row; ``for_p``: keep what the draft probe reads (a policy may want ``p``); ``more``: the
        step continues the row's window of proposals (after its last one, as if it were kept) instead of opening
        a new window; ``window``: the most steps this window will hold (a proposer may write them ahead)."""

    def score(self, rows: Sequence[int]) -> dict[int, float]:
        """The draft probe's ``p`` of each row's last proposal."""

    def write(self, rows: Sequence[int], limits: Mapping[int, int]) -> dict[int, Proposal]:
        """One step per row, kept as it is (the draft-only baseline)."""

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        """Tokens the target wrote (in the proposer's tokenization) enter the row's context."""

    def take(self, row: int, step: Proposal) -> None:
        """A step the target wrote enters the row's context (handed over in the proposer's tokenization)."""

    def keep(self, row: int, n: int) -> None:
        """Keep the first ``n`` proposed tokens of the row's window of proposals and forget the rest."""


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

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        self.cache.extend(row, tokens)

    def admit(self, prompt: Sequence[int], key) -> None:
        """A new row holding ``prompt`` (:meth:`~semanticspec.loop.StepLoop.admit`; its streams are the
        verifier's to add)."""
        self.cache.add_row(prompt)


class DraftProposer(CachePart):
    """The in-process draft model writing on its :class:`BatchedCache`.

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
        self.spec = FeatureSpec.of(probe.config) if probe is not None else None
        self.window: dict[int, list[StepDraft]] = {}  # per row: the steps of its window, in order (p reads the first)
        self.probe_s = 0.0  # seconds in the probe so far

    def _proposal(self, d: StepDraft) -> Proposal:
        return Proposal(d.tokens, d.n_forced, decode_text(self.tokenizer, d.tokens), d.logits,
                        eos=self.tokenizer.eos_token_id in d.tokens, confidence=least_logprob(d))

    def propose(self, rows: Mapping[int, RowState], *, for_p: bool, more: bool = False,
                window: int = 1) -> dict[int, Proposal]:
        for_p = for_p and self.spec is not None
        steps = self.writer.write(
            list(rows), {i: s.limit for i, s in rows.items()}, forced={i: list(s.forced) for i, s in rows.items()},
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

    def write(self, rows: Sequence[int], limits: Mapping[int, int]) -> dict[int, Proposal]:
        return {i: self._proposal(d) for i, d in self.writer.write(list(rows), dict(limits)).items()}

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
            x = probe_input(rows_features(self.spec, [d.tokens for d in drafts], hidden, logits), self.spec.groups)
            p = run_probe(self.probe, x)
        self.probe_s += time.perf_counter() - t0
        return dict(zip(rows, p))

    def take(self, row: int, step: Proposal) -> None:
        self.extend(row, self.handover.to_draft(list(step.tokens[step.n_forced :]), step.text))

    def keep(self, row: int, n: int) -> None:
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


def run_probe(probe, x: torch.Tensor) -> list[float]:
    """A probe's outputs for the rows of ``x`` (moved to the probe's device), as floats.

    A :class:`~probes.model.SemanticProbe` runs its :meth:`~probes.model.SemanticProbe.predict` (no per-call
    overhead); any other module is called.
    """
    predict = getattr(probe, "predict", None)
    if predict is not None:
        return predict(x).tolist()
    device = next(probe.parameters(), torch.empty(0)).device
    return probe(x.to(device)).float().cpu().tolist()
