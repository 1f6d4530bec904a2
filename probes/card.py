"""The model card (``README.md``) of an exported probe, written from its :class:`ProbeConfig` alone.

No torch import: the card says what the config records, nothing else. The front matter is a
:class:`~huggingface_hub.ModelCardData`; the body is the Jinja template ``card_template.md`` beside this
module, rendered by :meth:`~huggingface_hub.ModelCard.from_template`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from probes.config import ProbeConfig

TEMPLATE = Path(__file__).with_name("card_template.md")
"""The card's body, a Jinja template (Jinja drops the last newline): ``c`` is the config; :func:`model_card` builds
the rows."""


def model_card(config: ProbeConfig) -> ModelCard:
    """The model card of a probe with ``config``.

    Args:
        config: the exported probe's config; the card states only what it records.

    Returns:
        A card with Hub front matter (library, license, tags) and the sections "What it reads",
        "The model it reads", "Labels", "Training", "Test metrics" and "How to load it". A section whose facts the
        config does not record says so.
    """
    data = ModelCardData(library_name="semanticspec-probes", license="apache-2.0",
                         tags=["semanticspec", "speculative-decoding", f"{config.role}-probe"])
    test_metrics = [(k, f"{v:.4f}" if isinstance(v, float) else v) for k, v in sorted(config.test_metrics.items())]
    return ModelCard.from_template(
        data, template_path=TEMPLATE, c=config, reads=_reads_rows(config),
        table=lambda key, value, rows: markdown_table([key, value], rows) + "\n",
        labels=_label_rows(config), fingerprint=[(k, f"`{v}`") for k, v in config.reads.items()],
        test_metrics=test_metrics, training=[(k, f"`{v}`" if isinstance(v, str) else v)
                                             for k, v in config.training.items()])


def _reads_rows(config: ProbeConfig) -> list[tuple[str, str]]:
    """What the probe reads and how: features, the model's part in them, input, network and step."""
    f = config.features
    groups, codes = f.groups, lambda xs: ", ".join(f"`{x}`" for x in xs)
    rows = [("feature groups", codes(groups))]
    if "hidden" in groups:
        rows += [("layers", f"`{list(f.layer_ids)}` (HF `hidden_states` indices: 0 = embeddings, -1 = last layer)"),
                 ("pooling", f"`{f.pooling}` over the step's tokens"),
                 ("layer combination", f"`{config.layer_combine}`")]
    if "token_stats" in groups:
        rows.append(("token statistics", codes(f.token_stats)))
    if "topk_stats" in groups:
        rows.append((f"top-{f.top_k} statistics", codes(f.topk_stats)))
    norm = f", hidden states `{f.hidden_norm}`" if "hidden" in groups else ""
    standardised = ", standardised with the training rows' mean and standard deviation" if config.standardize else ""
    dims = " → ".join(str(d) for d in [config.input_size, *config.hidden_dims, 1])
    return rows + [("read by", f"`{f.source}`{norm}"),
                   ("input", f"{config.input_size} columns{standardised}"),
                   ("network", f"MLP {dims}, ReLU, dropout {config.dropout}, sigmoid" if config.hidden_dims
                    else f"linear {dims}, sigmoid"),  # no hidden layer: nothing for a ReLU or dropout to act on
                   ("step", f"text up to a delimiter in `{list(config.step.delimiters)!r}`, at most "
                            f"{config.step.max_step_tokens} tokens")]


def _label_rows(config: ProbeConfig) -> list[tuple[str, str]]:
    """The label provenance the config records; rows with nothing recorded are left out."""
    labels, sampling, judge = config.labels, config.sampling, config.labels.get("judge")
    if isinstance(judge, dict):
        model = judge.get("model")
        model = model.get("name_or_path") if isinstance(model, dict) else model
        judge = f"`{judge.get('kind', '?')}`" + _maybe(model, " (`{}`)")
    else:
        judge = _maybe(judge, "`{}`")
    rows = [("samples per prefix and model (N)", _maybe(labels.get("n_samples"), "{}")),
            ("sampling", f"temperature {sampling.temperature}, top_p {sampling.top_p}" if sampling else ""),
            ("labelling", _maybe(labels.get("labelling"), "`{}`")),
            ("meaning groups", _maybe(labels.get("clustering"), "`{}`")),
            ("judge", judge),
            ("seed", _maybe(labels.get("seed"), "{}"))]
    return [(k, v) for k, v in rows if v]


def _maybe(value: Any, fmt: str) -> str:
    """``fmt`` filled with ``value``, or "" when nothing is recorded."""
    return "" if value is None else fmt.format(value)


def markdown_table(header: list[str], rows) -> str:
    """A markdown table; a ``|`` inside a cell is escaped so that it stays in its cell (as ``\\|``, which GFM reads
    as ``|`` inside a code span too, where an entity such as ``&#124;`` is shown as written)."""
    return "\n".join(["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
                     + ["| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" for row in rows])
