"""Step samplers (datamodules.labels.samplers): the text-to-step rule, the openai sampler against local servers,
builds."""

import json
import time

import pytest
import torch

from datamodules.labels.build import build
from datamodules.labels.config import BuildConfig, EndpointConfig, JudgeConfig, OpenAIConfig, SamplingConfig
from datamodules.labels.openai_sampler import OpenAISampler
from datamodules.labels.samplers import minimal_stops, step_from_text
from generation.engines.base import Unreachable, Unsupported
from generation.specs import SamplingSpec, StepSpec
from generation.steps import DEFAULT_DELIMITERS
from tests.fake_openai import FakeServer, InFlight

STOPS = ["\n\n"]


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
# The rule that turns a returned completion into a step.


def test_minimal_stops_keeps_only_delimiters_holding_no_other():
    assert minimal_stops(DEFAULT_DELIMITERS) == ["\n\n"]
    assert minimal_stops(["A", "B", "xA"]) == ["A", "B"]


@pytest.mark.parametrize("text, finish, kw, want_text, eos, how", [
    ("24 + 8 = 32.\n\n", "stop", {}, "24 + 8 = 32.\n\n", False, "included"),
    ("24 + 8 = 32.", "stop", {"stop_reason": "\n\n"}, "24 + 8 = 32.\n\n", False, "reported"),
    ("Answer: 24", "stop", {"stop_reason": None}, "Answer: 24", True, "eos"),
    ("Answer: 24", "stop", {"stop_reason": 3}, "Answer: 24", True, "eos"),
    ("24 + 8 = 32.", "stop", {"generated_tokens": 99}, "24 + 8 = 32.\n\n", False, "counted"),
    ("24 + 8 = 32.", "stop", {"generated_tokens": 0}, "24 + 8 = 32.", True, "eos"),
    ("24 + 8 = 32.", "stop", {}, "24 + 8 = 32.\n\n", False, "assumed"),
    ("24 + 8 =", "length", {}, "24 + 8 =", False, "length"),
])
def test_step_from_text_restores_the_end(world_tokenizer, text, finish, kw, want_text, eos, how):
    tok = world_tokenizer
    if kw.get("generated_tokens") == 0:  # exactly the text's tokens: nothing was cut off, the model ended
        kw = {"generated_tokens": len(tok(text, add_special_tokens=False).input_ids)}
    ids, got = step_from_text(tok, text, finish, STOPS, **kw)
    assert got == how
    assert ids == tok(want_text, add_special_tokens=False).input_ids + ([tok.eos_token_id] if eos else [])


def test_a_stop_string_merged_into_the_last_token_is_assumed_not_guessed(world_tokenizer):
    """When the text with and without its delimiter has as many tokens, the count cannot tell; say so."""

    class Merging:  # a tokenizer whose last token swallows a trailing blank line
        eos_token_id = 3

        def __call__(self, text, add_special_tokens=False):
            ids = world_tokenizer(text.removesuffix("\n\n"), add_special_tokens=False).input_ids
            return type("Enc", (), {"input_ids": ids[:-1] + [ids[-1] + 1000] if text.endswith("\n\n") else ids})()

    ids, how = step_from_text(Merging(), "24 + 8 = 32.", "stop", STOPS, generated_tokens=6)
    assert how == "assumed" and ids[-1] >= 1000


def test_step_from_text_refuses_an_unknown_finish_reason(world_tokenizer):
    with pytest.raises(ValueError, match="finish_reason='abort'"):
        step_from_text(world_tokenizer, "x", "abort", STOPS)


# ---------------------------------------------------------------------------------------------
# The openai sampler against a local server backed by the world's draft.


def test_server_that_ignores_n_is_fanned_out_with_distinct_seeds(serve, world_tokenizer):
    server = serve()  # llama.cpp-like: one choice whatever n asks
    s = _sampler(server, world_tokenizer)
    ctx = _contexts(world_tokenizer)
    out = s.sample(ctx, 4, seed=11)
    assert [len(o) for o in out] == [4, 4, 4] and all(isinstance(x, list) and x for o in out for x in o)
    assert s.ignores_n == [True]
    seeds = [(b["prompt"], b["seed"]) for _, b in server.requests]
    assert len(set(seeds)) == len(seeds) == 3 * 4  # every sample its own request and seed
    # the first answer taught it: at most the prompts already in flight went out with n=4
    assert sum(b["n"] == 4 for _, b in server.requests) <= len(ctx)
    assert len({tuple(x) for o in out for x in o}) > 3  # the samples differ
    s.sample(ctx, 4, seed=11)
    assert all(b["n"] == 1 for _, b in server.requests[12:])
    assert s.stats()["samples"] == 24 and sum(s.stats()["step_ends"].values()) == 24


def test_server_that_honours_n_gets_one_request_per_prefix(serve, world_tokenizer):
    server = serve(honour_n=True, include_stop=True)
    s = _sampler(server, world_tokenizer)
    out = s.sample(_contexts(world_tokenizer), 4, seed=0)
    assert len(server.requests) == 3 and [len(o) for o in out] == [4, 4, 4]
    body = server.requests[0][1]
    assert body["stop"] == ["\n\n"] and body["max_tokens"] == 8 and body["temperature"] == 0.8
    assert body["top_p"] == 0.95 and body["include_stop_str_in_output"] is True
    assert set(s.step_ends) <= {"included", "eos", "length"}


