"""Timing decoding methods against each other: the order they run in, and whether the machine let the times compare.

A speedup is measured with the methods interleaved (docs/design.md "Benchmark figures"): on problem (or batch)
``k`` they run in :func:`rotation` order, so load that comes and goes hits every method alike. The benchmarks and
the live validation callback (:mod:`callbacks.speculative_validation`) share it. :func:`load_per_core` and
:func:`timing_noise` say when the times are not to be trusted: more runnable threads than cores, or a reference
whose cost per forward jumps from problem to problem.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence

MAX_LOAD_PER_CORE = 1.0
"""Above this 1-minute load average per core, threads wait for a core and a method's time depends on the scheduler."""
MAX_TIMING_NOISE = 0.2
"""Above this spread of the reference's seconds per forward across problems, the load changed under the run."""


def rotation(names: Sequence[str], k: int) -> list[str]:
    """The order the methods ``names`` run in on problem (or batch) ``k``: ``names`` started at ``k`` (modulo their
    count), so each method takes every position in turn."""
    k %= len(names)
    return [*names[k:], *names[:k]]


def load_per_core() -> float:
    """The 1-minute load average over the cores this process may run on; NaN where the system reports none."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has no load average
        return math.nan
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return load / cores


def timing_noise(seconds: Sequence[float], units: Sequence[float]) -> float:
    """Coefficient of variation (standard deviation over mean) of ``seconds / units`` across chunks of a run.

    Fed the reference method's seconds and forwards per problem, it measures how much the machine's speed changed
    during the run: a target-only forward costs about the same on every problem of a quiet machine, so its
    per-forward time spreads only when other work takes the cores. NaN with fewer than two chunks with units.
    """
    rates = [s / u for s, u in zip(seconds, units) if u > 0]
    if len(rates) < 2 or statistics.fmean(rates) <= 0:
        return math.nan
    return statistics.stdev(rates) / statistics.fmean(rates)


def unreliable_because(load: float, noise: float) -> list[str]:
    """Why a speedup timed at ``load`` per core (the highest seen) with ``noise`` (:func:`timing_noise`) cannot be
    trusted; empty when nothing says so (NaN figures say nothing)."""
    reasons = []
    if load > MAX_LOAD_PER_CORE:
        reasons.append(f"load average {load:.2f} per core (over {MAX_LOAD_PER_CORE}: threads waited for a core)")
    if noise > MAX_TIMING_NOISE:
        reasons.append(f"target-only seconds per forward varied by {noise:.0%} across problems "
                       f"(over {MAX_TIMING_NOISE:.0%}: the machine's speed changed during the run)")
    return reasons
