"""Build labelled training data: prefixes → sampled steps → pooled states → meaning groups → shards.

    python -m datamodules.build --data_dir data/arithmetic               # the embedded world
    python -m datamodules.build --config build.yaml                      # keys: data_dir, build.*
    torchrun --nproc_per_node 4 -m datamodules.build --config build.yaml # ranks share the shards

The work is cut into shards of ``shard_size`` prefixes. A shard's random streams are seeded by
``(seed, shard index)``, so a shard comes out the same whichever rank builds it and whether the
build was interrupted before: a rerun skips the whole shards on disk and builds the rest. Rank 0
merges everything into ``manifest.json`` (DESIGN.md "Formats").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from datamodules import shards as S
from datamodules.clustering import ClusterConfig, group_prefixes
from datamodules.labels import DRAFT, LABELLINGS, TARGET, joint_labels, per_model_labels
from datamodules.prefixes import Prefix, load_problems, make_prefixes, target_traces
from datamodules.reading import read_steps
from generation.writer import generate
from generation.steps import DEFAULT_DELIMITERS, StepStopper
from generation.features import TOKEN_STATS, FeatureSpec, check_groups

JUDGES = ("llm", "http", "nli", "none")
ROLES = ("target", "draft")
DEFAULT_HTTP_TEMPLATE = (
    "Do these two reasoning steps state the same thing?\nStep A: {a}\nStep B: {b}\nAnswer with yes or no."
)


@dataclass
class BuildConfig:
    """Everything that decides a label build. Defaults: the embedded arithmetic world."""

    task_file: str | None = None
    """JSONL of ``{"problem", "trace", "answer"}``; None generates problems from the embedded world."""
    n_problems: int = 200
    """World problems to generate (with ``task_file``: at most this many lines, 0 = all). 200 give about
    900 prefixes, 14k target rows and 7k draft rows in about a minute on 2 CPU cores."""
    task_seed: int = 1
    """Seed of the world's problem generator."""
    prefix_source: str = "reference"
    """Traces to cut into prefixes: ``reference`` (the task's) or ``target`` (the target's own generations)."""
    target: str | None = None
    """Folder of the target model; None = the embedded world's (``world_root()/target``)."""
    draft: str | None = None
    """Folder of the draft model; None = the embedded world's (``world_root()/draft``)."""
    judge: str = "llm"
    """Equivalence judge: ``llm`` (causal LM folder), ``http`` (OpenAI-compatible), ``nli``, or ``none`` (HDBSCAN only)."""
    judge_model: str | None = None
    """Judge model: a folder for ``llm``/``nli`` (None = the world's judge), the model name for ``http``."""
    judge_template: str | None = None
    """Judge prompt with ``{a}`` and ``{b}``; None = the world's ``JUDGE_TEMPLATE`` (llm) or a plain question (http)."""
    judge_yes: str = " yes"
    """``llm`` judge: the answer meaning "same" (its first token's probability is read); chat models often say ``Yes``."""
    judge_no: str = " no"
    """``llm`` judge: the answer meaning "different"."""
    judge_url: str = ""
    """Base URL of the ``http`` judge, e.g. ``http://127.0.0.1:8000/v1``."""
    judge_api: str = "chat"
    """``http`` judge route: ``chat`` (/chat/completions) or ``completions``."""
    judge_api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the ``http`` judge's API key (never logged)."""
    judge_timeout: float = 30.0
    """Seconds per ``http`` judge request."""
    judge_retries: int = 3
    """Attempts per ``http`` judge request before the build fails."""
    judge_threshold: float = 0.5
    """Combined P(same) from which two steps are one meaning."""
    clustering: str = "hdbscan+judge"
    """``hdbscan+judge`` (default), ``hdbscan`` (no judge) or ``judge`` (no HDBSCAN)."""
    min_cluster_size: int = 2
    """HDBSCAN ``min_cluster_size``."""
    membership_threshold: float = 0.5
    """HDBSCAN members below this membership probability go to the judge."""
    merge_distance: float = 2.0
    """Clusters whose centroids (unit-norm embeddings) are closer than this are judged for merging; 2.0 = all pairs."""
    votes: int = 1
    """Members of a candidate group an uncertain step is judged against (mean score decides)."""
    match_numbers: bool = True
    """Two steps whose numbers differ (as multisets) never share a meaning group, whatever the judge says.
    The world judge calls a step with a wrong result "the same" as the right one in 1 of 3 cases (issue 9);
    turn off for tasks whose paraphrases change numbers (e.g. 0.5 vs 1/2)."""
    n_samples: int = 8
    """Steps sampled per prefix from each model (paper: 20)."""
    temperature: float = 0.6
    """Sampling temperature (paper: 0.6)."""
    top_p: float = 0.95
    """Nucleus mass (paper: 0.95)."""
    max_step_tokens: int = 32
    """Longest step in tokens; a step ends at a delimiter, EOS or this cap."""
    delimiters: list[str] = field(default_factory=lambda: list(DEFAULT_DELIMITERS))
    """Step delimiters (default: the blank-line family)."""
    layer_ids: list[int] = field(default_factory=lambda: [-1])
    """HF ``hidden_states`` indices to pool (0 = embeddings, -1 = last layer)."""
    pooling: str = "mean"
    """``mean`` over the step's tokens or ``last``."""
    token_stats: list[str] = field(default_factory=lambda: list(TOKEN_STATS))
    """Token statistics stored per step (feature group ``token_stats``), from the reading forward's logits.
    Every build also stores the ``hidden`` group (pooled states of ``layer_ids``), which clustering uses."""
    device: str = "auto"
    """``auto`` (cuda with bf16 when present, else CPU float32), ``cpu``, ``cuda``, ``cuda:1``..."""
    labelling: str = "joint"
    """``joint`` (both models' samples grouped together) or ``per_model`` (the paper's)."""
    shard_size: int = 32
    """Prefixes per shard (the unit of resume and of work per rank)."""
    max_rows: int = 1024
    """Most sequences per forward pass when reading steps."""
    seed: int = 0
    """Seed of sampling; with the same seed a build is reproducible."""

    def __post_init__(self) -> None:
        errors = []
        choices = {"prefix_source": ("reference", "target"), "judge": JUDGES, "judge_api": ("chat", "completions"),
                   "clustering": ("hdbscan+judge", "hdbscan", "judge"), "pooling": ("mean", "last"), "labelling": LABELLINGS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                errors.append(f"{name}={getattr(self, name)!r}: expected one of {allowed}")
        if self.judge == "none" and self.clustering != "hdbscan":
            if self.clustering == "judge":
                errors.append("clustering='judge' needs a judge, but judge='none'")
            else:
                self.clustering = "hdbscan"  # no judge: HDBSCAN alone
        if self.judge == "http" and not self.judge_url:
            errors.append("judge='http' needs judge_url (e.g. http://127.0.0.1:8000/v1)")
        if self.judge == "http" and not self.judge_model:
            errors.append("judge='http' needs judge_model (the model name the server expects)")
        if self.judge == "nli" and not self.judge_model:
            errors.append("judge='nli' needs judge_model (a sequence-classification model folder)")
        for name, low in (("n_problems", 0), ("n_samples", 1), ("max_step_tokens", 1), ("shard_size", 1), ("max_rows", 1),
                          ("judge_retries", 1), ("min_cluster_size", 2), ("votes", 1)):
            if getattr(self, name) < low:
                errors.append(f"{name}={getattr(self, name)}: expected >= {low}")
        if self.task_file is None and self.n_problems < 1:
            errors.append(f"n_problems={self.n_problems}: the embedded world needs >= 1 problem")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            errors.append(f"temperature={self.temperature} (need >= 0), top_p={self.top_p} (need in (0, 1])")
        if not 0 < self.judge_threshold < 1:
            errors.append(f"judge_threshold={self.judge_threshold}: expected in (0, 1)")
        if self.judge_timeout <= 0:
            errors.append(f"judge_timeout={self.judge_timeout}: expected > 0")
        if not self.delimiters or any(not d for d in self.delimiters):
            errors.append(f"delimiters={self.delimiters!r}: give at least one non-empty delimiter")
        if not self.layer_ids:
            errors.append("layer_ids is empty: give at least one layer, e.g. [-1]")
        errors += check_groups(["hidden", "token_stats"], self.token_stats)
        if not (self.device in ("auto", "cpu", "cuda", "mps") or self.device.startswith("cuda:")):
            errors.append(f"device={self.device!r}: expected auto, cpu, cuda, cuda:N or mps")
        if errors:
            raise ValueError("invalid BuildConfig: " + "; ".join(errors))

    def model_path(self, role: str) -> str:
        """Folder of ``target``, ``draft`` or the ``judge`` (world defaults resolved now)."""
        from datamodules.arithmetic.models import world_root

        given = {"target": self.target, "draft": self.draft, "judge": self.judge_model}[role]
        if not given:
            return str(world_root() / role)
        from datamodules.models import local_model_dir

        return local_model_dir(given)  # a GGUF or ``pypi:PACKAGE`` becomes its converted, cached folder

    def cluster_config(self) -> ClusterConfig:
        return ClusterConfig(method=self.clustering, min_cluster_size=self.min_cluster_size,
                             membership_threshold=self.membership_threshold, merge_distance=self.merge_distance,
                             votes=self.votes, match_numbers=self.match_numbers)

    def feature_spec(self) -> FeatureSpec:
        """The feature groups every build stores: ``hidden`` and ``token_stats``."""
        return FeatureSpec(["hidden", "token_stats"], list(self.layer_ids), self.pooling, list(self.token_stats))

    def resolved_device(self) -> tuple[str, torch.dtype]:
        """The device and dtype models run in; with several ranks, ``cuda`` means this rank's GPU (LOCAL_RANK)."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and torch.cuda.is_available():
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"
        return device, (torch.bfloat16 if device.startswith("cuda") else torch.float32)


# ---------------------------------------------------------------------------------------------
# What a build is: the signature a manifest records and a config is compared with.


def folder_fingerprint(path: str) -> dict[str, Any]:
    """Fingerprint of a model folder from its ``config.json`` and tokenizer, without loading weights."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer

    from generation.fingerprints import model_fingerprint

    if not Path(path).is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model_fingerprint(SimpleNamespace(config=cfg), tok)


def judge_provenance(config: BuildConfig) -> dict[str, Any]:
    """What judged the labels: kind, model, template (and endpoint for ``http``)."""
    if config.judge == "none":
        return {"kind": "none"}
    out: dict[str, Any] = {"kind": config.judge, "threshold": config.judge_threshold}
    if config.judge in ("llm", "nli"):
        path = config.model_path("judge")
        out["model"] = folder_fingerprint(path) if Path(path).is_dir() else {"name_or_path": path}
    else:
        out.update(model=config.judge_model, url=config.judge_url, api=config.judge_api)
    if config.judge in ("llm", "http"):
        out["template"] = config.judge_template or _default_template(config)
    if config.judge == "llm" and (config.judge_yes, config.judge_no) != (" yes", " no"):
        out["answers"] = [config.judge_yes, config.judge_no]  # recorded only when not the default
    return out


def _default_template(config: BuildConfig) -> str:
    from datamodules.arithmetic.tokenizer import JUDGE_TEMPLATE

    return JUDGE_TEMPLATE if config.judge == "llm" else DEFAULT_HTTP_TEMPLATE


def label_provenance(config: BuildConfig) -> dict[str, Any]:
    """The ``labels`` entry of a probe's input spec: N, labelling, clustering, judge, seed."""
    cc = config.cluster_config()
    params = {"min_cluster_size": cc.min_cluster_size, "membership_threshold": cc.membership_threshold,
              "merge_distance": cc.merge_distance, "votes": cc.votes, "max_candidates": cc.max_candidates,
              "match_numbers": cc.match_numbers}
    return {"n_samples": config.n_samples, "labelling": config.labelling, "clustering": config.clustering,
            "clustering_params": params, "max_step_tokens": config.max_step_tokens,
            "judge": judge_provenance(config), "seed": config.seed, "temperature": config.temperature,
            "top_p": config.top_p}


def problems_provenance(config: BuildConfig) -> dict[str, Any]:
    if config.task_file is None:
        return {"source": "arithmetic", "n_problems": config.n_problems, "task_seed": config.task_seed,
                "prefix_source": config.prefix_source}
    digest = S.sha256_file(config.task_file) if Path(config.task_file).is_file() else None
    return {"source": "file", "task_file": str(config.task_file), "sha256": digest, "n_problems": config.n_problems,
            "prefix_source": config.prefix_source}


def signature(config: BuildConfig) -> dict[str, Any]:
    """The facts two builds must share for their data to mix; read from folders, no weights loaded."""
    return {
        "format_version": S.FORMAT_VERSION,
        "reads": {r: folder_fingerprint(config.model_path(r)) for r in ROLES},
        "layer_ids": list(config.layer_ids),
        "pooling": config.pooling,
        "feature_groups": ["hidden", "token_stats"],
        "token_stats": list(config.token_stats),
        "delimiters": list(config.delimiters),
        "max_step_tokens": config.max_step_tokens,
        "labels": label_provenance(config),
        "problems": problems_provenance(config),
        "shard_size": config.shard_size,
    }


def signature_mismatches(recorded: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    """``"field: data has X, config asks Y"`` for every differing field (``name_or_path`` is informative only)."""
    out = []
    for key in sorted(set(recorded) | set(wanted)):
        if key == "name_or_path":
            continue
        a, b = recorded.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += signature_mismatches(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: data has {a!r}, config asks {b!r}")
    return out


# ---------------------------------------------------------------------------------------------
# Models and judge.


@dataclass
class Models:
    target: Any
    draft: Any
    tokenizer: Any
    judge: Any
    device: str


def load_models(config: BuildConfig, cache_dir: Path, rank: int = 0) -> Models:
    """Load target, draft (same tokenizer required) and the judge on the configured device."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation.fingerprints import tokenizer_hash

    device, dtype = config.resolved_device()
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype).to(device).eval()
    tp, dp = config.model_path("target"), config.model_path("draft")
    tok = AutoTokenizer.from_pretrained(tp, local_files_only=True)
    dtok = AutoTokenizer.from_pretrained(dp, local_files_only=True)
    if tokenizer_hash(tok) != tokenizer_hash(dtok):
        raise ValueError(f"target {tp} and draft {dp} have different tokenizers ({tokenizer_hash(tok)} vs "
                         f"{tokenizer_hash(dtok)}); the target reads the draft's tokens, so they must share one")
    return Models(load(tp), load(dp), tok, make_judge(config, cache_dir, rank, device, dtype), device)


def make_judge(config: BuildConfig, cache_dir: Path | None = None, rank: int = 0, device: str = "cpu",
               dtype: torch.dtype = torch.float32):
    """The judge ``config`` asks for (None for ``judge="none"``), caching its answers in ``cache_dir``."""
    from datamodules import judges as J

    common = {"threshold": config.judge_threshold, "cache_dir": cache_dir, "cache_tag": str(rank)}
    if config.judge == "none":
        return None
    if config.judge == "http":
        return J.HTTPJudge(config.judge_url, config.judge_model, config.judge_template or DEFAULT_HTTP_TEMPLATE,
                           api=config.judge_api, api_key_env=config.judge_api_key_env, timeout=config.judge_timeout,
                           retries=config.judge_retries, **common)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    path = config.model_path("judge")
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    name = f"{Path(path).name}@{weights_stamp(path)}"  # a retrained judge must not reuse old cached answers
    if config.judge == "nli":
        model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True, dtype=dtype)
        return J.NLIJudge(model.to(device).eval(), tok, name=name, **common)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval()
    return J.LLMJudge(model, tok, config.judge_template or _default_template(config), yes=config.judge_yes,
                      no=config.judge_no, name=name, **common)


def weights_stamp(folder: str | os.PathLike, probe: int = 1 << 20) -> str:
    """Cheap content stamp of a model folder's weights: sha256 of each file's size, head and tail."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")) + sorted(Path(folder).glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(probe))
            fh.seek(max(0, size - probe))
            h.update(fh.read(probe))
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# One shard.


def shard_seed(seed: int, index: int, stream: str) -> int:
    """Seed of one random stream of one shard, independent of rank and of what was built before."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}:{stream}".encode()).digest()[:8], "little") & (2**63 - 1)


def _sample(model, tok, prefixes: list[Prefix], config: BuildConfig, seed: int, device: str) -> list[list[list[int]]]:
    g = torch.Generator(device=device).manual_seed(seed)
    stop = StepStopper(tok, config.delimiters, config.max_step_tokens)
    rows = generate(model, [p.token_ids for p in prefixes], max_new_tokens=config.max_step_tokens,
                    temperature=config.temperature, top_p=config.top_p, generator=g, stop=stop,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0, num_samples=config.n_samples)
    n = config.n_samples
    return [rows[i * n : (i + 1) * n] for i in range(len(prefixes))]


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
    tok, n, dev = models.tokenizer, config.n_samples, models.device
    pad = tok.pad_token_id or 0
    t0 = time.perf_counter()
    written = {w: _sample(m, tok, prefixes, config, shard_seed(config.seed, index, w), dev)
               for w, m in (("target", models.target), ("draft", models.draft))}
    t1 = time.perf_counter()
    joint = config.labelling == "joint"
    # per prefix: the target's samples then the draft's (sample j of prefix i has id i * 2N + j)
    both = [written["target"][i] + written["draft"][i] for i in range(len(prefixes))]
    t_reads = [both[i] if joint else written["target"][i] for i in range(len(prefixes))]
    ctx = [p.token_ids for p in prefixes]
    spec = config.feature_spec()
    feats = {  # {role: {group: (rows, ...)}}, from the function the decoder's verification pass calls
        "target": read_steps(models.target, ctx, t_reads, spec, pad, config.max_rows),
        "draft": read_steps(models.draft, ctx, written["draft"], spec, pad, config.max_rows),
    }
    t2 = time.perf_counter()
    texts = [[tok.decode(s, skip_special_tokens=True) for s in both[i]] for i in range(len(prefixes))]
    writers = np.array([TARGET] * n + [DRAFT] * n)
    tf = feats["target"]["hidden"].flatten(1).numpy().reshape(len(prefixes), -1, feats["target"]["hidden"][0].numel())
    df = feats["draft"]["hidden"].flatten(1).numpy().reshape(len(prefixes), n, -1)
    judge = models.judge
    judged_before = (judge.seconds, judge.calls) if judge is not None else (0.0, 0)
    if joint:
        groups = group_prefixes([(texts[i], tf[i]) for i in range(len(prefixes))], judge, config.cluster_config(), asked)
        labels = [joint_labels(g, writers) | {"groups": g} for g in groups]
    else:
        tg = group_prefixes([(texts[i][:n], tf[i]) for i in range(len(prefixes))], judge, config.cluster_config(), asked)
        dg = group_prefixes([(texts[i][n:], df[i]) for i in range(len(prefixes))], judge, config.cluster_config(), asked)
        labels = [per_model_labels(a, b) for a, b in zip(tg, dg)]
    t3 = time.perf_counter()
    judge_s = (judge.seconds - judged_before[0]) if judge is not None else 0.0
    tensors, records = _assemble(prefixes, texts, labels, feats, n, joint)
    for stage, dt in (("sampling", t1 - t0), ("reading", t2 - t1), ("clustering", t3 - t2 - judge_s), ("judge", judge_s),
                      ("labels", time.perf_counter() - t3)):
        timer[stage] = timer.get(stage, 0.0) + dt
    counts = {"prefixes": len(prefixes), "samples": 2 * n * len(prefixes),
              "groups": int(sum(int(l["groups"].max()) + 1 for l in labels)),
              "judge_calls": (judge.calls - judged_before[1]) if judge is not None else 0}
    return tensors, records, counts


def _assemble(prefixes, texts, labels, feats, n, joint) -> tuple[dict[str, torch.Tensor], list[dict]]:
    cols: dict[str, dict[str, list]] = {r: {k: [] for k in ("q", "p", "writer", "problem_id", "prefix_id", "sample_id",
                                                           "group_id", "group_entropy")} for r in ROLES}
    records = []
    for i, p in enumerate(prefixes):
        lab = labels[i]
        ids = np.arange(2 * n) + p.prefix_id * 2 * n
        writer = np.array([TARGET] * n + [DRAFT] * n)
        rows = {"target": np.arange(2 * n) if joint else np.arange(n), "draft": np.arange(n, 2 * n)}
        for r, idx in rows.items():
            c = cols[r]
            c["q"].append(lab["q"][idx]), c["p"].append(lab["p"][idx]), c["writer"].append(writer[idx])
            c["problem_id"].append(np.full(len(idx), p.problem_id)), c["prefix_id"].append(np.full(len(idx), p.prefix_id))
            c["sample_id"].append(ids[idx]), c["group_id"].append(lab["groups"][idx])
            c["group_entropy"].append(lab["entropy"][idx])
        records.append({"problem_id": p.problem_id, "prefix_id": p.prefix_id, "step_index": p.step_index, "prefix": p.text,
                        "samples": [{"sample_id": int(ids[j]), "writer": int(writer[j]), "text": texts[i][j],
                                     "group": int(lab["groups"][j]), "q": float(lab["q"][j]), "p": float(lab["p"][j])}
                                    for j in range(2 * n)]})
    dtypes = {"q": torch.float32, "p": torch.float32, "writer": torch.int8, "problem_id": torch.int64,
              "prefix_id": torch.int64, "sample_id": torch.int64, "group_id": torch.int32, "group_entropy": torch.float32}
    tensors: dict[str, torch.Tensor] = {}
    for r in ROLES:
        tensors[f"{r}.features"] = feats[r]["hidden"].flatten(1).to(torch.float16)  # group "hidden"
        tensors[f"{r}.token_stats"] = feats[r]["token_stats"].float()
        for k, dt in dtypes.items():
            tensors[f"{r}.{k}"] = torch.from_numpy(np.concatenate(cols[r][k])).to(dt)
        tensors[f"{r}.label"] = tensors[f"{r}.q" if r == "target" else f"{r}.p"].clone()
    return tensors, records


# ---------------------------------------------------------------------------------------------
# The build.


def dist_info() -> tuple[int, int]:
    """``(rank, world_size)`` from torch.distributed when initialised, else from RANK / WORLD_SIZE."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def is_complete(data_dir: str | os.PathLike) -> bool:
    """Whether ``data_dir`` holds a finished build (a manifest marked complete)."""
    m = S.read_manifest(data_dir)
    return bool(m and m.get("complete"))


def build(config: BuildConfig, data_dir: str | os.PathLike, *, max_shards: int | None = None, log=print) -> dict:
    """Build (or finish building) the dataset of ``config`` in ``data_dir``.

    Resumable: whole shards already on disk are kept; a shard is written under a temporary name
    and renamed, so a killed build never leaves half a shard. A finished build is checked against
    its manifest: shards that are missing or whose checksum differs are rebuilt, exactly those.
    Under torch.distributed (or with RANK / WORLD_SIZE set) each rank builds shards ``rank, rank +
    world_size, ...`` and rank 0 writes the manifest after a barrier. Each shard is built under a
    lock file (``.shard-00000.safetensors.lock``), so a second build into the same folder skips the
    shards another one is building and waits for them before writing the manifest.

    Args:
        config: what to build.
        data_dir: output folder.
        max_shards: stop after building this many new shards without writing the manifest
            (tests use it to simulate a kill).
        log: where the summary (and, when stderr is not a terminal, progress lines) go.

    Returns:
        The manifest (``complete=False`` and no checksums when stopped by ``max_shards``).

    Raises:
        ValueError: ``data_dir`` holds shards built for another config (naming the differing fields),
            cannot be created, or the task is empty or malformed (naming file and line), ... Every
            input is checked before anything is written.
        RuntimeError: an ``http`` judge stayed unreachable after its retries (finished shards stay).
    """
    data_dir = Path(data_dir)
    rank, world = dist_info()
    sig = signature(config)
    # Check every input before writing anything (issue 12): a refused build leaves no build.json behind.
    records = load_problems(config.task_file, config.n_problems, config.task_seed)
    _check_traces(config, records)
    existing, pinned = _check_recorded(data_dir, sig, log)
    _make_data_dir(data_dir)
    expected: dict[int, tuple[str, str]] = {}  # shard -> checksums a finished build recorded (rebuild what differs)
    if existing and existing.get("complete"):
        damaged = _damaged_shards(data_dir, existing)
        if not damaged:
            log(f"reusing {len(existing['shards'])} shards in {data_dir}")
            return existing
        log(f"{data_dir}: {len(damaged)} of {len(existing['shards'])} shards are missing or differ from manifest.json "
            f"({', '.join(S.shard_name(k) for k in damaged)}); rebuilding exactly those")
        expected = {k: (e["sha256"], e["steps_sha256"]) for k, e in enumerate(existing["shards"]) if k in damaged}
    if rank == 0 and not pinned:
        S.atomic_write_json(data_dir / "build.json", {"build": sig, "config": dataclasses.asdict(config)})

    timer: dict[str, float] = {}
    t0 = time.perf_counter()
    plan = _plan(config, records, data_dir, rank, timer)
    n_shards = len(plan["shards"])

    def needs(k: int) -> bool:
        """Shard ``k`` is not on disk, or differs from what the finished build recorded."""
        path = data_dir / S.shard_name(k)
        if not path.is_file():
            return True
        if k in expected:
            if (S.sha256_file(path), _sha_or_none(data_dir / S.steps_name(k))) != expected[k]:
                return True
            del expected[k]  # rebuilt (by us or another build): stop hashing it
        return False

    on_disk = {k for k in range(n_shards) if not needs(k)}
    mine = [k for k in range(n_shards) if k % world == rank and k not in on_disk]
    totals = {"prefixes": 0, "samples": 0, "groups": 0, "judge_calls": 0, "cache_hits": 0}
    state: dict[str, Any] = {"models": None, "hits0": 0}
    bar = tqdm(total=len(mine), desc=f"build shards (rank {rank})", unit="shard", disable=None)
    progress = _Progress(len(mine), rank, log)

    def build_one(k: int) -> None:
        if state["models"] is None:  # loaded only when a shard is left to build
            t = time.perf_counter()
            state["models"] = load_models(config, data_dir / "judge-cache", rank)
            timer["loading"] = time.perf_counter() - t
            state["hits0"] = state["models"].judge.cache_hits if state["models"].judge is not None else 0
        tensors, recs, counts = build_shard(k, plan["shards"][k], state["models"], config, timer)
        S.atomic_write_bytes(data_dir / S.steps_name(k), "".join(json.dumps(r) + "\n" for r in recs).encode())
        # one metadata key: safetensors writes a map's keys in no fixed order, and shards must be byte-stable
        meta = {"semanticspec": json.dumps({"format_version": S.FORMAT_VERSION, "shard": k}, sort_keys=True)}
        S.write_shard(data_dir / S.shard_name(k), tensors, meta)
        for key, v in counts.items():
            totals[key] += v
        bar.set_postfix(prefixes=totals["prefixes"], groups=totals["groups"], judge_calls=totals["judge_calls"],
                        **{f"{s}_s": round(v, 1) for s, v in timer.items() if s in ("sampling", "reading", "judge")})

    def done_one(k: int) -> None:
        bar.update(1)
        progress.update()

    built = _build_locked(data_dir, mine, needs, build_one, done_one, max_shards)
    bar.close()
    models = state["models"]
    if models is not None and models.judge is not None:
        totals["cache_hits"] = models.judge.cache_hits - state["hits0"]
    stopped = max_shards is not None and any(needs(k) for k in range(n_shards))
    stats = {"this_run": totals, "seconds_per_stage": {k: round(v, 3) for k, v in timer.items()},
             "seconds": round(time.perf_counter() - t0, 3), "rank": rank, "world_size": world,
             "built_shards": len(built), "reused_shards": len(on_disk)}
    if stopped:
        return {"complete": False, "shards_on_disk": sum((data_dir / S.shard_name(k)).is_file() for k in range(n_shards)),
                "n_shards": n_shards, "stats": stats}
    import torch.distributed as dist

    synced = dist.is_available() and dist.is_initialized()
    _barrier()
    if rank != 0:
        if not synced:  # ranks launched without a process group: rank 0 merges once it sees every shard
            return {"complete": False, "rank": rank, "n_shards": n_shards, "stats": stats}
        _barrier()
        return json.loads((data_dir / S.MANIFEST).read_text())
    if not synced:
        _wait_for_shards(data_dir, n_shards, needs)
    manifest = _manifest(config, sig, data_dir, n_shards, len(records), plan["n_prefixes"], stats)
    S.atomic_write_json(data_dir / S.MANIFEST, manifest)
    _barrier()
    _summary(manifest, log)
    return manifest


def _check_traces(config: BuildConfig, records: list[dict]) -> None:
    """Reference prefixes need every problem's trace; name the file and lines that lack one."""
    if config.prefix_source != "reference":
        return
    bad = [r.get("line", i + 1) for i, r in enumerate(records) if not isinstance(r.get("trace"), str) or not r["trace"].strip()]
    if bad:
        where = f"{config.task_file}:{bad[0]}" + (f" (and {len(bad) - 1} more lines: {bad[1:6]})" if len(bad) > 1 else "")
        raise ValueError(f"{where} has no 'trace'; prefix_source='reference' cuts prefixes from each problem's trace "
                         "(a non-empty string): add the traces, or let the target write them with "
                         "--build.prefix_source target")


def _check_recorded(data_dir: Path, sig: dict, log) -> tuple[dict | None, bool]:
    """Refuse a folder holding shards of another config; returns ``(manifest or None, build.json matches)``.

    A folder without a single shard is not pinned by what it records (a build refused or killed
    before its first shard): its stale manifest and target traces are removed, build.json rewritten.
    """
    existing = S.read_manifest(data_dir) if data_dir.is_dir() else None
    started = data_dir / "build.json"
    recorded = [existing.get("build")] if existing else []
    recorded += [json.loads(started.read_text())["build"]] if started.is_file() else []
    diff = next((d for d in (signature_mismatches(r, sig) for r in recorded if r is not None) if d), [])
    if not diff:
        return existing, started.is_file()
    shards = sorted(data_dir.glob("shard-*.safetensors"))
    if shards:
        raise ValueError(f"{data_dir} holds {len(shards)} shards built for another config: " + "; ".join(diff)
                         + ". Use another data_dir or delete this one to rebuild.")
    rank, _ = dist_info()
    if rank == 0:
        log(f"{data_dir} holds no shard yet; its records of another config are replaced ({'; '.join(diff)})")
        for name in (S.MANIFEST, "target-traces.jsonl"):
            (data_dir / name).unlink(missing_ok=True)
    return None, False


def _make_data_dir(data_dir: Path) -> None:
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a folder under /proc, or a file in the way: "No such file" would not say which
        raise ValueError(f"cannot create data_dir {data_dir} ({e.strerror or e}); give a folder on a writable disk "
                         "(--data_dir, or --data.data_dir for python -m probes.fit)") from None
    if not os.access(data_dir, os.W_OK | os.X_OK):
        raise ValueError(f"data_dir {data_dir} is not writable; give a folder on a writable disk "
                         "(--data_dir, or --data.data_dir for python -m probes.fit)")


def _sha_or_none(path: Path) -> str | None:
    return S.sha256_file(path) if path.is_file() else None


def _damaged_shards(data_dir: Path, manifest: dict) -> list[int]:
    """Indices of the shards of a finished build that are missing or differ from their checksums."""
    return [k for k, e in enumerate(manifest["shards"])
            if (_sha_or_none(data_dir / e["file"]), _sha_or_none(data_dir / e["steps_file"])) != (e["sha256"], e["steps_sha256"])]


# ---------------------------------------------------------------------------------------------
# Shard locks: two builds into one folder share the work instead of both computing every shard.

LOCK_POLL_S = 2.0
"""Seconds between looks at shards another build holds."""
EMPTY_LOCK_STALE_S = 60.0
"""A lock file still empty after this long was left by a writer killed before it wrote its pid."""


def _lock_path(data_dir: Path, k: int) -> Path:
    return data_dir / f".{S.shard_name(k)}.lock"


def _try_lock(data_dir: Path, k: int) -> bool:
    """Take shard ``k``'s lock (O_CREAT|O_EXCL, holding ``host pid``); a lock whose process is gone is taken over."""
    path = _lock_path(data_dir, k)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, S.file_mode())
        except FileExistsError:
            if not _lock_is_stale(path):
                return False
            path.unlink(missing_ok=True)  # its builder died (same host, pid gone): take the shard over
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()}\n")
        return True
    return False


