"""Step samplers (datamodules.labels.samplers): the openai sampler (the engine clients' writes) against local servers,
builds."""

import json
import time

import pytest
import torch

from datamodules.labels.build import build
from datamodules.labels.config import BuildConfig, EndpointConfig, JudgeConfig, OpenAIConfig, SamplingConfig
from datamodules.labels.openai_sampler import OpenAISampler
from generation.engines.base import Unreachable, Unsupported
from generation.specs import SamplingSpec, StepSpec
from generation.steps import DEFAULT_DELIMITERS
from tests.fake_openai import FakeServer, InFlight


@pytest.fixture(scope="module")
def world_models():
    from transformers import AutoModelForCausalLM

    from arithmetic_world.models import world_root

    return {r: AutoModelForCausalLM.from_pretrained(world_root() / r, local_files_only=True).eval()
            for r in ("target", "draft")}


@pytest.fixture()
def serve(world_models, world_tokenizer):
    servers = []

    def start(role="draft", **kw):
        kw.setdefault("name", f"world-{role}")
        servers.append(FakeServer(world_models[role], world_tokenizer, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _sampler(server_or_url, tok, **kw):
    url = server_or_url if isinstance(server_or_url, str) else server_or_url.url
    kw = {"api_key_env": "", "retries": 1, "timeout": 10.0, **kw}
    return OpenAISampler([url], kw.pop("model", None), tok, StepSpec(DEFAULT_DELIMITERS, 8),
                         SamplingSpec(kw.pop("temperature", 0.8), 0.95), **kw)


def _contexts(tok, n=3):
    from arithmetic_world.task import ArithmeticTask

    task = ArithmeticTask()
    return [task.prompt(tok, r["problem"]) for r in task.problems(n, 1)]


# ---------------------------------------------------------------------------------------------
# The openai sampler against local servers backed by the world's draft (llama-cpp-python-like, or vLLM-like with a
# version), and against the toy SGLang.


def test_llama_cpp_gets_one_request_per_sample_with_distinct_seeds(serve, world_tokenizer):
    server = serve()  # llama-cpp-python ignores n
    s = _sampler(server, world_tokenizer)
    assert s.engine == "llama.cpp"
    ctx = _contexts(world_tokenizer)
    out = s.sample(ctx, 4, seed=11)
    assert [len(o) for o in out] == [4, 4, 4] and all(isinstance(x, list) and x for o in out for x in o)
    from datamodules.labels.samplers import request_seed

    seeds = [(b["prompt"], b["seed"]) for _, b in server.requests]
    assert len(set(seeds)) == len(seeds) == 3 * 4  # every sample its own request and seed
    assert sorted(b["seed"] for _, b in server.requests) == sorted(request_seed(11, i, j) for i in range(3)
                                                                    for j in range(4))
    assert all(b.get("n") is None for _, b in server.requests)
    assert len({tuple(x) for o in out for x in o}) > 3  # the samples differ
    assert s.sample(ctx, 4, seed=11) == out  # the seeds make it reproducible
    assert s.stats()["samples"] == 24 and sum(s.stats()["step_ends"].values()) == 24


def test_vllm_gets_one_request_per_prefix(serve, world_tokenizer):
    server = serve(version="0.11.1")
    s = _sampler(server, world_tokenizer)
    out = s.sample(_contexts(world_tokenizer), 4, seed=0)
    assert len(server.requests) == 3 and [len(o) for o in out] == [4, 4, 4]
    body = server.requests[0][1]
    assert body["n"] == 4 and body["stop"] == list(DEFAULT_DELIMITERS) and body["max_tokens"] == 8
    assert body["temperature"] == 0.8 and body["top_p"] == 0.95 and body["include_stop_str_in_output"] is True
    assert set(s.step_ends) <= {"delimiter", "eos", "length"}


@pytest.mark.parametrize("version", [None, "0.11.1"], ids=["llama.cpp", "vllm"])
def test_greedy_server_steps_equal_the_hf_sampler(serve, world_models, world_tokenizer, version):
    """Whichever way the server marks a step's end, the step is the one the package's own sampler writes."""
    from datamodules.labels.samplers import HFSampler

    tok, ctx = world_tokenizer, _contexts(world_tokenizer, 6)
    ctx += [c + tok("19 plus 5 equals 24.\n\n24 + 8 = 32.\n\n32 - 8 = 24.\n\n", add_special_tokens=False).input_ids
            for c in ctx[:2]]  # prefixes whose next step is the last (it ends at EOS)
    hf = HFSampler(world_models["draft"], tok, StepSpec(DEFAULT_DELIMITERS, 16),
                   SamplingSpec(0.0, 1.0)).sample(ctx, 2, seed=0)
    s = OpenAISampler([serve(version=version).url], None, tok, StepSpec(DEFAULT_DELIMITERS, 16),
                      SamplingSpec(0.0, 1.0), api_key_env="", retries=1)
    assert s.sample(ctx, 2, seed=0) == hf
    assert "eos" in s.step_ends and "delimiter" in s.step_ends


def test_requests_stay_bounded_and_spread_over_endpoints(serve, world_tokenizer):
    both = InFlight()  # one gauge over both servers: the bound is on the sampler's requests in flight, wherever sent
    a, b = (serve(version="0.11.1", delay=0.05, in_flight=both) for _ in range(2))
    s = OpenAISampler([a.url, b.url], "world-draft", world_tokenizer, StepSpec(DEFAULT_DELIMITERS, 4),
                      SamplingSpec(0.8, 0.95), api_key_env="", concurrency=2, rank=1)
    s.sample(_contexts(world_tokenizer, 8), 2, seed=0)
    assert len(a.requests) == len(b.requests) == 4 and both.peak <= 2
    for rank, first in ((0, a), (1, b), (2, a)):  # ranks of a distributed build start at different endpoints
        r = OpenAISampler([a.url, b.url], "world-draft", world_tokenizer, StepSpec(DEFAULT_DELIMITERS, 4),
                          SamplingSpec(0.8, 0.95), api_key_env="", rank=rank)
        before = len(first.requests)
        r.sample(_contexts(world_tokenizer, 1), 1, seed=0)
        assert len(first.requests) == before + 1


def test_api_key_is_sent_but_never_shown(serve, world_tokenizer, monkeypatch):
    monkeypatch.setenv("SAMPLER_KEY", "sk-secret-123")
    server = serve(version="0.11.1")
    s = _sampler(server, world_tokenizer, api_key_env="SAMPLER_KEY")
    s.sample(_contexts(world_tokenizer, 1), 1, seed=0)
    assert server.requests[0][0]["authorization"] == "Bearer sk-secret-123"
    server.status = 401  # the server refuses and echoes the header back
    with pytest.raises(Unreachable) as e:
        s.sample(_contexts(world_tokenizer, 1), 1, seed=0)
    assert server.url.removesuffix("/v1") in str(e.value) and "401" in str(e.value)
    assert "set $SAMPLER_KEY to a key it accepts" in str(e.value)
    assert "sk-secret-123" not in str(e.value) and "sk-secret-123" not in json.dumps(s.provenance())


def test_failures_are_retried_a_bounded_number_of_times(serve, world_tokenizer):
    server = serve(version="0.11.1", fail_first=2)
    out = _sampler(server, world_tokenizer, retries=3).sample(_contexts(world_tokenizer, 1), 2, seed=0)
    assert len(server.requests) == 3 and len(out[0]) == 2
    server = serve(version="0.11.1", fail_first=5)
    with pytest.raises(Unreachable, match=r"failed /v1/completions after 2 attempt\(s\).*503"):
        _sampler(server, world_tokenizer, retries=2).sample(_contexts(world_tokenizer, 1), 2, seed=0)
    assert len(server.requests) == 2


def test_a_slow_server_times_out(serve, world_tokenizer):
    server = serve(delay=2.0)
    t = time.perf_counter()
    with pytest.raises(Unreachable, match="Timeout"):
        _sampler(server, world_tokenizer, timeout=0.3).sample(_contexts(world_tokenizer, 1), 1, seed=0)
    assert time.perf_counter() - t < 2.0


def test_model_and_server_are_checked_before_any_sampling(serve, world_tokenizer):
    server = serve(version="0.11.1")
    s = _sampler(server, world_tokenizer)
    assert s.model == "world-draft"
    assert s.provenance() == {"backend": "openai", "model": "world-draft", "urls": [server.url], "engine": "vllm",
                              "server_version": "0.11.1", "delimiters": list(DEFAULT_DELIMITERS)}
    with pytest.raises(Unsupported, match=r"does not serve model 'other'; it serves \['world-draft'\]"):
        _sampler(server, world_tokenizer, model="other")
    with pytest.raises(Unreachable, match="127.0.0.1:9/v1 did not answer /v1/models"):
        _sampler("http://127.0.0.1:9/v1", world_tokenizer)
    with pytest.raises(Unsupported, match=r"reports version 0.10.0; this client needs vLLM >= 0.11.1"):
        _sampler(serve(version="0.10.0"), world_tokenizer)
    assert not [b for x in server.requests for b in x]  # nothing was sampled


def _as_list(x):
    return x if isinstance(x, list) else [x]


def _sglang(**kw):
    from tests.fake_engines import FakeSGLang

    return FakeSGLang(**kw)


@pytest.mark.parametrize("kind", ["llama.cpp", "vllm", "sglang"])
def test_every_request_states_the_whole_distribution(serve, world_tokenizer, kind):
    """Servers fill unset sampling fields from their own defaults (llama-cpp-python), the model's generation config
    (vLLM; both penalties from 0.31) or --preferred-sampling-params (SGLang): each step and each continuation request
    sends temperature, top_p and the engine's neutral top_k, min_p, repetition penalty and both penalties."""
    from generation.engines import NEUTRAL_SAMPLING

    server = _sglang() if kind == "sglang" else serve(version={"vllm": "0.34.0"}.get(kind))
    try:
        s = _sampler(server.root if kind == "sglang" else server, world_tokenizer)
        assert s.engine == kind
        s.sample(_contexts(world_tokenizer, 1), 2, seed=0)
        s.complete(_contexts(world_tokenizer, 1), 4, seed=0)
        if kind == "sglang":  # a batch of n carries n sampling_params
            bodies = [p for b in server.posts("/generate") for p in _as_list(b["sampling_params"])]
        else:
            bodies = [b for _, b in server.requests]
        assert len(bodies) >= 2
        for body in bodies:
            assert body["temperature"] == 0.8 and body["top_p"] == 0.95
            fields = NEUTRAL_SAMPLING[kind]
            assert {f: body.get(f) for f in fields} == fields and body["presence_penalty"] == 0.0
    finally:
        if kind == "sglang":
            server.close()


def test_sglang_samples_of_one_prefix_are_seeded_apart_and_an_abort_is_asked_again(world_tokenizer):
    """One sampling_seed copied to n samples gives n identical ones under --enable-deterministic-inference: the n
    samples of a prefix go in one /generate batch, sample j seeded seed + j, as vLLM seeds a request's children. An
    abort SGLang answers with HTTP 200 is asked again instead of ending the build."""
    server = _sglang(abort=1)
    try:
        s = OpenAISampler([server.root], None, world_tokenizer, StepSpec(("\n\n",), 8), SamplingSpec(1.0, 1.0),
                          api_key_env="", retries=2)
        out = s.sample(_contexts(world_tokenizer, 1), 6, seed=3)
        first, again = server.posts("/generate")  # the aborted batch, asked again
        seeds = [p["sampling_params"] for p in [again]][0]
        assert first == again and [p["sampling_seed"] for p in seeds] == [seeds[0]["sampling_seed"] + j
                                                                           for j in range(6)]
        assert len(out[0]) == 6 and len({tuple(x) for x in out[0]}) > 1  # the samples differ
    finally:
        server.close()


def test_a_bos_the_tokenizer_does_not_add_stays_in_a_text_prompt(serve, world_tokenizer):
    """SmolLM2's BOS id is <|im_start|>, which its chat template writes and its tokenizer never adds: it must stay."""

    class NoBos:  # the world tokenizer, but adding no BOS (as SmolLM2's and its GGUF's)
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def __call__(self, text, **kw):
            return self._tok(text, **{**kw, "add_special_tokens": False})

    server = serve(version="0.11.1")
    ctx = _contexts(world_tokenizer, 1)
    _sampler(server, NoBos(world_tokenizer)).sample(ctx, 1, seed=0)
    assert server.requests[0][1]["prompt"] == world_tokenizer.decode(ctx[0])
    assert ctx[0][0] == world_tokenizer.bos_token_id
    _sampler(server, world_tokenizer).sample(ctx, 1, seed=0)
    assert server.requests[1][1]["prompt"] == world_tokenizer.decode(ctx[0][1:])  # the server adds its own BOS


# ---------------------------------------------------------------------------------------------
# The build config and a whole build.


def test_build_config_checks_the_backend():
    with pytest.raises(ValueError) as e:
        BuildConfig(sampling=SamplingConfig(backend="sglang"))
    assert "sampling.backend='sglang': expected one of ('hf', 'openai', 'vllm')" in str(e.value)
    with pytest.raises(ValueError) as e:
        BuildConfig(sampling=SamplingConfig(backend="openai", openai=OpenAIConfig(
            target=EndpointConfig(urls=["127.0.0.1:8000"]), concurrency=0)))
    msg = str(e.value)
    with pytest.raises(ValueError, match=r"sampling.openai.engine='tgi': expected one of"):
        BuildConfig(sampling=SamplingConfig(backend="openai", openai=OpenAIConfig(engine="tgi")))
    assert "sampling.openai.concurrency=0: expected >= 1" in msg
    assert "sampling.openai.target.urls: '127.0.0.1:8000' is not an http(s) URL" in msg
    assert "sampling.openai.draft.urls=[]: give the base URL" in msg
    BuildConfig(sampling=SamplingConfig(openai=OpenAIConfig(concurrency=0)))  # read only with backend: openai


def _world_config(urls=None, **sampling) -> BuildConfig:
    s = {"n_samples": 3, "temperature": 0.0, "seed": 3, **sampling}
    if urls:
        s["backend"] = "openai"
        s["openai"] = OpenAIConfig(target=EndpointConfig(urls=[urls["target"]]),
                                   draft=EndpointConfig(urls=[urls["draft"]]), api_key_env="")
    return BuildConfig(n_problems=3, shard_size=8, judge=JudgeConfig(kind="none"), sampling=SamplingConfig(**s),
                       steps=StepSpec(max_step_tokens=16))


@pytest.mark.slow  # over 8 s on 2 cores: in CI's slow set, out of the README's 5-minute command
def test_greedy_openai_build_equals_the_hf_build(serve, tmp_path):
    """Served by llama.cpp-like servers of the world's models, a greedy build writes the hf build's shards."""
    from safetensors.torch import load_file

    hf = build(_world_config(), tmp_path / "hf", log=lambda *a: None)
    urls = {r: serve(r).url for r in ("target", "draft")}
    served = build(_world_config(urls), tmp_path / "openai", log=lambda *a: None)
    assert served["build"]["sampler"] == "openai" and hf["build"]["sampler"] == "hf"
    assert served["sampler"]["draft"]["model"] == "world-draft"
    assert served["sampler"]["target"]["urls"] == [urls["target"]]
    assert hf["sampler"]["target"]["backend"] == "hf"
    ends = served["stats"]["this_run"]["sampler"]["draft"]["step_ends"]
    assert ends.get("delimiter", 0) > 0 and set(ends) <= {"delimiter", "eos", "length"}
    for a, b in zip(sorted((tmp_path / "hf").glob("shard-*.safetensors")),
                    sorted((tmp_path / "openai").glob("shard-*"))):
        x, y = load_file(a), load_file(b)
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], msg=k)
    # a folder built by one backend is not resumed by another
    with pytest.raises(ValueError, match="sampler: data has 'hf', config asks 'openai'"):
        build(_world_config(urls), tmp_path / "hf", log=lambda *a: None)
    # data built before the backends existed (no "sampler" recorded) still matches an hf config
    for name in ("manifest.json", "build.json"):
        record = json.loads((tmp_path / "hf" / name).read_text())
        del record["build"]["sampler"]
        (tmp_path / "hf" / name).write_text(json.dumps(record))
    assert build(_world_config(), tmp_path / "hf", log=lambda *a: None)["complete"]  # reused, not refused


