"""Top-k statistics: one function from full logits in-process and from a server's top-k answer."""

import math

import numpy as np
import pytest
import torch

from generation.features import LOGPROB_FLOOR, rows_features, token_scores, topk_of_logits, topk_scores
from generation.specs import TOPK_STATS, FeatureSpec, check_groups, require_features


def server_answer(logits: torch.Tensor, tokens: list[int], k: int, extra: int = 0):
    """What a server returns for a step: each token's own log-prob and the k (+ extra) largest, in float64."""
    logp = torch.log_softmax(logits.double(), dim=-1).numpy()
    own = np.array([logp[t, tok] for t, tok in enumerate(tokens)])
    top = np.stack([np.sort(row)[::-1][: k + extra] for row in logp])
    return torch.from_numpy(own), torch.from_numpy(top.copy())


def test_statistics_from_full_logits_equal_those_from_a_servers_top_k_answer():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(n, 300, generator=g) * 3 for n in (5, 1, 9)]
    tokens = [torch.randint(0, 300, (len(x),), generator=g).tolist() for x in logits]
    tokens[0][0] = int(logits[0][0].argmax())  # a top-1 token, the others mostly far outside the top-k
    tokens[2][3] = int(logits[2][3].topk(7).indices[-1])  # rank 6: inside the top-20, outside the top-5
    spec = FeatureSpec(["topk_stats"], top_k=20)
    in_process = rows_features(spec, tokens, logits=logits)["topk_stats"]
    # a server may answer more entries than asked: the k largest are used
    served = rows_features(spec, tokens, topk=[server_answer(x, t, 20, extra=3) for x, t in zip(logits, tokens)])
    assert in_process.shape == (3, len(TOPK_STATS))
    torch.testing.assert_close(served["topk_stats"], in_process, atol=1e-5, rtol=1e-5)
    got = dict(zip(TOPK_STATS, in_process[2].tolist()))
    assert got["not_top5_share"] > got["not_topk_share"]  # the rank-6 token is outside the top-5, inside the top-k
    # the logits given as consecutive parts (as a cache's feeds hand them out) give the same numbers
    parts = rows_features(spec, tokens, logits=[[x[:2], x[2:]] if len(x) > 2 else x for x in logits])
    torch.testing.assert_close(parts["topk_stats"], in_process)


def test_top_k_statistics_match_a_hand_computation_on_a_tiny_distribution():
    p = [0.4, 0.2, 0.1, 0.1, 0.08, 0.06, 0.04, 0.02]  # top-5 = the first five: mass 0.88
    q = [0.5, 0.5, 0, 0, 0, 0, 0, 0]  # zero probabilities: -inf logits
    # row 0: token 1 (rank 1), token 6 (outside the top-5: rank k = 5); row 1: token 1 (rank 0 of a tie)
    logits = [torch.tensor([p, p]).log(), torch.tensor([q]).log()]
    got = rows_features(FeatureSpec(["topk_stats"], top_k=5), [[1, 6], [1]], logits=logits)["topk_stats"]
    row0, row1 = (dict(zip(TOPK_STATS, r)) for r in got.tolist())
    h = -sum(x * math.log(x) for x in p[:5])
    want0 = {"mean_logprob": (math.log(0.2) + math.log(0.04)) / 2, "min_logprob": math.log(0.04),
             "not_top1_share": 1.0, "not_top5_share": 0.5, "not_topk_share": 0.5,
             "mean_log_rank": (math.log1p(1) + math.log1p(5)) / 2, "mean_topk_entropy": h, "max_topk_entropy": h,
             "mean_topk_mass": 0.88, "min_topk_mass": 0.88}
    want1 = {"mean_logprob": math.log(0.5), "min_logprob": math.log(0.5), "not_top1_share": 0.0,
             "not_top5_share": 0.0, "not_topk_share": 0.0, "mean_log_rank": 0.0, "mean_topk_entropy": math.log(2),
             "max_topk_entropy": math.log(2), "mean_topk_mass": 1.0, "min_topk_mass": 1.0}
    assert row0 == pytest.approx(want0, abs=1e-5)
    assert row1 == pytest.approx(want1, abs=1e-5)


def test_a_token_outside_the_top_k_has_rank_k_and_an_impossible_token_stays_finite():
    top = torch.tensor([[-0.5, -1.5, -2.0, -2.5, -3.0]])
    scores = topk_scores(torch.tensor([-4.0]), top)  # below every top-k entry
    lp, rank, outside, entropy, mass = scores[0].tolist()
    assert (lp, rank, outside) == (-4.0, 5.0, 1.0)
    assert mass == pytest.approx(float(top.exp().sum())) and entropy > 0
    # -inf log-prob (a server's answer for a token the model rules out) is clamped; its rank is still k
    lp, rank, outside, _, _ = topk_scores(torch.tensor([float("-inf")]), top)[0].tolist()
    assert (lp, rank, outside) == (LOGPROB_FLOOR, 5.0, 1.0)
    # the order of the top-k entries does not matter
    torch.testing.assert_close(topk_scores(torch.tensor([-2.0]), top.flip(1)), topk_scores(torch.tensor([-2.0]), top))


