"""Served benchmark: SemanticSpec through two llama-cpp-python servers of the embedded world.

    python -m benchmarks.served            # 64 held-out problems (benchmarks/results/served.json, .md)
    python -m benchmarks.served --quick    # 8 problems, a smaller build (served-quick.*)

The script starts the world's target and draft servers itself (``arithmetic_world.serve.world_server``: f32
weights and KV cache, one thread each, llama.cpp's verbose per-request output on, on free ports unless ``--ports``
names two) and stops them at the end. What it measures:

- ``build``: the engine-read label build and probe fit of ``configs/served.yaml`` pointed at these servers,
  run as a child ``python -m probes.fit`` (data and run folders in a temporary folder): its
  ``seconds_per_stage`` (the manifest's), ``peak_rss_mb`` (the child's ``ru_maxrss``, measured by a wrapper
  process around it so that no other child counts) and ``model_weights_loaded`` (the manifest's
  ``stats.models_loaded``: whether the build process loaded target or draft weights); the same fit with
  ``reading.backend: hf`` (in-process reading) beside it for comparison;
- ``build.label_agreement``: the engine-sampled build's labels against an in-process build (``hf`` sampling and
  reading) of the same problems, over the step texts both sampled at a prefix
  (:mod:`datamodules.labels.agreement`: ``ari`` of the meaning groups, ``mean_abs_dq`` of the ``q`` labels,
  ``shared_texts``, ``coverage``): ``served_vs_in_process``, beside ``in_process_other_seed`` (two in-process
  builds differing only in their sampling seed: the noise floor) and ``served_repeated`` (the two served builds
  above: whether the servers sample the same steps again);
- ``methods.{target_only,semanticspec,oracle_accept}``: accuracy, speedup (served target-only wall / the
  method's on the same servers) and step acceptance on held-out problems (``benchmarks.decode``'s problem
  seed and oracle), methods interleaved problem by problem, concurrency 1, at the probes' sampling, with
  the shipped in-process-trained ``probes-topk`` pair; ``methods.semanticspec_engine_probes`` decodes with
  the pair the build above trained on engine-read features;
- ``always_reject_equals_target_only``: greedy, every problem, text for text;
- ``requests_per_step`` ``{kept, refused}``: requests per kept and per refused draft step (each draft step's
  requests, counted by a recording wrapper around each engine and checked against the decoder's
  ``stats.requests``); ``prefill_tokens_per_step``: the tokens the TARGET server evaluated per verify
  request, from its own log (``Llama.generate: K prefix-match hit, remaining N prompt tokens to eval``),
  against the mean step length and the ``usage.prompt_tokens`` the server reports per request;
- ``server_request_overhead_ms``: median round trip of a minimal request (a one-word prompt after BOS,
  ``max_tokens`` 1) to the target server; ``client_ms_per_step``: the package's own time per step,
  ``(wall - sum of request round trips) / steps + requests_per_step * http_client_ms``, where
  ``http_client_ms`` is the ``openai`` client's own cost per request, measured against a loopback
  ``ThreadingHTTPServer`` that answers a canned completion at once (as tests/fake_openai.py's servers do);
  ``overhead_share``: ``(requests * server_request_overhead + probe seconds) / wall``;
- ``decision_agreement``: over the draft steps the served SemanticSpec runs read, the share on which the
  engine-trained target probe (on the server-read features) decides as the probe trained on in-process reads
  of the same build (the same sampled steps and labels; on in-process features of the same step, read by
  :class:`~generation.engines.local.LocalEngine` over the world's target); ``vs_shipped`` compares with the
  shipped in-process pair instead; ``same_probe`` is the share where the shipped probe decides alike on served
  and on in-process features (feature agreement, apart from training);
- ``projected_speedup_32b``: the cost model of docs/benchmarks.md ("Served") with the measured output and drafted
  tokens per judged step, acceptance, requests per step and request overhead, and assumed (cited) per-token costs of
  a 1.5B draft and a 32B target (``ceiling``: the same with free reads and no request overhead);
- ``concurrency.<1|4|16>.tokens_per_s`` of target-only and SemanticSpec.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks import harness
from benchmarks import report as tables
from benchmarks.common import PROBLEM_SEED, REPO, TASK, figures, oracle_for
from arithmetic_world.serve import world_server
from arithmetic_world import models, task
from datamodules.labels.agreement import label_agreement
from datamodules.labels.shards import read_manifest
from generation.engines import make_engine
from generation.engines.local import LocalEngine
from generation.specs import SamplingSpec
from probes.model import load_probe, run_probe
from semanticspec.parts import SHIPPED_WINDOW
from semanticspec.policies import OraclePolicy, ProbePolicy
from semanticspec.results import Decision, summarize
from semanticspec.served import ServedDecoder, features
from semanticspec.evaluate import Arm, interleaved

SHIPPED = REPO / "checkpoints" / "arithmetic" / "probes-topk"
LOOKAHEADS = (2, 4)
"""Windows of drafted steps per verify read beside the one-step loop: one draft write and one target read
per window."""
OVERLAP_ROW = f"semanticspec[lookahead={LOOKAHEADS[-1]} overlap]"
"""The widest window with the draft writing the next window while the target reads this one."""
SHIPPED_ROW = f"semanticspec[lookahead={SHIPPED_WINDOW.size} adaptive]"
"""SemanticSpec's shipped window (``DecodeConfig.lookahead=None``: up to 4 steps, adaptive), what a served decode runs
by default; the other SemanticSpec rows pin their window (``semanticspec``: one step per read)."""
WINDOWS = (*(str(k) for k in LOOKAHEADS), f"{SHIPPED_WINDOW.size} adaptive")
"""The windowed rows' keys (``semanticspec[lookahead=<key>]``) in the 32B projection by window."""
METHODS = ("target_only", "semanticspec", "oracle_accept", "semanticspec_engine_probes",
           *(f"semanticspec[lookahead={k}]" for k in LOOKAHEADS), SHIPPED_ROW, OVERLAP_ROW)
