"""`Scores`: what the verifier (and the proposer, for ``p``) measured of one row's proposal; policies decide from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scores:
    """What the verifier (and the proposer, for ``p``) measured of one row's proposal.

    Attributes:
        text: the step's text.
        output: the row's output text before the step (what an oracle judges against).
        features: the target probe's input row (None when the probe did not run).
        fast: the fast path keeps the step (the probes then do not run).
        q: the target probe's semantic probability, when computed.
        p: the draft probe's, when computed.
        coin: the row's uniform acceptance coin (from the row's own stream), when the policy draws one.
        judge: the judge's expected 0-9 score (SpecReason), when computed.
    """

    text: str
    output: str
    features: torch.Tensor | None = None
    fast: bool = False
    q: float | None = None
    p: float | None = None
    coin: float | None = None
    judge: float | None = None
