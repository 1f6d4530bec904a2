"""``reading.backend: engine``: steps read through a model's server give the in-process features; its config checks.

The server here is :class:`generation.engines.local.LocalEngine` (an in-process model answering as a served
one does); the real llama-cpp-python servers are in tests/arithmetic_world/test_served_world.py (slow).
"""

import random

import pytest
import torch

from datamodules.labels.config import BuildConfig, EndpointConfig, ReadingConfig, SamplingConfig
from datamodules.labels.engine_reading import read_steps_served
from datamodules.labels.reading import read_steps
from generation.engines.local import LocalEngine
from generation.specs import FeatureSpec
from tests.conftest import tiny_llama


class Counting(LocalEngine):
    """Counts the reads, to see that identical steps of a prefix are read once."""

    reads = 0

    def read(self, *a, **kw):
        Counting.reads += 1
        return super().read(*a, **kw)


def _prefixes_and_steps(tok, n_prefixes=4, seed=0):
    rng = random.Random(seed)
    words = [w for w in tok.get_vocab() if w.startswith(" ") and w.strip().isalpha()]
    prefixes = [tok("Take 5." + "".join(rng.sample(words, 3))).input_ids for _ in range(n_prefixes)]
    steps = [[tok("".join(rng.sample(words, rng.randint(1, 6))) + "\n\n", add_special_tokens=False).input_ids
              for _ in range(3)] for _ in prefixes]
    steps[0].append(list(steps[0][0]))  # a repeated sample: read once, its features copied
    return prefixes, steps


def test_engine_read_topk_stats_equal_in_process_reading(world_tokenizer):
    model = tiny_llama(len(world_tokenizer), seed=3)
    prefixes, steps = _prefixes_and_steps(world_tokenizer)
    spec = FeatureSpec(["topk_stats"], [-1], "mean", [], 20)
    ref = read_steps(model, prefixes, steps, spec)
    Counting.reads = 0
    got = read_steps_served(Counting(model, world_tokenizer), world_tokenizer, prefixes, steps, spec, concurrency=2)
    assert got["topk_stats"].shape == ref["topk_stats"].shape == (sum(map(len, steps)), 10)
    assert torch.allclose(got["topk_stats"], ref["topk_stats"], atol=1e-5)
    assert Counting.reads == sum(map(len, steps)) - 1  # the repeated step was read once
    assert torch.equal(got["topk_stats"][0], got["topk_stats"][3])


def test_engine_read_hidden_is_the_last_layer_after_the_final_norm(world_tokenizer):
    model = tiny_llama(len(world_tokenizer), seed=4)
    prefixes, steps = _prefixes_and_steps(world_tokenizer, 2, seed=1)
    spec = FeatureSpec(["hidden", "topk_stats"], [-1], "mean", [], 20)
    ref = read_steps(model, prefixes, steps, spec)
    got = read_steps_served(LocalEngine(model, world_tokenizer), world_tokenizer, prefixes, steps, spec)
    assert torch.allclose(got["hidden"], ref["hidden"], atol=1e-5)


def test_engine_reading_refuses_bad_concurrency_and_empty_steps(world_tokenizer):
    model = tiny_llama(len(world_tokenizer))
    eng = LocalEngine(model, world_tokenizer)
    spec = FeatureSpec(["topk_stats"], [-1], "mean", [], 20)
    with pytest.raises(ValueError, match="concurrency=0"):
        read_steps_served(eng, world_tokenizer, [[2, 5]], [[[6]]], spec, concurrency=0)
    with pytest.raises(ValueError, match="empty steps"):
        read_steps_served(eng, world_tokenizer, [[2, 5]], [[[]]], spec)


SERVERS = SamplingConfig(backend="openai")
SERVERS.openai.target = EndpointConfig(["http://127.0.0.1:8851/v1"])
SERVERS.openai.draft = EndpointConfig(["http://127.0.0.1:8852/v1"])


def test_an_engine_build_reads_topk_stats_from_its_engine():
    from datamodules.labels.clustering import ClusteringConfig

    cfg = BuildConfig(sampling=SERVERS, reading=ReadingConfig(backend="engine"), clustering=ClusteringConfig("judge"))
    spec = cfg.feature_spec()
    assert spec.groups == ("topk_stats",) and spec.source == "llama.cpp" and spec.top_k == cfg.top_k
    assert cfg.reading.endpoint("target", cfg.sampling).urls == ["http://127.0.0.1:8851/v1"]


@pytest.mark.parametrize("kw, match", [
    ({"reading": ReadingConfig(backend="engine")}, r"reading.target.urls=\[\].*reading.draft.urls=\[\]"),
    ({"sampling": SERVERS, "reading": ReadingConfig(backend="engine")}, "clustering.method='hdbscan\\+judge'"),
    ({"sampling": SERVERS, "reading": ReadingConfig(backend="engine", hidden=True, engine="vllm")},
     "reading.hidden=True with engine='vllm'"),
    ({"reading": ReadingConfig(backend="sglang")}, "reading.backend='sglang'"),
])
def test_engine_reading_config_is_refused_naming_the_field(kw, match):
    from datamodules.labels.clustering import ClusteringConfig

    kw = {"clustering": ClusteringConfig(), **kw}
    with pytest.raises(ValueError, match=match):
        BuildConfig(**kw)
