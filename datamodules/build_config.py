"""What a label build is: :class:`BuildConfig` and the signature a manifest records.

The signature (:func:`signature`) holds the facts two builds must share for their data to mix
(models read, layers, pooling, feature groups, steps, label provenance); a rebuild and the
datamodule compare a folder's recorded signature with the config's (:func:`signature_mismatches`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from datamodules import shards as S
from datamodules.build_parts import (  # noqa: F401  (re-exported: the parts are the config's public names too)
    BACKENDS,
    DEFAULT_HTTP_TEMPLATE,
    JUDGES,
    PARTS,
    ROLES,
    ClusteringConfig,
    EndpointConfig,
    JudgeConfig,
    OpenAIConfig,
    SamplingConfig,
    StepConfig,
    VLLMConfig,
    at_least,
    choices,
)
from datamodules.clustering import ClusterConfig
from datamodules.labels import LABELLINGS
from datamodules.tasks import ArithmeticTask, Task
from generation.features import TOKEN_STATS, FeatureSpec, check_groups


@dataclass
class BuildConfig:
    """Everything that decides a label build. Defaults: the embedded arithmetic world."""

    task: Task | None = None
    """Problems, prompt format, step delimiters, answer checker (:mod:`datamodules.tasks`), by
    ``class_path``/``init_args``; None = the embedded arithmetic world (``ArithmeticTask``). A file task
    (``BoxedMathTask``, ``MultipleChoiceTask``, your own) reads JSONL ``{"problem", "trace"?, "answer"}``
    from ``init_args.path``."""
    n_problems: int = 200
    """Problems to generate (for a file task: at most this many lines, 0 = all). 200 world problems give
    about 900 prefixes, 14k target rows and 7k draft rows in about a minute on 2 CPU cores."""
    task_seed: int = 1
    """Seed of the task's problem generator (a file task ignores it)."""
    prefix_source: str = "reference"
    """Traces to cut into prefixes: ``reference`` (the task's) or ``target`` (the target's own generations)."""
    target: str | None = None
    """Folder of the target model; None = the embedded world's (``world_root()/target``)."""
    draft: str | None = None
    """Folder of the draft model; None = the embedded world's (``world_root()/draft``)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The equivalence judge."""
    clustering: ClusteringConfig = field(default_factory=ClusteringConfig)
    """How samples are grouped by meaning."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How steps are sampled (recorded in the manifest; the probes carry it)."""
    steps: StepConfig = field(default_factory=StepConfig)
    """What a step is (recorded in the manifest; the probes carry it)."""
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

    def __post_init__(self) -> None:
        errors = []
        task = self.resolved_task()
        if not isinstance(task, Task):
            errors.append(f"task={task!r}: expected a datamodules.tasks.Task (class_path and init_args in YAML)")
        else:
            errors += task.errors(self.n_problems)
            if isinstance(self.steps, StepConfig) and self.steps.delimiters is None:
                self.steps.delimiters = list(task.delimiters)
        for name, cls in PARTS.items():
            part = getattr(self, name)
            if not isinstance(part, cls):
                errors.append(f"{name}={part!r}: expected a {cls.__name__}")
            else:
                errors += [f"{name}.{e}" for e in part.errors()]
        errors += choices(self, {"prefix_source": ("reference", "target"), "pooling": ("mean", "last"),
                                  "labelling": LABELLINGS})
        errors += at_least(self, n_problems=0, shard_size=1, max_rows=1)
        if isinstance(self.judge, JudgeConfig) and isinstance(self.clustering, ClusteringConfig) \
                and self.judge.kind == "none" and self.clustering.method != "hdbscan":
            if self.clustering.method == "judge":
                errors.append("clustering.method='judge' needs a judge, but judge.kind='none'")
            else:
                self.clustering.method = "hdbscan"  # no judge: HDBSCAN alone
        if not self.layer_ids:
            errors.append("layer_ids is empty: give at least one layer, e.g. [-1]")
        errors += check_groups(["hidden", "token_stats"], self.token_stats)
        if not (self.device in ("auto", "cpu", "cuda", "mps") or self.device.startswith("cuda:")):
            errors.append(f"device={self.device!r}: expected auto, cpu, cuda, cuda:N or mps")
        if errors:
            raise ValueError("invalid BuildConfig: " + "; ".join(errors))

    def resolved_task(self) -> Task:
        """The task: ``task``, or the embedded world's when it is None (kept None so the config prints as YAML)."""
        return ArithmeticTask() if self.task is None else self.task

    def model_path(self, role: str) -> str:
        """Folder of ``target``, ``draft`` or the ``judge`` (world defaults resolved now)."""
        from datamodules.arithmetic.models import world_root

        given = {"target": self.target, "draft": self.draft, "judge": self.judge.model}[role]
        if not given:
            return str(world_root() / role)
        from datamodules.models import local_model_dir

        return local_model_dir(given)  # a GGUF or ``pypi:PACKAGE`` becomes its converted, cached folder

    def cluster_config(self) -> ClusterConfig:
        """The clustering algorithm's settings (``datamodules.clustering``) for this build."""
        return ClusterConfig(**dataclasses.asdict(self.clustering))

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
    j = config.judge
    if j.kind == "none":
        return {"kind": "none"}
    out: dict[str, Any] = {"kind": j.kind, "threshold": j.threshold}
    if j.kind in ("llm", "nli"):
        path = config.model_path("judge")
        out["model"] = folder_fingerprint(path) if Path(path).is_dir() else {"name_or_path": path}
    else:
        out.update(model=j.model, url=j.url, api=j.api)
    if j.kind in ("llm", "http"):
        out["template"] = j.template or default_template(j)
    if j.kind == "llm" and (j.yes_answer, j.no_answer) != (" yes", " no"):
        out["answers"] = [j.yes_answer, j.no_answer]  # recorded only when not the default
    return out


