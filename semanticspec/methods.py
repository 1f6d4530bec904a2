"""The decoding methods: runner objects, and the one table that maps ``method=`` names to them.

A runner says what a round of the step loop does for the active rows (:class:`TargetOnly`,
:class:`DraftOnly`, :class:`Speculative` with an acceptance policy), or decodes on its own
(:class:`~semanticspec.hf.TransformersLoop`, transformers' loop). :data:`METHODS` is the only
place a method's name is read; the benchmarks import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from generation.specs import SamplingSpec
from semanticspec.hf import TransformersLoop
from semanticspec.loop import StepLoop, Window
from semanticspec.policies import AcceptancePolicy, OraclePolicy, ProbePolicy, RandomPolicy, SpecReasonPolicy
from semanticspec.results import StepEvent


class LoopRunner:
    """A runner on the package's step loop; ``caches`` bound each step (budget and context)."""

    caches: tuple[str, ...] = ("target", "draft")
    policy: AcceptancePolicy | None = None

    @property
    def probes_decide(self) -> bool:
        """The probes decide, so the decode samples as their labels were sampled."""
        return self.policy is not None and self.policy.decides_with_probes

    def stream(self, dec, batch: tuple, max_new_tokens: int, sampling: SamplingSpec, keys) -> Iterator[StepEvent]:
        """Decode one batch (``batch``: the decoder's inputs, sliced to the batch), yielding its
        :class:`~semanticspec.results.StepEvent` (prompt indices within the batch); ``keys``: each prompt's
        :data:`~generation.sampling.StreamKey` (its random streams)."""
        return dec.step_loop(batch, max_new_tokens, sampling, keys).stream(self)

    def step(self, loop: StepLoop, active: list[int]) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class TargetOnly(LoopRunner):
    """The target writes every step (the reference)."""

    caches = ("target",)

    def step(self, loop: StepLoop, active: list[int]) -> None:
        loop.target_steps(active, use_draft=False)


@dataclass(frozen=True)
class DraftOnly(LoopRunner):
    """The draft writes every step, all kept."""

    caches = ("draft",)

    def step(self, loop: StepLoop, active: list[int]) -> None:
        loop.draft_steps(active)


@dataclass(frozen=True)
class Speculative(LoopRunner):
    """The draft proposes each step (or a :class:`~semanticspec.loop.Window` of steps) and ``policy`` decides; the
    target writes the first step when ``target_first_step`` and every refused one."""

    policy: AcceptancePolicy
    window: Window = Window()

    def step(self, loop: StepLoop, active: list[int]) -> None:
        first = [i for i in active if loop.opt.target_first_step and loop.rows[i].steps_written == 0]
        spec = [i for i in active if i not in first]
        rejected = loop.speculate(spec, self.policy, self.window) if spec else []
        if first or rejected:
            loop.rewrite(first, rejected)


@dataclass(frozen=True)
class MethodArgs:
    """What a method's runner is built from: the decoder's SemanticSpec policy and ``generate``'s arguments."""

    policy: ProbePolicy
    accept_rate: float | None = None
    oracle: Callable[[str, str], bool] | None = None


METHODS: dict[str, Callable[[MethodArgs], object]] = {
    "target_only": lambda a: TargetOnly(),
    "semanticspec": lambda a: Speculative(a.policy),
    "draft_only": lambda a: DraftOnly(),
    "random_accept": lambda a: Speculative(RandomPolicy(a.accept_rate)),
    "always_reject": lambda a: Speculative(RandomPolicy(0.0)),
    "always_accept": lambda a: Speculative(RandomPolicy(1.0)),
    "oracle_accept": lambda a: Speculative(OraclePolicy(a.oracle)),
    "specreason": lambda a: Speculative(SpecReasonPolicy()),
    "hf_target_only": lambda a: TransformersLoop(assisted=False),
    "token_sd": lambda a: TransformersLoop(assisted=True),
}
"""``method=`` names of both decoders' ``generate``, each with the function that builds its runner from
:class:`MethodArgs` (raising ValueError naming a missing argument), in the benchmarks' order. ``always_reject`` and
``always_accept`` keep no draft step / every one (a random policy at rate 0 / 1): equivalence checks (greedy
``always_reject`` writes what ``target_only`` writes), which the decode benchmark leaves out. The served decoder runs
every name but transformers' loops and ``specreason`` (:class:`~semanticspec.served.ServedDecoder`)."""


def runner_for(method: str | AcceptancePolicy, args: MethodArgs):
    """The runner of ``method``: a name of :data:`METHODS`, or an acceptance policy (run speculatively).

    Raises:
        ValueError: an unknown name, or an argument the method needs is missing or bad.
    """
    if isinstance(method, AcceptancePolicy):
        return Speculative(method)
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {tuple(METHODS)}")
    return METHODS[method](args)
