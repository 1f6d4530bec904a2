"""Reasoning steps: delimiters, splitting a trace into steps, and deciding when a step is done."""

from __future__ import annotations

from typing import Sequence

DEFAULT_DELIMITERS: tuple[str, ...] = ("\n\n", ".\n\n", ":\n\n", "?\n\n", "!\n\n", ")\n\n")
"""The blank-line family the paper cuts steps at. Every member ends in a blank line."""


def split_steps(trace: str, delimiters: Sequence[str] = DEFAULT_DELIMITERS) -> list[str]:
    """Cut ``trace`` after every delimiter; each step keeps its delimiter, the last may lack one.

    >>> split_steps("a.\\n\\nb\\n\\nc")
    ['a.\\n\\n', 'b\\n\\n', 'c']
    """
    if not delimiters:
        raise ValueError("delimiters is empty; give at least one step delimiter such as '\\n\\n'")
    steps, start, i = [], 0, 0
    ordered = sorted(delimiters, key=len, reverse=True)
    while i < len(trace):
        hit = next((d for d in ordered if trace.startswith(d, i)), None)
        if hit is None:
            i += 1
            continue
        end = i + len(hit)
        while end < len(trace) and trace[end] == "\n":  # a run of newlines is one delimiter
            end += 1
        steps.append(trace[start:end])
        start = i = end
    if start < len(trace):
        steps.append(trace[start:])
    return steps


def ends_step(text: str, delimiters: Sequence[str] = DEFAULT_DELIMITERS) -> bool:
    """Whether ``text`` (a step being written) now contains a delimiter."""
    return any(d in text for d in delimiters)


class StepStopper:
    """Decides, token by token, when a sampled step is finished.

    A step ends at the first token that completes a delimiter, at EOS, or at ``max_step_tokens``.
    Only the last few tokens are decoded, so the check costs O(1) per token.

    Args:
        tokenizer: the sampling model's tokenizer.
        delimiters: step delimiters (text).
        max_step_tokens: hard cap on a step's length in tokens.
    """

    def __init__(self, tokenizer, delimiters: Sequence[str] = DEFAULT_DELIMITERS, max_step_tokens: int = 64):
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens={max_step_tokens}; expected >= 1")
        self.tokenizer = tokenizer
        self.delimiters = tuple(delimiters)
        self.max_step_tokens = max_step_tokens
        self.eos_token_id = tokenizer.eos_token_id
        self._tail = max(len(d) for d in self.delimiters) + 1

    def __call__(self, token_ids: Sequence[int]) -> bool:
        if not token_ids:
            return False
        if len(token_ids) >= self.max_step_tokens or token_ids[-1] == self.eos_token_id:
            return True
        tail = self.tokenizer.decode(token_ids[-self._tail :], skip_special_tokens=False)
        return ends_step(tail, self.delimiters)
