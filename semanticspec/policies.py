"""Acceptance policies: pure maps from a drafted step's :class:`~semanticspec.scores.Scores` to a decision.

The loop proposes a step per row, the verifier scores it (the target probe's ``q``, the fast-path
verdict, the judge's score, the acceptance coin) and the proposer adds the draft probe's ``p``
where the policy wants it; the policy then answers ``accept``, ``accept_fast`` or ``reject`` per
row. A policy calls no model and writes nothing into its input, so a test calls it on hand-made
scores. What it reads is declared in :class:`Needs`; the rules themselves are pure functions of
numbers and logits (:func:`threshold_keeps`, :func:`ratio_keeps`, :func:`fast_path_keeps_rows`,
:func:`judge_score`).

- :class:`ProbePolicy`: SemanticSpec, the target probe's ``q`` against a threshold, or the paper's
  ratio rule ``min(1, s * q / p)`` with the draft probe's ``p``; optional top-k fast path;
- :class:`RandomPolicy`: keep with a fixed probability (the control);
- :class:`OraclePolicy`: keep exactly what an oracle calls right (the ceiling);
- :class:`SpecReasonPolicy`: the target scores the step 0-9 after a judge turn (SpecReason-style).
"""

from __future__ import annotations

import json
import inspect
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from generation.features import token_scores
from generation.fingerprints import sha256_file
from generation.specs import is_finite, is_int, is_real
from semanticspec.results import Decision

if TYPE_CHECKING:
    from semanticspec.scores import Scores

RULES = ("ratio", "threshold")


def threshold_keeps(q: float, tau: float) -> bool:
    """The threshold rule: keep when the target probe's q reaches tau."""
    return q >= tau


def ratio_keeps(q: float, p: float | None, u: float, scale: float = 1.0) -> bool:
    """The paper's ratio rule with coin ``u``: keep when ``u < min(1, scale * q / p)``, i.e. ``u * p < scale * q``.

    ``p`` None means it was not computed because ``scale * q >= u`` keeps whatever ``p`` is.
    """
    return p is None or u * p < scale * q


def fast_path_keeps_rows(steps: Sequence[tuple[torch.Tensor, torch.Tensor | Sequence[int]]], top_k: int,
                         min_logprob: float) -> list[bool]:
    """The fast path's verdict on each step ``(logits, tokens)``: keep without the probe when every token is in the
    target's top-k and has log-prob >= ``min_logprob``; scored in one pass over all the steps' tokens.

    ``logits`` (k, V) are the target's logits predicting each drafted token, ``tokens`` (k,) the drafted tokens (a
    bonus token, which the target wrote, excluded). The verdicts are those of one call per step (a token's scores
    read its own logits only, as the token statistics score them); an empty step is never kept.
    """
    sizes = [len(tokens) for _, tokens in steps]
    if top_k < 1 or not any(sizes):
        return [False] * len(steps)
    scored = [(logits, tokens) for (logits, tokens), n in zip(steps, sizes) if n]
    ids = [int(t) for _, tokens in scored for t in tokens]
    logits = scored[0][0] if len(scored) == 1 else torch.cat([lg for lg, _ in scored])
    _, logp, rank = token_scores(logits, torch.tensor(ids))
    ok, out, at = ((rank < top_k) & (logp >= min_logprob)).tolist(), [], 0
    for n in sizes:
        out.append(n > 0 and all(ok[at : at + n]))
        at += n
    return out


def judge_score(logits: torch.Tensor, digit_ids: list[int]) -> float:
    """Expected 0-9 score from the logits of the ten digit tokens (SpecReason-style judge)."""
    probs = torch.softmax(logits.float()[digit_ids], dim=-1).cpu()
    return float((probs * torch.arange(10, dtype=torch.float32)).sum())


@dataclass(frozen=True)
class FastPath:
    """The gated top-k fast path: keep a step whose every drafted token is in the target's top-k and
    has at least ``min_logprob`` under it (:func:`fast_path_keeps_rows`)."""

    top_k: int
    min_logprob: float


@dataclass(frozen=True)
class Needs:
    """What a policy reads from the scores, so the verifier and the proposer compute only that.

    Attributes:
        q: the target probe's ``q`` (the target's logits, and hidden states if the probe reads them).
        p: the draft probe's ``p`` of the rows :meth:`AcceptancePolicy.wants_p` names.
        coin: one uniform coin per row the fast path did not keep, drawn in row order.
        judge: the judge's 0-9 score after the judge turn (SpecReason).
        fast_path: the fast path's verdict, when not None.
    """

    q: bool = False
    p: bool = False
    coin: bool = False
    judge: bool = False
    fast_path: FastPath | None = None


