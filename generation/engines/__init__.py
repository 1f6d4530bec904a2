"""Clients of the serving engines a verifier, a proposer or a label build can call (SGLang, vLLM, llama.cpp).

:mod:`generation.engines.base` holds what every client returns (typed, engine-neutral) and the
:class:`~generation.engines.base.Engine` protocol; one module per engine maps it onto that engine's
HTTP API.
"""

from __future__ import annotations

KINDS = ("sglang", "vllm", "llama.cpp")
"""The engines :func:`make_engine` connects to."""
_PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0}
NEUTRAL_SAMPLING = {
    "vllm": {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, **_PENALTIES},
    "sglang": {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, **_PENALTIES},
    "llama.cpp": {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, **_PENALTIES},
}
"""The sampling fields each engine must be sent, in its own names, so that it samples from temperature and top-p
alone, as the package's one sampler does. A field left out is filled by the server: vLLM from the model's
``generation_config.json`` (``--generation-config auto``, the default: ``top_k``, ``min_p``, ``repetition_penalty``,
and from 0.31 ``presence_penalty`` and ``frequency_penalty``; ``config/model.py`` ``get_diff_sampling_param``),
SGLang's ``/generate`` from ``--preferred-sampling-params`` (its ``top_k`` is -1 or >= 1), llama-cpp-python from its
own defaults (``top_k`` 40, ``min_p`` 0.05, ``repeat_penalty`` 1.1)."""
HIDDEN_NORM = {"sglang": "final_norm"}
"""The norm convention of the hidden rows each engine returns (only SGLang returns any over HTTP): after the
model's final norm, as transformers' last ``hidden_states`` entry (:mod:`generation.engines.sglang`)."""


def make_engine(kind: str, url: str, model: str | None = None, *, api_key_env: str = "OPENAI_API_KEY",
                timeout: float = 120.0, retries: int = 3, **options):
    """A client of the server at ``url`` (checked: it answers ``/v1/models`` and serves ``model``).

    Args:
        kind: ``"sglang"``, ``"vllm"`` or ``"llama.cpp"``.
        url: the server's base URL.
        model: the model name it serves; None = the one it lists.
        api_key_env: environment variable holding the API key ("" or unset: no key).
        timeout: seconds per request attempt.
        retries: attempts per request (connection errors, timeouts, 429 and 5xx are retried).
        options: engine-specific arguments (vLLM: ``max_logprobs``; llama.cpp: ``n_ctx``, the context its server was
            started with, which it states nowhere).

    Returns:
        An :class:`~generation.engines.base.Engine`.

    Raises:
        ValueError: an unknown ``kind``.
        Unreachable: the server does not answer (after the retries) or refuses the key.
        Unsupported: it does not serve ``model``, or its version is below the client's floor (SGLang 0.5.4,
            vLLM 0.11.1), naming the URL, the version and the floor.
    """
    if kind not in KINDS:
        raise ValueError(f"engine kind={kind!r}: expected one of {list(KINDS)}")
    from generation.engines.openai_compat import LlamaCppEngine, VLLMEngine
    from generation.engines.sglang import SGLangEngine  # imports openai_compat too

    client = {"sglang": SGLangEngine, "vllm": VLLMEngine, "llama.cpp": LlamaCppEngine}[kind]
    return client(url, model, api_key_env=api_key_env, timeout=timeout, retries=retries, **options)
