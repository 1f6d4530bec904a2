"""What a decode returns: the step trace, the counters, their aggregate, and the run-level figures every benchmark,
the evaluation and the live callback report, computed here only: :func:`speedup` and :func:`accuracy`
(docs/design.md "Benchmark figures")."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Decision(StrEnum):
    """What became of a step: a string enum, so a trace compares, prints and serialises as its value."""

    ACCEPT = "accept"
    """A draft step the policy kept."""
    ACCEPT_FAST = "accept_fast"
    """A draft step the top-k fast path kept (the probes did not run)."""
    REJECT = "reject"
    """A draft step thrown away; the next trace entry is the target's step."""
    TARGET = "target"
    """A step the target wrote."""

    @property
    def kept(self) -> bool:
        """A draft step that was kept (either acceptance)."""
        return self in (Decision.ACCEPT, Decision.ACCEPT_FAST)


@dataclass
class StepTrace:
    """One step of a decode.

    Attributes:
        writer: ``"target"`` or ``"draft"``.
        text: the step's text (special tokens dropped).
        n_tokens: tokens in the step, in the writer's tokenizer (a target bonus token included).
        q: target probe's semantic probability (None when not computed, e.g. fast path).
        p: draft probe's semantic probability (None when not computed).
        decision: a :class:`Decision`.
        seconds: the row's share of the loop's rounds since its previous step (a round's seconds shared evenly by
            the rows in it), split evenly among the steps one round traced for the row
            (:class:`~semanticspec.meter.Meter`). Over a batch the steps' seconds add up to at most the rows'
            ``wall_s``; one row's can exceed its own ``wall_s``, an even share of its batch's seconds, when it was
            in more rounds than the others.
        score: SpecReason judge score 0-9 (only for ``method="specreason"``).
    """

    writer: str
    text: str
    n_tokens: int
    q: float | None = None
    p: float | None = None
    decision: Decision = Decision.TARGET
    seconds: float = 0.0
    score: float | None = None
    confidence: float | None = None
    """Draft steps: the least log-probability (raw, temperature 1) the draft gave a token it drew in the step, when
    known: the draft-side signal an adaptive window reads (``DecodeConfig.window_min_logprob``)."""


@dataclass
class DecodeStats:
    """Counters of one prompt's decode (docs/design.md "Benchmark figures").

    Two kinds of seconds, told apart by their names:

    - **wall seconds** (``wall_s`` and the phase times, the other ``*_s``): in-process, a batch's seconds are shared
      evenly by its rows, so their sum over a decode's results is the decode's wall time (and its phases' times);
    - **row-seconds** (``*_row_s``): this row's own seconds while its batch ran, so summed over a batch's rows they
      can exceed its wall time (8 rows idle through one 2-second forward are 16 row-seconds).

    Served decoding (:class:`~semanticspec.served.ServedDecoder`) runs the same loop, all prompts as rows of one
    batch, so its seconds are shared the same way; ``http_s`` is the prompt's own request seconds (they overlap
    when requests run concurrently).

    ``steps`` counts committed steps (rejected proposals not included). Phases of the speculative loop: the
    target's first step (``first_step_s``), drafting (``draft_s``), the target's verification forward
    (``verify_s``), probes (``probe_s``) and the target rewriting refused steps (``rewrite_s``: the rewrite phase,
    or with rewrites in the rounds a rewriting row's share of the rounds it rides); the rest of ``wall_s`` is
    bookkeeping. Methods without a draft count only ``wall_s``.
    """

    wall_s: float = 0.0
    output_tokens: int = 0
    """Tokens of the kept steps, each counted by the model that wrote it (what ``max_new_tokens`` bounds): with one
    tokenizer the target's; with two, a kept draft step counts in the draft's tokens, which its text need not take in
    the target's (each step is still handed to the target as text)."""
    draft_tokens: int = 0
    steps: int = 0
    draft_steps_proposed: int = 0
    draft_steps_accepted: int = 0
    target_passes: int = 0
    """Target passes: in-process, forwards of the target that fed this row (one per token it wrote alone, one per
    step or window it read); served, requests to the target's server (a whole step written is one), so served and
    in-process figures of it do not compare."""
    draft_passes: int = 0
    """Draft passes, counted as ``target_passes`` is."""
    probe_s: float = 0.0
    first_step_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rewrite_s: float = 0.0
    drafted_tokens: int = 0
    """Tokens the draft wrote, kept or not (the bonus tokens that open steps excluded; a window's steps after a
    refused one included: they were thrown away unjudged, and so are the windows drafted after a rewrite's
    continuation that the target did not finish as drafted; the continuation's own tokens excluded, and so are served
    ``overlap``'s windows drafted ahead, counted in ``ahead_windows``)."""
    windows: int = 0
    """Verifications of drafted steps: one per window the target read (``lookahead``: up to that many steps each)."""
    ahead_windows: int = 0
    """Served ``overlap``: windows the draft wrote while the target read the one before (their requests counted)."""
    ahead_used: int = 0
    """Served ``overlap``: of those, the ones that held (the window before was kept whole and the target's bonus
    token was the draft's next token), so no draft request waited on the target."""
    idle_row_s: float = 0.0
    """Step loop, row-seconds: seconds of forwards that ran while this row was unfinished but fed nothing by them
    (an accepted row while the target rewrites another, a row whose step is written while others still draft)."""
    done_idle_row_s: float = 0.0
    """Step loop, row-seconds: seconds from the round this row finished in to the end of its batch."""
    requests: int = 0
    """Served decoding: requests sent to the servers (reads and writes of both)."""
    prefill_tokens: int = 0
    """Served decoding: prompt tokens the servers computed (their usage fields; cached ones excluded when reported)."""
    http_s: float = 0.0
    """Served decoding: the requests' wall time on the client, HTTP and server included."""


