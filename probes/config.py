"""`ProbeConfig`: everything a probe is and reads, serialised as the export's ``config.json``.

No torch import here: the config is read by tools that never build the probe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from generation.specs import (FeatureSpec, SamplingSpec, StepSpec, dump_yaml_as_mapping, is_count, is_finite, is_int,
                              is_real, layer_problems, spec_from_dict)

FORMAT_VERSION = 7
"""Version of the exported ``config.json`` layout; older versions keep loading.

1: pooled hidden states only. 2: named feature groups (``feature_groups``, ``token_stats``) and
input standardisation buffers in ``model.safetensors`` (a version-1 export loads as ``["hidden"]``
with identity standardisation). 3: the sampling spec of the labels (``sampling``; older exports
load with it unknown). 4: typed specs: ``step`` (delimiters and step cap, which format 3 kept in
``delimiters`` and ``labels.max_step_tokens``) and ``sampling`` (temperature and top-p; ``n_samples``
moves to ``labels``). 5: the ``topk_stats`` group (``top_k``, ``topk_stats``) and where the features come from
(``source``, ``hidden_norm``); formats 0-4 load with ``topk_stats`` unread, ``top_k=20``,
``source="transformers"`` and ``hidden_norm="final_norm"`` (what every earlier probe read). 6: what the probe
reads in one ``features`` entry (a :class:`~generation.specs.FeatureSpec`: ``groups``, ``layer_ids``, ``pooling``,
``token_stats``, ``top_k``, ``topk_stats``, ``source``, ``hidden_norm``), which formats 0-5 kept as flat keys
(``feature_groups`` for ``groups``). 7: how the probe was trained (``training``: the loss, the optimizer and its
learning rate, the epochs), empty in older exports."""
FINGERPRINT_FIELDS = ("architecture", "hidden_size", "num_layers", "vocab_size", "tokenizer_hash")
"""Fields of a reading model's fingerprint that must match at load time (name_or_path is informative)."""
ROLES = ("target", "draft")
"""Which model's semantic probability a probe estimates: the target's (q) or the draft's (p)."""


class NewerFormatError(ValueError):
    """A ``config.json`` written by a newer semanticspec-probes than this one (``format_version`` too high)."""


class OtherModelError(ValueError):
    """A probe exported for another model than the one it is given (its recorded fingerprint differs)."""


FEATURE_DTYPES = ("float16", "bfloat16", "float32")
"""The dtypes pooled features may be stored in."""


