"""The verification pass: the target reads every row's drafted step in one forward against its KV cache.

What it returns is all a policy decides from (:class:`~probes.decoding.policies.Verified`): the
step's tokens in the target's tokenization, the target's logits predicting each of them and its
hidden states at them, cut from this one forward.
"""

from __future__ import annotations

import torch

from generation.cache import BatchedCache
from generation.writer import StepDraft
from generation.handover import Handover
from probes.decoding.hf import decode_text
from probes.decoding.policies import AcceptancePolicy, Verified


def verify(tgt: BatchedCache, handover: Handover, outputs: dict[int, str], drafts: dict[int, StepDraft],
           policy: AcceptancePolicy):
    """The target reads every row's drafted step (plus the policy's judge turn) in one forward.

    Args:
        tgt: the target's cache; the steps are appended to its rows and fed.
        handover: turns the draft's steps into target tokens.
        outputs: per row, its output text before the step (what an oracle judges against).
        drafts: per row, the draft's step.
        policy: says what the decision needs (logits, hidden states, a judge turn).

    Returns:
        ``{row: Verified}`` for the rows it read, and per row: how many new tokens the target
        got, its logits predicting the first of them, and its logits after the step.
    """
    suffix = list(policy.suffix)
    texts, t_start, n_new, pre_logits = {}, {}, {}, {}
    for i in drafts:
        d = drafts[i]
        texts[i] = decode_text(handover.draft_tokenizer, d.tokens)
        new = handover.to_target(d, texts[i])
        t_start[i] = len(tgt.seq[i]) - handover.forced_in_target(d)
        n_new[i], pre_logits[i] = len(new), tgt.last_logits[i]
        tgt.seq[i].extend(new + suffix)
    fed = tgt.feed(list(drafts), hidden=policy.needs_hidden, all_logits=True)
    verified, after = {}, {}
    for i in drafts:
        f = fed.get(i)
        if f is None:  # empty step (cannot happen with max_step_tokens >= 1): refused
            continue
        off = t_start[i] - f.start  # index of the step's first token among the fed tokens
        end = len(tgt.seq[i]) - len(suffix) - f.start  # one past the step's last token
        step_logits = None
        if policy.needs_logits:  # (k, V) the target's logits predicting every step token
            step_logits = (f.logits[off - 1 : end - 1] if off >= 1
                           else torch.cat([pre_logits[i][None], f.logits[: end - 1]]))
        first_new = off + handover.forced_in_target(drafts[i])  # fed index of the first new token
        pre_logits[i] = (f.logits[first_new - 1] if first_new >= 1 else pre_logits[i]) if n_new[i] else None
        after[i] = f.logits[end - 1]
        verified[i] = Verified(
            texts[i], outputs[i], tgt.seq[i][t_start[i] : f.start + end], handover.forced_in_target(drafts[i]),
            step_logits, f.hidden[:, off:end] if policy.needs_hidden else None,
            f.logits[-1] if suffix else None, drafts[i],
        )
    return verified, n_new, pre_logits, after
