"""Per-prompt decode state: the output so far, the step trace, the counters, and when the prompt is done.

A row knows nothing of models or servers: the loop's parts tell it what a step holds
(:class:`~semanticspec.parts.Proposal`); the loop weighs its budget against their contexts' room.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from semanticspec.parts import Proposal
from semanticspec.results import DecodeStats, Decision, StepTrace


def answer_complete(text: str, marker: str | None) -> bool:
    """The output ``text`` ends a decode: its last line starting at ``marker`` is complete (a newline follows)."""
    if not marker:
        return False
    k = text.rfind(marker)
    return k >= 0 and "\n" in text[k:]


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
        shared: the models share one tokenizer (the output is kept as tokens, else as text).
        answer_marker: the prompt is done once a line starting with this is complete.
    """

    def __init__(self, budget: int, shared: bool, answer_marker: str | None) -> None:
        self.budget, self.shared, self.answer_marker = budget, shared, answer_marker
        self.out: list[int] = []  # output tokens (shared tokenizer)
        self.pieces: list[str] = []  # output text per committed step
        self.trace: list[StepTrace] = []
        self.stats = DecodeStats()
        self.done = False
        self.stop_reason: str | None = None  # eos, answer, budget or context (results.STOP_REASONS)
        self.forced: list = []  # the target's bonus token opening the next step (an id in-process, a text served)
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
        if self.shared:
            self.out.extend(step.tokens[step.n_forced :])
        self.pieces.append(trace.text)
        self.forced = []
        if step.eos:
            self.finish("eos")
        elif answer_complete(self.text, self.answer_marker):
            self.finish("answer")
        elif step.end is not None:
            self.finish(step.end)

    def finish(self, reason: str) -> None:
        """The prompt is done, for ``reason`` (eos, answer, budget or context)."""
        self.done, self.stop_reason = True, reason

    def fail(self, message: str, cause: BaseException | None = None) -> None:
        """The row ends with ``stop_reason="error"`` (a server failed it); ``message`` says why, ``cause`` is the
        engine's error (a :class:`~generation.engines.base.Refused`: the server refused the request as the caller's
        error)."""
        self.finish("error")
        self.error, self.cause = message, cause

    def close(self, text_of: Callable[[Sequence], str]) -> None:
        """Finish at the budget or the context end; a bonus token still waiting for its step becomes a last
        one-token step (``text_of``: the forced tokens' text)."""
        self.finish("budget" if self.stats.output_tokens >= self.budget else "context")
        if self.forced:
            text = text_of(self.forced)
            self.trace.append(StepTrace("target", text, len(self.forced), decision=Decision.TARGET))
            self.pieces.append(text)
            self.stats.steps += 1
            self.forced = []
