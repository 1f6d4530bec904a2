"""Typed specs that travel with the data and the probes: what a step is, how steps were sampled, what a probe reads.

Each spec is a small frozen dataclass, validated once where it is built, with one default per field.
The label build records them in the manifest, the DataModule reads them back, the fit CLI links them
into the probes' configs, the exported probe carries them, and the decoder and the live callback take
them from the probes (an explicit value that differs is refused, naming both). No torch import here:
configs and tools read specs without building a model.

- :class:`StepSpec`: step delimiters and the step cap; :meth:`StepSpec.stopper` makes the token-level stop check;
- :class:`SamplingSpec`: temperature and top-p of the one sampler;
- :class:`FeatureSpec`: the feature groups a probe reads and how each is computed, beside the names of the groups
  and statistics this version computes (:data:`FEATURE_GROUPS`, :data:`TOKEN_STATS`, :data:`TOPK_STATS`) and their
  checks (:func:`check_groups`, :func:`require_features`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Mapping, Sequence

from generation.steps import DEFAULT_DELIMITERS


def _refuse(spec: str, errors: list[str]) -> None:
    if errors:
        raise ValueError(f"invalid {spec}: " + "; ".join(errors))


@dataclass(frozen=True)
class StepSpec:
    """What a reasoning step is: text up to and including a delimiter, at most ``max_step_tokens`` tokens.

    Attributes:
        delimiters: step delimiters (the paper's blank-line family by default); a list is stored as a tuple.
        max_step_tokens: a step that reaches no delimiter is cut here.

    Raises:
        ValueError: an empty delimiter list, an empty delimiter, or a cap below 1 (naming field and value).
    """

    delimiters: tuple[str, ...] = DEFAULT_DELIMITERS
    max_step_tokens: int = 32

    def __post_init__(self) -> None:
        _refuse("StepSpec", self.errors(self.delimiters, self.max_step_tokens))
        object.__setattr__(self, "delimiters", tuple(self.delimiters))
        object.__setattr__(self, "max_step_tokens", int(self.max_step_tokens))

    @staticmethod
    def errors(delimiters: Any, max_step_tokens: Any) -> list[str]:
        """What is wrong with these values, one ``field=value: expected ...`` each (the one check)."""
        out = []
        if isinstance(delimiters, str) or not isinstance(delimiters, Sequence) or not delimiters \
                or not all(isinstance(d, str) and d for d in delimiters):
            out.append(f"delimiters={delimiters!r}: expected a non-empty list of non-empty strings")
        if not is_count(max_step_tokens):
            out.append(f"max_step_tokens={max_step_tokens!r}: expected an integer >= 1")
        return out

    def stopper(self, tokenizer):
        """The token-level stop check of this step definition for ``tokenizer``
        (:class:`~generation.steps.StepStopper`)."""
        from generation.steps import StepStopper

        return StepStopper(tokenizer, self.delimiters, self.max_step_tokens)


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""


@dataclass(frozen=True)
class SamplingSpec:
    """How the one sampler draws: temperature (0 = greedy) and nucleus mass (the paper's T = 0.6, top-p 0.95).

    A temperature below :data:`GREEDY_BELOW` is stored as 0, greedy, as vLLM's sampler treats it
    (``vllm/v1/sample/sampler.py``, ``_SAMPLING_EPS``): dividing logits by it overflows the softmax.

    Raises:
        ValueError: a temperature that is not a finite number >= 0, or a top-p outside (0, 1].
    """

    temperature: float = 0.6
    top_p: float = 0.95

    def __post_init__(self) -> None:
        _refuse("SamplingSpec", self.errors(self.temperature, self.top_p))
        object.__setattr__(self, "temperature", float(self.temperature) if self.temperature >= GREEDY_BELOW else 0.0)
        object.__setattr__(self, "top_p", float(self.top_p))

    @staticmethod
    def errors(temperature: Any, top_p: Any) -> list[str]:
        """What is wrong with these values (the one check; configs that hold the fields call it too)."""
        out = []
        if not (is_finite(temperature) and temperature >= 0):
            out.append(f"temperature={temperature!r}: expected a finite number >= 0 (0 = greedy)")
        if not is_real(top_p) or not 0 < top_p <= 1:
            out.append(f"top_p={top_p!r}: expected a number in (0, 1]")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def is_int(x: Any) -> bool:
    """An integer (a NumPy one too), not a bool: a seed, a count, a bound."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_count(x: Any) -> bool:
    """An integer (not a bool) of at least 1: a step cap, a token budget, a batch size."""
    return is_int(x) and x >= 1


def is_real(x: Any) -> bool:
    """A real number (a NumPy one too), not a bool: a threshold, a rate, a log-probability."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_finite(x: Any) -> bool:
    """A real number a float holds: not a bool, NaN, an infinity, or an integer past a float's range (Python's and
    JSON's integers have no bound, and ``math.isfinite(10**400)`` raises ``OverflowError``)."""
    try:
        return is_real(x) and math.isfinite(x)
    except OverflowError:
        return False


FEATURE_GROUPS: tuple[str, ...] = ("hidden", "token_stats", "topk_stats")
"""Feature groups a probe can read, in the order they are concatenated into its input."""
TOKEN_STATS: tuple[str, ...] = (
    "mean_logprob",
    "min_logprob",
    "mean_entropy",
    "max_entropy",
    "not_top1_share",
    "not_top5_share",
    "mean_log_rank",
)
"""Token statistics this version computes (``token_stats`` group), in storage order."""
TOPK_STATS: tuple[str, ...] = (
    "mean_logprob",
    "min_logprob",
    "not_top1_share",
    "not_top5_share",
    "not_topk_share",
    "mean_log_rank",
    "mean_topk_entropy",
    "max_topk_entropy",
    "mean_topk_mass",
    "min_topk_mass",
)
"""Top-k statistics this version computes (``topk_stats`` group), in storage order: each is exact from the
token's log-prob and the reading model's k largest log-probs (what a server's top-k answer holds)."""
STAT_GROUPS: dict[str, tuple[str, ...]] = {"token_stats": TOKEN_STATS, "topk_stats": TOPK_STATS}
"""The statistics groups and the names each can hold."""


def check_groups(groups: Sequence[str], stats: Sequence[str] | None, topk: Sequence[str] | None = None) -> list[str]:
    """Problems with a list of feature groups and of their statistics (empty when all are valid).

    Args:
        groups: feature groups, a subset of :data:`FEATURE_GROUPS` in that order.
        stats: the ``token_stats`` names (checked when ``token_stats`` is read); None checks the groups alone
            (the statistics are chosen elsewhere, e.g. by the data).
        topk: the ``topk_stats`` names (checked when ``topk_stats`` is read); None = not checked.
    """
    if isinstance(groups, str):  # iterated letter by letter, each an unknown group
        return [f"feature groups {groups!r}: expected a list of group names, e.g. [{groups!r}]"]
    problems = []
    unknown = [g for g in groups if g not in FEATURE_GROUPS]
    if not groups or unknown or len(set(groups)) != len(groups):
        problems.append(f"feature groups {list(groups)}: expected a non-empty subset of {list(FEATURE_GROUPS)}"
                        + (f" (unknown: {unknown})" if unknown else ""))
    elif list(groups) != [g for g in FEATURE_GROUPS if g in groups]:
        problems.append(f"feature groups {list(groups)}: list them in the order {list(FEATURE_GROUPS)}")
    for group, names in (("token_stats", stats), ("topk_stats", topk)):
        bad = [s for s in names or () if s not in STAT_GROUPS[group]]
        twice = sorted({s for s in names or () if list(names).count(s) > 1})
        if names is not None and group in groups and (not names or bad or twice):
            problems.append(f"{group} {list(names)}: expected a non-empty subset of {list(STAT_GROUPS[group])}"
                            + (f" (this version cannot compute {bad})" if bad else "")
                            + (f" ({twice} named twice)" if twice else ""))
    return problems


def require_features(
    wanted_groups: Sequence[str],
    wanted_stats: Sequence[str],
    provided_groups: Sequence[str],
    provided_stats: Sequence[str],
    where: str,
    provider: str,
    wanted_topk: Sequence[str] = (),
    provided_topk: Sequence[str] = TOPK_STATS,
) -> None:
    """Raise naming both lists when ``where`` reads feature groups or statistics that ``provider`` cannot give.

    ``wanted_topk``/``provided_topk`` are the ``topk_stats`` names, checked as ``wanted_stats``/``provided_stats``
    are for ``token_stats``.

    Raises:
        ValueError: a group, or (for ``token_stats`` and ``topk_stats``) a statistic, is missing from what is provided.
    """
    missing = [g for g in wanted_groups if g not in provided_groups]
    for group, wanted, provided in (("token_stats", wanted_stats, provided_stats),
                                    ("topk_stats", wanted_topk, provided_topk)):
        if group in wanted_groups and group in provided_groups:
            missing += [f"{group}.{s}" for s in wanted if s not in provided]
    if missing:
        topk = f", top-k statistics {list(wanted_topk)}" if "topk_stats" in wanted_groups else ""
        has = f", top-k statistics {list(provided_topk)}" if "topk_stats" in provided_groups else ""
        raise ValueError(
            f"{where} reads feature groups {list(wanted_groups)} (token statistics {list(wanted_stats)}{topk}), but "
            f"{provider} provides {list(provided_groups)} (token statistics {list(provided_stats)}{has}); "
            f"missing {missing}. Use a probe trained on features this source provides, or rebuild the data with them."
        )


def layer_problems(layer_ids: list[int], num_layers: int | None = None) -> list[str]:
    """Problems with ``layer_ids`` (empty when valid); with ``num_layers``, each id must index ``hidden_states``.

    A model with ``num_layers`` decoder layers returns ``num_layers + 1`` hidden states (the embeddings
    first), so valid ids are ``-(num_layers + 1) .. num_layers``.
    """
    if not isinstance(layer_ids, (list, tuple)) or not layer_ids:
        return [f"layer_ids={layer_ids!r}: expected a non-empty list of layer indices, e.g. [-1]"]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids):
        return [f"layer_ids={layer_ids!r}: expected integers (hidden_states indices)"]
    problems = []
    if len(set(layer_ids)) != len(layer_ids):
        problems.append(f"layer_ids={layer_ids}: a layer is listed twice")
    if num_layers is not None:
        n = num_layers + 1
        bad = [i for i in layer_ids if not -n <= i < n]
        if bad:
            problems.append(f"layer_ids={layer_ids}: {bad} out of range for a model with {num_layers} layers "
                            f"({n} hidden_states: valid ids are {-n}..{n - 1})")
    return problems


SOURCES: tuple[str, ...] = ("transformers", "sglang", "vllm", "llama.cpp")
"""Where a probe's features are read: in-process transformers, or an engine's server."""
HIDDEN_NORMS: tuple[str, ...] = ("final_norm", "pre_norm")
"""Norm conventions of the last layer's hidden states: after the model's final norm (transformers' last
``hidden_states`` entry, ``lm_head`` of it gives the logits) or before it."""


@dataclass(frozen=True)
class FeatureSpec:
    """What a probe reads: its feature groups, how each is computed, and where the features come from.

    Attributes:
        groups: feature groups, a subset of :data:`FEATURE_GROUPS`, in that order.
        layer_ids: ``hidden``: HF ``hidden_states`` indices (0 = embeddings, -1 = last layer).
        pooling: ``hidden``: ``mean`` over the step's tokens or ``last``.
        token_stats: ``token_stats``: names from :data:`TOKEN_STATS` (none when the group is not
            read).
        top_k: ``topk_stats``: how many of the reading model's largest log-probs the statistics see
            (at least 5: top-5 membership is one of them).
        topk_stats: ``topk_stats``: names from :data:`TOPK_STATS` (none when the group is not
            read).
        source: where the features are read (:data:`SOURCES`): ``transformers`` in-process, or a server.
        hidden_norm: ``hidden``: the norm convention of the last layer's states (:data:`HIDDEN_NORMS`).

    Raises:
        ValueError: an unknown group, statistic, pooling, source or norm convention, ``hidden`` without
            layers, or a ``top_k`` that is not an integer >= 5 (naming field and value).
    """

    groups: tuple[str, ...] = ("hidden",)
    layer_ids: tuple[int, ...] = (-1,)
    pooling: str = "mean"
    token_stats: tuple[str, ...] = TOKEN_STATS
    top_k: int = 20
    topk_stats: tuple[str, ...] = TOPK_STATS
    source: str = "transformers"
    hidden_norm: str = "final_norm"

    def __post_init__(self) -> None:
        lists = [f for f in ("groups", "layer_ids", "token_stats", "topk_stats")
                 if isinstance(getattr(self, f), (str, bytes)) or not isinstance(getattr(self, f), Iterable)]
        _refuse("feature spec", [f"{f}={getattr(self, f)!r}: expected a list" for f in lists])
        for f in ("groups", "layer_ids", "token_stats", "topk_stats"):
            object.__setattr__(self, f, tuple(getattr(self, f)))
        for g in ("token_stats", "topk_stats"):  # the names of a group not read are none (one spelling per spec)
            if g not in self.groups:
                object.__setattr__(self, g, ())
        problems = check_groups(list(self.groups), list(self.token_stats), list(self.topk_stats))
        if self.pooling not in ("mean", "last"):
            problems.append(f"pooling={self.pooling!r}: expected 'mean' or 'last'")
        if "hidden" in self.groups:  # the model's depth is checked where the model is known (layer_problems)
            problems += layer_problems(list(self.layer_ids))
        problems += self.origin_errors(self.top_k, self.source, self.hidden_norm)
        _refuse("feature spec", problems)
        object.__setattr__(self, "top_k", int(self.top_k))  # a NumPy integer too: config.json is written by json

    @staticmethod
    def origin_errors(top_k: Any, source: Any, hidden_norm: Any) -> list[str]:
        """What is wrong with ``top_k``, ``source`` and ``hidden_norm`` (configs that hold the fields call it too)."""
        out = []
        if not (isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool) and top_k >= 5):
            out.append(f"top_k={top_k!r}: expected an integer >= 5 (top-5 membership is one of the top-k statistics)")
        if source not in SOURCES:
            out.append(f"source={source!r}: expected one of {list(SOURCES)}")
        if hidden_norm not in HIDDEN_NORMS:
            out.append(f"hidden_norm={hidden_norm!r}: expected one of {list(HIDDEN_NORMS)}")
        return out

    @property
    def needs_hidden(self) -> bool:
        return "hidden" in self.groups

    @property
    def needs_topk(self) -> bool:
        """The probe reads ``topk_stats`` (a server's top-k answer, or top-k of in-process logits)."""
        return "topk_stats" in self.groups

    @property
    def needs_logits(self) -> bool:
        """An in-process reader must keep the logits predicting the step's tokens (``token_stats`` or
        ``topk_stats``)."""
        return "token_stats" in self.groups or self.needs_topk

    def width(self, hidden_size: int) -> int:
        """Width of one flattened probe input for a model of ``hidden_size``."""
        w = len(self.layer_ids) * hidden_size if self.needs_hidden else 0
        w += len(self.token_stats) if "token_stats" in self.groups else 0
        return w + (len(self.topk_stats) if self.needs_topk else 0)

    def check_source(self, source: str, hidden_norm: str, where: str) -> None:
        """Refuse reading this spec's ``hidden`` group from another source or norm convention than it was trained on.

        Statistics do not depend on the source (the top-k ones are exact from a top-k answer), so a probe that
        does not read ``hidden`` is accepted from any source.

        Raises:
            ValueError: the probe reads ``hidden`` and ``source`` or ``hidden_norm`` differs, naming both.
        """
        if self.needs_hidden and (source, hidden_norm) != (self.source, self.hidden_norm):
            raise ValueError(
                f"{where}: the probe reads hidden states from source={self.source!r} "
                f"(hidden_norm={self.hidden_norm!r}), "
                f"but they would come from source={source!r} (hidden_norm={hidden_norm!r}); hidden states differ "
                "between sources and norm conventions. Use a probe trained on this source's features, or one that "
                "reads only token statistics (token_stats, topk_stats)."
            )


