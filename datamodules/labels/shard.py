"""One shard of a label build: load the models and the judge, sample, read, group, label.

A shard's random streams are seeded by ``(sampling.seed, shard index)`` (:func:`shard_seed`), so it
comes out the same whichever rank builds it and whether the build was interrupted before.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datamodules.labels.config import DEFAULT_HTTP_TEMPLATE, ROLES, BuildConfig, default_template
from datamodules.labels.clustering import group_prefixes
from datamodules.labels.shares import DRAFT, TARGET, joint_labels, per_model_labels
from datamodules.labels.prefixes import Prefix
from datamodules.labels.reading import read_steps
from datamodules.labels.openai_sampler import OpenAISampler
from datamodules.labels.samplers import HFSampler, StepSampler, VLLMSampler
from generation.fingerprints import weights_stamp
from generation.loading import quiet_loading
from generation.handover import Handover, whole_prefix

# ---------------------------------------------------------------------------------------------
# Models and judge.


@dataclass
class Models:
    target: Any
    draft: Any
    tokenizer: Any
    """The target's tokenizer."""
    judge: Any
    draft_tokenizer: Any = None
    """The draft's own tokenizer, or None when it shares the target's (steps then cross as tokens, not text)."""
    samplers: dict[str, Any] = field(default_factory=dict)
    """Who writes each role's steps (:mod:`datamodules.labels.samplers`), by role."""
    readers: dict[str, Any] = field(default_factory=dict)
    """``reading.backend: engine``: each role's server (:class:`generation.engines.base.Engine`), by role."""


def load_tokenizers(config: BuildConfig) -> tuple[Any, Any]:
    """The target's tokenizer and the draft's, or None for the draft's when the two are the same vocabulary."""
    from transformers import AutoTokenizer

    from generation.fingerprints import tokenizer_hash

    tok = AutoTokenizer.from_pretrained(config.model_path("target"), local_files_only=True)
    dtok = AutoTokenizer.from_pretrained(config.model_path("draft"), local_files_only=True)
    return tok, (None if tokenizer_hash(tok) == tokenizer_hash(dtok) else dtok)


def load_model(config: BuildConfig, role: str):
    """``role``'s causal LM (``target`` or ``draft``) on the configured device and dtype, in eval mode."""
    from transformers import AutoModelForCausalLM

    device, dtype = config.resolved_device()
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(config.model_path(role), local_files_only=True, dtype=dtype)
    return model.to(device).eval()


def make_sampler(config, role: str, model, tokenizer, rank: int = 0) -> StepSampler:
    """The sampler ``config.sampling.backend`` asks for, for ``role`` (``target`` or ``draft``).

    Args:
        config: the :class:`~datamodules.labels.config.BuildConfig`.
        role: whose steps it samples.
        model: that role's loaded model (the ``hf`` backend samples with it).
        tokenizer: that role's tokenizer (steps come back in its ids).
        rank: this process's rank; the ``openai`` backend starts its round-robin over the endpoints there.
    """
    s = config.sampling
    common = (tokenizer, config.steps, s.spec)
    if s.backend == "hf":
        return HFSampler(model, *common)
    if s.backend == "vllm":
        v = s.vllm
        return VLLMSampler(config.model_path(role), *common, tensor_parallel_size=v.tensor_parallel_size,
                           gpu_memory_utilization=v.gpu_memory_utilization, seed=s.seed, dtype=v.dtype)
    o = s.openai
    e = getattr(o, role)
    return OpenAISampler(e.urls, e.model, *common, engine=o.engine, api_key_env=o.api_key_env,
                         concurrency=o.concurrency, timeout=o.timeout, retries=o.retries, rank=rank)


