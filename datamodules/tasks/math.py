"""Boxed-answer math: problems from a JSONL file whose answers are the last ``\\boxed{...}``, compared as math."""

from __future__ import annotations

from typing import Any

from datamodules.tasks.base import Task


class BoxedMathTask(Task):
    """Math problems from a JSONL file; the answer is the last ``\\boxed{...}``, compared as math.

    ``1/2``, ``0.5``, ``\\frac{1}{2}`` and ``\\dfrac{2}{4}`` are equal; so are ``2x+1`` and ``1+2x``
    (:func:`~datamodules.tasks.math_equal.math_equal`). A missing or unbalanced box is wrong, never an error.

    Args:
        path: JSONL of ``{"problem", "answer", "trace"?}`` lines (``answer`` with or without ``\\boxed``).
    """

    answer_marker = "\\boxed"

    def extract(self, text: str) -> str | None:
        return last_boxed(text)

    def equal(self, got: str, answer: Any) -> bool:
        from datamodules.tasks.math_equal import math_equal

        return math_equal(got, last_boxed(str(answer)) or str(answer))


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    text = text or ""
    k = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if k < 0:
        return None
    start = text.index("{", k) + 1
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip() or None
    return None  # the box never closes