def _lock_is_stale(path: Path) -> bool:
    """Whether a lock's holder is known to be gone: same host and no such pid (another host's lock stays)."""
    try:
        text = path.read_text().split()
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return True  # released meanwhile
    if len(text) != 2 or not text[1].isdigit():
        return age > EMPTY_LOCK_STALE_S  # being written now, or its writer was killed before writing
    host, pid = text[0], int(text[1])
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _build_locked(data_dir: Path, pending: list[int], needs, build_one, done_one, max_shards: int | None) -> list[int]:
    """Build every shard of ``pending`` that ``needs`` building, each under its lock.

    Shards another build holds are skipped and looked at again until they are on disk (or their
    holder died and this build takes them over). Returns the shards this process built.
    """
    built: list[int] = []
    pending = list(pending)
    while pending:
        progressed = False
        for k in list(pending):
            if max_shards is not None and len(built) >= max_shards:
                return built
            if needs(k):
                if not _try_lock(data_dir, k):
                    continue  # another build is writing it
                try:
                    if needs(k):  # checked again under the lock: another build may have just finished it
                        build_one(k)
                        built.append(k)
                finally:
                    _lock_path(data_dir, k).unlink(missing_ok=True)
            pending.remove(k)
            done_one(k)
            progressed = True
        if pending and not progressed:
            time.sleep(LOCK_POLL_S)
    return built