class AcceptancePolicy:
    """Maps each row's scores to a :class:`~semanticspec.results.Decision` (accept, accept_fast or reject); pure
    (no model call, no writes)."""

    needs = Needs()
    decides_with_probes = False
    """The probes decide: the decode must sample as the probes' labels were sampled."""

    def wants_p(self, scores: Scores) -> bool:
        """Whether this row's decision needs the draft probe's ``p`` (given its ``q`` and coin)."""
        return False

    def keep(self, scores: Scores) -> Decision:
        """The decision for one row."""
        raise NotImplementedError

    def decide(self, scores: Mapping[int, Scores]) -> dict[int, Decision]:
        """The decision for every scored row."""
        return {i: self.keep(s) for i, s in scores.items()}


@dataclass(frozen=True)
class ProbePolicy(AcceptancePolicy):
    """SemanticSpec: the probes decide (threshold or ratio rule), after the optional top-k fast path.

    Args:
        rule: ``threshold`` (default: accept when ``q >= tau``) or ``ratio`` (the paper's: accept
            with probability ``min(1, ratio_scale * q / p)``). On the embedded world the ratio rule
            keeps 2-5x more wrong draft steps than the threshold at the same acceptance (the draft
            probe's p is small on the draft's own rare wrong steps, so q/p stays large).
        tau: threshold of the threshold rule.
        ratio_scale: multiplies ``q / p`` in the ratio rule (>1 accepts more; a speed knob).
        top_k: fast path: keep a step without the probe when every draft token is in the target's
            top-k and passes ``fast_path_min_logprob``; 0 (default) disables it. The paper's plain
            top-2 test kept many of the wrong steps SemanticSpec accepted, so it is gated.
            Needs a shared tokenizer (the decoder refuses it otherwise).
        fast_path_min_logprob: fast path: every draft token's log-probability under the target must
            be at least this (default log 0.5: the target itself would write it more often than not).
        lazy_p: ratio rule: skip ``p`` when ``q`` alone accepts (same decisions from the same coin,
            less probe time); such steps then have ``p=None`` in the trace. The default computes
            ``p`` for every judged step, which diagnostics (acceptance against ``q/p``) need.

    Raises:
        ValueError: a bad rule or number, naming every bad value at once.
    """

    rule: str = "threshold"
    tau: float = 0.5
    ratio_scale: float = 1.0
    top_k: int = 0
    fast_path_min_logprob: float = math.log(0.5)
    lazy_p: bool = False
    decides_with_probes = True

    def __post_init__(self) -> None:
        errors = []
        if self.rule not in RULES:
            errors.append(f"rule={self.rule!r}: expected one of {RULES}")
        if not (is_real(self.tau) and 0 <= self.tau <= 1):
            errors.append(f"tau={self.tau!r}: expected a number with 0 <= tau <= 1")
        scale = self.ratio_scale
        if not (is_finite(scale) and scale > 0):
            errors.append(f"ratio_scale={self.ratio_scale!r}: expected a finite number > 0")
        if not (is_int(self.top_k) and self.top_k >= 0):
            errors.append(f"top_k={self.top_k!r}: expected an integer >= 0 (0 disables the fast path)")
        if not (is_real(self.fast_path_min_logprob) and self.fast_path_min_logprob <= 0):
            errors.append(f"fast_path_min_logprob={self.fast_path_min_logprob!r}: expected a log-probability <= 0")
        if not isinstance(self.lazy_p, bool):
            errors.append(f"lazy_p={self.lazy_p!r}: expected True or False")
        if errors:
            raise ValueError("invalid ProbePolicy: " + "; ".join(errors))

    @property
    def needs(self) -> Needs:
        ratio = self.rule == "ratio"
        fast = FastPath(self.top_k, float(self.fast_path_min_logprob)) if self.top_k else None
        return Needs(q=True, p=ratio, coin=ratio, fast_path=fast)

    def wants_p(self, scores: Scores) -> bool:
        if self.rule != "ratio" or scores.fast or scores.q is None:
            return False
        return not (self.lazy_p and self.ratio_scale * scores.q >= scores.coin)

    def keep(self, scores: Scores) -> Decision:
        if scores.fast:
            return Decision.ACCEPT_FAST
        if self.rule == "threshold":
            return Decision.ACCEPT if threshold_keeps(scores.q, self.tau) else Decision.REJECT
        return Decision.ACCEPT if ratio_keeps(scores.q, scores.p, scores.coin, self.ratio_scale) else Decision.REJECT


def default_policy(fast_path: bool = True, tau: float | None = None) -> ProbePolicy:
    """SemanticSpec's default policy: the threshold rule at ``tau`` (None: 0.5; the decoders pass the threshold
    ``python -m semanticspec.evaluate`` stored beside the probes, :func:`stored_tau`), after the
    gated top-1 fast path when the decoder can run it (``fast_path``; in-process it compares the draft's token ids
    with the target's top-k, so both models must share a tokenizer; a served target reads the step in its own
    tokens), without it otherwise.

    The fast path keeps a step whose every draft token is the target's top-1 at log-probability >= log 0.5
    without calling the probe. On the embedded world it decided 999 of 1,000 draft steps as the probe alone did
    (``benchmarks.probe_cost``), kept one right step more and no wrong one on the decode benchmark's 400 problems,
    and cut the probe's share of the wall time by about a third.
    """
    return ProbePolicy(tau=0.5 if tau is None else tau, top_k=1 if fast_path else 0)


