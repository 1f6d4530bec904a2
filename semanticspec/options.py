"""How the decoder's step loop runs, apart from who decides (:class:`LoopOptions`), and the dtype its probes run in
(:func:`resolve_probe_dtype`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from generation.specs import StepSpec, is_count

SPECREASON_SUFFIX = "\nScore 0-9:"
"""Judge turn appended after a draft step for SpecReason-style scoring (SpecReason asks for a 0-9 score)."""


@dataclass(frozen=True)
class LoopOptions:
    """The step loop's options (every method runs through the same loop).

    Args:
        target_first_step: the target writes the first step (the paper); off by default, as
            ``benchmarks/first_step.py`` backs (docs/benchmarks.md, "Who writes the first step").
        step: what a step is (:class:`~generation.specs.StepSpec`: delimiters and cap). None (default) =
            the step the probes' labels were cut at (``config.step``), else ``StepSpec()``. A probe is
            used on the steps it was trained on: a step that differs from a probe's is refused, naming both.
        answer_marker: stop once a line starting at this marker is complete (e.g. ``"Answer:"``).
        token_sd: the target writes its steps (first and rejected) with token-level speculative
            sampling from the same draft; lossless for those steps. None (default) = on when the
            models share a tokenizer (``benchmarks/first_step.py``); True with two is refused.
        token_sd_tokens: draft tokens proposed per target pass when ``token_sd``.
        rewrite_in_rounds: with ``token_sd``, a refused step is rewritten inside the loop's rounds instead of
            in a phase of its own while the other rows wait: the target redraws the step from the
            verification forward it already ran (the refused step as a point-mass proposal, so the rewrite
            is an exact draw from the target), and an unfinished rewrite continues as the draft's proposal,
            checked token by token in the next round's verification forward beside the other rows' steps.
        bonus_token: on accept, the token the target predicts after the step opens the next step
            (one tokenizer only).
        judge_suffix: the judge turn of the SpecReason baseline; every method keeps room for it
            (and a bonus token) at the context's end.

    Raises:
        ValueError: a bad value, naming every bad value at once.
    """

    target_first_step: bool = False
    step: StepSpec | None = None
    answer_marker: str | None = None
    token_sd: bool | None = None
    token_sd_tokens: int = 4
    rewrite_in_rounds: bool = True
    bonus_token: bool = True
    judge_suffix: str = SPECREASON_SUFFIX

    def __post_init__(self) -> None:
        errors = []
        if self.step is not None and not isinstance(self.step, StepSpec):
            errors.append(f"step={self.step!r}: expected a generation.specs.StepSpec or None")
        if not is_count(self.token_sd_tokens):
            errors.append(f"token_sd_tokens={self.token_sd_tokens}: expected an integer >= 1")
        if errors:
            raise ValueError("invalid LoopOptions: " + "; ".join(errors))


PROBE_DTYPES = ("auto", "float32", "float16")
"""``probe_dtype`` values: the dtype a decoder runs its probes' MLPs in."""


def resolve_probe_dtype(value: str, device: torch.device) -> torch.dtype:
    """The dtype a probe's MLP runs in on ``device`` for ``probe_dtype=value``.

    ``auto`` is float16 where a float16 matrix-vector product is fast: on CUDA, and on x86 CPUs whose kernels
    PyTorch built for AVX2 or AVX-512 (which convert float16 in registers). A batch-1 probe call reads every
    weight once, and the models' forwards evict them from the CPU's caches between calls, so halving the bytes
    halves the call (the world's paper-size MLP: 0.74 ms to 0.38 ms after a target forward, its q within
    3.4e-4 of float32's on every labelled row, no decision at tau 0.5 changed). Elsewhere (no SIMD kernels)
    float16 is several times slower, so ``auto`` keeps float32.

    Raises:
        ValueError: a value outside :data:`PROBE_DTYPES`, naming it.
    """
    if value not in PROBE_DTYPES:
        raise ValueError(f"probe_dtype={value!r}; expected one of {list(PROBE_DTYPES)}")
    if value == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and torch.backends.cpu.get_cpu_capability() in
                                         ("AVX2", "AVX512"))
        value = "float16" if fast else "float32"
    return getattr(torch, value)