@dataclass(frozen=True)
class StepEvent:
    """One event of a streamed decode (``stream()`` of either decoder): a step of one prompt, or its end.

    A prompt's events come in its order: one per step it tried (a refused draft step too, ``decision`` reject,
    whose text is not in the output), then one end event (``step`` None) with its ``stop_reason`` and its whole
    :class:`DecodeResult`. Events of different prompts interleave as they are decoded.

    Attributes:
        prompt: the prompt's index in the call.
        step: the step, or None on the end event.
        text: the prompt's output so far, after the step: its kept steps' texts joined. In-process with one
            tokenizer each step's text is what its tokens add to the output decoded whole, so a character whose bytes
            two steps hold comes with the second, and the end event's ``result.text`` (decoded in one go) is the
            same text. A failed prompt's end event has ``""``, as its result (its steps are in the result).
        result: on the end event, the prompt's :class:`DecodeResult` (what ``generate`` returns for it).
    """

    prompt: int
    step: StepTrace | None
    text: str
    result: DecodeResult | None = None

    @property
    def end(self) -> bool:
        """The prompt's last event."""
        return self.result is not None

    @property
    def stop_reason(self) -> str | None:
        """On the end event, why the prompt stopped (:data:`STOP_REASONS`); None before."""
        return self.result.stop_reason if self.result is not None else None


def step_events(prompt: int, trace: Sequence[StepTrace], pieces: Sequence[str], start: int) -> list[StepEvent]:
    """Events for ``trace[start:]``, the steps a prompt tried since its last events, each with the output so far.

    ``pieces`` holds the text of each step kept so far, one per trace entry that is not a refused draft step (the
    invariant both loops keep), so the text before the new entries is the pieces before theirs."""
    new = trace[start:]
    kept = len(pieces) - sum(t.decision != Decision.REJECT for t in new)
    out = []
    for t in new:
        kept += t.decision != Decision.REJECT
        out.append(StepEvent(prompt, t, "".join(pieces[:kept])))
    return out


def collect(events, n: int) -> list[DecodeResult]:
    """The results of ``n`` prompts from their events (each prompt's end event), in prompt order.

    Raises:
        RuntimeError: a prompt without an end event (the stream stopped early).
    """
    results: list[DecodeResult | None] = [None] * n
    for e in events:
        if e.end:
            results[e.prompt] = e.result
    missing = [k for k, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"the decode ended without a result for prompts {missing}")
    return results


STOP_REASONS = ("eos", "answer", "budget", "context", "error")
"""Why a decode ended: EOS, a completed answer-marker line, ``max_new_tokens``, the models' context end, or an
error (a served decode whose server failed: the result's ``error`` says why)."""


