"""Labels from groups (joint and per-model) and meaning groups from HDBSCAN plus a judge."""

import math
import random

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from arithmetic_world import task
from datamodules.labels.clustering import ClusteringConfig, group_prefixes
from datamodules.labels.judges import OracleJudge
from datamodules.labels.shares import DRAFT, TARGET, entropy, joint_labels, per_model_labels


def test_joint_labels_are_shares_of_each_model():
    rng = np.random.default_rng(0)
    groups = rng.integers(0, 4, size=20)
    writers = np.array([TARGET] * 10 + [DRAFT] * 10)
    lab = joint_labels(groups, writers)
    for i in range(20):
        same = groups == groups[i]
        assert lab["q"][i] == pytest.approx((same & (writers == TARGET)).sum() / 10)
        assert lab["p"][i] == pytest.approx((same & (writers == DRAFT)).sum() / 10)
    # every model's shares over its distinct groups add up to one
    for w, key in ((TARGET, "q"), (DRAFT, "p")):
        firsts = {g: i for i, g in reversed(list(enumerate(groups))) if writers[i] == w}
        assert sum(lab[key][i] for i in firsts.values()) == pytest.approx(1.0)
    assert lab["entropy"][0] == pytest.approx(entropy(groups[:10]))
    assert lab["entropy"][15] == pytest.approx(entropy(groups[10:]))


def test_entropy_of_uniform_groups_is_log_k():
    assert entropy(np.array([0, 1, 2, 3] * 3)) == pytest.approx(math.log(4))
    assert entropy(np.array([5, 5, 5])) == 0.0


def test_per_model_labels_leave_the_other_share_undefined():
    lab = per_model_labels(np.array([0, 0, 1]), np.array([0, 1, 1, 1]))
    assert lab["q"][:3].tolist() == pytest.approx([2 / 3, 2 / 3, 1 / 3]) and np.isnan(lab["q"][3:]).all()
    assert lab["p"][3:].tolist() == pytest.approx([0.25, 0.75, 0.75, 0.75]) and np.isnan(lab["p"][:3]).all()
    assert set(lab["groups"][:3]).isdisjoint(lab["groups"][3:])


def _prefix_samples(rng: random.Random, n: int = 12, embed: str = "meaning"):
    """Samples of one prefix: a few meanings (incl. wrong results) in random templates, and embeddings."""
    a, b = rng.randint(2, 40), rng.randint(1, 9)
    meanings = [task.Meaning("add", a, b, a + b), task.Meaning("add", a, b, a + b + 1),
                task.Meaning("sub", a, b, a - b)]
    picked = [rng.choice(meanings[: rng.randint(1, 3)]) for _ in range(n)]
    templates = [rng.randrange(task.N_TEMPLATES) for _ in range(n)]
    texts = [task.render_step(m, t) + "\n\n" for m, t in zip(picked, templates)]
    centers = {m: np.random.default_rng(hash(m) % 2**32).normal(size=16) for m in meanings}
    tcenters = {t: np.random.default_rng(100 + t).normal(size=16) for t in range(task.N_TEMPLATES)}
    noise = np.random.default_rng(rng.randrange(2**32)).normal(scale=0.05, size=(n, 16))
    # "meaning": embeddings cluster by meaning; "template": by wording (the case HDBSCAN gets wrong)
    emb = np.stack([(centers[m] if embed == "meaning" else tcenters[t]) for m, t in zip(picked, templates)]) + noise
    return texts, emb, [task.meaning(t) for t in texts]


@pytest.mark.parametrize("method", ["hdbscan+judge", "judge"])
@pytest.mark.parametrize("embed", ["meaning", "template"])
def test_judge_settles_what_hdbscan_gets_wrong(method, embed):
    rng = random.Random(1)
    batch = [_prefix_samples(rng, embed=embed) for _ in range(8)]
    asked = []
    groups = group_prefixes([(t, e) for t, e, _ in batch], OracleJudge(), ClusteringConfig(method=method), asked)
    for g, (_, _, truth) in zip(groups, batch):
        assert adjusted_rand_score([str(m) for m in truth], g) == 1.0
        assert g.dtype == np.int32 and g[0] == 0
    assert asked and all(isinstance(s, bool) for _, _, s in asked)


def test_hdbscan_alone_follows_the_embeddings():
    rng = random.Random(2)
    batch = [_prefix_samples(rng, embed="meaning") for _ in range(6)]
    groups = group_prefixes([(t, e) for t, e, _ in batch], None, ClusteringConfig(method="hdbscan"))
    good = np.mean([adjusted_rand_score([str(m) for m in truth], g) for g, (_, _, truth) in zip(groups, batch)])
    bad = [_prefix_samples(rng, embed="template") for _ in range(6)]
    groups = group_prefixes([(t, e) for t, e, _ in bad], None, ClusteringConfig(method="hdbscan"))
    worse = np.mean([adjusted_rand_score([str(m) for m in truth], g) for g, (_, _, truth) in zip(groups, bad)])
    # tiny sets: HDBSCAN alone is rough even on good embeddings
    assert good > 0.75 and worse < good - 0.2, (good, worse)
    with pytest.raises(ValueError, match="needs a judge"):
        group_prefixes([(t, e) for t, e, _ in bad], None, ClusteringConfig())


def test_identical_texts_are_one_group_without_asking():
    class Counting(OracleJudge):
        def _prob_same(self, pairs):
            raise AssertionError(f"asked {pairs}")

    texts = ["3 + 4 = 7.\n\n"] * 5
    (g,) = group_prefixes([(texts, np.random.default_rng(0).normal(size=(5, 8)))], Counting())
    assert g.tolist() == [0] * 5


def test_cluster_config_names_bad_values():
    assert ClusteringConfig(method="kmeans", votes=0).errors() == [
        "method='kmeans': expected one of ('hdbscan+judge', 'hdbscan', 'judge')", "votes=0: expected >= 1"]
    with pytest.raises(ValueError, match="method='kmeans'"):
        group_prefixes([(["a"], np.zeros((1, 2)))], None, ClusteringConfig(method="kmeans"))


def test_steps_whose_numbers_differ_never_share_a_group():
    """A judge that calls everything "the same" (as the world judge does for 1 in 3 wrong results)."""
    from datamodules.labels.clustering import numbers
    from datamodules.labels.judges import Judge

    class YesJudge(Judge):
        id = "yes"

        def _prob_same(self, pairs):
            return [1.0] * len(pairs)

    texts = ["84 - 4 = 80.\n\n", "Subtracting 4 from 84 gives 80.\n\n", "84 minus 4 equals 82.\n\n",
             "80 is what we get from 84 minus 4.\n\n"]
    emb = np.random.default_rng(0).normal(size=(4, 8))
    (g,) = group_prefixes([(texts, emb)], YesJudge(), ClusteringConfig(method="judge"))
    assert g[0] == g[1] == g[3] != g[2]
    (g,) = group_prefixes([(texts, emb)], YesJudge(), ClusteringConfig(method="judge", match_numbers=False))
    assert len(set(g.tolist())) == 1
    assert numbers("84 - 4 = 80.") == numbers("80 is what we get from 84 minus 4.") != numbers("84 - 4 = 82.")
    assert numbers("1,000 and 2.5") == numbers("2.5 then 1,000")