def load_models(config: BuildConfig, cache_dir: Path, rank: int = 0, samplers: dict | None = None) -> Models:
    """Load target, draft (each with its own tokenizer), their samplers and the judge on the configured device.

    ``samplers``: server or vLLM samplers made before (the target's, when it wrote its own traces), reused.
    """
    device, dtype = config.resolved_device()
    tok, dtok = load_tokenizers(config)
    toks = {"target": tok, "draft": dtok or tok}
    samplers = dict(samplers or {})
    # a server sampler asks its server first: an unreachable one fails before models load
    if config.sampling.backend != "hf":
        samplers.update({r: make_sampler(config, r, None, toks[r], rank) for r in toks if r not in samplers})
    readers = make_readers(config, toks) if config.reading.backend == "engine" else {}
    # a model is loaded only when the package itself samples or reads with it
    needed = config.sampling.backend == "hf" or not readers
    models = {r: load_model(config, r) if needed else None for r in toks}
    samplers.update({r: make_sampler(config, r, models[r], toks[r], rank) for r in toks if r not in samplers})
    refuse_swapped(config, {r: (s.urls[0], s.model) for r, s in samplers.items() if s.backend == "openai"})
    refuse_swapped(config, {r: (e.url, e.model) for r, e in readers.items()})
    return Models(models["target"], models["draft"], tok, make_judge(config, cache_dir, rank, device, dtype), dtok,
                  samplers, readers)


def refuse_swapped(config: BuildConfig, servers: dict[str, tuple[str, str | None]]) -> None:
    """Refuse role servers that look swapped: a role's server serving the model the build names for the other role
    (:func:`~generation.engines.checks.swapped_roles`). ``servers``: per role, its URL and served model name."""
    from generation.engines.checks import model_names, swapped_roles

    if set(servers) == {"target", "draft"}:
        own = {r: model_names(getattr(config, r) or config.model_path(r)) for r in servers}
        if why := swapped_roles(servers, own):
            raise ValueError(why)


def make_readers(config: BuildConfig, toks: dict[str, Any]) -> dict[str, Any]:
    """Each role's server for ``reading.backend: engine``, checked to serve the build's feature groups (fails fast,
    before anything is sampled or read)."""
    from generation.engines import make_engine
    from generation.engines.checks import require

    r, spec = config.reading, config.feature_spec()
    out = {}
    for role in toks:
        e = r.endpoint(role, config.sampling)
        out[role] = make_engine(r.engine, e.urls[0], e.model, api_key_env=r.api_key_env, timeout=r.timeout,
                                retries=r.retries)
        require(out[role], spec, role)
    return out


def make_judge(config: BuildConfig, cache_dir: Path | None = None, rank: int = 0, device: str = "cpu",
               dtype: torch.dtype = torch.float32):
    """The judge ``config`` asks for (None for ``judge.kind="none"``), caching its answers in ``cache_dir``."""
    from datamodules.labels import judges as J

    j = config.judge
    common = {"threshold": j.threshold, "cache_dir": cache_dir, "cache_tag": str(rank)}
    if j.kind == "none":
        return None
    if j.kind == "http":
        return J.HTTPJudge(j.url, j.model, j.template or DEFAULT_HTTP_TEMPLATE, api=j.api, api_key_env=j.api_key_env,
                           timeout=j.timeout, retries=j.retries, **common)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    path = config.model_path("judge")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    name = f"{Path(path).name}@{weights_stamp(path)}"  # a retrained judge must not reuse old cached answers
    auto = AutoModelForSequenceClassification if j.kind == "nli" else AutoModelForCausalLM
    with quiet_loading():
        model = auto.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval()
    if j.kind == "nli":
        return J.NLIJudge(model, tok, name=name, **common)
    template = j.template or default_template(j)
    return J.LLMJudge(model, tok, template, yes=j.yes_answer, no=j.no_answer, name=name, **common)


# ---------------------------------------------------------------------------------------------
# One shard.