PROGRESS_EVERY_S = 30.0
"""When stderr is not a terminal (CI, nohup, a log file), a progress line after a shard once this many seconds
passed since the last line..."""
PROGRESS_EVERY_SHARDS = 0.1
"""... or every time this share of the shards is done."""


class _Progress:
    """Progress lines for logs: tqdm draws a bar on a terminal and nothing elsewhere (issue 12)."""

    def __init__(self, total: int, rank: int, log):
        self.total, self.rank, self.log = total, rank, log
        self.enabled = total > 0 and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
        self.done = self.logged_done = 0
        self.t0 = self.logged_at = time.perf_counter()

    def update(self) -> None:
        self.done += 1
        now = time.perf_counter()
        step = max(1, int(self.total * PROGRESS_EVERY_SHARDS))
        if self.enabled and (self.done == self.total or now - self.logged_at >= PROGRESS_EVERY_S
                             or self.done - self.logged_done >= step):
            self.log(f"build (rank {self.rank}): {self.done}/{self.total} shards, {now - self.t0:.0f} s elapsed")
            self.logged_at, self.logged_done = now, self.done


def _wait_for_shards(data_dir: Path, n_shards: int, needs=None, poll_s: float = 2.0, timeout_s: float = 12 * 3600) -> None:
    """Rank 0 without a process group: wait until the other ranks' shards are all on disk (and as recorded)."""
    needs = needs or (lambda k: not (data_dir / S.shard_name(k)).is_file())
    t0 = time.time()
    while True:
        missing = [S.shard_name(k) for k in range(n_shards) if needs(k)]
        if not missing:
            return
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"rank 0 waited {timeout_s:.0f} s for {len(missing)} shards of the other ranks in {data_dir} "
                               f"(first: {missing[0]}); rerun the build to finish them")
        time.sleep(poll_s)


