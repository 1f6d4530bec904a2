"""Boxed-answer math: problems from a JSONL file whose answers are the last ``\\boxed{...}``, compared as math by
Hugging Face's Math-Verify (the grader of lighteval and open-r1 on MATH-500, AIME and AMC)."""

from __future__ import annotations

import re
import threading
from typing import Any

from datamodules.tasks.base import Task


class BoxedMathTask(Task):
    """Math problems from a JSONL file; the answer is the last ``\\boxed{...}``, compared as math.

    ``1/2``, ``0.5``, ``\\frac{1}{2}`` and ``\\dfrac{2}{4}`` are equal; so are ``2x+1`` and ``1+2x``
    (:func:`math_equal`). A missing or unbalanced box is wrong, never an error.

    Args:
        path: JSONL of ``{"problem", "answer", "trace"?}`` lines (``answer`` with or without ``\\boxed``).
    """

    answer_marker = "\\boxed"

    def extract(self, text: str) -> str | None:
        return last_boxed(text)

    def equal(self, got: str, answer: Any) -> bool:
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


TIMEOUT_S = 2
"""Math-Verify's limit on reading and on comparing one answer, in the main thread (its timer is ``signal.alarm``)."""
_TOWER = re.compile(r"\^[^+\-*/=,\\]*\^")  # 9^{9^{9}}, 9^9^9, (10^{10})^{10}: powers too large to compute
MAX_CHARS = 120
"""Outside the main thread, where no timer can stop Math-Verify, longer answers are only compared as text."""


def math_equal(got: str, answer: str) -> bool:
    """Whether ``got`` and ``answer`` (LaTeX or plain) are the same number, expression, interval or set; False (never
    an error) otherwise. Math-Verify reads both (``.5``, ``\\sqrt3``, ``\\$5``, ``5\\text{ cm}``, ``1,000``,
    ``x = 5``, ``50\\%`` read as their values) and compares them with sympy; nothing is evaluated as Python. Outside
    the main thread it runs without its timer, so a power tower or a long answer is then compared as text only."""
    from math_verify import parse, verify

    got, answer = str(got).strip(), str(answer).strip()
    timed = threading.current_thread() is threading.main_thread()
    if not timed and (max(len(got), len(answer)) > MAX_CHARS or any(map(_TOWER.search, (got, answer)))):
        return bool(got) and got == answer
    limit = TIMEOUT_S if timed else None
    gold, pred = parse(f"${answer}$", parsing_timeout=limit), parse(f"${got}$", parsing_timeout=limit)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=limit))
