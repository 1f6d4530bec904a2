"""Feature groups: token statistics by hand, the feature spec's checks, and probes that read both groups."""

import dataclasses
import json
import math
import re

import pytest
import torch

from generation.specs import TOKEN_STATS, FeatureSpec, require_features
from generation.features import probe_input, rows_features
from probes.config import ProbeConfig
from probes.model import SemanticProbe, export_probe, load_probe


def _token_stats(logits, tokens, names=TOKEN_STATS):
    """The token statistics of one step: ``logits`` (k, V) predicting its ``tokens``."""
    return rows_features(FeatureSpec(["token_stats"], token_stats=list(names)), [tokens],
                         logits=[logits])["token_stats"]


def test_token_stats_match_a_hand_computation():
    # one step of 2 tokens, vocabulary of 6
    probs = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.1, 0.6, 0.1, 0.1, 0.05, 0.05]])
    got = dict(zip(TOKEN_STATS, _token_stats(probs.log(), [1, 1])[0].tolist()))
    entropy = [-(p * p.log()).sum().item() for p in probs]
    assert got["mean_logprob"] == pytest.approx((math.log(0.2) + math.log(0.6)) / 2, abs=1e-5)
    assert got["min_logprob"] == pytest.approx(math.log(0.2), abs=1e-5)
    assert got["mean_entropy"] == pytest.approx(sum(entropy) / 2, abs=1e-5)
    assert got["max_entropy"] == pytest.approx(max(entropy), abs=1e-5)
    assert got["not_top1_share"] == pytest.approx(0.5)  # token 1 is second at position 0, first at position 1
    assert got["not_top5_share"] == 0.0
    assert got["mean_log_rank"] == pytest.approx(math.log(2) / 2, abs=1e-6)


def test_token_stats_stay_finite_for_impossible_tokens_and_check_names():
    logits = torch.tensor([[0.0, float("-inf")], [0.0, 0.0]])
    out = _token_stats(logits, [1, 0], ["min_logprob", "mean_entropy"])
    assert torch.isfinite(out).all() and out[0, 0] == pytest.approx(-30.0)
    with pytest.raises(ValueError, match=r"this version cannot compute \['median_logprob'\]"):
        _token_stats(logits, [1, 0], ["median_logprob"])  # refused where the spec is built


def test_rows_features_and_probe_input_follow_the_spec():
    hidden = [torch.randn(2, 3, 4), torch.randn(2, 2, 4)]  # per row (L, k_i, D) at the spec's two layers
    logits, tokens = [torch.randn(3, 5), torch.randn(2, 5)], [[0, 4, 2], [1, 3]]
    spec = FeatureSpec(["hidden", "token_stats"], [-1, 1], "mean", ["mean_logprob", "min_logprob"])
    parts = rows_features(spec, tokens, hidden, logits)
    assert parts["hidden"].shape == (2, 2, 4) and parts["token_stats"].shape == (2, 2)
    torch.testing.assert_close(parts["hidden"][1, 0], hidden[1][0].mean(0))
    x = probe_input(parts, spec.groups)
    assert x.shape == (2, spec.width(4)) == (2, 10)
    torch.testing.assert_close(x[:, -2:], parts["token_stats"])
    with pytest.raises(ValueError, match="needs the logits"):
        rows_features(spec, tokens, hidden)
    only = rows_features(FeatureSpec(["token_stats"], token_stats=["mean_logprob"]), tokens, logits=logits)
    assert set(only) == {"token_stats"}


@pytest.mark.parametrize("kwargs, match", [
    ({"groups": ["pixels"]}, "unknown: \\['pixels'\\]"),
    ({"groups": ["token_stats", "hidden"]}, "in the order"),
    ({"groups": ["token_stats"], "token_stats": ["median"]}, "cannot compute \\['median'\\]"),
    ({"groups": ["token_stats"], "token_stats": []}, "non-empty subset"),
])
def test_feature_spec_names_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FeatureSpec(**kwargs)