def shard_seed(seed: int, index: int, stream: str) -> int:
    """Seed of one random stream of one shard, independent of rank and of what was built before."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}:{stream}".encode()).digest()[:8], "little") & (2**63 - 1)


def build_shard(index: int, prefixes: list[Prefix], models: Models, config: BuildConfig, timer: dict[str, float],
                asked: list | None = None) -> tuple[dict[str, torch.Tensor], list[dict], dict[str, int]]:
    """Sample, read, group and label one shard's prefixes.

    Returns:
        The shard's tensors, its step texts (one record per prefix) and counts.
    """
    with warnings.catch_warnings():  # transformers 5 warns on `past_key_values=`, which the sampler uses on purpose
        warnings.filterwarnings("ignore", message=".*past_key_values.*")
        return _build_shard(index, prefixes, models, config, timer, asked)


def _build_shard(index: int, prefixes: list[Prefix], models: Models, config: BuildConfig, timer: dict[str, float],
                 asked: list | None = None) -> tuple[dict[str, torch.Tensor], list[dict], dict[str, int]]:
    n = config.sampling.n_samples
    # Each model samples in its own tokenization; with two tokenizers a draft step reaches the target as
    # its text, through the decoder's handover (generation.handover), cut at the same delimiters.
    tok = models.tokenizer
    handover = Handover(tok, models.draft_tokenizer)
    dtok = handover.draft_tokenizer
    ctx = {"target": [p.token_ids for p in prefixes],
           "draft": [p.token_ids if models.draft_tokenizer is None else p.draft_token_ids for p in prefixes]}
    t0 = time.perf_counter()
    written = {w: models.samplers[w].sample(ctx[w], n, shard_seed(config.sampling.seed, index, w))
               for w in ("target", "draft")}
    t1 = time.perf_counter()
    joint = config.labelling == "joint"
    # per prefix: the target's samples then the draft's (sample j of prefix i has id i * 2N + j)
    # with two tokenizers a draft step is handed over up to its last whole character, as the decoder hands it
    cut = (lambda s: s) if handover.shared else (lambda s: s[: whole_prefix(dtok, s)])
    texts = [[tok.decode(s, skip_special_tokens=True) for s in written["target"][i]]
             + [dtok.decode(cut(s), skip_special_tokens=True) for s in written["draft"][i]]
             for i in range(len(prefixes))]
    drafted = written["draft"] if handover.shared else [  # the draft's steps as the target reads them
        [handover.text_to_target(t) or [tok.eos_token_id] for t in texts[i][n:]] for i in range(len(prefixes))]
    t_reads = [written["target"][i] + drafted[i] if joint else written["target"][i] for i in range(len(prefixes))]
    feats = _read(models, config, ctx, {"target": t_reads, "draft": written["draft"]}, {"target": tok, "draft": dtok})
    t2 = time.perf_counter()
    writers = np.array([TARGET] * n + [DRAFT] * n)
    tf, df = (_embeddings(feats[r], len(prefixes)) for r in ("target", "draft"))
    judge = models.judge
    judged_before = (judge.seconds, judge.calls) if judge is not None else (0.0, 0)
    if joint:
        groups = group_prefixes([(texts[i], tf[i]) for i in range(len(prefixes))], judge, config.clustering, asked)
        labels = [joint_labels(g, writers) | {"groups": g} for g in groups]
    else:
        tg = group_prefixes([(texts[i][:n], tf[i]) for i in range(len(prefixes))], judge, config.clustering, asked)
        dg = group_prefixes([(texts[i][n:], df[i]) for i in range(len(prefixes))], judge, config.clustering, asked)
        labels = [per_model_labels(a, b) for a, b in zip(tg, dg)]
    t3 = time.perf_counter()
    judge_s = (judge.seconds - judged_before[0]) if judge is not None else 0.0
    tensors, records = _assemble(prefixes, texts, labels, feats, writers, joint)
    for stage, dt in (("sampling", t1 - t0), ("reading", t2 - t1), ("clustering", t3 - t2 - judge_s),
                      ("judge", judge_s),
                      ("labels", time.perf_counter() - t3)):
        timer[stage] = timer.get(stage, 0.0) + dt
    counts = {"prefixes": len(prefixes), "samples": 2 * n * len(prefixes),
              "groups": int(sum(int(lab["groups"].max()) + 1 for lab in labels)),
              "judge_calls": (judge.calls - judged_before[1]) if judge is not None else 0}
    return tensors, records, counts


def _read(models: Models, config: BuildConfig, ctx: dict, reads: dict,
          toks: dict) -> dict[str, dict[str, torch.Tensor]]:
    """``{role: {group: (rows, ...)}}``: each role reads its steps, in-process or through its server, with the
    function the decoder's verification pass calls."""
    spec = config.feature_spec()
    if models.readers:
        from datamodules.labels.engine_reading import read_steps_served

        return {r: read_steps_served(models.readers[r], toks[r], ctx[r], reads[r], spec,
                                     concurrency=config.reading.concurrency) for r in reads}
    return {r: read_steps(getattr(models, r), ctx[r], reads[r], spec, toks[r].pad_token_id or 0, config.max_rows)
            for r in reads}


