"""The llama.cpp server helpers the tests and benchmarks use, kept importable from here.

They live in the package, :mod:`datamodules.arithmetic.serve` (``python -m datamodules.arithmetic.serve`` starts
the world's two servers for a user). ``.ci/run`` installs the server (compiled once, then taken from pip's cache).
"""

from datamodules.arithmetic.serve import GGML_TYPE_F32, LlamaServer, server_available, world_server

__all__ = ["GGML_TYPE_F32", "LlamaServer", "server_available", "world_server"]