@pytest.mark.parametrize("kw", [{}, {"honour_n": True, "report_stop_reason": True},  # llama.cpp, SGLang-like
                                {"honour_n": True, "include_stop": True, "report_stop_reason": True}])  # vLLM
def test_greedy_server_steps_equal_the_hf_sampler(serve, world_models, world_tokenizer, kw):
    """Whichever way the server marks a step's end, the step is the one the package's own sampler writes."""
    from datamodules.labels.samplers import HFSampler

    tok, ctx = world_tokenizer, _contexts(world_tokenizer, 6)
    ctx += [c + tok("19 plus 5 equals 24.\n\n24 + 8 = 32.\n\n32 - 8 = 24.\n\n", add_special_tokens=False).input_ids
            for c in ctx[:2]]  # prefixes whose next step is the last (it ends at EOS)
    hf = HFSampler(world_models["draft"], tok, StepSpec(DEFAULT_DELIMITERS, 16),
                   SamplingSpec(0.0, 1.0)).sample(ctx, 2, seed=0)
    s = _sampler(serve(**kw), tok, temperature=0.0)
    s.max_step_tokens = 16
    assert s.sample(ctx, 2, seed=0) == hf
    assert "eos" in s.step_ends and s.step_ends.get("assumed", 0) == 0


def test_requests_stay_bounded_and_spread_over_endpoints(serve, world_tokenizer):
    both = InFlight()  # one gauge over both servers: the bound is on the sampler's requests in flight, wherever sent
    a, b = (serve(honour_n=True, delay=0.05, in_flight=both) for _ in range(2))
    s = OpenAISampler([a.url, b.url], "world-draft", world_tokenizer, StepSpec(DEFAULT_DELIMITERS, 4),
                      SamplingSpec(0.8, 0.95),
                      api_key_env="", concurrency=2, rank=1)
    s.sample(_contexts(world_tokenizer, 8), 2, seed=0)
    assert len(a.requests) == len(b.requests) == 4 and both.peak <= 2
    for rank, first in ((0, a), (1, b), (2, a)):  # ranks of a distributed build start at different endpoints
        r = OpenAISampler([a.url, b.url], "world-draft", world_tokenizer, StepSpec(DEFAULT_DELIMITERS, 4),
                          SamplingSpec(0.8, 0.95),
                          api_key_env="", rank=rank)
        before = len(first.requests)
        r.sample(_contexts(world_tokenizer, 1), 1, seed=0)
        assert len(first.requests) == before + 1


def test_api_key_is_sent_but_never_shown(serve, world_tokenizer, monkeypatch):
    monkeypatch.setenv("SAMPLER_KEY", "sk-secret-123")
    server = serve(honour_n=True)
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
    server = serve(honour_n=True, fail_first=2)
    out = _sampler(server, world_tokenizer, retries=3).sample(_contexts(world_tokenizer, 1), 2, seed=0)
    assert len(server.requests) == 3 and len(out[0]) == 2
    server = serve(honour_n=True, fail_first=5)
    with pytest.raises(Unreachable, match=r"failed /v1/completions .* after 2 attempt\(s\).*503"):
        _sampler(server, world_tokenizer, retries=2).sample(_contexts(world_tokenizer, 1), 2, seed=0)
    assert len(server.requests) == 2


def test_a_slow_server_times_out(serve, world_tokenizer):
    server = serve(delay=2.0)
    t = time.perf_counter()
    with pytest.raises(Unreachable, match="Timeout"):
        _sampler(server, world_tokenizer, timeout=0.3).sample(_contexts(world_tokenizer, 1), 1, seed=0)
    assert time.perf_counter() - t < 2.0


def test_model_and_server_are_checked_before_any_sampling(serve, world_tokenizer):
    server = serve(version="0.11.0")
    s = _sampler(server, world_tokenizer)
    assert s.model == "world-draft" and s.server_version == "0.11.0"
    assert s.provenance() == {"backend": "openai", "model": "world-draft", "urls": [server.url], "engine": "vllm",
                              "server_version": "0.11.0", "prompt": "text", "stops": ["\n\n"],
                              "sampling_fields": {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}}
    with pytest.raises(Unsupported, match=r"does not serve model 'other'; it serves \['world-draft'\]"):
        _sampler(server, world_tokenizer, model="other")
    with pytest.raises(Unreachable, match="127.0.0.1:9/v1 did not answer /v1/models"):
        _sampler("http://127.0.0.1:9/v1", world_tokenizer)


