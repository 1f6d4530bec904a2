"""Whether two final answers mean the same number or expression (``\\frac{1}{2}`` == ``0.5`` == ``1/2``).

Answers are normalised (LaTeX spacing, ``\\left``/``\\right``, ``$``, a leading ``x =``, thousands
separators, ``%`` and degree signs), compared as text, then, when both read as simple expressions,
compared with sympy (``simplify(a - b) == 0``). Only digits, operators, brackets and one-letter
variables (plus ``sqrt`` and ``pi``) reach sympy's parser, so model output is never evaluated as
Python; huge powers are refused rather than computed.
"""

from __future__ import annotations

import re

_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", "^\\circ", "^{\\circ}", "\\%", "%")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_SQRT = re.compile(r"\\sqrt\s*\{([^{}]*)\}")
_ALLOWED = re.compile(r"[0-9a-z+\-*/().\s]*")
_NAMES = {"sqrt", "pi"}
_HUGE = re.compile(r"\*\*\s*\(?\s*\d{3,}|\*\*[\s\d.()]*\*\*|\*\*\s*\([^)]*\*\*")  # 2**999, 9**9**9, 9**(9**9)
MAX_CHARS = 120
"""Longer answers are only compared as text."""


def normalize(answer: str) -> str:
    """The answer's text without layout: ``"$x = \\\\dfrac{1}{2}$"`` -> ``"\\\\frac{1}{2}"``."""
    s = str(answer).strip()
    for d in _DROP:
        s = s.replace(d, "")
    s = _TEXT.sub(r"\1", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"(\d),(?=\d{3}(?!\d))", r"\1", s)  # 1,000 -> 1000
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s.strip())  # x = 5 -> 5
    return re.sub(r"\s+", "", s).rstrip(".")


def to_sympy_text(s: str) -> str | None:
    """A normalised LaTeX answer as sympy input, or None when it is not a simple expression."""
    for _ in range(8):  # nested \frac and \sqrt, innermost first
        t = _SQRT.sub(r"sqrt(\1)", _FRAC.sub(r"((\1)/(\2))", s))
        if t == s:
            break
        s = t
    s = (s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi").replace("^", "**")
         .replace("{", "(").replace("}", ")"))
    if "\\" in s or not _ALLOWED.fullmatch(s):
        return None
    if any(len(w) > 1 and w not in _NAMES for w in re.findall(r"[a-z]+", s)):
        return None  # words are not math (and never reach the parser)
    if re.search(r"(?<!\d)\.|\.(?!\d)", s) or _HUGE.search(s):
        return None  # attribute access, or a power too large to compute
    return s or None


def _parse(s: str):
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    return parse_expr(s, transformations=standard_transformations + (implicit_multiplication_application, convert_xor))


def math_equal(got: str, answer: str) -> bool:
    """Whether ``got`` and ``answer`` are the same number or expression; False (never an error) otherwise."""
    a, b = normalize(got), normalize(answer)
    if a == b:
        return bool(a)
    if max(len(a), len(b)) > MAX_CHARS:
        return False
    sa, sb = to_sympy_text(a), to_sympy_text(b)
    if sa is None or sb is None:
        return False
    try:
        import sympy

        return bool(sympy.simplify(_parse(sa) - _parse(sb)) == 0)
    except Exception:  # unreadable input is simply not equal
        return False