GREEDY = SamplingSpec(temperature=0.0)
GOALS = {"requests_kept": 2.0, "requests_refused": 3.0, "client_ms_per_step": 5.0, "decision_agreement": 0.99}
ASSUMED_32B = {
    "t_T_ms": (25.0, "32B target, bf16, batch 1, one H100-class GPU: ~64 GB of weights read per token at "
                     "~2.6 TB/s effective bandwidth (memory-bound decode)"),
    "t_D_ms": (6.0, "1.5B draft at batch 1: ~3 GB of weights is ~1 ms of bandwidth, but a small model's decode "
                    "step is bound by kernel launches and scheduling, ~5-7 ms per token in vLLM/SGLang"),
    "v": (1.1, "a verify prefill of L (~10-60) tokens on a 32B target in units of one decode step: below a few "
               "hundred tokens a forward stays memory-bound, so it costs about one decode step"),
}
"""Assumed inputs of the 32B projection: (value, why)."""


# -- recording engines --------------------------------------------------------------------------------


@dataclass
class Request:
    """One request an engine answered: its kind, the method running, its round trip and what it returned."""

    role: str
    kind: str
    tag: str
    order: int
    seconds: float
    answer: object
    context: str = ""
    step: str = ""


@dataclass
class Recorded:
    """An engine whose requests are recorded in order (forwarding everything else to it)."""

    engine: object
    role: str
    log: list[Request] = field(default_factory=list)
    tag: str = ""
    counter = itertools.count()
    """One order over both engines' requests (concurrency 1: the order they were sent in)."""

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def read(self, context: str, step: str, **kw):
        t0 = time.perf_counter()
        out = self.engine.read(context, step, **kw)
        self.log.append(Request(self.role, "read", self.tag, next(self.counter), time.perf_counter() - t0, out,
                                context, step))
        return out

    def write(self, context: str, **kw):
        t0 = time.perf_counter()
        out = self.engine.write(context, **kw)
        self.log.append(Request(self.role, "write", self.tag, next(self.counter), time.perf_counter() - t0, out,
                                context))
        return out


# -- build ----------------------------------------------------------------------------------------------

RSS_WRAPPER = ("import json, resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
               "print(json.dumps({'rc': rc, 'maxrss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))")
"""Runs a command and prints its exit code and peak RSS: only that command's process tree counts."""


def fit_command(urls: Sequence[str], folder: Path, n_problems: int, epochs: int, backend: str) -> list[str]:
    """``python -m probes.fit --config configs/served.yaml`` pointed at ``urls`` with its data and runs in
    ``folder``."""
    return [sys.executable, "-m", "probes.fit", "--config", str(REPO / "configs" / "served.yaml"),
            "--data.data_dir", str(folder / "data"), "--data.build.n_problems", str(n_problems),
            "--data.build.sampling.openai.target.urls", json.dumps([urls[0]]),
            "--data.build.sampling.openai.draft.urls", json.dumps([urls[1]]),
            "--data.build.reading.backend", backend, "--trainer.max_epochs", str(epochs),
            "--trainer.default_root_dir", str(folder / "runs"),
            "--trainer.logger.init_args.save_dir", str(folder / "runs")]