@pytest.mark.parametrize("version,fields", [
    (None, {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0}),  # llama-cpp-python (top_k 40, min_p 0.05, 1.1)
    ("0.11.0", {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}),  # vLLM (the model's generation config)
])
def test_every_request_states_the_whole_distribution(serve, world_tokenizer, version, fields):
    """Servers fill unset sampling fields from their own defaults or the model's generation_config.json: each step
    and each continuation request sends temperature, top_p and the engine's neutral top_k, min_p and penalty."""
    server = serve(honour_n=True, version=version)
    s = _sampler(server, world_tokenizer)
    s.sample(_contexts(world_tokenizer, 1), 2, seed=0)
    s.complete(_contexts(world_tokenizer, 1), 4, seed=0)
    for _, body in server.requests:
        assert body["temperature"] == 0.8 and body["top_p"] == 0.95
        assert {f: body.get(f) for f in fields} == fields


def test_token_prompts_send_the_exact_ids(serve, world_tokenizer):
    server = serve(honour_n=True)
    ctx = _contexts(world_tokenizer, 1)
    _sampler(server, world_tokenizer, prompt="tokens").sample(ctx, 1, seed=0)
    assert server.requests[0][1]["prompt"] == ctx[0]
    _sampler(server, world_tokenizer).sample(ctx, 1, seed=0)
    assert server.requests[1][1]["prompt"] == world_tokenizer.decode(ctx[0][1:])  # the server adds its own BOS


def test_a_bos_the_tokenizer_does_not_add_stays_in_a_text_prompt(serve, world_tokenizer):
    """SmolLM2's BOS id is <|im_start|>, which its chat template writes and its tokenizer never adds: it must stay."""

    class NoBos:  # the world tokenizer, but adding no BOS (as SmolLM2's and its GGUF's)
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        def __call__(self, text, **kw):
            return self._tok(text, **{**kw, "add_special_tokens": False})

    server = serve(honour_n=True)
    ctx = _contexts(world_tokenizer, 1)
    _sampler(server, NoBos(world_tokenizer)).sample(ctx, 1, seed=0)
    assert server.requests[0][1]["prompt"] == world_tokenizer.decode(ctx[0])
    assert ctx[0][0] == world_tokenizer.bos_token_id


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
    assert ends.get("counted", 0) > 0 and "assumed" not in ends
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

    def fingerprint(path):  # no 32B folder here: what config.json would say
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
    assert b.sampling.backend == "openai" and b.sampling.n_samples == 20 and b.sampling.openai.prompt == "tokens"
    assert b.judge.kind == "http" and b.judge.url == b.sampling.openai.target.urls[0]
    assert cli.model.probes["target"].config.hidden_size == 5120
    assert cli.model.probes["draft"].config.hidden_size == 1536
    for role in ("target", "draft"):
        e = getattr(b.sampling.openai, role)
        assert e.urls[0].startswith("http://127.0.0.1:800") and e.model
        server = serve(role, name=e.model, honour_n=True, report_stop_reason=True)
        e.urls = [server.url]
        s = make_sampler(b, role, None, world_tokenizer)
        out = s.sample(_contexts(world_tokenizer, 1), 2, seed=0)
        assert len(out[0]) == 2 and s.model == e.model
        body = server.requests[0][1]
        assert isinstance(body["prompt"], list) and body["max_tokens"] == b.steps.max_step_tokens
        assert body["temperature"] == 0.6 and body["top_p"] == 0.95 and body["stop"] == ["\n\n"]


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
                return types.SimpleNamespace(text=text, finish_reason=finish, stop_reason=reason)
            return [types.SimpleNamespace(outputs=[out("1 + 2 = 3.\n\n", "stop", "\n\n"),
                                                   out("Answer: 3", "stop", None)])
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
    assert params[0].kw == {"n": 2, "temperature": 0.6, "top_p": 0.95, "max_tokens": 16, "stop": ["\n\n"],
                            "include_stop_str_in_output": True, "seed": params[0].kw["seed"]}
    assert params[0].kw["seed"] != params[1].kw["seed"]
    tok = world_tokenizer
    assert out[0] == [tok("1 + 2 = 3.\n\n", add_special_tokens=False).input_ids,
                      tok("Answer: 3", add_special_tokens=False).input_ids + [tok.eos_token_id]]
    assert s.provenance() == {"backend": "vllm", "model": "/models/x", "server_version": "9.9"}
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'semanticspec-probes\[vllm\]'"):
        VLLMSampler("/models/x", world_tokenizer, StepSpec(DEFAULT_DELIMITERS, 16), SamplingSpec(0.6, 0.95))


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
    servers = {r: serve(r, honour_n=True, report_stop_reason=True) for r in ("target", "draft")}
    config = _world_config({r: s.url for r, s in servers.items()}, temperature=0.6)
    config.prefix_source, config.n_problems = "target", 2
    m = build(config, tmp_path, log=lambda *a: None)
    traces = [json.loads(line) for line in (tmp_path / "target-traces.jsonl").read_text().splitlines()]
    assert len(traces) == 2 and all(t["trace"] for t in traces) and m["n_prefixes"] >= 2
    first = [b for _, b in servers["target"].requests[:2]]  # the traces: no stop strings, 16 step caps long
    assert all(b.get("stop") is None and b["max_tokens"] == 16 * 16 and b["n"] == 1 for b in first)
    assert all(b.get("stop") == ["\n\n"] for _, b in servers["target"].requests[2:])  # then the steps
