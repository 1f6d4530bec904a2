"""Refuse, before any decoding or sampling, a server that cannot serve what a probe reads."""

from __future__ import annotations

from generation.engines.base import Capabilities, EngineError

FULL_VOCAB = ("token_stats: full-vocabulary statistics (exact entropy and rank); no engine returns the whole "
              "distribution; train the probe on 'topk_stats' (exact from the top-k alone) instead")


def servable_groups(caps: Capabilities) -> tuple[str, ...]:
    """The feature groups an engine with these capabilities can serve."""
    return (("hidden",) if caps.hidden else ()) + (("topk_stats",) if caps.prompt_logprobs else ())


def _needs_topk(spec) -> bool:
    # FeatureSpec.needs_topk and .top_k come with the topk branch; until it is merged, read them with defaults.
    return bool(getattr(spec, "needs_topk", "topk_stats" in spec.groups))


def missing(engine, spec) -> list[str]:
    """What ``engine`` cannot give that ``spec`` reads, one ``what: why; fix`` each (empty: it can serve it)."""
    caps = engine.capabilities()
    out = []
    if "hidden" in spec.groups and not caps.hidden:
        if engine.name == "sglang":
            out.append("hidden: last-layer hidden states; restart the SGLang server with --enable-return-hidden-states")
        else:
            out.append(f"hidden: last-layer hidden states; {engine.name} returns none over HTTP; serve the model "
                       "with SGLang (--enable-return-hidden-states) or train the probe without 'hidden'")
    if "token_stats" in spec.groups:
        out.append(FULL_VOCAB)
    if _needs_topk(spec):
        k = int(getattr(spec, "top_k", 20))
        if not caps.prompt_logprobs:
            out.append("topk_stats: prompt-token log-probs; " + " ".join(caps.remarks))
        elif caps.max_top_k is not None and k > caps.max_top_k:
            fix = (f"restart vllm serve with --max-logprobs {k}" if engine.name == "vllm" else
                   "raise the server's cap")
            out.append(f"topk_stats: top_k={k} log-probs per position, above the server's cap of {caps.max_top_k}; "
                       f"{fix}, or train the probe with top_k <= {caps.max_top_k}")
    return out


def require(engine, spec, role: str) -> Capabilities:
    """Check that ``engine`` can serve the features ``spec`` reads, before any decoding or sampling.

    Args:
        engine: an :class:`~generation.engines.base.Engine`.
        spec: the probe's :class:`~generation.specs.FeatureSpec`.
        role: who reads through it (``"target"``, ``"draft"``), for the message.

    Returns:
        The engine's capabilities.

    Raises:
        EngineError: naming the server's URL, what is missing, the fix, and the groups this engine can serve.
        ValueError: the probe's features come from another source or norm convention
            (``FeatureSpec.check_source``, when the spec has it).
    """
    caps = engine.capabilities()
    problems = missing(engine, spec)
    if problems:
        can = servable_groups(caps)
        raise EngineError(f"the {role} server {engine.url} ({engine.name}) cannot serve the probe's groups "
                          f"{list(spec.groups)}: missing " + "; ".join(problems)
                          + f". This server can serve {list(can) or 'no probe group'}.", engine.url)
    check = getattr(spec, "check_source", None)
    if check is not None and "hidden" in spec.groups:
        check(engine.name, caps.hidden_norm, f"the {role} server {engine.url}")
    return caps
