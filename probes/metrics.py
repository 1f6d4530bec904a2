"""The run-level figures of speculative decoding that every benchmark and the live callback
(:class:`~callbacks.speculative_validation.SpeculativeValidation`) report, computed here only (docs/design.md
"Benchmark figures"): :func:`speedup` and :func:`accuracy`.

The per-decode ratios (step acceptance, draft token share, target passes per 100 tokens, probe overhead) are
plain divisions of the decoder's counters, made by :func:`~semanticspec.results.summarize`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


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