def _plan(config: BuildConfig, records: list[dict], data_dir: Path, rank: int, timer: dict) -> dict:
    """All prefixes, cut into shards. Target-written traces are generated once and kept on disk."""
    from transformers import AutoTokenizer

    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(config.model_path("target"), local_files_only=True)
    if config.prefix_source == "target":
        records = _target_traces(config, records, tok, data_dir, rank)
    prefixes = make_prefixes(records, tok, config.delimiters, config.prefix_source)
    timer["prefixes"] = timer.get("prefixes", 0.0) + time.perf_counter() - t
    k = config.shard_size
    return {"shards": [prefixes[i : i + k] for i in range(0, len(prefixes), k)], "n_prefixes": len(prefixes)}


def _target_traces(config: BuildConfig, records: list[dict], tok, data_dir: Path, rank: int) -> list[dict]:
    path = data_dir / "target-traces.jsonl"
    if rank == 0 and not path.is_file():
        from transformers import AutoModelForCausalLM

        device, dtype = config.resolved_device()
        model = AutoModelForCausalLM.from_pretrained(config.model_path("target"), local_files_only=True, dtype=dtype)
        out = target_traces(model.to(device).eval(), tok, records, max_new_tokens=16 * config.max_step_tokens,
                            temperature=config.temperature, top_p=config.top_p, seed=shard_seed(config.seed, -1, "traces"))
        S.atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in out).encode())
    _barrier()
    return [json.loads(line) for line in path.read_text().splitlines()]