def run_fit(cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` under :data:`RSS_WRAPPER`; its exit code, peak RSS (MB) and seconds. Fails with the log's tail."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *cmd], stdout=subprocess.PIPE, stderr=out,
                              text=True, cwd=REPO)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if got["rc"] != 0:
        tail = "".join(open(log).readlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {got['rc']}); see {log}:\n{tail}")
    return {"peak_rss_mb": got["maxrss_kb"] / 1024, "seconds": time.perf_counter() - t0}


def build_stage(urls: Sequence[str], tmp: Path, args) -> tuple[dict, dict[str, Path]]:
    """The engine-read build + fit and the in-process-read one beside it (the same servers sample the same steps
    from the same seeds); returns ``build`` and both exported pairs, by reading backend."""
    n, epochs = args.build_problems or (8 if args.quick else 48), 4 if args.quick else 12
    out, pairs = {"n_problems": n, "max_epochs": epochs}, {}
    for backend in ("engine", "hf"):
        print(f"build + fit, reading.backend {backend}, {n} problems ...", flush=True)
        folder = tmp / f"fit-{backend}"
        got = run_fit(fit_command(urls, folder, n, epochs, backend), tmp / f"fit-{backend}.log")
        manifest = read_manifest(folder / "data")
        stats = manifest["stats"]
        loaded = stats.get("models_loaded", {})
        fig = {"peak_rss_mb": got["peak_rss_mb"], "seconds": got["seconds"],
               "seconds_per_stage": stats["seconds_per_stage"], "models_loaded": loaded,
               "model_weights_loaded": bool(loaded.get("target") or loaded.get("draft")),
               "rows": {r: v["rows"] for r, v in manifest["roles"].items()}}
        pairs[backend] = sorted((folder / "runs").glob("fit-served/version_*/export"))[-1]
        if backend == "engine":
            out.update(fig)
        else:
            out["in_process_read"] = fig
    out["label_agreement"] = label_stage(tmp, n, {b: tmp / f"fit-{b}" / "data" for b in ("engine", "hf")})
    out["weights_mb"] = {r: sum(f.stat().st_size for f in (models.world_root(None) / r).glob("*.safetensors")) / 2**20
                         for r in ("target", "draft")}
    out["note"] = ("peak RSS of the whole `python -m probes.fit` child (build, then training); both load the "
                   "world's judge in-process for clustering. The world's models are a few MB, so RSS barely "
                   "differs; model_weights_loaded is the build's own record of what it loaded.")
    return out, pairs


def in_process_build(folder: Path, n_problems: int, seed: int, log: Path) -> Path:
    """``configs/served.yaml``'s label build of ``n_problems`` sampled and read in-process (``hf``) into
    ``folder``, with sampling seed ``seed``; returns the folder."""
    cmd = [sys.executable, "-m", "datamodules.labels.build", "--fit_config", str(REPO / "configs" / "served.yaml"),
           "--data_dir", str(folder), "--build.n_problems", str(n_problems), "--build.sampling.backend", "hf",
           "--build.reading.backend", "hf", "--build.sampling.seed", str(seed)]
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    if done.returncode != 0:
        tail = "".join(open(log).readlines()[-15:])
        raise RuntimeError(f"the in-process label build failed (exit {done.returncode}); see {log}:\n{tail}")
    return folder


def label_stage(tmp: Path, n_problems: int, served: dict[str, Path]) -> dict:
    """The served build's labels against an in-process build of the same problems
    (:func:`datamodules.labels.agreement.label_agreement`: ARI of the groups and mean |dq| over the step texts
    both sampled at a prefix), beside the same figures for two in-process builds that differ only in their
    sampling seed (the noise floor of sampling) and for the two served builds of :func:`build_stage` (the same
    servers and seeds: whether served sampling repeats)."""
    print(f"label agreement: two in-process builds of the same {n_problems} problems ...", flush=True)
    hf = [in_process_build(tmp / f"labels-hf-{seed}", n_problems, seed, tmp / f"labels-hf-{seed}.log")
          for seed in (0, 1)]
    return {"served_vs_in_process": label_agreement(served["engine"], hf[0]),
            "in_process_other_seed": label_agreement(hf[0], hf[1]),
            "served_repeated": label_agreement(served["engine"], served["hf"]),
            "note": "a = the first build named, b = the second; in-process builds use sampling seeds 0 and 1"}


# -- decoding -------------------------------------------------------------------------------------------


def decoders(target, draft, engine_pair: Path) -> dict[str, ServedDecoder]:
    """The shipped in-process-trained pair's decoder and the engine-trained pair's, at the threshold rule, one request
    in flight at a time."""
    return {name: ServedDecoder(target, draft, str(pair / "target"), str(pair / "draft"), ProbePolicy(), task=TASK,
                                concurrency=1)
            for name, pair in (("shipped", SHIPPED), ("engine", engine_pair))}


def arms(decs: dict, args) -> dict[str, Arm]:
    """Every method of :data:`METHODS` as the evaluation's core decodes it: its decoder (the engine-trained pair's for
    ``semanticspec_engine_probes``) and its ``generate`` keywords (one step a pass unless the row names a window; the
    oracle's depends on the problem)."""
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
           "lookahead": 1}
    out = {}
    for m in METHODS:
        kw = {**gen, "method": "semanticspec" if m.startswith("semanticspec") else m}
        if "[lookahead=" in m:
            size, *flags = m[m.index("=") + 1 : -1].split()
            kw.update(lookahead=int(size), overlap="overlap" in flags)
            if "adaptive" in flags:
                kw.update(window_min_logprob=SHIPPED_WINDOW.min_logprob)
        if m == "oracle_accept":
            kw = lambda k, p, so_far: {**gen, "method": OraclePolicy(oracle_for(p))}  # noqa: E731
        out[m] = Arm(decs["engine" if m == "semanticspec_engine_probes" else "shipped"], kw)
    return out


@contextlib.contextmanager
def tagged(engines: tuple, method: str):
    """The engines' requests tagged with ``method`` while it decodes (the request log groups them by it)."""
    for e in engines:
        e.tag = method
    try:
        yield
    finally:
        for e in engines:
            e.tag = ""


def greedy_equivalence(dec: ServedDecoder, prompts: list[str], args) -> dict:
    """Greedy always-reject against greedy target-only, every problem, text for text."""
    mismatches = []
    for k, prompt in enumerate(tqdm(prompts, desc="greedy always_reject", unit="problem")):
        a, b = (dec.generate([prompt], method=m, temperature=0.0, seed=args.seed + k,
                             max_new_tokens=args.max_new_tokens)[0] for m in ("target_only", "always_reject"))
        if a.text != b.text or a.stop_reason == "error" or b.stop_reason == "error":
            mismatches.append({"problem": k, "target_only": a.text[-80:], "always_reject": b.text[-80:],
                               "errors": [a.error, b.error]})
    return {"equal": not mismatches, "mismatches": len(mismatches), "n_problems": len(prompts),
            "first_mismatches": mismatches[:3]}


def step_groups(log: list[Request], tag: str, prompts: list[str]) -> list[list[Request]]:
    """The requests of ``tag``'s run grouped by draft step, prompt after prompt: a request belongs to the prompt its
    context opens with, and within a prompt a draft write opens a group (``log``: both engines' requests in the
    order they were sent; the loop sends a round's requests for all its rows, so prompts interleave)."""
    by_prompt: dict[int, list[list[Request]]] = {k: [] for k in range(len(prompts))}
    order = sorted(range(len(prompts)), key=lambda k: -len(prompts[k]))  # the longest prompt a context opens with
    for r in log:
        if r.tag != tag:
            continue
        k = next(k for k in order if r.context.startswith(prompts[k]))
        groups = by_prompt[k]
        if r.kind == "write" and r.role == "draft":
            groups.append([r])
        elif groups:
            groups[-1].append(r)
    return [g for k in range(len(prompts)) for g in by_prompt[k]]


def requests_per_step(runs: dict, engines: tuple, prompts: list[str], tag: str = "semanticspec") -> dict:
    """Requests per kept and per refused draft step of ``tag``'s run, checked against ``stats.requests``."""
    merged = sorted([r for e in engines for r in e.log], key=lambda r: r.order)
    groups = step_groups(merged, tag, prompts)
    steps = [s for res in runs[tag] for s in res.steps if s.writer == "draft"]
    counted = sum(res.stats.requests for res in runs[tag])
    if len(groups) != len(steps):
        raise RuntimeError(f"{len(groups)} draft-step request groups but {len(steps)} draft steps in the traces")
    kept = [len(g) for g, s in zip(groups, steps) if s.decision.kept]
    refused = [len(g) for g, s in zip(groups, steps) if s.decision == Decision.REJECT]
    return {"kept": _mean(kept), "refused": _mean(refused), "kept_max": max(kept, default=0),
            "refused_max": max(refused, default=0), "n_kept": len(kept), "n_refused": len(refused),
            "requests_recorded": sum(len(g) for g in groups), "requests_counted_by_decoder": counted,
            "per_committed_step": counted / max(sum(res.stats.steps for res in runs[tag]), 1)}


def request_ms(engines: tuple, tag: str = "semanticspec") -> dict:
    """Mean round trip (ms) of ``tag``'s requests by server and kind (a target read is the verify request)."""
    out = {}
    for e in engines:
        for kind in ("read", "write"):
            times = [r.seconds for r in e.log if r.tag == tag and r.kind == kind]
            if times:
                out[f"{e.role}_{kind}"] = {"mean_ms": _mean(times) * 1000, "n": len(times)}
    return out


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


# -- the target server's log ----------------------------------------------------------------------------

_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
_EVAL = re.compile(r"prompt eval time =\s*[\d.]+ ms /\s*(\d+) tokens")


def server_prefills(text: str) -> list[dict]:
    """Per completion request in a llama-cpp-python verbose log: prefix tokens reused and prompt tokens evaluated."""
    out, block = [], []
    for line in text.splitlines():
        if '"POST /v1/completions' in line:
            joined = "\n".join(block)
            hit, ev = _HIT.search(joined), _EVAL.search(joined)
            out.append({"prefix_hit": int(hit.group(1)) if hit else 0,
                        "remaining": int(hit.group(2)) if hit else None,
                        "perf_prompt_eval": int(ev.group(1)) if ev else None})
            block = []
        else:
            block.append(line)
    return out


def prefill_figures(target: Recorded, log_text: str, prompts: set[str], tag: str = "semanticspec") -> dict:
    """What the target server prefilled per verify request of ``tag``'s run, from its own log, against the step."""
    server = server_prefills(log_text)
    if len(server) != len(target.log):
        return {"error": f"the target's log shows {len(server)} completion requests, the client sent "
                         f"{len(target.log)}; not aligned"}
    reads = [(r, s) for r, s in zip(target.log, server) if r.tag == tag and r.kind == "read"]
    evald = [s["remaining"] if s["remaining"] is not None else s["perf_prompt_eval"] for _, s in reads]
    step_tokens = [len(r.answer.step.tokens) for r, _ in reads]
    prompt_tokens = [r.answer.usage.prompt_tokens for r, _ in reads]
    # a prompt's first verify finds another method's sequence in the server's one slot (methods interleave), so
    # it prefills the prompt too; the goal is about the verifies after it, whose prefix the slot holds
    later = [(e, n) for (r, _), e, n in zip(reads, evald, step_tokens) if r.context not in prompts]
    return {"prefill_tokens_per_step": _mean(e for e, _ in later), "mean_step_tokens": _mean(n for _, n in later),
            "prefill_tokens_per_step_all_verifies": _mean(evald), "mean_step_tokens_all_verifies": _mean(step_tokens),
            "first_verifies_of_a_prompt": len(reads) - len(later),
            "usage_prompt_tokens_per_request": _mean(prompt_tokens),
            "prefix_hit_tokens_per_request": _mean(s["prefix_hit"] for _, s in reads),
            "verify_requests": len(reads),
            "prefill_over_step": _mean(e for e, _ in later) / max(_mean(n for _, n in later), 1e-9),
            "source": "target server log: 'Llama.generate: K prefix-match hit, remaining N prompt tokens to eval' "
                      "(N; no such line: the whole prompt, from llama_perf_context_print's prompt eval tokens)"}


# -- overheads ------------------------------------------------------------------------------------------


def server_request_overhead_ms(engine, n: int) -> float:
    """Median round trip (ms) of a minimal completion (BOS + one word, ``max_tokens`` 1) to ``engine``'s server."""
    create = engine.conn.client.completions.create
    seconds = harness.median_seconds(lambda: create(model=engine.model, prompt="1", max_tokens=1, temperature=0.0), n)
    return seconds * 1000


CANNED = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def http_client_ms(n: int) -> float:
    """Median ms of one ``openai`` completions call against a loopback server that answers a canned body at once."""
    import openai

    body = json.dumps(CANNED).encode()

    class Instant(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def setup(self):
            super().setup()  # no Nagle: headers and body leave at once (else delayed ACKs add ~40 ms a request)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Instant)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="none", max_retries=0)
        seconds = harness.median_seconds(lambda: client.completions.create(model="m", prompt="1", max_tokens=1), n)
    finally:
        server.shutdown()
        server.server_close()
    return seconds * 1000


def overheads(results, rps: float, o_ms: float, client_ms: float) -> dict:
    """``client_ms_per_step`` and ``overhead_share`` of one method's results (see the module docstring)."""
    s = summarize(results)
    wall, http, steps, requests, probe = (s[k] for k in ("wall_s", "http_s", "steps", "requests", "probe_s"))
    return {"client_ms_per_step": ((wall - http) / max(steps, 1) + rps * client_ms / 1000) * 1000,
            "outside_requests_ms_per_step": (wall - http) / max(steps, 1) * 1000,
            "overhead_share": (requests * o_ms / 1000 + probe) / wall if wall else math.nan,
            "requests": requests, "steps": steps, "wall_s": wall, "request_s": http, "probe_s": probe}


# -- decision agreement ---------------------------------------------------------------------------------


def decision_agreement(target: Recorded, local: LocalEngine, shipped, engine_probe, tau: float,
                       same_build=None) -> dict:
    """Decisions (q >= tau) over the draft steps the served SemanticSpec runs read.

    ``share``: the engine-trained probe on served features against the probe trained on in-process reads of the
    same build (the same sampled steps and labels; only the reading backend differs) on in-process features;
    ``vs_shipped``: against the shipped in-process pair (trained on a bigger build); ``same_probe``: the shipped
    probe on served against in-process features (the features alone).
    """
    s_spec, e_spec = shipped.config.features, engine_probe.config.features
    rows = []
    for r in target.log:
        if r.kind != "read" or not r.tag.startswith("semanticspec"):
            continue
        served = r.answer.step
        mine = local.read(r.context, r.step, top_k=s_spec.top_k, hidden=False, sampling=GREEDY, seed=0).step
        q_engine = run_probe(engine_probe, features(e_spec, _cut(served, e_spec.top_k), None))[0]
        q_served = run_probe(shipped, features(s_spec, _cut(served, s_spec.top_k), None))[0]
        q_local = run_probe(shipped, features(s_spec, mine, None))[0]
        q_same = run_probe(same_build, features(same_build.config.features, mine, None))[0] \
            if same_build is not None else math.nan
        rows.append((float(q_engine), float(q_served), float(q_local), float(q_same)))
    if not rows:
        return {"share": math.nan, "n_steps": 0}
    vs_shipped = _mean((a >= tau) == (c >= tau) for a, _, c, _ in rows)
    return {"share": _mean((a >= tau) == (d >= tau) for a, _, _, d in rows) if same_build is not None else vs_shipped,
            "vs_shipped": vs_shipped, "same_probe": _mean((b >= tau) == (c >= tau) for _, b, c, _ in rows),
            "n_steps": len(rows), "tau": tau, "max_abs_q_diff_same_probe": max(abs(b - c) for _, b, c, _ in rows),
            "mean_abs_q_diff_engine_vs_same_build": _mean(abs(a - d) for a, _, _, d in rows)
            if same_build is not None else math.nan}


def _cut(step, k: int):
    """A server's step answer with its top-k cut to ``k`` columns (the read asked for the most any probe reads)."""
    return replace(step, top=step.top[:, :k])


# -- projection and concurrency -------------------------------------------------------------------------


def projection(method: dict, o_ms: float, prefill: dict) -> dict:
    """The cost model of docs/benchmarks.md ("Served") for a 1.5B draft and a 32B target, per judged draft step.

    Target-only pays ``t_T`` for each of the ``s`` output tokens a judged step yields (the step kept, or the target's
    own step in its place, with its opening token); SemanticSpec pays the draft for the ``L`` tokens it wrote (a
    window's steps thrown away after a refused one included, so ``L`` may exceed ``s``), the verify reads, the
    target's own steps for the refused share ``r`` and the requests' overhead. ``ceiling`` is the same model with
    free reads and no request overhead: what the draft's cost and the refusals alone allow."""
    n = max(method["draft_steps_proposed"], 1)
    s, L, rps = method["output_tokens"] / n, method["drafted_tokens"] / n, method["requests"] / n
    r = 1.0 - method["step_acceptance"]
    w = method.get("windows", n) / n
    t_t, t_d, v = (ASSUMED_32B[k][0] for k in ("t_T_ms", "t_D_ms", "v"))
    draft_and_refused = L * t_d + r * s * t_t
    return {
        "value": s * t_t / (draft_and_refused + w * v * t_t + rps * o_ms),
        "ceiling": s * t_t / draft_and_refused,
        "formula": "speedup = s*t_T / (L*t_D + w*v*t_T + r*s*t_T + requests_per_step*o)",
        "inputs": {
            "s": {"value": s, "measured": True, "what": "output tokens per judged draft step (a kept step, or the "
                                                         "target's step in place of a refused one)"},
            "L": {"value": L, "measured": True, "what": "tokens the draft wrote per judged draft step (a window's "
                                                         "steps thrown away after a refused one included)"},
            "r": {"value": r, "measured": True, "what": "1 - step_acceptance (served semanticspec)"},
            "w": {"value": w, "measured": True, "what": "verify reads per judged draft step (1 without lookahead; "
                                                         "a window of steps is read at once, still ~one decode step "
                                                         "while memory-bound)"},
            "requests_per_step": {"value": rps, "measured": True, "what": "requests per proposed draft step"},
            "o_ms": {"value": o_ms, "measured": True, "what": "server_request_overhead_ms (this CPU's server)"},
            "prefill_tokens_per_step": {"value": prefill.get("prefill_tokens_per_step"), "measured": True,
                                        "what": "what v assumes: the verify request prefills only the step"},
            **{k: {"value": val, "measured": False, "what": why} for k, (val, why) in ASSUMED_32B.items()},
        },
    }


def concurrency(decs: dict, prompts: list[str], args, sizes=(1, 4, 16)) -> dict:
    """Output tokens per second of target-only and SemanticSpec with ``sizes`` prompts in flight."""
    dec = decs["shipped"]
    out: dict = {}
    for n in sizes:
        dec.concurrency = n
        row = {}
        for m in ("target_only", "semanticspec"):
            res = dec.generate(prompts, method=m, seed=args.seed, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, top_p=args.top_p, lookahead=1)
            tokens = sum(r.stats.output_tokens for r in res)
            row[m] = {"tokens_per_s": tokens / dec.last_wall_s, "wall_s": dec.last_wall_s,
                      "n_errors": sum(r.stop_reason == "error" for r in res)}
        out[str(n)] = row
    dec.concurrency = 1
    out["n_prompts"] = len(prompts)
    out["note"] = ("llama-cpp-python serializes requests (one lock, one cached sequence): concurrency cannot help, "
                   "and interleaved prompts evict each other's cached prefix, so every request re-prefills its "
                   "context. A batching engine (vLLM, SGLang) would run the in-flight requests as one batch, with "
                   "a prefix cache per sequence (SGLang's radix cache).")
    return out


# -- the run --------------------------------------------------------------------------------------------


def warm_up(decs: dict, tok, args) -> None:
    """Two other problems with every method: first requests pay one-off costs (the servers' first evals)."""
    warm = [TASK.prompt_text(tok, p.problem) for p in task.generate_problems(2, args.seed - 1)]
    for m in ("target_only", "semanticspec", "always_reject"):
        decs["shipped"].generate(warm, method=m, max_new_tokens=24, temperature=args.temperature, top_p=args.top_p)


def measure(args, servers, tmp: Path, n: int) -> dict:
    """Every figure of the module docstring, on servers already started."""
    urls = [s.url for s in servers]
    if args.engine_probes:
        build, pairs = {"skipped": f"--engine-probes {args.engine_probes}"}, {"engine": Path(args.engine_probes)}
    else:
        build, pairs = build_stage(urls, tmp, args)
    world = models.load_world(None)
    tok = world.tokenizer
    problems = task.generate_problems(n, args.seed, task.TaskConfig(min_ops=4, max_ops=4))
    prompts = [TASK.prompt_text(tok, p.problem) for p in problems]
    target = Recorded(make_engine("llama.cpp", urls[0], "target"), "target")
    draft = Recorded(make_engine("llama.cpp", urls[1], "draft"), "draft")
    decs = decoders(target, draft, pairs["engine"])
    sampling = decs["shipped"].target_probe.config.sampling
    args.temperature, args.top_p = sampling.temperature, sampling.top_p
    warm_up(decs, tok, args)
    target.log.clear()
    draft.log.clear()
    offset = Path(servers[0].log).stat().st_size
    runs = interleaved(arms(decs, args), problems, prompts, args.seed, around=lambda m: tagged((target, draft), m),
                       desc="methods")  # every method on every problem, one prompt at a time, the order rotating
    time.sleep(1.0)  # the server's log lines of the last request
    with open(servers[0].log, "rb") as f:
        f.seek(offset)
        log_text = f.read().decode("utf-8", "replace")
    prefill = prefill_figures(target, log_text, set(prompts))
    rps = requests_per_step(runs, (target, draft), prompts)
    rps["request_ms"] = request_ms((target, draft))
    ref = sum(r.stats.wall_s for r in runs["target_only"])
    methods = {m: figures(runs[m], problems, ref) for m in METHODS}
    for m in METHODS:
        s = summarize(runs[m])
        methods[m]["n_errors"] = sum(r.stop_reason == "error" for r in runs[m])
        methods[m].update({k: s[k] for k in ("requests", "drafted_tokens", "windows", "ahead_windows", "ahead_used")})
        methods[m]["requests_per_committed_step"] = s["requests"] / max(s["steps"], 1)
    print("decision agreement (in-process reads of every served draft step) ...", flush=True)
    same_build = load_probe(pairs["hf"] / "target", role="target") if "hf" in pairs else None
    agreement = decision_agreement(target, LocalEngine(world.target, tok), decs["shipped"].target_probe,
                                   decs["engine"].target_probe, decs["shipped"].policy.tau, same_build)
    greedy = greedy_equivalence(decs["shipped"], prompts, args)
    o_ms = server_request_overhead_ms(target.engine, 15 if args.quick else 50)
    client = http_client_ms(100 if args.quick else 300)
    ov = overheads(runs["semanticspec"], rps["per_committed_step"], o_ms, client)
    conc = concurrency(decs, prompts[: 8 if args.quick else 16], args)
    return {
        "build": build,
        "methods": methods,
        "always_reject_equals_target_only": greedy["equal"],
        "always_reject_mismatches": greedy["mismatches"],
        "always_reject": greedy,
        "requests_per_step": rps,
        "prefill_tokens_per_step": prefill.get("prefill_tokens_per_step"),
        "prefill": prefill,
        "server_request_overhead_ms": o_ms,
        "http_client_ms": client,
        "client_ms_per_step": ov["client_ms_per_step"],
        "overhead_share": ov["overhead_share"],
        "overheads": ov,
        "decision_agreement": agreement,
        "projected_speedup_32b": projection(methods["semanticspec"], o_ms, prefill),
        "projected_speedup_32b_by_lookahead": {k: projection(methods[f"semanticspec[lookahead={k}]"], o_ms, prefill)
                                               for k in WINDOWS},
        "concurrency": conc,
        "unsure_top_k_positions": {"target": target.engine.unsure_positions, "draft": draft.engine.unsure_positions},
        "n_problems": n,
        "seed": args.seed,
        "config": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                   "tau": decs["shipped"].policy.tau, "rule": decs["shipped"].policy.rule, "quick": args.quick,
                   "server_threads": 1, "concurrency": 1, "engine": "llama-cpp-python",
                   "shipped_probes": "checkpoints/arithmetic/probes-topk"},
    }


def goals(report: dict) -> dict:
    """The served goals with the measured values, whether each is met and by how much it is missed."""
    rps, agree = report["requests_per_step"], report["decision_agreement"]
    prefill = report["prefill"]
    rows = {
        "always_reject_equals_target_only": (report["always_reject_mismatches"], 0, "mismatches"),
        "requests_per_kept_step_at_most_2": (rps["kept"], GOALS["requests_kept"], "requests"),
        "requests_per_refused_step_at_most_3": (rps["refused"], GOALS["requests_refused"], "requests"),
        # the step as the decoder counts it: the drafted tokens plus the token that opened it (the previous read's
        # bonus token, or the last token the server wrote), which the server drew but never fed
        "verify_prefills_only_the_step": (prefill.get("prefill_tokens_per_step", math.nan),
                                          prefill.get("mean_step_tokens", math.nan) + 1, "tokens"),
        "client_ms_per_step_at_most_5": (report["client_ms_per_step"], GOALS["client_ms_per_step"], "ms"),
    }
    out = {k: {"value": v, "limit": lim, "met": bool(v <= lim + 1e-9), "missed_by": max(v - lim, 0.0), "unit": u}
           for k, (v, lim, u) in rows.items()}
    share = agree.get("share", math.nan)
    out["decision_agreement_at_least_0.99"] = {"value": share, "limit": GOALS["decision_agreement"],
                                               "met": bool(share >= GOALS["decision_agreement"]),
                                               "missed_by": max(GOALS["decision_agreement"] - share, 0.0)}
    out["build_loads_no_model_weights"] = {"value": report["build"].get("model_weights_loaded"),
                                           "met": report["build"].get("model_weights_loaded") is False}
    return out


def markdown(report: dict) -> str:
    """The figures as a markdown table."""
    methods = [[m, f"{f['accuracy']:.3f}", f"{f['speedup']:.2f}x", f"{f['step_acceptance']:.3f}", f"{f['wall_s']:.1f}",
                str(f["requests"]), str(f["n_errors"])] for m, f in report["methods"].items()]
    rps, pre, agree = report["requests_per_step"], report["prefill"], report["decision_agreement"]
    b = report["build"]
    rows = [
        ("always_reject_equals_target_only (greedy, every problem)",
         f"{report['always_reject_equals_target_only']} ({report['always_reject_mismatches']} mismatches)"),
        ("requests_per_step kept / refused", f"{rps['kept']:.2f} / {rps['refused']:.2f}"),
        ("prefill_tokens_per_step (target server log) / mean step tokens / usage.prompt_tokens",
         f"{pre.get('prefill_tokens_per_step', math.nan):.1f} / {pre.get('mean_step_tokens', math.nan):.1f} / "
         f"{pre.get('usage_prompt_tokens_per_request', math.nan):.1f}"),
        ("server_request_overhead_ms (median)", f"{report['server_request_overhead_ms']:.2f}"),
        ("http_client_ms (openai client, instant loopback server)", f"{report['http_client_ms']:.2f}"),
        ("client_ms_per_step", f"{report['client_ms_per_step']:.2f}"),
        ("overhead_share", f"{report['overhead_share']:.3f}"),
        ("decision_agreement (engine-trained vs in-process) / same probe",
         f"{agree.get('share', math.nan):.4f} / {agree.get('same_probe', math.nan):.4f} "
         f"({agree.get('n_steps')} steps)"),
    ]
    if "peak_rss_mb" in b:
        rows += [("build.peak_rss_mb engine-read / in-process-read",
                  f"{b['peak_rss_mb']:.0f} / {b['in_process_read']['peak_rss_mb']:.0f}"),
                 ("build.model_weights_loaded engine-read / in-process-read",
                  f"{b['model_weights_loaded']} / {b['in_process_read']['model_weights_loaded']}"),
                 ("build.seconds_per_stage", ", ".join(f"{k} {v:.1f}" for k, v in b["seconds_per_stage"].items()))]
    proj = report["projected_speedup_32b"]
    rows.append(("projected_speedup_32b (ceiling: free reads, no request overhead)",
                 f"{proj['value']:.2f}x ({proj['ceiling']:.2f}x): {proj['formula']}"))
    for k, v in proj["inputs"].items():
        val = v["value"]
        rows.append((f"  {k} ({'measured' if v['measured'] else 'assumed'})",
                     f"{val:.3g}" if isinstance(val, (int, float)) else str(val)))
    if OVERLAP_ROW in report["methods"]:
        m, plain = report["methods"][OVERLAP_ROW], report["methods"][f"semanticspec[lookahead={LOOKAHEADS[-1]}]"]
        rows.append((f"{OVERLAP_ROW}: speedup on this CPU, overlap on / off; windows drafted ahead used / drafted",
                     f"{m['speedup']:.2f}x / {plain['speedup']:.2f}x; {m['ahead_used']} / {m['ahead_windows']}"))
    for k, p in report.get("projected_speedup_32b_by_lookahead", {}).items():
        m = report["methods"][f"semanticspec[lookahead={k}]"]
        rows.append((f"lookahead={k}: requests per committed step / projected_speedup_32b (ceiling)",
                     f"{m['requests_per_committed_step']:.2f} / {p['value']:.2f}x ({p['ceiling']:.2f}x)"))
    for n, row in report["concurrency"].items():
        if isinstance(row, dict):
            rows.append((f"concurrency {n} tokens/s target_only / semanticspec",
                         f"{row['target_only']['tokens_per_s']:.0f} / {row['semanticspec']['tokens_per_s']:.0f}"))
    labels = ["", tables.served_labels(report)] if "label_agreement" in b else []
    return "\n".join([harness.table(["method", "accuracy", "speedup", "step acceptance", "wall s", "requests",
                                      "errors"], methods), "", harness.table(["figure", "value"], rows), *labels])


def arguments():
    ap = harness.parser(__doc__, quick="8 problems and an 8-problem build, writes served-quick.json",
                        name="served")
    ap.add_argument("--n-problems", type=harness.count, default=None, help="held-out problems (default 64, --quick 8)")
    ap.add_argument("--build-problems", type=harness.count, default=None,
                    help="problems of the engine-read build (default 48, --quick 8)")
    ap.add_argument("--max-new-tokens", type=harness.count, default=96)
    ap.add_argument("--seed", type=harness.non_negative, default=PROBLEM_SEED)
    ap.add_argument("--ports", type=harness.port, nargs=2, default=None,
                    help="target and draft server ports (default: two free ones, so runs at once do not share "
                         "servers)")
    ap.add_argument("--engine-probes", default=None,
                    help="an exported engine-trained pair ({target,draft}); skips the build stage")
    return ap


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring) and write its figures; returns the report."""
    ap = arguments()
    args = ap.parse_args(argv)
    if args.ports is not None and args.ports[0] == args.ports[1]:
        ap.error(f"--ports {args.ports[0]} {args.ports[1]}: the target's and the draft's servers need two ports")
    if args.engine_probes is not None and (missing := [r for r in ("target", "draft")
                                                       if not Path(args.engine_probes, r, "config.json").is_file()]):
        ap.error(f"--engine-probes {args.engine_probes}: no exported probe in {' or '.join(r + '/' for r in missing)} "
                 "(config.json + model.safetensors)")
    torch.set_num_threads(1)
    n = args.n_problems or (8 if args.quick else 64)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="served-bench-") as tmp:
        tmp = Path(tmp)
        servers = [world_server(role, port, log=tmp / f"{role}.log", n_threads=1, verbose=True)
                   for role, port in zip(("target", "draft"), args.ports or harness.free_ports(2))]
        try:
            for s in servers:
                s.start()
            report = measure(args, servers, tmp, n)
        finally:
            for s in servers:
                s.stop()
    report["goals"] = goals(report)
    report["seconds"] = time.perf_counter() - t0
    out = harness.results_path("served", args.quick, args.out)
    harness.write(report, out, markdown(report), save_table=True)
    missed = {k: g for k, g in report["goals"].items() if not g["met"]}
    for k, g in missed.items():
        print(f"goal MISSED: {k}: {g['value']} (limit {g.get('limit')}, missed by {g.get('missed_by')})")
    return report


if __name__ == "__main__":
    main()