def _embeddings(feats: dict[str, torch.Tensor], n_prefixes: int) -> np.ndarray:
    """(prefixes, samples, width) what clustering compares: the pooled hidden states, or, when the servers return
    none, the step's other features (clustering is then ``judge``-only and uses them only to order its questions)."""
    x = feats["hidden"] if "hidden" in feats else torch.cat([v.flatten(1) for v in feats.values()], dim=1)
    return x.flatten(1).float().numpy().reshape(n_prefixes, -1, x[0].numel())


def _assemble(prefixes, texts, labels, feats, writer, joint) -> tuple[dict[str, torch.Tensor], list[dict]]:
    dtypes = {"q": torch.float32, "p": torch.float32, "writer": torch.int8, "problem_id": torch.int64,
              "prefix_id": torch.int64, "sample_id": torch.int64, "group_id": torch.int32,
              "group_entropy": torch.float32}
    cols: dict[str, dict[str, list]] = {r: {k: [] for k in dtypes} for r in ROLES}
    records, n = [], len(writer) // 2  # each prefix's samples: the target's n, then the draft's n
    rows = {"target": np.arange(2 * n) if joint else np.arange(n), "draft": np.arange(n, 2 * n)}
    for i, p in enumerate(prefixes):
        lab = labels[i]
        ids = np.arange(2 * n) + p.prefix_id * 2 * n
        columns = {"q": lab["q"], "p": lab["p"], "writer": writer, "problem_id": np.full(2 * n, p.problem_id),
                   "prefix_id": np.full(2 * n, p.prefix_id), "sample_id": ids, "group_id": lab["groups"],
                   "group_entropy": lab["entropy"]}  # one value per sample; each role keeps its rows
        for r, idx in rows.items():
            for k, v in columns.items():
                cols[r][k].append(v[idx])
        records.append({"problem_id": p.problem_id, "prefix_id": p.prefix_id, "step_index": p.step_index,
                        "prefix": p.text,
                        "samples": [{"sample_id": int(ids[j]), "writer": int(writer[j]), "text": texts[i][j],
                                     "group": int(lab["groups"][j]), "q": float(lab["q"][j]), "p": float(lab["p"][j])}
                                    for j in range(2 * n)]})
    tensors: dict[str, torch.Tensor] = {}
    for r in ROLES:
        for g, v in feats[r].items():  # group "hidden" is stored as "features" (fp16), the statistics as float32
            tensors[f"{r}.features" if g == "hidden" else f"{r}.{g}"] = v.flatten(1).to(
                torch.float16 if g == "hidden" else torch.float32)
        for k, dt in dtypes.items():
            tensors[f"{r}.{k}"] = torch.from_numpy(np.concatenate(cols[r][k])).to(dt)
        tensors[f"{r}.label"] = tensors[f"{r}.q" if r == "target" else f"{r}.p"].clone()
    return tensors, records
