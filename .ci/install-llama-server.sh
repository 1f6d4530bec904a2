#!/usr/bin/env bash
# Install the llama.cpp server that the `openai` sampling backend is tested and measured against (issue 13):
# tests/datamodules/test_llama_server.py and benchmarks/backends.py start it as `python -m llama_cpp.server`.
# llama-cpp-python compiles llama.cpp from source (about 7 minutes on 2 cores); pip caches the wheel,
# so later runs install it in seconds. Idempotent. A user installs the same with `pip install -e ".[server]"`
# (README "Serving"); this script pins the version CI measured and builds a wheel that runs on any x86-64 CPU.
#
# GGML_NATIVE=OFF: a portable build (AVX2 on x86-64), because pip's cache keys the wheel by version only,
# not by the CPU it was compiled for. A native build on this machine crashed with SIGILL in libggml-cpu
# (the CPU lists AMX and AVX-512, which the sandbox does not let a process use).
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
SPEC="llama-cpp-python[server]==0.3.36"
FLAGS="-DGGML_NATIVE=OFF"
if [ "$(uname -m)" = "x86_64" ]; then
  FLAGS="$FLAGS -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
  FLAGS="$FLAGS -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF"
fi
export CMAKE_ARGS="$FLAGS"
python -m pip install -q "$SPEC"

# A wheel that pip cached from another build (e.g. a native one) may not run on this CPU: load the embedded
# world's draft (its f32 GGUF, written once into checkpoints/arithmetic/gguf/; no real-model package needed) and
# decode two tokens in a child process; if that dies, rebuild without the cache.
smoke() {
  python - <<'PY'
from llama_cpp import Llama
from arithmetic_world.gguf import world_gguf
llm = Llama(model_path=str(world_gguf("draft")), n_ctx=256, n_threads=1, verbose=False)
out = llm.create_completion("Start with 7.", max_tokens=2, temperature=0.0)
assert out["choices"][0]["text"] is not None
PY
}
if ! smoke; then
  echo "the cached llama-cpp-python wheel does not run here; rebuilding it from source" >&2
  python -m pip cache remove llama_cpp_python >/dev/null 2>&1 || true  # so the portable wheel is cached instead
  python -m pip install -q --force-reinstall --no-deps "llama-cpp-python==0.3.36"
  smoke
fi