def spec_from_dict(cls, d: Mapping[str, Any] | None, where: str):
    """A spec from its recorded dict (manifest, ``config.json``); unknown keys are refused, naming ``where``."""
    if d is None:
        return None
    if isinstance(d, cls):
        return d
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}: unknown {cls.__name__} keys {unknown}; known: {sorted(known)}")
    return cls(**d)


def plain(value: Any) -> Any:
    """``value`` with every dataclass as the dict of its fields and every tuple as a list, at any depth: the form
    JSON and safe YAML loaders read back (``config.json`` holds a spec so)."""
    if hasattr(value, "__dataclass_fields__") and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def dump_yaml_as_mapping(cls: type) -> type:
    """Make PyYAML write ``cls`` (a dataclass) as the plain mapping of its fields (:func:`plain`), not as a
    ``!!python/object`` that safe loaders refuse: Lightning writes a module's hyperparameters, which hold specs, to
    ``hparams.yaml`` with ``yaml.dump``, and reads them back with ``yaml.safe_load``. Returns ``cls``."""
    import yaml

    for dumper in (yaml.Dumper, yaml.SafeDumper):
        dumper.add_representer(cls, lambda d, value: d.represent_dict(plain(value)))
    return cls


for _spec in (StepSpec, SamplingSpec, FeatureSpec):
    dump_yaml_as_mapping(_spec)