def _manifest(config, sig, data_dir: Path, n_shards: int, n_problems: int, n_prefixes: int, stats: dict) -> dict:
    shards, rows = [], {r: 0 for r in ROLES}
    width = {}
    for k in range(n_shards):
        path = data_dir / S.shard_name(k)
        shapes = S.shard_shapes(path)
        count = {r: shapes[f"{r}.features"][0] for r in ROLES}
        for r in ROLES:
            rows[r] += count[r]
            width[r] = shapes[f"{r}.features"][1]
        shards.append({"file": path.name, "sha256": S.sha256_file(path), "bytes": path.stat().st_size, "count": count,
                       "steps_file": S.steps_name(k), "steps_sha256": S.sha256_file(data_dir / S.steps_name(k))})
    # One record of what the data is: ``build`` (models read, layers, pooling, feature groups, step
    # delimiters, label provenance), which rebuilds and the datamodule compare; no top-level copies (issue 12).
    return {
        "format_version": S.FORMAT_VERSION,
        "complete": True,
        "build": sig,
        "config": dataclasses.asdict(config),
        "roles": {r: {"width": width.get(r, len(config.layer_ids) * sig["reads"][r]["hidden_size"]), "rows": rows[r]}
                  for r in ROLES},
        "n_problems": n_problems,
        "n_prefixes": n_prefixes,
        "shards": shards,
        "stats": stats,
    }