THRESHOLD_FILE = "threshold.json"
"""The threshold ``python -m semanticspec.evaluate`` picked for a probe pair, in the export folder beside the pair's
``target/`` and ``draft/``."""
THRESHOLD_FORMAT = 1
"""Format version of :data:`THRESHOLD_FILE`: ``{"format_version", "tau", "rule", "target_probe_sha256", ...}``."""


def stored_tau(target_probe) -> float | None:
    """The threshold picked for ``target_probe`` (an exported probe directory), from :data:`THRESHOLD_FILE` in the
    folder above it; None when there is none, when ``target_probe`` is no directory, or when the file was written for
    other weights (then with a warning, naming the file).

    A decoder given no policy decides at this ``tau``; an explicit policy (or a request's threshold) wins.
    """
    if not isinstance(target_probe, (str, os.PathLike)):
        return None
    target_probe = Path(target_probe).expanduser().absolute()  # as load_probe reads it; "." has a folder above
    path = target_probe.parent / THRESHOLD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        tau, version = data["tau"], data["format_version"]
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(f"{path}: not a threshold file ({e}); deciding at the default tau", stacklevel=3)
        return None
    why = None
    if not (is_real(tau) and 0 <= tau <= 1):  # NaN fails the range
        why = f"tau={tau!r} is no threshold in [0, 1]"
    elif isinstance(version, bool) or not isinstance(version, int) or version > THRESHOLD_FORMAT:
        why = f"format_version={version!r}: this version reads {THRESHOLD_FORMAT} and older"
    elif data.get("target_probe_sha256") != sha256_file(target_probe / "model.safetensors"):
        why = "it was written for other probe weights"
    if why is not None:
        warnings.warn(f"{path}: {why}; deciding at the default tau", stacklevel=3)
        return None
    return float(tau)


def check_policy(policy) -> None:
    """Refuse a decoder's ``policy=`` that is not a :class:`ProbePolicy`, SemanticSpec's acceptance (every other
    method is named per call: ``generate(method=RandomPolicy(0.5))``)."""
    if policy is not None and not isinstance(policy, ProbePolicy):
        raise TypeError(f"policy={policy!r}: expected a ProbePolicy (SemanticSpec's acceptance) or None; name another "
                        "method per call, e.g. generate(prompts, method=RandomPolicy(0.5))")


@dataclass(frozen=True)
class RandomPolicy(AcceptancePolicy):
    """Keep each step with probability ``rate`` (its coin below the rate; one coin per step, in row order)."""

    rate: float
    needs = Needs(coin=True)

    def __post_init__(self) -> None:
        if not (is_real(self.rate) and 0 <= self.rate <= 1):
            raise ValueError(f"RandomPolicy(rate={self.rate!r}): expected a number in [0, 1]")

    def keep(self, scores: Scores) -> Decision:
        return Decision.ACCEPT if scores.coin < self.rate else Decision.REJECT


@dataclass(frozen=True)
class OraclePolicy(AcceptancePolicy):
    """Keep exactly the steps ``oracle(step_text, output_so_far)`` calls right."""

    oracle: Callable[[str, str], bool]

    def __post_init__(self) -> None:
        if not callable(self.oracle) or not _takes_two(self.oracle):  # a ValueError, as every bad generate() argument
            raise ValueError(
                f"OraclePolicy(oracle={self.oracle!r}): expected a callable oracle(step_text, output_so_far) -> bool")

    def keep(self, scores: Scores) -> Decision:
        kept = self.oracle(scores.text, scores.output)
        if not isinstance(kept, (bool, np.bool_)):  # "no" would keep the step, None refuse it
            raise TypeError(f"OraclePolicy: oracle({scores.text!r}, ...) returned {kept!r}; expected True or False")
        return Decision.ACCEPT if kept else Decision.REJECT


def _takes_two(fn) -> bool:
    """Whether ``fn`` can be called with two positional arguments (True when its signature cannot be read)."""
    try:
        inspect.signature(fn).bind("", "")
    except TypeError:
        return False
    except ValueError:  # a builtin without a signature
        return True
    return True


@dataclass(frozen=True)
class SpecReasonPolicy(AcceptancePolicy):
    """The target reads a judge turn after the step and scores it 0-9; keep at ``threshold`` or above."""

    threshold: float = 7.0
    needs = Needs(judge=True)

    def __post_init__(self) -> None:
        t = self.threshold
        if not (is_real(t) and 0 <= t <= 9):
            raise ValueError(f"SpecReasonPolicy(threshold={t!r}): expected a number in [0, 9] (the judge's score)")

    def keep(self, scores: Scores) -> Decision:
        return Decision.ACCEPT if scores.judge >= self.threshold else Decision.REJECT
