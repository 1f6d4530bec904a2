"""Per-prompt decode state: the output so far, the step trace, the counters, and when the prompt is done.

A row knows nothing of models or servers: the loop's parts tell it what a step holds
(:class:`~semanticspec.parts.Proposal`); the loop weighs its budget against their contexts' room.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from generation.handover import text_delta
from semanticspec.parts import NOTHING_FORCED, Proposal
from semanticspec.results import DecodeStats, Decision, StepTrace


def answer_complete(text: str, marker: str | None) -> bool:
    """The output ``text`` ends a decode: a newline follows an occurrence of ``marker`` before the next one, wherever
    it stands in its line (``\\boxed{`` mid-sentence too). Read token by token, as transformers' loop reads it, that
    is a newline after the last occurrence so far; a step that completes the marker's line and writes it again (a
    step cut at ``=`` with the marker ``=``) ends the decode too."""
    return bool(marker) and any("\n" in after for after in text.split(marker)[1:])


@dataclass
class TargetStep:
    """A refused step the target is rewriting across rounds (token-level speculation in the loop's own forwards).

    Attributes:
        tokens: the step so far, in both caches (its last token pending); forced tokens first.
        n_forced: leading tokens that were given (the target's bonus token), not written for this step.
        limit: the most tokens the step may hold, forced ones included.
        chunk: the most draft tokens proposed per target forward (the target's own steps written with token-level
            speculation, ``DecodeConfig.token_sd_tokens``); None: up to the step's end (a refused step rewritten in
            the rounds, from the draft's continuation of it).
    """

    tokens: list[int]
    n_forced: int
    limit: int
    chunk: int | None = None

    def room(self) -> int:
        """The most tokens the step may hold after the next proposal."""
        return self.limit if self.chunk is None else min(len(self.tokens) + self.chunk, self.limit)


class Row:
    """Decode state of one prompt.

    Args:
        budget: output tokens it may write.
        answer_marker: the prompt is done once a newline follows an occurrence of it (:func:`answer_complete`).
        decode: the models share one tokenizer in-process: the output is kept as ids too, its text is these ids
            decoded whole (``decode(ids)``), and each kept step's text is what its ids add to that text, up to the last
            whole character (:func:`~generation.handover.text_delta`: a character whose bytes two steps hold comes
            with the second); None: the output's text is its steps' texts, joined.
    """

    def __init__(self, budget: int, answer_marker: str | None, decode: Callable[[list[int]], str] | None = None
                 ) -> None:
        self.budget, self.answer_marker, self.decode = budget, answer_marker, decode
        self.out: list[int] = []  # output token ids (one tokenizer, in-process)
        self.shown = (0, 0)  # text_delta's offsets into out: the steps' texts hold out[:shown[1]]
        self.pieces: list[str] = []  # output text per committed step
        self.trace: list[StepTrace] = []
        self.stats = DecodeStats()
        self.done = False
        self.stop_reason: str | None = None  # eos, answer, budget or context (results.STOP_REASONS)
        self.forced = NOTHING_FORCED  # the target's bonus token opening the next step
        self.rewriting: TargetStep | None = None  # the target step being written over rounds, if any
        self.steps_written = 0
        self.error: str | None = None  # why the row failed (a server's answer), with stop_reason "error"
        self.cause: BaseException | None = None  # the engine's error behind it, if one

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def commit(self, trace: StepTrace, step: Proposal) -> None:
        """Add a kept step (its trace entry says who wrote it) to the output; decide whether the prompt is finished."""
        self.trace.append(trace)
        self.steps_written += 1
        self.stats.steps += 1
        self.stats.output_tokens += step.n_new
        if trace.writer == "draft":
            self.stats.draft_tokens += step.n_new
        if self.decode is not None:
            self.out.extend(step.tokens[step.n_forced :])
            trace.text = self._shown_text()
        self.pieces.append(trace.text)
        self.forced = NOTHING_FORCED
        if step.eos:
            self.finish("eos")
        elif answer_complete(self.text, self.answer_marker):
            self.finish("answer")
        elif step.end is not None:
            self.finish(step.end)
        if self.done:
            self._flush()

    def _shown_text(self, flush: bool = False) -> str:
        """The text the output's ids add since the last step's (one tokenizer)."""
        text, self.shown = text_delta(self.decode, self.out, self.shown, flush)
        return text

    def _flush(self) -> None:
        """The row ended: the text a last unfinished character held back joins the last kept step's."""
        if self.decode is not None and self.shown[1] < len(self.out):
            last = next(t for t in reversed(self.trace) if t.decision != Decision.REJECT)
            last.text += (text := self._shown_text(flush=True))
            self.pieces[-1] += text

    def finish(self, reason: str) -> None:
        """The prompt is done, for ``reason`` (eos, answer, budget or context)."""
        self.done, self.stop_reason = True, reason

    def fail(self, message: str, cause: BaseException | None = None) -> None:
        """The row ends with ``stop_reason="error"`` (a server failed it); ``message`` says why, ``cause`` is the
        engine's error (a :class:`~generation.engines.base.Refused`: the server refused the request as the caller's
        error)."""
        self.finish("error")
        self.error, self.cause = message, cause

    def close(self) -> None:
        """Finish at the budget or the context end; a bonus token still waiting for its step becomes a last
        one-token step."""
        self.finish("budget" if self.stats.output_tokens >= self.budget else "context")
        self.last_forced_step()
        self._flush()

    def last_forced_step(self) -> None:
        """A bonus token still waiting for its step (counted in ``output_tokens`` when drawn) becomes a last one-token
        step of the trace, as the finished row has no next step to open."""
        if self.forced or self.forced.eos:  # a server's EOS has no text, so no length: one token all the same
            ids = list(self.forced.ids)
            text = self._shown_text(flush=True) if ids and self.decode is not None else self.forced.text
            self.trace.append(StepTrace("target", text, max(len(self.forced), 1), decision=Decision.TARGET))
            self.pieces.append(text)
            self.stats.steps += 1
            self.forced = NOTHING_FORCED

    def output(self) -> str:
        """The decode's text: empty for a failed row, else the ids decoded whole (one tokenizer) or the steps'
        texts."""
        if self.error:
            return ""
        return self.decode(self.out) if self.decode is not None else self.text