def test_require_features_names_both_lists():
    require_features(["hidden"], [], ["hidden", "token_stats"], list(TOKEN_STATS), "probe", "decoder")
    with pytest.raises(ValueError, match=r"probe reads feature groups \['hidden', 'token_stats'\].*"
                                         r"data provides \['hidden'\].*missing \['token_stats'\]"):
        require_features(["hidden", "token_stats"], ["mean_logprob"], ["hidden"], [], "probe", "data")
    with pytest.raises(ValueError, match=r"missing \['token_stats.max_entropy'\]"):
        require_features(["token_stats"], ["max_entropy"], ["token_stats"], ["mean_logprob"], "probe", "data")


def hybrid_config(**kw):
    return ProbeConfig(hidden_size=8, hidden_dims=[16], **kw, features=FeatureSpec(
        ["hidden", "token_stats"], [-1, -2], token_stats=["mean_logprob", "min_logprob", "not_top1_share"]))


@pytest.mark.parametrize("combine", ["concat", "weighted_sum"])
def test_hybrid_probe_standardises_and_round_trips(tmp_path, combine):
    probe = SemanticProbe(hybrid_config(layer_combine=combine)).eval()
    assert probe.config.input_size == 2 * 8 + 3
    x = torch.randn(5, 19) * 10 + 3
    before = probe(x)
    probe.set_standardization(x.mean(0), x.std(0))
    after = probe(x)
    assert not torch.allclose(before, after)
    same = SemanticProbe(hybrid_config(layer_combine=combine)).eval()
    same.load_state_dict(probe.state_dict())
    torch.testing.assert_close(same(x), after)  # the buffers carry the scaling
    loaded = load_probe(export_probe(probe, tmp_path / "p"))
    torch.testing.assert_close(loaded(x), after)
    assert json.loads((tmp_path / "p" / "config.json").read_text())["features"]["groups"] == ["hidden", "token_stats"]
    with pytest.raises(ValueError, match="expects 19 features per row, a \\(batch, 19\\) input.*got 16 per row"):
        probe(torch.randn(2, 16))
    for one in (torch.randn(19), torch.tensor(1.0)):  # one row without its batch: it said "got 19", or an IndexError
        shape = re.escape(str(tuple(one.shape)))
        with pytest.raises(ValueError, match=r"a \(batch, 19\) input.*got shape " + shape):
            probe(one)


def test_a_version_1_export_loads_as_a_hidden_only_probe_without_scaling(tmp_path):
    """Exports from before feature groups have no standardisation tensors and no feature_groups key."""
    from safetensors.torch import save_file

    old = SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[4])).eval()
    d = tmp_path / "v1"
    d.mkdir()
    cfg = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(old.config))).items()
           if k not in ("features", "standardize")}
    cfg.update(format_version=1, layer_ids=[-1], pooling="mean")  # format 1: what the probe reads kept flat
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in old.state_dict().items() if not k.startswith("input_")}, str(d / "model.safetensors"))
    loaded = load_probe(d)
    assert loaded.config.features.groups == ("hidden",) and not loaded.config.standardize
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded(x), old(x))


def test_a_probe_reading_statistics_this_version_cannot_compute_is_refused(tmp_path):
    probe = SemanticProbe(hybrid_config())
    path = export_probe(probe, tmp_path / "p")
    cfg = json.loads((path / "config.json").read_text())
    cfg["features"]["token_stats"] = ["mean_logprob", "surprisal_of_the_future"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"token_stats \['mean_logprob', 'surprisal_of_the_future'\].*"
                                         r"expected a non-empty subset of \[.*'mean_logprob'.*cannot compute"):
        load_probe(path)