@pytest.mark.parametrize("name", ["qwq-32b.yaml", "r1-distill-qwen-32b.yaml"])
def test_paper_configs_sample_on_servers(name, serve, world_tokenizer, monkeypatch, tmp_path):
    """The paper-scale configs instantiate (model loading replaced) and their samplers reach servers named as
    configured."""
    from pathlib import Path

    from datamodules.datamodule import SemanticProbeDataModule
    from datamodules.labels.shard import make_sampler
    from probes.fit_cli import PROG, ProbeArgumentParser, ProbeCLI
    from probes.module import SemanticProbeModule

    widths = {"target": 5120, "draft": 1536}

    def fingerprint(path, option):  # no 32B folder here: what config.json would say
        role = "target" if "32B" in path else "draft"
        return {"name_or_path": path, "architecture": "Qwen2ForCausalLM", "hidden_size": widths[role],
                "num_layers": 64 if role == "target" else 28, "vocab_size": 152064, "tokenizer_hash": "q"}

    monkeypatch.setattr("datamodules.labels.config.folder_fingerprint", fingerprint)
    config = Path(__file__).resolve().parents[2] / "configs" / name
    cli = ProbeCLI(SemanticProbeModule, SemanticProbeDataModule, run=False, auto_configure_optimizers=False,
                   args=["--config", str(config), "--trainer.logger", "false", "--data.data_dir", str(tmp_path),
                         "--trainer.default_root_dir", str(tmp_path)],
                   parser_class=ProbeArgumentParser, parser_kwargs={"prog": PROG})
    b = cli.datamodule.build
    assert b.sampling.backend == "openai" and b.sampling.n_samples == 20 and b.sampling.openai.engine == "vllm"
    assert b.judge.kind == "http" and b.judge.url == b.sampling.openai.target.urls[0]
    assert cli.model.probes["target"].config.hidden_size == 5120
    assert cli.model.probes["draft"].config.hidden_size == 1536
    for role in ("target", "draft"):
        e = getattr(b.sampling.openai, role)
        assert e.urls[0].startswith("http://127.0.0.1:800") and e.model
        server = serve(role, name=e.model, version="0.11.1")
        e.urls = [server.url]
        s = make_sampler(b, role, None, world_tokenizer)
        out = s.sample(_contexts(world_tokenizer, 1), 2, seed=0)
        assert len(out[0]) == 2 and s.model == e.model
        body = server.requests[0][1]
        assert body["n"] == 2 and body["max_tokens"] == b.steps.max_step_tokens
        assert body["temperature"] == 0.6 and body["top_p"] == 0.95 and body["stop"] == list(b.steps.delimiters)


