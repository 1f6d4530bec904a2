"""Refuse, before any decoding or sampling, a server that cannot serve what a probe reads."""

from __future__ import annotations

import re

from generation.engines.base import Capabilities, Unsupported

FULL_VOCAB = ("token_stats: full-vocabulary statistics (exact entropy and rank); no engine returns the whole "
              "distribution; train the probe on 'topk_stats' (exact from the top-k alone) instead")


def servable_groups(caps: Capabilities) -> tuple[str, ...]:
    """The feature groups an engine with these capabilities can serve."""
    return (("hidden",) if caps.hidden else ()) + (("topk_stats",) if caps.prompt_logprobs else ())


def missing(engine, spec) -> list[str]:
    """What ``engine`` cannot give that ``spec`` reads, one ``what: why; fix`` each (empty: it can serve it)."""
    caps = engine.capabilities()
    out = _hidden_missing(engine, caps, spec) if spec.needs_hidden else []
    if "token_stats" in spec.groups:
        out.append(FULL_VOCAB)
    if spec.needs_topk:
        k = spec.top_k
        if not caps.prompt_logprobs:
            out.append("topk_stats: prompt-token log-probs; " + " ".join(caps.remarks))
        elif caps.max_top_k is not None and k > caps.max_top_k:
            fix = (f"restart vllm serve with --max-logprobs {k}" if engine.name == "vllm" else
                   "raise the server's cap")
            out.append(f"topk_stats: top_k={k} log-probs per position, above the server's cap of {caps.max_top_k}; "
                       f"{fix}, or train the probe with top_k <= {caps.max_top_k}")
    return out


def _hidden_missing(engine, caps: Capabilities, spec) -> list[str]:
    """What is missing for the ``hidden`` group: the rows, the probe's layers, or the probe's source."""
    if not caps.hidden:
        if engine.name == "sglang":
            return ["hidden: last-layer hidden states; " + " ".join(caps.remarks)]
        return [f"hidden: last-layer hidden states; {engine.name} returns none over HTTP; serve the model "
                "with SGLang (--enable-return-hidden-states) or train the probe without 'hidden'"]
    if tuple(spec.layer_ids) != (-1,):
        return [f"hidden: layers {list(spec.layer_ids)}; servers return the last layer only; use a probe on "
                "layer_ids [-1]"]
    try:
        spec.check_source(engine.name, caps.hidden_norm, f"{engine.url}")
    except ValueError as e:
        return [f"hidden: {e}"]
    return []


def require(engine, spec, role: str) -> Capabilities:
    """Check that ``engine`` can serve the features ``spec`` reads, before any decoding or sampling.

    Args:
        engine: an :class:`~generation.engines.base.Engine`.
        spec: the probe's :class:`~generation.specs.FeatureSpec`.
        role: who reads through it (``"target"``, ``"draft"``), for the message.

    Returns:
        The engine's capabilities.

    Raises:
        Unsupported: naming the server's URL, what is missing (a probe trained on another source's or norm
            convention's hidden states included), the fix, and the groups this engine can serve.
    """
    caps = engine.capabilities()
    problems = missing(engine, spec)
    if problems:
        can = servable_groups(caps)
        raise Unsupported(f"the {role} server {engine.url} ({engine.name}) cannot serve the probe's groups "
                          f"{list(spec.groups)}: missing " + "; ".join(problems)
                          + f". This server can serve {list(can) or 'no probe group'}.", engine.url)
    return caps


def serving_problems(engine, spec, role: str) -> list[str]:
    """What ``engine`` cannot serve of what the ``role`` probe reads (:func:`missing`; a server writing a step
    returns no hidden rows, so a draft probe cannot read them either)."""
    out = [f"the {role} server {engine.url} ({engine.name}) cannot give {m}" for m in missing(engine, spec)]
    if role == "draft" and spec.needs_hidden:
        out.append("the draft probe reads hidden, but a server writing a step returns no hidden rows; use "
                   "rule='threshold' or a draft probe without hidden")
    if out:
        can = [g for g in servable_groups(engine.capabilities()) if role == "target" or g != "hidden"]
        out[-1] += f" (groups it can serve: {can})"
    return out


def model_names(path: str | None) -> set[str]:
    """The names a server may serve a model by: its path or hub id, and that path's last part (as a server's alias
    often is); for a GGUF file (llama-cpp-python without ``--model_alias`` serves its path), that part without
    ``.gguf`` too, and without the weights key the world's files carry (``target-<16 hex>.gguf``)."""
    path = str(path or "")
    last = path.rstrip("/").rsplit("/", 1)[-1]
    names = {path, last}
    if last.lower().endswith(".gguf"):
        stem = last[: -len(".gguf")]
        names |= {stem, re.sub(r"-[0-9a-f]{16}$", "", stem)}
    return names - {""}


def swapped_roles(served: dict[str, tuple[str, str | None]], own: dict[str, set[str]],
                  whose: str = "model") -> str | None:
    """Why the target's and the draft's servers look swapped, or None: a role's server serves a model named (by its
    path or the path's last part) as the other role's and not as its own.

    Args:
        served: per role, its server's URL and the model name it serves.
        own: per role, the names of the model it should serve (:func:`model_names`).
        whose: what the names are of, for the message.
    """
    for role, other in (("target", "draft"), ("draft", "target")):
        url, model = served[role]
        names = model_names(model)  # a served path is known by its last part too
        if names & own[other] and not names & own[role]:
            return (f"the {role} server {url} serves {model!r}, the {other}'s {whose} ({max(own[other], key=len)!r}); "
                    "are the target's and the draft's servers swapped? Give the target's server as the target")
    return None

