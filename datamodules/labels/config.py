"""What a label build is: :class:`BuildConfig`, its parts, and the signature a manifest records.

Each part (judge, clustering, sampling with its backends, steps) only holds values and lists what is
wrong with them (``errors()``, names relative to the part); :class:`BuildConfig` checks them all at
once, naming each bad value by its full dotted name (``sampling.n_samples=0``), which a part checking
itself could not know.

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

from datamodules.labels import shards as S
from datamodules.labels.clustering import ClusteringConfig, at_least, choices
from datamodules.labels.shares import LABELLINGS
from datamodules.tasks.base import Task
from datamodules.tasks.worlds import default_world
from generation.fingerprints import weights_stamp
from generation.specs import (FEATURE_GROUPS, TOKEN_STATS, TOPK_STATS, FeatureSpec, SamplingSpec, StepSpec,
                              check_groups, layer_problems, plain)


JUDGES = ("llm", "http", "nli", "none")
BACKENDS = ("hf", "openai", "vllm")
"""Sampling backends (:mod:`datamodules.labels.samplers`)."""
ROLES = S.ROLES
DEFAULT_HTTP_TEMPLATE = (
    "Do these two reasoning steps state the same thing?\nStep A: {a}\nStep B: {b}\nAnswer with yes or no."
)
@dataclass
class JudgeConfig:
    """The equivalence judge that settles what clustering leaves uncertain (YAML: ``build.judge.*``)."""

    kind: str = "llm"
    """``llm`` (causal LM folder), ``http`` (OpenAI-compatible), ``nli``, or ``none`` (HDBSCAN only)."""
    model: str | None = None
    """Judge model: a folder for ``llm``/``nli`` (None = the world's judge), the model name for ``http``."""
    template: str | None = None
    """Judge prompt with ``{a}`` and ``{b}``; None = the world's ``JUDGE_TEMPLATE`` (llm) or a plain question (http)."""
    yes_answer: str = " yes"
    """``llm`` judge: the answer meaning "same" (its first token's probability is read); the default is a space
    then ``yes``, the word as it follows the prompt; chat models often say ``Yes``. (Not a bare ``yes:`` key:
    YAML reads that as a boolean.)"""
    no_answer: str = " no"
    """``llm`` judge: the answer meaning "different"; the default is a space then ``no``."""
    url: str = ""
    """Base URL of the ``http`` judge, e.g. ``http://127.0.0.1:8000/v1``."""
    api: str = "chat"
    """``http`` judge route: ``chat`` (/chat/completions) or ``completions``."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the ``http`` judge's API key (never logged)."""
    timeout: float = 30.0
    """Seconds per ``http`` judge request."""
    retries: int = 3
    """Attempts per ``http`` judge request before the build fails."""
    threshold: float = 0.5
    """Combined P(same) from which two steps are one meaning."""

    def errors(self) -> list[str]:
        """What is wrong, one ``name=value: expected ...`` per problem (names relative to this part)."""
        out = choices(self, {"kind": JUDGES, "api": ("chat", "completions")}) + at_least(self, retries=1)
        if self.kind == "http" and not self.url:
            out.append("url='': kind='http' needs url (e.g. http://127.0.0.1:8000/v1)")
        if self.kind in ("http", "nli") and not self.model:
            what = "the model name the server expects" if self.kind == "http" else "a sequence-classification folder"
            out.append(f"model=None: kind={self.kind!r} needs model ({what})")
        if not 0 < self.threshold < 1:
            out.append(f"threshold={self.threshold}: expected in (0, 1)")
        if self.template is not None:
            out += _template_errors(self.template)
        if self.timeout <= 0:
            out.append(f"timeout={self.timeout}: expected > 0")
        out += [f"{name}={getattr(self, name)!r}: expected the answer's text, e.g. ' yes' (the judge reads the "
                "probability of its first token)" for name in ("yes_answer", "no_answer") if not getattr(self, name)]
        if self.yes_answer and self.yes_answer == self.no_answer:
            out.append(f"yes_answer={self.yes_answer!r}, no_answer={self.no_answer!r}: expected two different answers")
        return out


def _template_errors(template: str) -> list[str]:
    """What keeps ``template`` from being a judge prompt: it must hold ``{a}`` and ``{b}`` and format with them alone
    (a literal brace doubled, as ``str.format`` reads it)."""
    try:
        template.format(a="", b="")
    except (KeyError, IndexError, ValueError) as e:
        return [f"template={template!r}: {{a}} and {{b}} are its only fields (double a literal brace: {{{{ }}}}); "
                f"str.format says {type(e).__name__}: {e}"]
    missing = [f for f in ("{a}", "{b}") if f not in template]
    return [f"template={template!r}: lacks {' and '.join(missing)}"] if missing else []


@dataclass
class EndpointConfig:
    """OpenAI-compatible servers that serve one model (YAML: ``build.sampling.openai.target`` / ``.draft``)."""

    urls: list[str] = field(default_factory=list)
    """Base URLs, e.g. ``[http://127.0.0.1:8000/v1]``; several spread the load (round-robin, per rank)."""
    model: str | None = None
    """The model name the servers expect; None = the one model the first server lists."""


@dataclass
class OpenAIConfig:
    """The ``openai`` sampling backend (YAML: ``build.sampling.openai.*``): the models' servers write the steps; see
    :mod:`datamodules.labels.openai_sampler`."""

    target: EndpointConfig = field(default_factory=EndpointConfig)
    """Servers of the target model."""
    draft: EndpointConfig = field(default_factory=EndpointConfig)
    """Servers of the draft model."""
    engine: str | None = None
    """The servers' engine: ``llama.cpp`` (llama-cpp-python's server), ``vllm`` or ``sglang``; None = told from the
    first server's routes."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (never logged); unset or empty = no key."""
    concurrency: int = 8
    """Requests in flight per model."""
    timeout: float = 120.0
    """Seconds per request attempt."""
    retries: int = 3
    """Attempts per request (connection errors, timeouts, 429 and 5xx are retried with backoff)."""

    def errors(self) -> list[str]:
        out = at_least(self, concurrency=1, retries=1)
        if self.engine is not None:
            out += choices(self, {"engine": ENGINES})
        if self.timeout <= 0:
            out.append(f"timeout={self.timeout}: expected > 0")
        for role in ROLES:
            e = getattr(self, role)
            if not isinstance(e, EndpointConfig):
                out.append(f"{role}={e!r}: expected urls and model")
                continue
            if not e.urls:
                out.append(f"{role}.urls=[]: give the base URL of at least one server, e.g. http://127.0.0.1:8000/v1")
            out += [f"{role}.urls: {u!r} is not an http(s) URL" for u in e.urls
                    if not str(u).startswith(("http://", "https://"))]
        return out


READERS = ("hf", "engine")
"""Reading backends: in-process transformers copies, or each model's server
(:mod:`datamodules.labels.engine_reading`)."""
ENGINES = ("llama.cpp", "vllm", "sglang")


@dataclass
class ReadingConfig:
    """Who reads the sampled steps for their features (YAML: ``build.reading.*``)."""

    backend: str = "hf"
    """``hf``: in-process transformers copies of both models (every feature group); ``engine``: each model's
    server reads its steps (``topk_stats``, and on SGLang ``hidden``) and no model is loaded in the build."""
    engine: str = "llama.cpp"
    """The servers' engine: ``llama.cpp`` (llama-cpp-python's server), ``vllm`` or ``sglang``."""
    target: EndpointConfig = field(default_factory=EndpointConfig)
    """The target's server (its first URL); empty = ``sampling.openai.target``'s."""
    draft: EndpointConfig = field(default_factory=EndpointConfig)
    """The draft's server; empty = ``sampling.openai.draft``'s."""
    hidden: bool = False
    """Also read the last layer's hidden states (SGLang started with ``--enable-return-hidden-states`` only)."""
    concurrency: int = 1
    """Prefixes read at once (1 keeps llama.cpp's single cached sequence; more for engines that batch)."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the servers' API key (never logged)."""
    timeout: float = 120.0
    """Seconds per request attempt."""
    retries: int = 3
    """Attempts per request."""

    def errors(self) -> list[str]:
        out = choices(self, {"backend": READERS, "engine": ENGINES}) + at_least(self, concurrency=1, retries=1)
        if self.timeout <= 0:
            out.append(f"timeout={self.timeout}: expected > 0")
        if self.hidden and self.engine != "sglang":
            out.append(f"hidden=True with engine={self.engine!r}: only SGLang returns hidden states over HTTP; "
                       "read topk_stats only (hidden=False) or serve the models with SGLang")
        return out

    def endpoint(self, role: str, sampling: "SamplingConfig") -> EndpointConfig:
        """The server reading ``role``'s steps: this part's, else the ``openai`` sampling backend's."""
        own = getattr(self, role)
        return own if own.urls or sampling.backend != "openai" else getattr(sampling.openai, role)


@dataclass
class VLLMConfig:
    """The ``vllm`` sampling backend (YAML: ``build.sampling.vllm.*``): vLLM's offline engine in this process."""

    tensor_parallel_size: int = 1
    """GPUs each model's engine is sharded over."""
    gpu_memory_utilization: float = 0.4
    """Share of GPU memory each engine takes; leave room for the other engine and for reading with transformers."""
    dtype: str = "auto"
    """vLLM's ``dtype``."""

    def errors(self) -> list[str]:
        out = at_least(self, tensor_parallel_size=1)
        if not 0 < self.gpu_memory_utilization <= 1:
            out.append(f"gpu_memory_utilization={self.gpu_memory_utilization}: expected in (0, 1]")
        return out


@dataclass
class SamplingConfig:
    """How steps are sampled from each model after every prefix (YAML: ``build.sampling.*``)."""

    backend: str = "hf"
    """Who samples: ``hf`` (the package's sampler, no server), ``openai`` (OpenAI-compatible servers, see
    ``openai``) or ``vllm`` (vLLM's offline engine, GPUs; ``pip install "semanticspec-probes[vllm]"``).
    Reading the steps and labelling always stay in the package."""
    openai: OpenAIConfig = field(default_factory=OpenAIConfig)
    """The ``openai`` backend's servers and client settings (read only with ``backend: openai``)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The ``vllm`` backend's engine settings (read only with ``backend: vllm``)."""
    n_samples: int = 8
    """Steps sampled per prefix from each model (paper: 20)."""
    temperature: float = SamplingSpec.temperature
    """Sampling temperature (paper: 0.6; the default is :class:`~generation.specs.SamplingSpec`'s)."""
    top_p: float = SamplingSpec.top_p
    """Nucleus mass (paper: 0.95)."""
    seed: int = 0
    """Seed of sampling; with the same seed a build is reproducible."""

    def errors(self) -> list[str]:
        """What is wrong (names relative to this part)."""
        out = at_least(self, n_samples=1) + choices(self, {"backend": BACKENDS})
        for name, cls in (("openai", OpenAIConfig), ("vllm", VLLMConfig)):
            part = getattr(self, name)
            if not isinstance(part, cls):
                out.append(f"{name}={part!r}: expected a {cls.__name__}")
            elif self.backend == name:
                out += [f"{name}.{e}" for e in part.errors()]
        return out + SamplingSpec.errors(self.temperature, self.top_p)

    @property
    def spec(self) -> SamplingSpec:
        """Temperature and top-p as the typed spec the manifest records and the probes carry."""
        return SamplingSpec(self.temperature, self.top_p)


PARTS = {"judge": JudgeConfig, "clustering": ClusteringConfig, "sampling": SamplingConfig, "reading": ReadingConfig}
"""The nested parts of :class:`BuildConfig`, by field name."""


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
    reading: ReadingConfig = field(default_factory=ReadingConfig)
    """Who reads the steps for their features: in-process models (``hf``) or the models' servers (``engine``)."""
    steps: StepSpec = field(default_factory=StepSpec)
    """What a step is (recorded in the manifest; the probes carry it). Delimiters left at the default become the
    task's when the task has its own."""
    layer_ids: list[int] = field(default_factory=lambda: [-1])
    """HF ``hidden_states`` indices to pool (0 = embeddings, -1 = last layer)."""
    pooling: str = "mean"
    """``mean`` over the step's tokens or ``last``."""
    token_stats: list[str] = field(default_factory=lambda: list(TOKEN_STATS))
    """Token statistics stored per step (feature group ``token_stats``), from the reading forward's logits.
    Every build also stores the ``hidden`` group (pooled states of ``layer_ids``), which clustering uses."""
    top_k: int = 20
    """``topk_stats``: how many of the reading model's largest log-probs the top-k statistics see (>= 5)."""
    topk_stats: list[str] = field(default_factory=lambda: list(TOPK_STATS))
    """Top-k statistics stored per step (feature group ``topk_stats``): exact from the token's log-prob and the
    ``top_k`` largest, so probes reading only them can be fed by a server's top-k answer."""
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
            errors.append(f"task={task!r}: expected a datamodules.tasks.base.Task (class_path and init_args in YAML)")
        else:
            errors += task.errors(self.n_problems)
            if isinstance(self.steps, StepSpec) and self.steps.delimiters == StepSpec.delimiters:
                self.steps = dataclasses.replace(self.steps, delimiters=tuple(task.delimiters))
        if not isinstance(self.steps, StepSpec):
            errors.append(f"steps={self.steps!r}: expected a generation.specs.StepSpec")
        for name, cls in PARTS.items():
            part = getattr(self, name)
            if not isinstance(part, cls):
                errors.append(f"{name}={part!r}: expected a {cls.__name__}")
            else:
                errors += [f"{name}.{e}" for e in part.errors()]
        errors += choices(self, {"prefix_source": ("reference", "target"), "pooling": ("mean", "last"),
                                  "labelling": LABELLINGS})
        said = {e.split("=", 1)[0] for e in errors}  # one reason per value: the task's own n_problems rule wins
        errors += [e for e in at_least(self, n_problems=0, task_seed=0, shard_size=1, max_rows=1)
                   if e.split("=", 1)[0] not in said]
        if isinstance(self.judge, JudgeConfig) and isinstance(self.clustering, ClusteringConfig) \
                and self.judge.kind == "none" and self.clustering.method != "hdbscan":
            if self.clustering.method == "judge":
                errors.append("clustering.method='judge' needs a judge, but judge.kind='none'")
            else:
                self.clustering.method = "hdbscan"  # no judge: HDBSCAN alone
        errors += layer_problems(self.layer_ids)
        errors += check_groups(list(FEATURE_GROUPS), self.token_stats, self.topk_stats)
        errors += FeatureSpec.origin_errors(self.top_k, "transformers", "final_norm")
        errors += self._reading_errors()
        if not (self.device in ("auto", "cpu", "cuda", "mps") or self.device.startswith("cuda:")):
            errors.append(f"device={self.device!r}: expected auto, cpu, cuda, cuda:N or mps")
        if errors:
            raise ValueError("invalid BuildConfig: " + "; ".join(errors))

    def _reading_errors(self) -> list[str]:
        """An engine reader needs each role's server, and clusters without hidden states only through the judge."""
        r = self.reading
        if not isinstance(r, ReadingConfig) or r.backend != "engine" or not isinstance(self.sampling, SamplingConfig):
            return []
        out = [f"reading.{role}.urls=[]: reading.backend='engine' needs the {role}'s server (or sampling.backend "
               "'openai' with its urls)" for role in ROLES if not r.endpoint(role, self.sampling).urls]
        if not r.hidden and isinstance(self.clustering, ClusteringConfig) and self.clustering.method != "judge":
            out.append(f"clustering.method={self.clustering.method!r} with reading.backend='engine': HDBSCAN clusters "
                       "hidden states, which this engine does not return; use clustering.method 'judge' (or "
                       "reading.hidden: true on SGLang)")
        return out

    def resolved_task(self) -> Task:
        """The task: ``task``, or the embedded world's when it is None (kept None so the config prints as YAML)."""
        return default_world().task() if self.task is None else self.task

    def labelled_problems(self, n_problems: int | None = None, task_seed: int | None = None) -> set[str]:
        """The texts of the problems this build labels (``n_problems`` and ``task_seed``: the build's own unless
        given, e.g. as its manifest recorded them), which held-out problems must not be among."""
        n = self.n_problems if n_problems is None else n_problems
        seed = self.task_seed if task_seed is None else task_seed
        return {p["problem"] for p in self.resolved_task().problems(n, seed)}

    def model_path(self, role: str) -> str:
        """Folder of ``target``, ``draft`` or the ``judge`` (world defaults resolved now)."""
        given = {"target": self.target, "draft": self.draft, "judge": self.judge.model}[role]
        if not given:
            return str(default_world().model_root() / role)
        from generation.loading import local_model_dir

        return local_model_dir(given)  # a GGUF or ``pypi:PACKAGE`` becomes its converted, cached folder

    def feature_spec(self) -> FeatureSpec:
        """The feature groups this build stores. Read in-process: ``hidden``, ``token_stats`` and ``topk_stats``.
        Read by the models' servers: ``topk_stats`` (and ``hidden``, the last layer, on SGLang), recorded with
        the engine as their source and its norm convention."""
        r = self.reading
        if r.backend == "engine":
            from generation.engines import HIDDEN_NORM

            groups = (["hidden"] if r.hidden else []) + ["topk_stats"]
            return FeatureSpec(groups, [-1], self.pooling, [], self.top_k, list(self.topk_stats), source=r.engine,
                               hidden_norm=HIDDEN_NORM.get(r.engine, "final_norm"))
        return FeatureSpec(FEATURE_GROUPS, list(self.layer_ids), self.pooling, list(self.token_stats), self.top_k,
                           list(self.topk_stats))

    def resolved_device(self) -> tuple[str, Any]:
        """The device and the ``torch.dtype`` models run in; with several ranks, ``cuda`` means this rank's GPU
        (LOCAL_RANK). (torch is imported here, not with the module: jsonargparse reads this module's annotations,
        even under ``TYPE_CHECKING``, and the command lines parse before torch loads.)"""
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and torch.cuda.is_available():
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"
        return device, (torch.bfloat16 if device.startswith("cuda") else torch.float32)


# ---------------------------------------------------------------------------------------------
# What a build is: the signature a manifest records and a config is compared with.


def folder_fingerprint(path: str, option: str = "model folder") -> dict[str, Any]:
    """Fingerprint of a model folder from its ``config.json`` and tokenizer, without loading weights.

    Raises:
        FileNotFoundError: ``path`` is no folder, naming ``option`` (the setting that gave it, e.g. ``build.target``).
        ValueError: transformers cannot read it as a model with a tokenizer, naming ``option`` and transformers' reason.
    """
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer

    from generation.fingerprints import model_fingerprint

    if not Path(path).is_dir():
        what = "a file, not a model folder" if Path(path).exists() else "no such folder"
        raise FileNotFoundError(f"{option}={path}: {what}")
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{option}={path}: not a model folder transformers can read ({e})") from e
    return model_fingerprint(SimpleNamespace(config=cfg), tok)


def judge_provenance(config: BuildConfig) -> dict[str, Any]:
    """What judged the labels: kind, model, template (and endpoint for ``http``)."""
    j = config.judge
    if j.kind == "none":
        return {"kind": "none"}
    out: dict[str, Any] = {"kind": j.kind, "threshold": j.threshold}
    if j.kind in ("llm", "nli"):
        path = config.model_path("judge")
        out["model"] = folder_fingerprint(path, "build.judge.model")  # refused here, before anything is written
        out["weights"] = weights_stamp(path)  # a judge retrained in place groups steps otherwise
    else:
        out.update(model=j.model, url=j.url, api=j.api)
    if j.kind in ("llm", "http"):
        out["template"] = j.template or default_template(j)
    if j.kind == "llm" and (j.yes_answer, j.no_answer) != (" yes", " no"):
        out["answers"] = [j.yes_answer, j.no_answer]  # recorded only when not the default
    return out


def default_template(judge: JudgeConfig) -> str:
    """The prompt of a judge given no ``template``: the world's (``llm``) or a plain question (``http``)."""
    return default_world().judge_template if judge.kind == "llm" else DEFAULT_HTTP_TEMPLATE


def label_provenance(config: BuildConfig) -> dict[str, Any]:
    """The ``labels`` entry of a probe's input spec: labelling, clustering, judge, step cap, seed."""
    cc = config.clustering
    params = {k: getattr(cc, k) for k in ("min_cluster_size", "membership_threshold", "merge_distance", "votes",
                                          "max_candidates", "match_numbers", "verify_members")}
    # max_step_tokens stays here too: probes exported before the step spec had its own entry read it from labels
    return {"labelling": config.labelling, "clustering": cc.method, "clustering_params": params,
            "max_step_tokens": config.steps.max_step_tokens, "judge": judge_provenance(config),
            "seed": config.sampling.seed}


def sampling_record(config: BuildConfig) -> dict[str, Any]:
    """The manifest's ``sampling`` entry: samples per prefix and the :class:`~generation.specs.SamplingSpec`."""
    return {"n_samples": config.sampling.n_samples, **config.sampling.spec.to_dict()}


def problems_provenance(config: BuildConfig) -> dict[str, Any]:
    """The ``problems`` entry: the task (its class and arguments, or file and checksum), count, seed, prefix source."""
    task = config.resolved_task()
    return {**task.provenance(config.n_problems, config.task_seed), "prefix_source": config.prefix_source}


def config_record(config: BuildConfig) -> dict[str, Any]:
    """The config as JSON (build.json, the manifest's ``config``); the task as its ``class_path``/``init_args``."""
    return {f.name: config.resolved_task().spec() if f.name == "task" else plain(getattr(config, f.name))
            for f in dataclasses.fields(config)}


def signature(config: BuildConfig) -> dict[str, Any]:
    """The facts two builds must share for their data to mix; read from folders, no weights loaded."""
    spec = config.feature_spec()
    return {
        "format_version": S.FORMAT_VERSION,
        "reads": {r: folder_fingerprint(config.model_path(r), f"build.{r}") for r in ROLES},
        "weights": {r: weights_stamp(config.model_path(r)) for r in ROLES},  # a model retrained in place differs
        "layer_ids": list(spec.layer_ids),
        "pooling": config.pooling,
        "feature_groups": list(spec.groups),
        "token_stats": list(spec.token_stats),
        "top_k": config.top_k,
        "topk_stats": list(config.topk_stats),
        "source": spec.source,  # in-process: transformers, hidden states after the final norm; else the engine
        "hidden_norm": spec.hidden_norm,
        "reader": config.reading.backend,
        "delimiters": list(config.steps.delimiters),
        "max_step_tokens": config.steps.max_step_tokens,
        "sampling": sampling_record(config),
        "sampler": config.sampling.backend,
        "labels": label_provenance(config),
        "problems": problems_provenance(config),
        "shard_size": config.shard_size,
    }


def signature_mismatches(recorded: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    """``"field: data has X, config asks Y"`` for every differing field (``name_or_path`` is informative only; a build
    recorded before the models' ``weights`` stamps were has none to compare)."""
    out = []
    for key in sorted(set(recorded) | set(wanted)):
        if key == "name_or_path" or (key == "weights" and key not in recorded):  # builds before the stamps
            continue
        a, b = recorded.get(key), wanted.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += signature_mismatches(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: data has {a!r}, config asks {b!r}")
    return out
