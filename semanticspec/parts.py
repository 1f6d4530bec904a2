"""The step loop's contract with its two parts: what a :class:`Proposer` and a :class:`Verifier` do, and the typed
objects they take and return (vLLM's proposer/scorer, transformers' candidate generators).

Two families implement both protocols, each in its decoder's module: the in-process parts over the models' batched
caches (:mod:`semanticspec.decoder`) and the served parts over two servers (:mod:`semanticspec.served`).
:class:`~semanticspec.loop.StepLoop` holds no cache and sends no request; it reads only the members listed here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from semanticspec.policies import Needs
from semanticspec.scores import Scores


@dataclass(frozen=True)
class Window:
    """How many drafted steps one verification judges (``DecodeConfig.lookahead`` and its companions).

    Attributes:
        size: the most steps per window (1: one step per target pass).
        min_logprob: an adaptive window stops after a step the draft drew a token of below this raw log-probability.
        overlap: the draft writes each row's next window while the target reads this one, as if it were kept whole
            (an engine proposer; the work is thrown away when a step is refused or the target's bonus token differs
            from the draft's next one).
    """

    size: int = 1
    min_logprob: float | None = None
    overlap: bool = False


ONE_STEP = Window()
"""One drafted step per target pass (the paper's loop)."""

SHIPPED_WINDOW = Window(4, math.log(0.5))
"""SemanticSpec's window when ``DecodeConfig.lookahead`` is not given (and the decoder and policy allow windows): up to
4 drafted steps per target pass, the next one drafted only after a step whose every token the draft drew at
probability >= 0.5 (a threshold read off problems other than the benchmark's). What it gains over one step per
pass, and why the gain grows with a forward's fixed cost: ``python -m benchmarks.decode``, docs/benchmarks.md
"Lookahead"."""


@dataclass(frozen=True)
class Forced:
    """Tokens that open a row's next step, already in its context (the target's bonus token, or the part of a target
    step written so far): their ids in-process, their texts served (a server answers with text), each in a field of
    its own.

    Attributes:
        ids: the tokens' ids (in-process parts).
        texts: the tokens' texts, one a token (served parts).
        eos: the token ends the sequence (served it has no text).
    """

    ids: tuple[int, ...] = ()
    texts: tuple[str, ...] = ()
    eos: bool = False

    def __len__(self) -> int:
        """Tokens held."""
        return max(len(self.ids), len(self.texts))

    @property
    def text(self) -> str:
        return "".join(self.texts)


NOTHING_FORCED = Forced()
"""No token opens the step."""


@dataclass(frozen=True)
class RowState:
    """What a proposer is told about one row.

    Attributes:
        forced: tokens that open the step, already in the row's context.
        limit: the most tokens the step may hold, forced ones included.
        rewrite: the step is the target's (a refused step being rewritten): the proposal continues it for
            token-level speculation, and no probe reads it.
    """

    forced: Forced
    limit: int
    rewrite: bool = False


@dataclass(frozen=True)
class Proposal:
    """One row's step: drafted for the target to verify, or written by one side and kept as it is.

    Attributes:
        tokens: the step's token ids in its writer's tokenization, forced tokens first (in-process; a served step
            has none: a server answers with text).
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
        forced_texts: the forced tokens' texts (served).
    """

    tokens: Sequence[int]
    n_forced: int
    text: str
    logits: Sequence[torch.Tensor] = ()
    n_new: int | None = None
    eos: bool = False
    end: str | None = None
    confidence: float | None = None
    forced_texts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.n_new is None:
            object.__setattr__(self, "n_new", len(self.tokens) - self.n_forced)

    @property
    def size(self) -> int:
        """Tokens in the step, forced ones included."""
        return self.n_forced + self.n_new

    @property
    def forced(self) -> Forced:
        """The forced tokens that opened the step (they open the target's step when it is refused)."""
        return Forced(tuple(self.tokens[: self.n_forced]), self.forced_texts)


@dataclass(frozen=True)
class Commit:
    """What a row committed after a decision, for each part to sync its context to (:meth:`Part.sync`).

    Attributes:
        kept: new tokens of the row's last read (its window, or a rewrite's continuation) that stay, counted from the
            start of the read; the rest leave the context. None: all of them stay.
        then: target token ids that follow (the target's bonus token, or the token it drew after the kept ones).
        step: a step the target wrote, already in the target's context: the draft reads it next.
    """

    kept: int | None = None
    then: tuple[int, ...] = ()
    step: Proposal | None = None


RoomAfter = Callable[[int, list[Proposal], RowState], int]
"""``room_after(row, window, state)``: tokens a next step of the row's window may hold (0: the window ends)."""


class Part(Protocol):
    """What the loop asks of both of its parts, whatever model they drive."""

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

    def admit(self, prompt, key) -> None:
        """A new row (the loop has added it to its rows): its prompt as this part reads it, and its stream key."""

    def retire(self, rows: Sequence[int]) -> None:
        """The rows are done: later work leaves them out."""

    def sync(self, row: int, commit: Commit) -> None:
        """The row committed ``commit``: the part's context follows the row's committed output (in-process parts crop
        or feed their caches; a served part holds no context between requests, the server reads the row's text)."""

    def write(self, rows: Sequence[int], limits: Mapping[int, int], forced: Mapping[int, Forced] | None = None,
              alone: bool = False) -> dict[int, Proposal]:
        """One step per row after its forced tokens, kept as it is; ``alone`` (a baseline: no other part reads the
        row) lets a served part write the row's whole output in one request."""


class Proposer(Part, Protocol):
    """The draft side: writes windows of steps for the target to judge and scores them with the draft probe."""

    def propose(self, rows: Mapping[int, RowState], *, for_p: bool, window: Window = ONE_STEP,
                room_after: RoomAfter | None = None) -> dict[int, list[Proposal]]:
        """A window of steps per row, each after the ones before it (:func:`grow_windows`); ``for_p``: keep what
        the draft probe reads of the first step (a policy may want ``p``)."""

    def score(self, rows: Sequence[int]) -> dict[int, float]:
        """The draft probe's ``p`` of each row's first proposed step."""


class Verifier(Part, Protocol):
    """The target side: reads windows of steps, scores them, and draws the token after a kept window."""

    def verify(self, windows: Mapping[int, Sequence[Proposal]], outputs: Mapping[int, str], needs: Needs,
               rewrites: Collection[int] = ()) -> dict[int, list[Scores]]:
        """Each row's window read after its output, every step scored as the step-by-step loop would."""

    def bonus(self, rows: list[int]) -> dict[int, Forced]:
        """The target's next token after each row's kept window, from the read that judged it (it enters the
        target's context; it opens the row's next step unless it ends the sequence)."""


@runtime_checkable
class TokenVerifier(Verifier, Protocol):
    """A verifier that also writes the target's steps token by token from the draft's proposals (token-level
    speculation inside a step, ``DecodeConfig.token_sd``): the in-process target, whose verification forward gives
    its logits at every token it read. A served target writes its steps inside its server."""

    def rewrite(self, row: int, tokens: Sequence[int], limit: int, proposal: Proposal, drawn: bool,
                offset: int = 0) -> tuple[int, int | None] | None:
        """The target's step so far (``tokens``, at most ``limit``) continued by the proposal's new tokens, as read
        by the last :meth:`verify` (after ``offset`` new tokens of the row's read): how many of them the target keeps,
        and the token it draws after them (None when it keeps them all, or the step ends within them); None when the
        row was not read. ``drawn``: the proposal was drawn from the draft's logits (it carries them)."""

    def finished(self, tokens: Sequence[int], n_forced: int, limit: int) -> Proposal | None:
        """The target's step of ``tokens`` (its first ``n_forced`` given) as the row commits it, once it is finished
        (its stopper says so, or it holds ``limit`` tokens); else None."""


def grow_windows(windows: dict[int, list[Proposal]], states: Mapping[int, RowState], window: Window,
                 write_more: Callable[[dict[int, RowState]], dict[int, Proposal]], room_after: RoomAfter) -> None:
    """Grow each row's window (its first step proposed) to up to ``window.size`` steps, each after the ones before
    it, while the row would go on (``room_after`` leaves room for a step) and, for an adaptive window, while the
    draft drew every token of the last step at ``window.min_logprob`` or more. ``write_more`` writes the next step
    of the rows it is given.

    With windows above one step, a row rewriting a refused step (its state's ``rewrite``) whose continuation ends
    the step gets a window after it on the same terms (the continuation taken as the window's first proposal)."""
    def sure(d: Proposal) -> bool:
        m = window.min_logprob
        return m is None or (d.confidence is not None and d.confidence >= m)

    def cap(i: int) -> int:  # proposals a row's window may hold: a rewrite's continuation comes first
        return window.size + 1 if states[i].rewrite and window.size > 1 else window.size

    for _ in range(window.size):
        more = {i: RowState(NOTHING_FORCED, left) for i, w in windows.items()
                if len(w) < cap(i) and sure(w[-1]) and (left := room_after(i, w, states[i])) > 0}
        if not more:
            return
        for i, d in write_more(more).items():
            windows[i].append(d)