@dump_yaml_as_mapping  # Lightning's hparams.yaml holds it: a mapping that yaml.safe_load reads
@dataclass
class ProbeConfig:
    """Architecture, input spec, role and provenance of one semantic probe."""

    hidden_size: int = 128
    """Width of the hidden states the probe reads (the reading model's hidden size)."""
    features: FeatureSpec = field(default_factory=FeatureSpec)
    """What the probe reads (:class:`~generation.specs.FeatureSpec`): its feature groups, concatenated in order
    (``hidden``: pooled states of ``layer_ids``; ``token_stats``: the reading model's statistics of the step's tokens;
    ``topk_stats``: statistics exact from its top-k log-probs, which a server can give), the layers and pooling, the
    statistics' names, and where the features are read (``source``, ``hidden_norm``); see ``generation.features``."""
    layer_combine: str = "concat"
    """How several layers become one input: ``concat`` or ``weighted_sum`` (learned softmax weights)."""
    standardize: bool = True
    """Standardise every input column with the training rows' mean and standard deviation (stored as buffers)."""
    hidden_dims: list[int] = field(default_factory=lambda: [2048, 512, 256])
    """Widths of the MLP's hidden layers (paper: 2048, 512, 256). Empty = linear probe."""
    dropout: float = 0.3
    """Dropout after every hidden layer (paper: 0.3)."""
    role: str = "target"
    """Which model's semantic probability the probe estimates: ``target`` (q) or ``draft`` (p)."""
    features_dtype: str = "float16"
    """dtype the label build stored the pooled hidden states in (float16: a record, which the fit refuses to change);
    the probe computes in float32."""
    reads: dict[str, Any] = field(default_factory=dict)
    """Fingerprint of the model whose hidden states the probe reads (see ``model_fingerprint``)."""
    step: StepSpec = field(default_factory=StepSpec)
    """What a step is: the delimiters and step cap the labels were cut at (the decoder cuts its steps so)."""
    sampling: Optional[SamplingSpec] = None
    """Temperature and top-p the labelled steps were sampled at (the decoder samples so); None = unknown
    (exports before format 3 did not record it)."""
    labels: dict[str, Any] = field(default_factory=dict)
    """Label provenance: labelling, clustering, judge, samples per model (``n_samples``), seed."""
    test_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics on the held-out test split at export time (``loss`` is the training loss's, ``training.loss``)."""
    training: dict[str, Any] = field(default_factory=dict)
    """How the fit trained it, recorded at export: ``loss`` (``mse`` or ``bce``), ``optimizer`` (its class),
    ``lr``, ``epochs`` (run), ``precision``."""
    format_version: int = FORMAT_VERSION
    """Layout version of this config."""

    def __post_init__(self) -> None:
        errors = self._typed_specs()
        if not is_count(self.hidden_size):
            errors.append(f"hidden_size={self.hidden_size!r}: expected an integer >= 1")
        errors += self._feature_errors(errors)
        errors += self._records()
        if self.layer_combine not in ("concat", "weighted_sum"):
            errors.append(f"layer_combine={self.layer_combine!r}: expected 'concat' or 'weighted_sum'")
        if not isinstance(self.hidden_dims, (list, tuple)) or not all(is_count(d) for d in self.hidden_dims):
            errors.append(f"hidden_dims={self.hidden_dims!r}: expected a list of integer widths >= 1 ([] = linear)")
        if not is_real(self.dropout) or not 0 <= self.dropout < 1:
            errors.append(f"dropout={self.dropout!r}: expected a number with 0 <= dropout < 1")
        if not isinstance(self.standardize, bool):
            errors.append(f"standardize={self.standardize!r}: expected true or false")
        if self.role not in ROLES:
            errors.append(f"role={self.role!r}: expected 'target' or 'draft'")
        if self.features_dtype not in FEATURE_DTYPES:
            errors.append(f"features_dtype={self.features_dtype!r}: expected one of {list(FEATURE_DTYPES)}")
        named = _fields_named(errors)  # a spec dict whose problems are named already
        if not isinstance(self.step, StepSpec) and "step" not in named:
            errors.append(f"step={self.step!r}: expected a generation.specs.StepSpec")
        if self.sampling is not None and not isinstance(self.sampling, SamplingSpec) and "sampling" not in named:
            errors.append(f"sampling={self.sampling!r}: expected a generation.specs.SamplingSpec or None")
        if self.format_version != FORMAT_VERSION:  # from_dict upgrades an older layout to today's
            errors.append(f"format_version={self.format_version!r}: a ProbeConfig holds today's layout "
                          f"({FORMAT_VERSION}); read an older config.json with ProbeConfig.from_dict")
        if errors:
            raise ValueError("invalid ProbeConfig: " + "; ".join(errors))
        self._python_numbers()

    def _python_numbers(self) -> None:
        """Python's ``int`` and ``float`` for the NumPy numbers the checks accept: ``config.json`` is written with
        ``json.dumps``, which refuses a NumPy one (a bare TypeError at export, after the training)."""
        self.hidden_size, self.dropout = int(self.hidden_size), float(self.dropout)
        self.hidden_dims = [int(d) for d in self.hidden_dims]
        for name in ("reads", "labels", "test_metrics", "training"):
            setattr(self, name, _plain_numbers(getattr(self, name)))

    def _feature_errors(self, errors: list[str]) -> list[str]:
        """Problems of ``features`` (unless ``errors`` already names them): a FeatureSpec whose layers index the
        hidden states of the model ``reads`` records."""
        if not isinstance(self.features, FeatureSpec):
            return [] if "features" in _fields_named(errors) else [
                f"features={self.features!r}: expected a generation.specs.FeatureSpec (an object of groups, "
                "layer_ids, pooling, ...)"]
        depth = self.reads.get("num_layers") if isinstance(self.reads, dict) else None
        layers = list(self.features.layer_ids)  # indices of the hidden states: none read without `hidden`
        out = [f"features.{p}" for p in layer_problems(layers, depth if is_count(depth) else None)
               if self.features.needs_hidden]
        if depth is not None and not is_count(depth):
            out.append(f"reads.num_layers={depth!r}: expected an integer >= 1")
        return out

    def _records(self) -> list[str]:
        """Problems of the provenance fields: ``reads``, ``labels``, ``test_metrics`` and ``training`` are objects, the
        metrics finite numbers (JSON has no NaN: an undefined metric is left out)."""
        errors = [f"{name}={getattr(self, name)!r}: expected an object (a dict)"
                  for name in ("reads", "labels", "test_metrics", "training")
                  if not isinstance(getattr(self, name), dict)]
        if isinstance(self.test_metrics, dict) and not all(
                is_finite(v) for v in self.test_metrics.values()):
            errors.append(f"test_metrics={self.test_metrics!r}: expected finite numbers")
        return errors

    def _typed_specs(self) -> list[str]:
        """``step``, ``sampling`` and ``features`` given as dicts (``config.json``, YAML) become their specs; problems,
        by field."""
        errors = []
        for name, spec in (("step", StepSpec), ("sampling", SamplingSpec), ("features", FeatureSpec)):
            value = getattr(self, name)
            if not isinstance(value, dict):
                continue
            try:
                setattr(self, name, spec_from_dict(spec, value, where=name))
            # "invalid SamplingSpec: temperature=nan: ..." -> "sampling.temperature=nan: ..."
            except (TypeError, ValueError) as e:
                msg = str(e)
                errors += ([f"{name}.{p}" for p in msg.split(": ", 1)[1].split("; ")] if msg.startswith("invalid ")
                           else [msg])
        return errors

    @property
    def hidden_width(self) -> int:
        """Columns of the ``hidden`` group: ``len(layer_ids) * hidden_size`` (0 when the probe does not read it)."""
        return len(self.features.layer_ids) * self.hidden_size if self.features.needs_hidden else 0

    @property
    def input_size(self) -> int:
        """Width of one flattened input row: the ``hidden`` columns, then one per token and per top-k statistic."""
        return self.features.width(self.hidden_size)

    @classmethod
    def of(cls, value: "ProbeConfig | dict[str, Any]") -> "ProbeConfig":
        """``value`` as a config: a dict of fields (YAML, Python, a checkpoint's hyperparameters) in today's layout
        unless it says its ``format_version`` (an old ``config.json`` without one is format 0, :meth:`from_dict`; a
        dict written by hand is not, and read so it lost standardisation)."""
        return cls.from_dict({"format_version": FORMAT_VERSION, **value}) if isinstance(value, dict) else value

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProbeConfig":
        """Build from a ``config.json`` dict, upgrading older layouts (the config says :data:`FORMAT_VERSION` then) and
        naming unknown keys. A dict without ``format_version`` is today's format when it nests ``features`` (format 6
        on), else format 0 (an old ``config.json``); ``SemanticProbe(dict)`` assumes today's.

        Raises:
            NewerFormatError: ``format_version`` is newer than this code writes.
            ValueError: unknown keys, or a field out of range or of the wrong type (``features``, ``reads``,
                ``labels``, ``test_metrics``), each named.
        """
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object of probe config fields, got {type(d).__name__}")
        d = dict(d)
        d.setdefault("format_version", FORMAT_VERSION if "features" in d else 0)  # nested `features`: format 6 on
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
        if d["format_version"] < 4:
            d = _upgrade_specs(d)
        if d["format_version"] < 6:
            d = nest_features(d)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown probe config keys {unknown}; known keys: {sorted(known)}")
        return cls(**{**d, "format_version": FORMAT_VERSION})  # today's layout now: a re-export writes it as such


FLAT_FEATURES = {"feature_groups": "groups", **{k: k for k in ("layer_ids", "pooling", "token_stats", "top_k",
                                                                 "topk_stats", "source", "hidden_norm")}}
"""Format 0-5 keys of what a probe reads, kept flat in ``config.json``, and their :class:`FeatureSpec` fields."""


def nest_features(d: dict[str, Any]) -> dict[str, Any]:
    """A format 0-5 ``config.json`` dict with what the probe reads in one ``features`` entry (format 6); what an older
    format left out is what every probe of it read (pooled last-layer states, no statistics)."""
    d = dict(d)
    features = {"groups": ["hidden"], "token_stats": [], "topk_stats": []}
    features.update({new: d.pop(old) for old, new in FLAT_FEATURES.items() if old in d})
    d["features"] = features
    return d


def _upgrade_specs(d: dict[str, Any]) -> dict[str, Any]:
    """A format 0-3 ``config.json`` dict with its step and sampling specs in the format-4 layout.

    The step was ``delimiters`` plus ``labels.max_step_tokens`` (absent: the default cap); the sampling spec was
    ``sampling`` (format 3) or part of ``labels`` (format 2) with ``n_samples``, which moves to ``labels``.
    """
    bad = [f"{k}={d[k]!r}: expected an object (a dict)" for k in ("labels", "sampling")
           if d.get(k) is not None and not isinstance(d[k], dict)]
    if bad:  # else read as unknown (a sampling) or by dict() (a list of pairs), or a bare TypeError
        raise ValueError("invalid ProbeConfig: " + "; ".join(bad))
    d, labels = dict(d), dict(d.get("labels") or {})
    old = d.pop("sampling", None)
    old = old if isinstance(old, dict) else {k: labels[k] for k in ("n_samples", "temperature", "top_p") if k in labels}
    for k in ("temperature", "top_p"):
        labels.pop(k, None)
    if "n_samples" in old:
        labels["n_samples"] = old["n_samples"]
    if "temperature" in old or "top_p" in old:
        d["sampling"] = {k: old[k] for k in ("temperature", "top_p") if k in old}
    step = {"delimiters": d.pop("delimiters", ["\n\n"])}
    if labels.get("max_step_tokens") is not None:
        step["max_step_tokens"] = labels.pop("max_step_tokens")
    d["step"], d["labels"] = step, labels
    return d


def _fields_named(errors: list[str]) -> set[str]:
    """The fields ``errors`` are about (``"step.delimiters=..."`` and ``"step: ..."`` are about ``step``)."""
    return {re.split(r"[.:=]", e, maxsplit=1)[0] for e in errors}


def _plain_numbers(value: Any) -> Any:
    """``value`` with every NumPy integer or real number, at any depth of its dicts and lists, as Python's."""
    if isinstance(value, dict):
        return {k: _plain_numbers(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_numbers(v) for v in value)
    if is_int(value) and type(value) is not int:
        return int(value)
    return float(value) if is_real(value) and not isinstance(value, (int, float)) else value
