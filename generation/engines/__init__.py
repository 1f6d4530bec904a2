"""Clients of the serving engines a verifier, a proposer or a label build can call (SGLang, vLLM, llama.cpp).

:mod:`generation.engines.base` holds what every client returns (typed, engine-neutral) and the
:class:`~generation.engines.base.Engine` protocol; one module per engine maps it onto that engine's
HTTP API.
"""
