"""End to end on the world's shipped pair: refused steps rewritten in the loop's rounds sample as the target.

Every draft step is refused (``random_accept`` at rate 0), so every step of the output is the target's, written by
the rewrites in the rounds: the point-mass redraw from the verification forward, then token-level speculation
riding the next rounds. Their texts must follow target-only's distribution (chi-square over the texts' openings).
"""

import collections

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from arithmetic_world import models, task
from semanticspec.decoder import SemanticSpecDecoder
from semanticspec.config import DecodeConfig
from semanticspec.policies import RandomPolicy

pytestmark = pytest.mark.slow

CALLS, COPIES = 60, 10  # 600 samples per method: each copy of the prompt samples from its own stream


def _openings(dec, prompt: str, **method) -> collections.Counter:
    counts = collections.Counter()
    for s in range(CALLS):
        for r in dec.generate([prompt] * COPIES, seed=1000 + s, max_new_tokens=24, temperature=0.6, top_p=0.95,
                              **method):
            counts[r.text[:40]] += 1  # the first steps
    return counts


def test_every_step_rewritten_in_the_rounds_samples_as_target_only():
    world = models.load_world(None)
    dec = SemanticSpecDecoder(world.target, world.draft, world.tokenizer,
                              config=DecodeConfig(answer_marker=task.ANSWER_MARKER))
    assert dec.loop_setup().token_sd and dec.loop_setup().rewrite_in_rounds
    prompt = task.generate_problems(1, 123, task.TaskConfig(min_ops=4, max_ops=4))[0].problem + task.STEP_DELIMITER
    ref = _openings(dec, prompt, method="target_only")
    rewritten = _openings(dec, prompt, method=RandomPolicy(0.0))
    keys = [k for k in set(ref) | set(rewritten) if ref[k] + rewritten[k] >= 5]
    assert len(keys) >= 4  # enough different openings for the test to see a difference
    table = np.array([[ref[k] for k in keys], [rewritten[k] for k in keys]])
    assert chi2_contingency(table)[1] > 1e-3, (ref.most_common(6), rewritten.most_common(6))
