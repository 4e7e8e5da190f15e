#!/usr/bin/env bash
# Fetch the Python trees of the vLLM releases the conformance suite (tests/compat, marker
# vllm_compat) runs besides the installed one, into a cache outside the clone.
#   scripts/fetch_vllm_releases.sh               every tested release but the installed vLLM (0.33.0, 0.34.0)
#   scripts/fetch_vllm_releases.sh 0.35.0 ...    these releases
# Cache: $KVPUSH_VLLM_CACHE, default /var/cache/kvpush/vllm-releases (~190 MB per release once
# unpacked; the ~336 MB wheel is removed). Idempotent: a release already there is not fetched.
# Exits non-zero, naming the release, when a wheel cannot be had. The suite fetches on its own
# too; this is for set-up steps that have the network when the tests may not.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,9s/^# \{0,1\}//p' "$0"
  exit 0
fi
VENV="${KVPUSH_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
[[ -x "$PY" ]] || PY="${PYTHON:-python3}"
exec "$PY" -m kvpush_dev.vllm_releases "$@"
