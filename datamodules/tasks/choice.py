"""Multiple choice (GPQA style): problems from a JSONL file whose answers are letters."""

from __future__ import annotations

import re
from typing import Any

from datamodules.tasks.base import Task
from datamodules.tasks.math import last_box_start, last_boxed

_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")


class MultipleChoiceTask(Task):
    """Multiple-choice problems (GPQA style) from a JSONL file; answers are letters.

    The answer is read from the last "Answer: (B)", "the answer is B", "answer: **C**" or ``\\boxed{D}``.

    Args:
        path: JSONL of ``{"problem", "answer", "trace"?}`` lines (``problem`` lists the choices).
        letters: the choice letters.
    """

    def __init__(self, path: str | None = None, letters: str = "ABCD") -> None:
        super().__init__(path)
        if not isinstance(letters, str) or not letters or not letters.isalpha() or not letters.isupper():
            raise ValueError(f"letters={letters!r}: expected upper-case letters, e.g. 'ABCD'")
        self.letters = letters
        # one run of separators after "answer" (or "answer is"; LaTeX's $B$ and \(B\) too): side-by-side optional runs
        # of spaces backtracked in cubic time on a long run of whitespace
        self._rx = re.compile(r"(?i:answers?)(?:\s+(?i:is))?(?:\s+(?i:option|choice))?[\s:=(*\[$\\-]*([" + letters
                              + r"])(?![A-Za-z])")

    def extract(self, text: str) -> str | None:
        """The letter of whichever comes last: an "answer" phrase or a box holding one letter."""
        text = text or ""
        found = list(self._rx.finditer(text))
        boxed = _TEXT.sub(r"\1", last_boxed(text) or "").strip("() .")  # \boxed{\text{(D)}} and \boxed{D.} say D
        box_at = last_box_start(text)
        if len(boxed) == 1 and boxed in self.letters and (not found or box_at > found[-1].start()):
            return boxed
        return found[-1].group(1) if found else None

    def equal(self, got: str, answer: Any) -> bool:
        return got.upper() == str(answer).strip().strip("()").upper()