def _summary(manifest: dict, log) -> None:
    st = manifest["stats"]
    t = st["this_run"]
    built, reused = st["built_shards"], st["reused_shards"]
    others = len(manifest["shards"]) - built - reused
    log(f"built {built} shards, reused {reused}" + (f", {others} built by other processes" if others else "")
        + f" in {st['seconds']:.1f} s: {t['prefixes']} prefixes, {t['samples']} samples, "
        f"{t['groups']} groups, {t['judge_calls']} judge calls, {t['cache_hits']} cache hits; rows "
        + ", ".join(f"{r}={v['rows']}" for r, v in manifest["roles"].items()))
    log("seconds per stage: " + ", ".join(f"{k} {v:.1f}" for k, v in st["seconds_per_stage"].items()))


def main(args: list[str] | None = None) -> dict:
    """CLI: ``python -m datamodules.build [--config build.yaml] [--data_dir DIR] [--build.KEY VALUE ...]``."""
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    class OneLineParser(ArgumentParser):
        def error(self, message: str, ex: Exception | None = None):
            if not self.exit_on_error:  # jsonargparse asks for an exception here
                super().error(message, ex)
            _fail(message)

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings become --help text
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML with data_dir and build.* keys")
    parser.add_argument("--fit_config", type=str | None, default=None,
                        help="Take data_dir and build from the data: section of a `python -m probes.fit` YAML "
                             "(later options override it).")
    parser.add_argument("--data_dir", type=str, default="data/arithmetic", help="Output folder of shards and manifest.json.")
    parser.add_argument("--max_shards", type=int | None, default=None, help="Stop after this many new shards (no manifest).")
    parser.add_class_arguments(BuildConfig, "build")
    args = list(sys.argv[1:] if args is None else args)
    if "--fit_config" in args:  # the fit YAML's data: section, then the other options on top
        i = args.index("--fit_config")
        if i + 1 >= len(args) or not Path(args[i + 1]).is_file():
            _fail(f"--fit_config {' '.join(args[i + 1 : i + 2])}: expected the path of a `python -m probes.fit` YAML")
        data = (yaml.safe_load(Path(args[i + 1]).read_text()) or {}).get("data") or {}
        section = {"data_dir": data.get("data_dir", "data/arithmetic"), "build": data.get("build") or {}}
        args = ["--config", yaml.safe_dump(section)] + args[:i] + args[i + 2 :]
    cfg = parser.parse_args(args)
    _, world = dist_info()
    import torch.distributed as dist

    if world > 1 and not dist.is_initialized() and "MASTER_ADDR" in os.environ:
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(hours=12))
    try:
        config = parser.instantiate(cfg).build
        return build(config, cfg.data_dir, max_shards=cfg.max_shards)
    except (ValueError, FileNotFoundError) as e:  # refused input: config values, task file, data_dir, models
        _fail(str(e))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PROG = "python -m datamodules.build"


def _fail(message: str) -> NoReturn:
    """Report bad input as one line on stderr and exit 2 (issue 12: no traceback, no page of usage)."""
    noise = ("Subtypes:", "Errors:", "Given value type:")  # jsonargparse explains a type error over several lines
    text = " ".join(line.strip() for line in str(message).splitlines() if line.strip() and not line.strip().startswith(noise))
    print(f"{PROG}: error: {text} (see `{PROG} --help`)", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