@dataclass
class DecodeResult:
    """Output of one prompt: the generated text (prompt excluded), the step trace, counters and why it stopped.

    ``stop_reason`` is one of :data:`STOP_REASONS`. A prompt whose decode failed (``stop_reason="error"``)
    has ``text=""``, so no answer checker counts it as solved; ``error`` holds the message and ``steps``
    what was committed before it.
    """

    text: str
    steps: list[StepTrace] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    stop_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The decode finished (EOS, answer, budget or context), it did not fail."""
        return self.error is None and self.stop_reason != "error"


def _ratio(num: float, den: float) -> float:
    """``num / den`` as a float, and 0 when nothing was counted (``den == 0``)."""
    return num / den if den > 0 else 0.0


def summarize(results: Sequence[DecodeResult]) -> dict[str, float]:
    """Aggregate figures over prompts, named as in docs/design.md "Benchmark figures".

    Every counter of :class:`DecodeStats` is summed over the results: ``wall_s`` and the phase times (``*_s``)
    are wall seconds (for an in-process decode, its wall time and its phases'), ``idle_row_s`` and
    ``done_idle_row_s`` are row-seconds (summed over rows, so they can exceed ``wall_s``); see
    :class:`DecodeStats` for served decoding.

    Returns:
        ``step_acceptance`` (``draft_steps_accepted`` / ``draft_steps_proposed``), ``draft_token_share``
        (``draft_tokens`` / ``output_tokens``), ``target_passes_per_100_tokens`` (100 * ``target_passes`` /
        ``output_tokens``), ``probe_overhead`` (``probe_s`` / ``wall_s``), ``tokens_per_s`` (``output_tokens`` /
        ``wall_s``), each 0 when its denominator is 0 (nothing counted),
        ``n_prompts``, ``n_errors`` (prompts whose decode failed: their counters are included up to the failure;
        an accuracy over these results must count them as wrong, as their empty text does), and the sums of
        every :class:`DecodeStats` field: ``wall_s``, ``output_tokens``, ``steps``, ``draft_steps_proposed``,
        ``draft_steps_accepted``, ``target_passes``, ``draft_passes``, the phase times (``probe_s``,
        ``first_step_s``, ``draft_s``, ``verify_s``, ``rewrite_s``), the row-seconds (``idle_row_s``,
        ``done_idle_row_s``) and the served counters (``requests``, ``prefill_tokens``, ``http_s``).
    """
    s = [r.stats for r in results]
    tot = {k: sum(getattr(x, k) for x in s) for k in DecodeStats.__dataclass_fields__}
    return {
        "step_acceptance": _ratio(tot["draft_steps_accepted"], tot["draft_steps_proposed"]),
        "draft_token_share": _ratio(tot["draft_tokens"], tot["output_tokens"]),
        "target_passes_per_100_tokens": _ratio(100 * tot["target_passes"], tot["output_tokens"]),
        "probe_overhead": _ratio(tot["probe_s"], tot["wall_s"]),
        "tokens_per_s": _ratio(tot["output_tokens"], tot["wall_s"]),
        "n_prompts": len(results),
        "n_errors": sum(not r.ok for r in results),
        **tot,
    }


def speedup(reference_wall_s: float, wall_s: float) -> float:
    """Speedup: the reference's total wall time / the method's (docs/design.md "Benchmark figures").

    The reference is target-only decoding of the same problems with the same seeds in the same run
    (a baseline that runs in another library's loop is divided by that library's own target-only time).

    Args:
        reference_wall_s: total wall seconds of the reference.
        wall_s: total wall seconds of the method (or a predicted time, for a cost model).

    Returns:
        ``reference_wall_s / wall_s`` as a float; NaN when ``wall_s`` is 0 (nothing was timed).

    Raises:
        ValueError: a negative time (naming both).

    Example:
        >>> speedup(3.0, 1.5)
        2.0
    """
    ref, wall = float(reference_wall_s), float(wall_s)
    if ref < 0 or wall < 0:
        raise ValueError(f"wall times must be non-negative, got reference_wall_s={ref}, wall_s={wall}")
    return ref / wall if wall > 0 else math.nan


def accuracy(correct: Iterable[bool]) -> float:
    """Accuracy: the share of problems whose final answer the task's checker accepts.

    Args:
        correct: one flag per problem (``task.check(text, answer)``).

    Returns:
        Correct problems / problems as a float; 0 when there is no problem.

    Example:
        >>> accuracy([True, False, True, True])
        0.75
    """
    flags = [bool(c) for c in correct]
    return sum(flags) / len(flags) if flags else 0.0