def _ragged_rows(lengths, V=11, L=2, D=4, seed=0):
    """Per-row tokens, (L, k, D) states and (k, V) logits of ragged steps; row 0's logits come in two parts."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    hidden = [torch.randn(L, n, D, generator=g) * 3 for n in lengths]
    logits = [torch.randn(n, V, generator=g) * 2 for n in lengths]
    logits[1][0, tokens[1][0]] = float("-inf")  # an impossible token stays finite
    return tokens, hidden, [[x[:1], x[1:]] if i == 0 else x for i, x in enumerate(logits)], logits


@pytest.mark.parametrize("chunk", [None, 11])  # one tensor for the batch, or a few tokens' logits at a time
def test_rows_features_equal_a_hand_computation_and_each_row_alone(monkeypatch, chunk):
    from generation import features
    from generation.specs import TOPK_STATS

    if chunk:
        monkeypatch.setattr(features, "_CHUNK_ELEMENTS", chunk)
    lengths = [3, 1, 5, 2]
    tokens, hidden, logits, whole = _ragged_rows(lengths)
    spec = FeatureSpec(["hidden", "token_stats", "topk_stats"], [0, 1], "mean", top_k=5)
    got = features.rows_features(spec, tokens, hidden, logits)
    for i, (x, t) in enumerate(zip(whole, tokens)):  # pooled states and token statistics by hand, row by row
        torch.testing.assert_close(got["hidden"][i], hidden[i].mean(1), atol=1e-6, rtol=0)
        logp = torch.log_softmax(x, -1)
        lp = logp[torch.arange(len(t)), t].clamp(min=-30.0)
        ent = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)
        rank = (x > x[torch.arange(len(t)), t][:, None]).sum(-1).float()
        by_hand = [lp.mean(), lp.min(), ent.mean(), ent.max(), (rank >= 1).float().mean(), (rank >= 5).float().mean(),
                   torch.log1p(rank).mean()]
        assert list(spec.token_stats) == list(TOKEN_STATS)
        torch.testing.assert_close(got["token_stats"][i], torch.stack(by_hand), atol=1e-5, rtol=0)
    for i, (x, t) in enumerate(zip(whole, tokens)):  # top-k statistics by hand, row by row
        lp, rank, outside, ent, mass = features.topk_scores(*features.topk_of_logits(x, torch.tensor(t), 5)).T
        by_hand = [lp.mean(), lp.min(), (rank >= 1).float().mean(), (rank >= 5).float().mean(), outside.mean(),
                   torch.log1p(rank).mean(), ent.mean(), ent.max(), mass.mean(), mass.min()]
        assert list(spec.topk_stats) == list(TOPK_STATS)
        torch.testing.assert_close(got["topk_stats"][i], torch.stack(by_hand), atol=1e-6, rtol=0)
        alone = features.rows_features(spec, [t], [hidden[i]], [logits[i]])
        for g in got:
            torch.testing.assert_close(got[g][i : i + 1], alone[g], atol=1e-6, rtol=0)
        assert torch.equal(got["hidden"][i : i + 1], alone["hidden"])  # a row's pooled state ignores the batch
    last = features.rows_features(FeatureSpec(["hidden"], [0, 1], "last"), tokens, hidden)["hidden"]
    assert torch.equal(last, torch.stack([h[:, -1] for h in hidden]))


def test_rows_features_refuse_logits_or_states_that_do_not_cover_the_step():
    from generation.features import rows_features

    tokens, hidden, logits, _ = _ragged_rows([3, 2])
    with pytest.raises(ValueError, match=r"row 1: 1 logits for a step of 2 tokens"):
        rows_features(FeatureSpec(["token_stats"]), tokens, logits=[logits[0], logits[1][:1]])
    with pytest.raises(ValueError, match=r"hidden states of \[3, 1\] positions for steps of \[3, 2\] tokens"):
        rows_features(FeatureSpec(["hidden"], [0]), tokens, [hidden[0][:1], hidden[1][:1, :1]])
    with pytest.raises(ValueError, match=r"step lengths \[3, 0\] must be >= 1"):
        rows_features(FeatureSpec(["token_stats"]), [tokens[0], []], logits=[logits[0], logits[1][:0]])


def test_features_made_first_in_inference_mode_still_work_under_autograd():
    # the statistics' plan is cached: made first by a decode (in inference mode), it stopped every later features
    # computation autograd records with "Inference tensors cannot be saved for backward"
    from generation.features import _plan

    _plan.cache_clear()
    spec = FeatureSpec(["token_stats"], token_stats=list(TOKEN_STATS))
    logits = torch.randn(3, 11)
    with torch.inference_mode():
        rows_features(spec, [[1, 2, 3]], logits=[logits])
    tracked = logits.clone().requires_grad_(True)  # as a model's output outside no_grad is
    torch.testing.assert_close(rows_features(spec, [[1, 2, 3]], logits=[tracked])["token_stats"].detach(),
                               rows_features(spec, [[1, 2, 3]], logits=[logits])["token_stats"])
