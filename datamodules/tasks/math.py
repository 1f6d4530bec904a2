"""Boxed-answer math: problems from a JSONL file whose answers are the last ``\\boxed{...}``, compared as math by
Hugging Face's Math-Verify (the grader of lighteval and open-r1 on MATH-500, AIME and AMC)."""

from __future__ import annotations

import logging
import re
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


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
"""Where a box opens: ``\\boxed{``, ``\\fbox{``, and LaTeX's ``\\boxed {`` with spaces."""


def last_box_start(text: str) -> int:
    """Index of the last box's opening in ``text`` (:data:`_BOX`), -1 for none."""
    starts = [m.start() for m in _BOX.finditer(text or "")]
    return starts[-1] if starts else -1


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, spaces before the brace allowed) with balanced braces,
    else None."""
    text = text or ""
    k = last_box_start(text)
    if k < 0:
        return None
    start = text.index("{", k) + 1
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip() or None
    return None  # the box never closes


MAX_CHARS = 400
"""Longer answers are only compared as text: Math-Verify's reading time grows fast with length."""
MAX_DEPTH = 20
"""Answers nesting brackets deeper are only compared as text (its parser slows down sharply with depth)."""
_GROUPS = re.compile(r"(\d)\\[,!;: ](?=\d{3}(?!\d))")
"""A thin space between digit groups (``10\\,000``), which Math-Verify reads as two numbers."""
_HUGE = re.compile(
    r"\^\s*\{[^{}]*\^"  # an exponent holding a power: 9^{9^{9}}, (10^{10})^{10^{10}}
    r"|\^\s*(?:\w|\{[^{}]*\})\s*\^"  # a chained power: 9^9^9, 10^{10}^{10}
    r"|\^\s*\{?\s*\(?\s*\d{5,}"  # an exponent of five digits or more: 2^{10000000000}
    r"|(?:\d{4,}|[)}])\s*!"  # the factorial of a large or bracketed number: 10000000!, (10^{10})!
    r"|\\binom\s*\{[^{}]*\d{4,}"  # a binomial of large numbers
)


def math_equal(got: str, answer: str) -> bool:
    """Whether ``got`` and ``answer`` (LaTeX or plain) are the same number, expression, interval or set; False (never
    an error) otherwise. Math-Verify reads both (``.5``, ``\\sqrt3``, ``\\$5``, ``5\\text{ cm}``, ``1,000``,
    ``x = 5``, ``50\\%`` read as their values) and compares them with sympy; nothing is evaluated as Python.

    Math-Verify's own timer is ``signal.alarm``: it cancels a caller's alarm and fails outside the main thread. It is
    not used; instead an answer too costly to compute (a power tower, a huge exponent or factorial, longer than
    :data:`MAX_CHARS`, nested deeper than :data:`MAX_DEPTH`) is compared as text, the same in every thread."""
    from math_verify import parse, verify

    got, answer = (_GROUPS.sub(r"\1", str(x).strip()) for x in (got, answer))
    if _too_costly(got) or _too_costly(answer):
        return bool(got) and got == answer
    gold, pred = parse(f"${answer}$", parsing_timeout=None), parse(f"${got}$", parsing_timeout=None)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def _too_costly(s: str) -> bool:
    depth = peak = 0
    for ch in s:
        depth += (ch in "({[") - (ch in ")}]")
        peak = max(peak, depth)
    return len(s) > MAX_CHARS or peak > MAX_DEPTH or _HUGE.search(s) is not None


class _TimerNotice(logging.Filter):
    """Drops Math-Verify's notice that its timer is off: :func:`math_equal` turns it off and bounds the cost itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_TimerNotice())
