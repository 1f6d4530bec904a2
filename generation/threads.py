"""The intra-op thread policy of the fit and the label build: how many torch threads each process uses, and how
an idle one waits.

The package's CPU work is many small ops on small models (the embedded world's target has 4.8M parameters).
Between two ops, torch's OpenMP threads (libgomp in the pip wheels) spin-wait: 300,000 spins by libgomp's
default before they sleep. Alone that makes small ops fast; beside any other busy process (a second job, a test
run, another rank) every spin steals a core the other process needs, so both slow down far past their fair
share (docs/benchmarks.md "Threads" measures how far).

The policy, in the order it is applied:

1. ``--threads N`` (the fit's and the build's option), when given;
2. else ``OMP_NUM_THREADS``, when set (the variable torch itself reads: a user's or launcher's choice stands);
3. else the host's cores divided between the ranks on it (``LOCAL_WORLD_SIZE``, as torchrun sets it, or the
   number of processes the fit launches), never below one: torch's own count for a single process;

and, whatever the count, idle threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, set by
:func:`set_wait_policy` first thing in the CLIs' ``main()``, before torch loads), unless ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` is set already (a user's choice stands). libgomp reads them once, when torch loads it, so from
Python after ``import torch`` the policy cannot change (the line :func:`apply_threads` prints says which applies).

``python -m benchmarks.threads`` measures the build and the fit alone and beside a competing 2-thread torch
process at 1 thread, at 2 threads spinning as libgomp does by default (what the CLIs did before), at 2 passive
threads (the default on 2 cores) and at 2 threads spinning 3000 times (``GOMP_SPINCOUNT=3000``). Only intra-op
threads are set: the package starts no inter-op work (no ``torch.jit.fork``), so torch's inter-op pool is never
created and needs no setting. Figures that sum in floating point over threads (the fit's metrics, in their last
digits) depend on the count, so a run repeats exactly only at the same count.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

DEFAULT_THREADS: int | None = None
"""Most threads per process when neither ``--threads`` nor ``OMP_NUM_THREADS`` says otherwise; None: the host's
cores divided between its ranks, as torch counts them. With :data:`WAIT_POLICY` that is as fast alone as torch's
own default and degrades far less beside another torch job (``python -m benchmarks.threads``; docs/benchmarks.md
"Threads")."""

WAIT_POLICY = "PASSIVE"
"""``OMP_WAIT_POLICY`` of the CLIs: idle OpenMP threads sleep at once instead of spinning (libgomp spins 300,000
times by default, stealing the cores another job needs)."""

OPTION_HELP = (
    "Intra-op torch threads of this process (>= 1). Default: OMP_NUM_THREADS when set, else the host's cores "
    f"divided between its ranks; idle threads sleep rather than spin (OMP_WAIT_POLICY={WAIT_POLICY} unless "
    "OMP_WAIT_POLICY or GOMP_SPINCOUNT is set), so another job on the machine keeps its share. Metrics repeat to "
    "the last digit only at the same count."
)
"""The ``--help`` text of the fit's and the build's ``--threads`` option."""


def check_threads(value: Any, source: str = "--threads") -> int:
    """``value`` as a thread count, or a ``ValueError`` naming it.

    Args:
        value: an int >= 1 (or, from the environment, its decimal string).
        source: where the value came from, for the message (``--threads``, ``OMP_NUM_THREADS``).

    Raises:
        ValueError: ``value`` is not a whole number >= 1 (booleans, floats, 0 and negatives included).
    """
    n = value
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        n = int(value)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{source} {value!r}: expected a whole number of threads >= 1 (e.g. --threads 1); "
                         "leave it out for the default")
    return n


def local_ranks(env: Mapping[str, str] = os.environ, launched: int = 1) -> int:
    """Processes on this host that share its cores: ``LOCAL_WORLD_SIZE`` (torchrun) when set, else ``launched``."""
    if env.get("LOCAL_WORLD_SIZE"):
        return check_threads(env["LOCAL_WORLD_SIZE"], "LOCAL_WORLD_SIZE")
    return max(1, launched)


def launched_processes(devices: Any) -> int:
    """Processes a fit with Lightning's ``trainer.devices`` starts on this host: an int (``-1``/``"auto"``
    count as one here: the accelerator decides), the length of a list of ids, or a ``"N"`` / ``"0,1"`` string."""
    if isinstance(devices, (list, tuple)):
        return max(1, len(devices))
    if isinstance(devices, str):
        parts = [p for p in devices.split(",") if p.strip()]
        if len(parts) > 1:
            return len(parts)
        devices = int(parts[0]) if parts and parts[0].strip().isdigit() else 1
    return devices if isinstance(devices, int) and not isinstance(devices, bool) and devices > 1 else 1


def resolve_threads(threads: Any = None, *, ranks: int = 1, cpu_count: int | None = None,
                    env: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """The thread count of this process and why (see the module's docstring for the order).

    Args:
        threads: the ``--threads`` value, or None for the default.
        ranks: processes on this host that share its cores (see :func:`local_ranks`).
        cpu_count: cores this process may use (default: its CPU affinity).
        env: the environment (``OMP_NUM_THREADS``).

    Returns:
        ``(threads, reason)``: the count, and a few words on where it came from.

    Raises:
        ValueError: ``threads`` or ``OMP_NUM_THREADS`` is not a whole number >= 1, naming the value.
    """
    if threads is not None:
        return check_threads(threads), "--threads"
    if env.get("OMP_NUM_THREADS"):
        return check_threads(env["OMP_NUM_THREADS"], "OMP_NUM_THREADS"), "OMP_NUM_THREADS"
    cores = cpu_count or available_cores()
    n = max(1, cores // max(1, ranks))
    if DEFAULT_THREADS is not None:
        n = min(n, DEFAULT_THREADS)
    return n, f"default: {cores} cores" + (f" shared by {ranks} ranks" if ranks > 1 else "")


def set_wait_policy(env: MutableMapping[str, str] = os.environ) -> bool:
    """Let idle OpenMP threads sleep instead of spinning: ``OMP_WAIT_POLICY`` = :data:`WAIT_POLICY` in ``env``,
    unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is set already (a user's choice stands).

    libgomp reads the variable once, when torch loads it, so the CLIs call this first thing in ``main()``; once
    torch is imported it would change nothing, and it is skipped.

    Returns:
        Whether it set the variable.
    """
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return False
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    return True


def wait_policy(env: Mapping[str, str] = os.environ) -> str:
    """A few words on how idle OpenMP threads wait under ``env`` (for the line :func:`apply_threads` prints)."""
    if env.get("OMP_WAIT_POLICY"):
        return f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}"
    if env.get("GOMP_SPINCOUNT"):
        return f"GOMP_SPINCOUNT={env['GOMP_SPINCOUNT']}"
    return "libgomp's default spin"


def available_cores() -> int:
    """Cores this process may run on (its affinity where the OS says, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def apply_threads(threads: Any = None, *, launched: int = 1, log: Callable[[str], Any] | None = print,
                  env: Mapping[str, str] = os.environ) -> int:
    """Resolve the thread count (:func:`resolve_threads`), set it with ``torch.set_num_threads`` and say so.

    Call it once, right after parsing a command's arguments and before any model work.

    Args:
        threads: the ``--threads`` value, or None for the default.
        launched: processes this command starts on this host (the fit's ``trainer.devices``); torchrun's
            ``LOCAL_WORLD_SIZE`` takes precedence.
        log: where the one line that says the choice goes (on local rank 0 only); None: silent.
        env: the environment.

    Returns:
        The count set.

    Raises:
        ValueError: a bad ``threads``, ``OMP_NUM_THREADS`` or ``LOCAL_WORLD_SIZE``, naming the value.
    """
    ranks = local_ranks(env, launched)
    n, why = resolve_threads(threads, ranks=ranks, env=env)
    import torch  # after the checks: a refused value costs no torch import

    torch.set_num_threads(n)
    if log is not None and env.get("LOCAL_RANK", "0") == "0":
        log(f"torch threads: {n} per process ({why}; set with --threads N), idle threads: {wait_policy(env)}")
    return n
