"""The model card (``README.md``) of an exported probe, written from its :class:`ProbeConfig` alone.

No torch import: the card says what the config records, nothing else. Hub-style YAML front matter
first, then what the probe reads, the model it reads, its labels, its test metrics and how to load it.
"""

from __future__ import annotations

from typing import Any

from probes.config import ProbeConfig

ROLE_TEXT = {
    "target": "the **target** model would write a step with the same meaning (q)",
    "draft": "the **draft** model would write a step with the same meaning (p)",
}


def model_card(config: ProbeConfig) -> str:
    """Markdown model card of a probe with ``config``.

    Returns:
        The card's text: front matter, then the sections "What it reads", "The model it reads",
        "Labels", "Test metrics" and "How to load it".
    """
    name = config.reads.get("name_or_path") or "an unrecorded model"
    parts = [
        _front_matter(config),
        f"# SemanticSpec {config.role} probe for `{name}`\n",
        f"A semantic probe of semanticspec-probes (SemanticSpec, arXiv 2602.03708): it reads what "
        f"the model computes while reading a reasoning step (prefix in context) and estimates the probability that "
        f"{ROLE_TEXT[config.role]}. `SemanticSpecDecoder` keeps a draft step when the target probe's q is high "
        f"enough (the package's docs/design.md, \"Decoding\").\n",
        _reads_section(config),
        _model_section(config),
        _labels_section(config),
        _metrics_section(config),
        _load_section(config),
    ]
    return "\n".join(parts)


def _front_matter(config: ProbeConfig) -> str:
    tags = ["semanticspec", "speculative-decoding", f"{config.role}-probe"]
    return "\n".join(["---", "library_name: semanticspec-probes", "tags:", *[f"- {t}" for t in tags], "---", ""])


def _reads_section(config: ProbeConfig) -> str:
    rows = [("feature groups", ", ".join(f"`{g}`" for g in config.feature_groups))]
    if "hidden" in config.feature_groups:
        rows += [("layers", f"`{config.layer_ids}` (HF `hidden_states` indices: 0 = embeddings, -1 = last layer)"),
                 ("pooling", f"`{config.pooling}` over the step's tokens"),
                 ("layer combination", f"`{config.layer_combine}`")]
    if "token_stats" in config.feature_groups:
        rows.append(("token statistics", ", ".join(f"`{s}`" for s in config.token_stats)))
    if "topk_stats" in config.feature_groups:
        rows.append((f"top-{config.top_k} statistics", ", ".join(f"`{s}`" for s in config.topk_stats)))
    rows.append(("read by", f"`{config.source}`" + (f", hidden states `{config.hidden_norm}`"
                                                     if "hidden" in config.feature_groups else "")))
    dims = " → ".join(str(d) for d in [config.input_size, *config.hidden_dims, 1])
    rows += [("input", f"{config.input_size} columns" + (", standardised with the training rows' mean and "
                                                         "standard deviation" if config.standardize else "")),
             ("network", f"MLP {dims}, ReLU, dropout {config.dropout}, sigmoid"),
             ("step", f"text up to a delimiter in `{list(config.step.delimiters)!r}`, at most "
                      f"{config.step.max_step_tokens} tokens")]
    return "## What it reads\n\n" + _table(("what", "value"), rows)


def _model_section(config: ProbeConfig) -> str:
    if not config.reads:
        return ("## The model it reads\n\nNot recorded (an old export): only the width, hidden_size="
                f"{config.hidden_size}, is checked at load time. Re-export the probe to record its model.\n")
    rows = [(k, f"`{v}`") for k, v in config.reads.items()]
    return ("## The model it reads\n\nThe fingerprint recorded at export; `load_probe` refuses a model or tokenizer "
            "that differs in any field but the name, naming each field.\n\n" + _table(("field", "value"), rows))


def _labels_section(config: ProbeConfig) -> str:
    labels, sampling = config.labels, config.sampling
    judge = labels.get("judge")
    judge_text = ""
    if isinstance(judge, dict):
        model = judge.get("model")
        model_name = model.get("name_or_path") if isinstance(model, dict) else model
        judge_text = f"`{judge.get('kind', '?')}`" + _maybe(model_name, " (`{}`)")
    elif judge is not None:
        judge_text = f"`{judge}`"
    rows = [("samples per prefix and model (N)", _maybe(labels.get("n_samples"), "{}")),
            ("sampling", f"temperature {sampling.temperature}, top_p {sampling.top_p}" if sampling else ""),
            ("labelling", _maybe(labels.get("labelling"), "`{}`")),
            ("meaning groups", _maybe(labels.get("clustering"), "`{}`")),
            ("judge", judge_text),
            ("seed", _maybe(labels.get("seed"), "{}"))]
    rows = [(k, v) for k, v in rows if v]
    if not rows:
        return "## Labels\n\nNo label provenance recorded.\n"
    return ("## Labels\n\nEach training row is a sampled step labelled with the share of the model's samples that "
            "fall in its meaning group.\n\n" + _table(("what", "value"), rows))


def _metrics_section(config: ProbeConfig) -> str:
    if not config.test_metrics:
        return "## Test metrics\n\nNone recorded at export.\n"
    rows = [(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in sorted(config.test_metrics.items())]
    return ("## Test metrics\n\nOn the held-out test problems at export (`draft_written/...`: the rows the draft "
            "wrote, where the decoder decides).\n\n" + _table(("metric", "value"), rows))


def _load_section(config: ProbeConfig) -> str:
    other = "draft" if config.role == "target" else "target"
    return f"""## How to load it

```python
from probes.export import load_probe

# model, tokenizer: the {config.role} model this probe reads (see "The model it reads")
probe = load_probe("path/to/this/folder", model=model, tokenizer=tokenizer, role="{config.role}")
```

or pass the folder to `SemanticSpecDecoder(..., {config.role}_probe="path/to/this/folder")` with its
{other} counterpart. The folder holds `config.json` (format version {config.format_version}) and
`model.safetensors`; nothing is unpickled.
"""


def _maybe(value: Any, fmt: str) -> str:
    """``fmt`` filled with ``value``, or "" when nothing is recorded (so rows and suffixes drop out)."""
    return "" if value is None else fmt.format(value)


def _table(header: tuple[str, str], rows: list[tuple[str, Any]]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {k} | {str(v).replace('|', '&#124;')} |" for k, v in rows]
    return "\n".join(lines) + "\n"
