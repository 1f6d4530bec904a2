"""Speculative-decoding figures in torchmetrics' functional update/compute form (docs/design.md "Benchmark figures").

Each figure is a ratio of two sums, so it has a pure ``_update`` that turns a batch into sums and a pure
``_compute`` that turns sums into the figure (after ``torchmetrics/regression/mse.py``);
:func:`~probes.decoding.results.summarize` reports them. :func:`speedup` and :func:`accuracy` are the run-level
figures that every benchmark and the live callback report, computed here only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

Number = int | float | Tensor


def _ratio_update(numerator: Number, denominator: Number) -> tuple[Tensor, Tensor]:
    """Sum a batch of numerators and denominators (scalars or 1-D). Returns two float64 scalars."""
    num = torch.as_tensor(numerator, dtype=torch.float64).sum()
    den = torch.as_tensor(denominator, dtype=torch.float64).sum()
    if bool(num < 0) or bool(den < 0):
        raise ValueError(f"counts must be non-negative, got numerator={float(num)}, denominator={float(den)}")
    return num, den


def _ratio_compute(num: Tensor, den: Tensor, scale: float = 1.0) -> Tensor:
    """``scale * num / den``, and 0 when nothing was counted (``den == 0``)."""
    return torch.where(den > 0, scale * num / den.clamp(min=1e-12), torch.zeros_like(num)).float()


def _acceptance_update(accepted: Number, proposed: Number) -> tuple[Tensor, Tensor]:
    """Sums of accepted and proposed draft steps; refuses more accepted than proposed."""
    acc, prop = _ratio_update(accepted, proposed)
    if bool(acc > prop):
        raise ValueError(f"accepted={int(acc)} draft steps exceeds proposed={int(prop)}")
    return acc, prop


def step_acceptance(accepted: Number, proposed: Number) -> Tensor:
    """Functional step acceptance over counts (per prompt or totals): accepted draft steps / proposed draft steps
    (0 when none was proposed).

    >>> float(step_acceptance([3, 1], [4, 4]))
    0.5
    """
    return _ratio_compute(*_acceptance_update(accepted, proposed))


def draft_token_share(draft_tokens: Number, output_tokens: Number) -> Tensor:
    """Output tokens written by the draft / all output tokens."""
    return _ratio_compute(*_ratio_update(draft_tokens, output_tokens))


def target_passes_per_100_tokens(target_passes: Number, output_tokens: Number) -> Tensor:
    """Sequential target forward calls per 100 output tokens (hardware-independent cost)."""
    return _ratio_compute(*_ratio_update(target_passes, output_tokens), scale=100.0)


def probe_overhead(probe_s: Number, wall_s: Number) -> Tensor:
    """Time inside probe forwards / total decode time."""
    return _ratio_compute(*_ratio_update(probe_s, wall_s))


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