def test_rank_within_k_equals_the_full_vocabulary_rank():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(400, 64, generator=g) * 2
    tokens = torch.randint(0, 64, (400,), generator=g)
    _, _, full_rank = token_scores(logits, tokens)
    rank = topk_scores(*topk_of_logits(logits, tokens, 10))[:, 1]
    within = full_rank < 10
    assert 0 < int(within.sum()) < 400  # both cases occur
    torch.testing.assert_close(rank[within], full_rank[within].float())
    assert bool((rank[~within] == 10).all())


def test_topk_of_logits_is_the_descending_top_k_of_the_log_softmax():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, 3.0, 0.5]])
    lp, top = topk_of_logits(logits, torch.tensor([2]), 5)
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, logp[:, 2])
    torch.testing.assert_close(top, logp[:, [4, 0, 2, 5, 1]])
    assert topk_of_logits(logits, torch.tensor([2]), 20)[1].shape == (1, 6)  # a vocabulary below k: all of it


@pytest.mark.parametrize("top_k", [4, 0, -5, True, 5.0, "20", None])
def test_top_k_below_five_or_not_an_integer_is_refused_naming_field_and_value(top_k):
    with pytest.raises(ValueError, match=rf"top_k={top_k!r}: expected an integer >= 5"):
        FeatureSpec(["topk_stats"], top_k=top_k)


def test_a_short_or_missing_server_answer_is_refused_with_counts():
    spec = FeatureSpec(["topk_stats"], top_k=20)
    logits = torch.randn(3, 50)
    short = server_answer(logits, [1, 2, 3], 19)
    with pytest.raises(ValueError, match=r"row 0: top-k answer of shape \(3, 19\) for 3 tokens.*>= 20"):
        rows_features(spec, [[1, 2, 3]], topk=[short])
    missing = server_answer(logits[:2], [1, 2], 20)
    with pytest.raises(ValueError, match=r"rows of \[2\] tokens, but the steps have \[3\] tokens"):
        rows_features(spec, [[1, 2, 3]], topk=[missing])
    with pytest.raises(ValueError, match="topk_stats feature group needs the logits"):
        rows_features(spec, [[1, 2, 3]])


def test_the_spec_counts_topk_stats_and_keeps_logits_in_process():
    spec = FeatureSpec(["hidden", "token_stats", "topk_stats"], [-1], "mean", ["mean_logprob"], 20,
                       ["min_logprob", "mean_topk_mass"])
    assert spec.width(8) == 8 + 1 + 2 and spec.needs_topk and spec.needs_logits
    only = FeatureSpec(["topk_stats"])
    assert only.needs_logits and only.needs_topk and only.width(8) == len(TOPK_STATS)
    assert not FeatureSpec(["hidden"]).needs_logits and not FeatureSpec(["hidden"]).needs_topk
    assert check_groups(["topk_stats"], None, ["mean_rank"]) == [
        f"topk_stats ['mean_rank']: expected a non-empty subset of {list(TOPK_STATS)} "
        "(this version cannot compute ['mean_rank'])"]
    with pytest.raises(ValueError, match=r"topk_stats \[\]: expected a non-empty subset"):
        FeatureSpec(["topk_stats"], topk_stats=[])
    with pytest.raises(ValueError, match=r"missing \['topk_stats.min_topk_mass'\]"):
        require_features(["topk_stats"], [], ["topk_stats"], [], "probe", "data", ["min_topk_mass"], ["min_logprob"])


@pytest.mark.parametrize("field, value", [("source", "ollama"), ("hidden_norm", "post_norm")])
def test_an_unknown_source_or_norm_convention_is_refused(field, value):
    with pytest.raises(ValueError, match=rf"{field}='{value}': expected one of"):
        FeatureSpec(**{field: value})


def test_check_source_refuses_hidden_states_from_another_source_or_norm_naming_both():
    hidden = FeatureSpec(["hidden", "topk_stats"])
    hidden.check_source("transformers", "final_norm", "decoder")
    with pytest.raises(ValueError, match=r"decoder: .*source='transformers' \(hidden_norm='final_norm'\).*"
                                         r"source='sglang' \(hidden_norm='final_norm'\)"):
        hidden.check_source("sglang", "final_norm", "decoder")
    with pytest.raises(ValueError, match=r"hidden_norm='pre_norm'"):
        hidden.check_source("transformers", "pre_norm", "decoder")
    served = FeatureSpec(["hidden"], source="sglang", hidden_norm="pre_norm")
    with pytest.raises(ValueError, match="source='sglang'.*source='transformers'"):
        served.check_source("transformers", "final_norm", "SemanticSpecDecoder")
    for source in ("transformers", "sglang", "vllm", "llama.cpp"):  # statistics do not depend on the source
        FeatureSpec(["token_stats", "topk_stats"], source="vllm").check_source(source, "pre_norm", "decoder")
