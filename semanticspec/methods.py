"""The decoding methods: one table that maps ``method=`` names to what a round of the step loop does.

A :class:`Method` names its round function (one of the loop's: the target writes a step, the draft writes
one, or the draft proposes and an acceptance policy decides), the parts whose room bounds a step, and its
policy and window. :class:`~semanticspec.hf.TransformersLoop` is the one method that is not a round of the
loop: the in-process decoder runs transformers' own loop for it. :data:`METHODS` is the only place a method's
name is read; the benchmarks import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from semanticspec.hf import TransformersLoop
from semanticspec.loop import StepLoop
from semanticspec.parts import Window
from semanticspec.policies import AcceptancePolicy, ProbePolicy, RandomPolicy, SpecReasonPolicy


@dataclass(frozen=True)
class Method:
    """A method on the step loop.

    Attributes:
        round: the loop's round function, what one round does for the active rows, ``round(loop, rows, method)``
            (:meth:`~semanticspec.loop.StepLoop.target_round`, :meth:`~semanticspec.loop.StepLoop.draft_round`,
            :meth:`~semanticspec.loop.StepLoop.speculative_round`).
        uses: the parts whose context room bounds a step (``"target"``, ``"draft"``).
        policy: the acceptance policy of a speculative method, else None.
        window: drafted steps judged per target pass (speculative methods).
    """

    round: Callable[[StepLoop, list[int], Method], None]
    uses: tuple[str, ...] = ("target", "draft")
    policy: AcceptancePolicy | None = None
    window: Window = Window()

    @property
    def probes_decide(self) -> bool:
        """The probes decide, so the decode samples as their labels were sampled."""
        return self.policy is not None and self.policy.decides_with_probes


def speculative(policy: AcceptancePolicy) -> Method:
    """The speculative method deciding with ``policy``."""
    return Method(StepLoop.speculative_round, policy=policy)


METHODS: dict[str, Callable[[ProbePolicy], Method | TransformersLoop]] = {
    "target_only": lambda policy: Method(StepLoop.target_round, ("target",)),
    "semanticspec": speculative,
    "draft_only": lambda policy: Method(StepLoop.draft_round, ("draft",)),
    "always_reject": lambda policy: speculative(RandomPolicy(0.0)),
    "always_accept": lambda policy: speculative(RandomPolicy(1.0)),
    "specreason": lambda policy: speculative(SpecReasonPolicy()),
    "hf_target_only": lambda policy: TransformersLoop(assisted=False),
    "token_sd": lambda policy: TransformersLoop(assisted=True),
}
"""``method=`` names of both decoders' ``generate``, each with the function that builds its :class:`Method` from the
decoder's SemanticSpec policy, in the benchmarks' order. A method with arguments is named by its policy instead
(``method=RandomPolicy(0.5)``, ``method=OraclePolicy(oracle)``). ``always_reject`` and ``always_accept`` keep no
draft step / every one (a random policy at rate 0 / 1): equivalence checks (greedy ``always_reject`` writes what
``target_only`` writes), which the decode benchmark leaves out. The served decoder runs every name but
transformers' loops and ``specreason`` (:class:`~semanticspec.served.ServedDecoder`)."""


def method_for(method: str | AcceptancePolicy, policy: ProbePolicy) -> Method | TransformersLoop:
    """The method ``method`` names: a name of :data:`METHODS` (``policy``: the decoder's SemanticSpec policy), or an
    acceptance policy (run speculatively).

    Raises:
        ValueError: an unknown name (:func:`unknown_method`, which a :class:`~semanticspec.config.DecodeConfig` naming
            it already refused where it was built).
    """
    if isinstance(method, AcceptancePolicy):
        return speculative(method)
    if (why := unknown_method(method)) is not None:
        raise ValueError(f"method={method!r}: {why}")
    return METHODS[method](policy)


def unknown_method(name: str) -> str | None:
    """What is expected instead of ``name`` when it names no method of :data:`METHODS` (None: it names one)."""
    if name in METHODS:
        return None
    return (f"expected one of {tuple(METHODS)} or an AcceptancePolicy (RandomPolicy(rate), OraclePolicy(oracle), "
            "ProbePolicy(...))")