def default_template(judge: JudgeConfig) -> str:
    """The prompt of a judge given no ``template``: the world's (``llm``) or a plain question (``http``)."""
    from datamodules.arithmetic.tokenizer import JUDGE_TEMPLATE

    return JUDGE_TEMPLATE if judge.kind == "llm" else DEFAULT_HTTP_TEMPLATE


def label_provenance(config: BuildConfig) -> dict[str, Any]:
    """The ``labels`` entry of a probe's input spec: labelling, clustering, judge, step cap, seed."""
    cc = config.cluster_config()
    params = {"min_cluster_size": cc.min_cluster_size, "membership_threshold": cc.membership_threshold,
              "merge_distance": cc.merge_distance, "votes": cc.votes, "max_candidates": cc.max_candidates,
              "match_numbers": cc.match_numbers}
    # max_step_tokens stays here too: probes exported before the step spec had its own entry read it from labels
    return {"labelling": config.labelling, "clustering": cc.method, "clustering_params": params,
            "max_step_tokens": config.steps.max_step_tokens, "judge": judge_provenance(config),
            "seed": config.sampling.seed}


def sampling_spec(config: BuildConfig) -> dict[str, Any]:
    """The ``sampling`` entry: how the labelled steps were sampled (the probes carry it to the decoder)."""
    return {k: getattr(config.sampling, k) for k in S.SAMPLING_KEYS}


def problems_provenance(config: BuildConfig) -> dict[str, Any]:
    """The ``problems`` entry: the task (its class and arguments, or file and checksum), count, seed, prefix source."""
    task = config.resolved_task()
    return {**task.provenance(config.n_problems, config.task_seed), "prefix_source": config.prefix_source}


def config_record(config: BuildConfig) -> dict[str, Any]:
    """The config as JSON (build.json, the manifest's ``config``); the task as its ``class_path``/``init_args``."""
    return {f.name: config.resolved_task().spec() if f.name == "task" else _plain(getattr(config, f.name))
            for f in dataclasses.fields(config)}


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def signature(config: BuildConfig) -> dict[str, Any]:
    """The facts two builds must share for their data to mix; read from folders, no weights loaded."""
    return {
        "format_version": S.FORMAT_VERSION,
        "reads": {r: folder_fingerprint(config.model_path(r)) for r in ROLES},
        "layer_ids": list(config.layer_ids),
        "pooling": config.pooling,
        "feature_groups": ["hidden", "token_stats"],
        "token_stats": list(config.token_stats),
        "delimiters": list(config.steps.delimiters),
        "max_step_tokens": config.steps.max_step_tokens,
        "sampling": sampling_spec(config),
        "sampler": config.sampling.backend,
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
