"""What a label build is: :class:`BuildConfig` and the signature a manifest records.

The signature (:func:`signature`) holds the facts two builds must share for their data to mix
(models read, layers, pooling, feature groups, steps, label provenance); a rebuild and the
datamodule compare a folder's recorded signature with the config's (:func:`signature_mismatches`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from datamodules import shards as S
from datamodules.clustering import ClusterConfig
from datamodules.labels import LABELLINGS
from generation.features import TOKEN_STATS, FeatureSpec, check_groups
from generation.steps import DEFAULT_DELIMITERS

JUDGES = ("llm", "http", "nli", "none")
ROLES = S.ROLES
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
        out["template"] = config.judge_template or default_template(config)
    if config.judge == "llm" and (config.judge_yes, config.judge_no) != (" yes", " no"):
        out["answers"] = [config.judge_yes, config.judge_no]  # recorded only when not the default
    return out


def default_template(config: BuildConfig) -> str:
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
