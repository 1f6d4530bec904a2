"""Reasoning steps: delimiters, splitting a trace into steps, and deciding when a step is done."""

from __future__ import annotations

import weakref
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
    The check looks at token ids first: a token can only complete a delimiter if its own text
    holds the delimiter's last character (every delimiter here ends in a newline), and the set of
    such ids is computed once per tokenizer. Only for those tokens are the last few tokens
    decoded, so the check costs O(1) per token and almost never calls the tokenizer.

    Args:
        tokenizer: the sampling model's tokenizer.
        delimiters: step delimiters (text).
        max_step_tokens: hard cap on a step's length in tokens.
    """

    def __init__(self, tokenizer, delimiters: Sequence[str], max_step_tokens: int):
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens={max_step_tokens}; expected >= 1")
        if not delimiters or not all(delimiters):
            raise ValueError(f"delimiters={list(delimiters)!r}; expected non-empty strings")
        self.tokenizer = tokenizer
        self.delimiters = tuple(delimiters)
        self.max_step_tokens = max_step_tokens
        self.eos_token_id = tokenizer.eos_token_id
        self._tail = max(len(d) for d in self.delimiters) + 1
        self._enders = _ender_ids(tokenizer, {d[-1] for d in self.delimiters})

    def __call__(self, token_ids: Sequence[int]) -> bool:
        if not token_ids:
            return False
        last = token_ids[-1]
        if len(token_ids) >= self.max_step_tokens or last == self.eos_token_id:
            return True
        if self._enders is not None and last not in self._enders:
            return False
        tail = self.tokenizer.decode(token_ids[-self._tail :], skip_special_tokens=False)
        return ends_step(tail, self.delimiters)


_ENDERS: "weakref.WeakKeyDictionary[object, dict[frozenset[str], frozenset[int]]]" = weakref.WeakKeyDictionary()


def _ender_ids(tokenizer, last_chars: set[str]) -> frozenset[int] | None:
    """Ids whose own text holds one of ``last_chars``; None (decode always) for non-ASCII characters.

    An ASCII character is one byte in every byte-level and sentencepiece vocabulary, so a token
    that completes a delimiter ending in it shows it when decoded alone. Cached per tokenizer.
    """
    if not all(c.isascii() for c in last_chars):
        return None
    key = frozenset(last_chars)
    try:
        known = _ENDERS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: compute without caching
        known = {}
    if key not in known:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
        known[key] = frozenset(i for i, t in enumerate(texts) if any(c in t for c in last_chars))
    return known[key]