def test_vllm_sampler_maps_the_build_onto_sampling_params(world_tokenizer, monkeypatch):
    """The vllm backend's plumbing, with a stand-in for vLLM's engine (the real one is tested under `gpu`)."""
    import sys
    import types

    from datamodules.labels.samplers import VLLMSampler

    calls = {}

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class LLM:
        def __init__(self, **kw):
            calls["engine"] = kw

        def generate(self, prompts, params, use_tqdm=False):
            calls["generate"] = (prompts, params)
            def out(text, finish, reason):
                return types.SimpleNamespace(text=text, token_ids=[], finish_reason=finish, stop_reason=reason)
            return [types.SimpleNamespace(outputs=[out("1 + 2 = 3.\n\n", "stop", "\n\n"),
                                                   out("Answer: 3", "stop", 7)])  # an end-of-turn id
                    for _ in prompts]

    monkeypatch.setitem(sys.modules, "vllm",
                        types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, __version__="9.9"))
    s = VLLMSampler("/models/x", world_tokenizer, StepSpec(DEFAULT_DELIMITERS, 16), SamplingSpec(0.6, 0.95),
                    tensor_parallel_size=2,
                    gpu_memory_utilization=0.3, seed=4)
    assert calls["engine"] == {"model": "/models/x", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.3,
                               "seed": 4, "dtype": "auto"}
    ctx = _contexts(world_tokenizer, 2)
    out = s.sample(ctx, 2, seed=1)
    prompts, params = calls["generate"]
    assert prompts == [{"prompt_token_ids": c} for c in ctx]
    assert params[0].kw == {"n": 2, "temperature": 0.6, "top_p": 0.95, "max_tokens": 16,
                            "stop": list(DEFAULT_DELIMITERS), "include_stop_str_in_output": True,
                            "seed": params[0].kw["seed"]}
    assert params[0].kw["seed"] != params[1].kw["seed"]
    tok = world_tokenizer
    assert out[0] == [tok("1 + 2 = 3.\n\n", add_special_tokens=False).input_ids,
                      tok("Answer: 3", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    assert s.provenance() == {"backend": "vllm", "model": "/models/x", "server_version": "9.9"}
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'semanticspec-probes\[vllm\]'"):
        VLLMSampler("/models/x", world_tokenizer, StepSpec(DEFAULT_DELIMITERS, 16), SamplingSpec(0.6, 0.95))


def test_vllm_sampler_reads_an_end_id_at_the_cap_as_eos(world_tokenizer, monkeypatch, tmp_path):
    """vLLM's V1 engine before 0.11.1 tests the length limit before EOS (``v1/core/sched/utils.py`` ``check_stop``,
    0.11.0), so a step whose last allowed token is an end id ends at ``length`` with that id last in
    ``CompletionOutput.token_ids`` (``vllm/outputs.py``) and out of the text: the step ended at EOS all the same.
    The end ids are the tokenizer's EOS and ``generation_config.json``'s
    (``SamplingParams.update_from_generation_config``)."""
    import sys
    import types

    from datamodules.labels.samplers import VLLMSampler

    tok, eot = world_tokenizer, 5
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, eot]}))
    ids = tok("1 + 2", add_special_tokens=False).input_ids

    class LLM:
        def __init__(self, **kw):
            pass

        def generate(self, prompts, params, use_tqdm=False):
            def out(last):
                return types.SimpleNamespace(text="1 + 2", token_ids=ids + last, finish_reason="length",
                                             stop_reason=None)
            return [types.SimpleNamespace(outputs=[out([tok.eos_token_id]), out([eot]), out([])])]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM, SamplingParams=lambda **kw: kw))
    s = VLLMSampler(str(tmp_path), tok, StepSpec(DEFAULT_DELIMITERS, 16), SamplingSpec(0.6, 0.95))
    assert s.end_ids == {tok.eos_token_id, eot}
    assert s.sample(_contexts(tok, 1), 3, seed=0) == [[ids + [tok.eos_token_id]] * 2 + [ids]]
    assert s.step_ends == {"eos": 2, "length": 1}


