"""`ProbeConfig`: everything a probe is and reads, serialised as the export's ``config.json``.

No torch import here: the config is read by tools that never build the probe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from generation.groups import check_groups

FORMAT_VERSION = 3
"""Version of the exported ``config.json`` layout; older versions keep loading.

1: pooled hidden states only. 2: named feature groups (``feature_groups``, ``token_stats``) and
input standardisation buffers in ``model.safetensors`` (a version-1 export loads as ``["hidden"]``
with identity standardisation). 3: the sampling spec of the labels (``sampling``; older exports
load with ``{}``, unknown)."""
FINGERPRINT_FIELDS = ("architecture", "hidden_size", "num_layers", "vocab_size", "tokenizer_hash")
"""Fields of a reading model's fingerprint that must match at load time (name_or_path is informative)."""
ROLES = ("target", "draft")
"""Which model's semantic probability a probe estimates: the target's (q) or the draft's (p)."""


class NewerFormatError(ValueError):
    """A ``config.json`` written by a newer semanticspec-probes than this one (``format_version`` too high)."""


def layer_problems(layer_ids: list[int], num_layers: Optional[int] = None) -> list[str]:
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


def sampling_problems(sampling: dict[str, Any]) -> list[str]:
    """Problems with a recorded sampling spec (``n_samples``, ``temperature``, ``top_p``); empty when valid."""
    if not isinstance(sampling, dict):
        return [f"sampling={sampling!r}: expected a mapping such as {{'temperature': 0.6, 'top_p': 0.95}}"]

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    problems = []
    t, p, n = sampling.get("temperature"), sampling.get("top_p"), sampling.get("n_samples")
    if t is not None and not (number(t) and t >= 0):
        problems.append(f"sampling.temperature={t!r}: expected a finite number >= 0 (0 = greedy)")
    if p is not None and not (number(p) and 0 < p <= 1):
        problems.append(f"sampling.top_p={p!r}: expected a number in (0, 1]")
    if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        problems.append(f"sampling.n_samples={n!r}: expected an integer >= 1")
    return problems


@dataclass
class ProbeConfig:
    """Architecture, input spec, role and provenance of one semantic probe."""

    hidden_size: int = 128
    """Width of the hidden states the probe reads (the reading model's hidden size)."""
    layer_ids: list[int] = field(default_factory=lambda: [-1])
    """HF ``hidden_states`` indices the probe reads; 0 = embeddings, -1 = last layer."""
    layer_combine: str = "concat"
    """How several layers become one input: ``concat`` or ``weighted_sum`` (learned softmax weights)."""
    pooling: str = "mean"
    """How a step's token states become one vector: ``mean`` over the step's tokens, or ``last``."""
    feature_groups: list[str] = field(default_factory=lambda: ["hidden"])
    """Feature groups the probe reads, concatenated in this order: ``hidden`` (pooled states of ``layer_ids``)
    and/or ``token_stats`` (the reading model's statistics of the step's tokens; see ``generation.features``)."""
    token_stats: list[str] = field(default_factory=list)
    """Names of the token statistics the ``token_stats`` group holds, in order (e.g. ``mean_logprob``)."""
    standardize: bool = True
    """Standardise every input column with the training rows' mean and standard deviation (stored as buffers)."""
    hidden_dims: list[int] = field(default_factory=lambda: [2048, 512, 256])
    """Widths of the MLP's hidden layers (paper: 2048, 512, 256). Empty = linear probe."""
    dropout: float = 0.3
    """Dropout after every hidden layer (paper: 0.3)."""
    role: str = "target"
    """Which model's semantic probability the probe estimates: ``target`` (q) or ``draft`` (p)."""
    features_dtype: str = "float16"
    """dtype the pooled features are stored in; the probe computes in float32."""
    reads: dict[str, Any] = field(default_factory=dict)
    """Fingerprint of the model whose hidden states the probe reads (see ``model_fingerprint``)."""
    delimiters: list[str] = field(default_factory=lambda: ["\n\n"])
    """Step delimiters the labels were made with."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """How the labelled steps were sampled: ``n_samples`` per model, ``temperature``, ``top_p`` (the build's
    ``sampling``); format-2 exports take it from their ``labels``, older ones have ``{}``."""
    labels: dict[str, Any] = field(default_factory=dict)
    """Label provenance: labelling, clustering, judge, step cap (``max_step_tokens``), seed."""
    test_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics on the held-out test split at export time."""
    format_version: int = FORMAT_VERSION
    """Layout version of this config."""

    def __post_init__(self) -> None:
        errors = []
        if self.hidden_size < 1:
            errors.append(f"hidden_size={self.hidden_size}: expected >= 1")
        errors += layer_problems(self.layer_ids, self.reads.get("num_layers") if isinstance(self.reads, dict) else None)
        if self.layer_combine not in ("concat", "weighted_sum"):
            errors.append(f"layer_combine={self.layer_combine!r}: expected 'concat' or 'weighted_sum'")
        if self.pooling not in ("mean", "last"):
            errors.append(f"pooling={self.pooling!r}: expected 'mean' or 'last'")
        errors += check_groups(self.feature_groups, self.token_stats)
        if any(d < 1 for d in self.hidden_dims):
            errors.append(f"hidden_dims={self.hidden_dims}: widths must be >= 1")
        if not 0 <= self.dropout < 1:
            errors.append(f"dropout={self.dropout}: expected 0 <= dropout < 1")
        if self.role not in ROLES:
            errors.append(f"role={self.role!r}: expected 'target' or 'draft'")
        errors += sampling_problems(self.sampling)
        if errors:
            raise ValueError("invalid ProbeConfig: " + "; ".join(errors))

    @property
    def hidden_width(self) -> int:
        """Columns of the ``hidden`` group: ``len(layer_ids) * hidden_size`` (0 when the probe does not read it)."""
        return len(self.layer_ids) * self.hidden_size if "hidden" in self.feature_groups else 0

    @property
    def input_size(self) -> int:
        """Width of one flattened input row: the ``hidden`` columns, then one per token statistic."""
        return self.hidden_width + (len(self.token_stats) if "token_stats" in self.feature_groups else 0)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProbeConfig":
        """Build from a ``config.json`` dict, upgrading older layouts and naming unknown keys.

        Raises:
            NewerFormatError: ``format_version`` is newer than this code writes.
            ValueError: unknown keys, or a field out of range (each named).
        """
        d = dict(d)
        d.setdefault("format_version", 0)
        version = d["format_version"]
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"format_version={version!r}: expected an integer from 0 to {FORMAT_VERSION}")
        if version > FORMAT_VERSION:
            raise NewerFormatError(
                f"format_version={version}: written by a newer semanticspec-probes (this one reads formats up to "
                f"{FORMAT_VERSION}); upgrade semanticspec-probes to load it")
        if d["format_version"] < 2:  # before feature groups every probe read pooled hidden states only
            d.setdefault("feature_groups", ["hidden"])
            d.setdefault("standardize", False)
        if d["format_version"] < 3 and "sampling" not in d:  # format 2 kept the sampling spec among the labels
            labels = d.get("labels") or {}
            d["sampling"] = {k: labels[k] for k in ("n_samples", "temperature", "top_p") if k in labels}
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown probe config keys {unknown}; known keys: {sorted(known)}")
        return cls(**d)
