"""The decoder's parts as pure functions on scripted numbers: acceptance rules, speculative sampling, handover."""

import math

import pytest
import torch
from scipy.stats import chisquare

from generation.writer import StepDraft
from generation.handover import Handover
from probes.decoding.policies import (OraclePolicy, RandomPolicy, Verified, judge_score, ratio_keeps,
                                      threshold_keeps)
from generation.sampling import sampling_probs
from probes.decoding.speculative import speculative_step

PT = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])  # target, 2 positions + after
PD = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.4, 0.1, 0.1]])  # draft, far from the target on purpose


def _run(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    first, second = [], []
    for _ in range(n):
        proposal = [int(torch.multinomial(PD[j], 1, generator=g)) for j in range(2)]
        kept, extra = speculative_step(PT, PD, proposal, g)
        out = proposal[:kept] + ([extra] if extra is not None else [])
        first.append(out[0])
        if len(out) > 1:
            second.append(out[1])
    return first, second


def _chi2(samples, probs):
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return chisquare(counts.numpy(), expected.numpy()).pvalue


def test_speculative_sampling_is_lossless_under_sampling():
    """The first token follows the target's distribution, and so does the second (given the first was kept)."""
    first, second = _run(12000)
    assert _chi2(first, PT[0]) > 1e-3
    assert len(second) > 2000 and _chi2(second, PT[1]) > 1e-3
    # the test can fail: the draft's own distribution is rejected with these sample sizes
    assert _chi2(first, PD[0]) < 1e-6


def test_speculative_step_stops_where_the_step_ends_and_checks_shapes():
    g = torch.Generator().manual_seed(0)
    sure = torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 3)
    assert speculative_step(sure, sure[:2], [1, 1], g) == (2, 1)  # all kept, the target adds one
    assert speculative_step(sure, sure[:2], [1, 1], g, ends_after=lambda j: j == 1) == (1, None)
    kept, extra = speculative_step(sure, torch.tensor([[1.0, 0, 0, 0]] * 2), [0, 0], g)
    assert (kept, extra) == (0, 1)  # the target never writes token 0: refused, the residual is the target's token
    with pytest.raises(ValueError, match="2 proposed tokens need 3 target and 2 draft"):
        speculative_step(sure[:2], sure[:2], [1, 1], g)


def test_sampling_probs_is_what_the_sampler_draws_from():
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0]])
    greedy = sampling_probs(logits, 0.0, 1.0)
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    nucleus = sampling_probs(logits, 1.0, 0.7)
    assert nucleus[0, 2:].sum() == 0 and math.isclose(float(nucleus.sum()), 1.0, rel_tol=1e-6)


def test_acceptance_rules_on_scripted_numbers():
    assert threshold_keeps(0.5, 0.5) and not threshold_keeps(0.49, 0.5)
    assert ratio_keeps(0.3, 0.6, u=0.49) and not ratio_keeps(0.3, 0.6, u=0.51)  # min(1, q/p) = 0.5
    assert ratio_keeps(0.3, 0.6, u=0.9, scale=2.0)  # scale 2: min(1, 1.0) keeps everything
    assert ratio_keeps(0.9, None, u=0.5)  # p skipped because q alone keeps
    logits = torch.full((20,), -10.0)
    digits = list(range(10, 20))
    logits[digits[8]] = 10.0  # the judge says 8
    assert judge_score(logits, digits) == pytest.approx(8.0, abs=1e-3)


def _verified(text="Add 2.\n\n"):
    return Verified(text, "", [1, 2], 0, torch.zeros(2, 4), None, None, StepDraft(0, [1, 2]))


def test_random_and_oracle_policies():
    coins = torch.Generator().manual_seed(0)
    rp = RandomPolicy(0.25, coins)
    kept = [d == "accept" for _ in range(400) for d in rp.decide({0: _verified()}, None).values()]
    assert 0.18 < sum(kept) / len(kept) < 0.32
    with pytest.raises(ValueError, match="accept_rate=1.5"):
        RandomPolicy(1.5, coins)
    op = OraclePolicy(lambda step, out: step.startswith("Add"))
    assert op.decide({0: _verified(), 1: _verified("Sub 2.\n\n")}, None) == {0: "accept", 1: "reject"}


def test_handover_shared_passes_tokens_and_two_tokenizers_pass_text(world_tokenizer):
    import copy

    shared = Handover(world_tokenizer)
    step = StepDraft(5, [7, 8, 9], n_forced=1)
    assert shared.shared and shared.to_target(step, "ignored") == [8, 9] and shared.forced_in_target(step) == 1
    other = copy.deepcopy(world_tokenizer)
    text = Handover(world_tokenizer, other)
    ids = world_tokenizer("Add 2.\n\n", add_special_tokens=False).input_ids
    assert not text.shared and text.forced_in_target(step) == 0
    assert text.to_target(step, "Add 2.\n\n") == ids and text.to_draft([1, 2], "Add 2.\n\n") == ids