@pytest.mark.gpu
def test_vllm_sampler_on_a_gpu(world_tokenizer, tmp_path):
    """vLLM's real engine samples the world's draft; its greedy steps equal the hf sampler's."""
    pytest.importorskip("vllm")
    from arithmetic_world.models import world_root
    from datamodules.labels.samplers import HFSampler, VLLMSampler

    path = str(world_root() / "draft")
    s = VLLMSampler(path, world_tokenizer, StepSpec(DEFAULT_DELIMITERS, 16), SamplingSpec(0.0, 1.0),
                    gpu_memory_utilization=0.2)
    ctx = _contexts(world_tokenizer, 4)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    assert s.sample(ctx, 1, seed=0) == HFSampler(model, world_tokenizer, StepSpec(DEFAULT_DELIMITERS, 16),
                                                 SamplingSpec(0.0, 1.0)).sample(ctx, 1, 0)


@pytest.mark.slow  # over 8 s on 2 cores: in CI's slow set, out of the README's 5-minute command
def test_target_traces_come_from_the_server_with_an_openai_backend(serve, tmp_path):
    """prefix_source: target with a server: the target's traces are written by its server, not by a local copy."""
    servers = {r: serve(r, version="0.11.1") for r in ("target", "draft")}
    config = _world_config({r: s.url for r, s in servers.items()}, temperature=0.6)
    config.prefix_source, config.n_problems = "target", 2
    m = build(config, tmp_path, log=lambda *a: None)
    traces = [json.loads(line) for line in (tmp_path / "target-traces.jsonl").read_text().splitlines()]
    assert len(traces) == 2 and all(t["trace"] for t in traces) and m["n_prefixes"] >= 2
    first = [b for _, b in servers["target"].requests[:2]]  # the traces: no stop strings, 16 step caps long
    assert all(b.get("stop") is None and b["max_tokens"] == 16 * 16 and b.get("n") is None for b in first)
    assert all(b.get("stop") == list(DEFAULT_DELIMITERS) for _, b in servers["target"].requests[2:])  # the steps
