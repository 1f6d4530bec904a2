"""The parts of a label build's config: judge, clustering, sampling (with its backends) and steps.

Each part only holds values and lists what is wrong with them (``errors()``, names relative to the
part); :class:`~datamodules.build_config.BuildConfig` checks them all at once, naming each bad value
by its full dotted name (``sampling.n_samples=0``), which a part checking itself could not know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from datamodules import shards as S

JUDGES = ("llm", "http", "nli", "none")
BACKENDS = ("hf", "openai", "vllm")
"""Sampling backends (:mod:`datamodules.samplers`)."""
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
    """``llm`` judge: the answer meaning "same" (its first token's probability is read); chat models often say ``Yes``.
    (Not a bare ``yes:`` key: YAML reads that as a boolean.)"""
    no_answer: str = " no"
    """``llm`` judge: the answer meaning "different"."""
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
        if self.timeout <= 0:
            out.append(f"timeout={self.timeout}: expected > 0")
        return out


@dataclass
class ClusteringConfig:
    """How one prefix's samples are grouped by meaning (YAML: ``build.clustering.*``)."""

    method: str = "hdbscan+judge"
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

    def errors(self) -> list[str]:
        """What is wrong (names relative to this part)."""
        return (choices(self, {"method": ("hdbscan+judge", "hdbscan", "judge")})
                + at_least(self, min_cluster_size=2, votes=1))


@dataclass
class EndpointConfig:
    """OpenAI-compatible servers that serve one model (YAML: ``build.sampling.openai.target`` / ``.draft``)."""

    urls: list[str] = field(default_factory=list)
    """Base URLs, e.g. ``[http://127.0.0.1:8000/v1]``; several spread the load (round-robin, per rank)."""
    model: str | None = None
    """The model name the servers expect; None = the one model the first server lists."""


@dataclass
class OpenAIConfig:
    """The ``openai`` sampling backend (YAML: ``build.sampling.openai.*``); see :mod:`datamodules.openai_sampler`."""

    target: EndpointConfig = field(default_factory=EndpointConfig)
    """Servers of the target model."""
    draft: EndpointConfig = field(default_factory=EndpointConfig)
    """Servers of the draft model."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (never logged); unset or empty = no key."""
    concurrency: int = 8
    """Requests in flight per model."""
    timeout: float = 120.0
    """Seconds per request attempt."""
    retries: int = 3
    """Attempts per request (connection errors, timeouts, 429 and 5xx are retried with backoff)."""
    prompt: str = "text"
    """Send prefixes as ``text`` (any server) or ``tokens`` (vLLM, SGLang: the exact ids, no re-tokenization)."""
    extra_body: dict[str, Any] | None = None
    """Extra request fields; None = ask vLLM and SGLang to keep the stop string in the text; ``{}`` = none."""

    def errors(self) -> list[str]:
        out = choices(self, {"prompt": ("text", "tokens")}) + at_least(self, concurrency=1, retries=1)
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
    temperature: float = 0.6
    """Sampling temperature (paper: 0.6)."""
    top_p: float = 0.95
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
        if self.temperature < 0:
            out.append(f"temperature={self.temperature}: expected >= 0")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p}: expected in (0, 1]")
        return out


@dataclass
class StepConfig:
    """What a step is (YAML: ``build.steps.*``); recorded in the manifest and carried by the probes."""

    delimiters: list[str] | None = None
    """Step delimiters; None = the task's (every built-in task: the blank-line family)."""
    max_step_tokens: int = 32
    """Longest step in tokens; a step ends at a delimiter, EOS or this cap."""

    def errors(self) -> list[str]:
        """What is wrong (names relative to this part)."""
        out = at_least(self, max_step_tokens=1)
        if self.delimiters is not None and (not self.delimiters or any(not d for d in self.delimiters)):
            out.append(f"delimiters={self.delimiters!r}: give at least one non-empty delimiter")
        return out


def choices(part, allowed: dict[str, tuple]) -> list[str]:
    """``name=value: expected one of ...`` for each field of ``part`` outside its allowed values."""
    return [f"{k}={getattr(part, k)!r}: expected one of {v}" for k, v in allowed.items() if getattr(part, k) not in v]


def at_least(part, **low: int) -> list[str]:
    """``name=value: expected >= low`` for each field of ``part`` below its lower bound."""
    return [f"{k}={getattr(part, k)}: expected >= {v}" for k, v in low.items() if getattr(part, k) < v]


PARTS = {"judge": JudgeConfig, "clustering": ClusteringConfig, "sampling": SamplingConfig, "steps": StepConfig}
"""The nested parts of :class:`BuildConfig`, by field name."""
