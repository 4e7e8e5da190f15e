#!/usr/bin/env bash
# The GPU path on a machine with a GPU, in one command: the legacy allocation (a cudaMalloc
# tensor exported by CUDA IPC, opened in a second process, NIXL VRAM registration), the VMM
# allocation (cuMemCreate with the POSIX-fd export type, the fd passed over a unix socket by
# SCM_RIGHTS, imported and mapped in a second process, bytes compared both ways, NIXL VRAM
# registration), a kvpushd WRITE between two GPU regions (per-layer
# FlashAttention caches, bytes compared with the reference copy), layer-wise streaming's
# interprocess event pool opened in a second process by the daemon's gate (LayerGate over
# CudaEventPort: held while the kernel runs, through once it ended), each model family's KV as
# vLLM lays it out on CUDA (sliding window beside full attention, Mamba2 and gated-delta-net
# state, FlashMLA) moved by kvpushd between two CUDA allocations and compared through vLLM's
# own views and, when vLLM with CUDA imports, a 1P1D pair on one GPU through kvpush, then one
# per family preset (swa, mla, mamba). Ends with one verdict line.
#
# Exit codes: 0 PASS, 1 FAIL, 2 bad usage or kvpush not installable,
#             77 no GPU here (nothing was run; 77 is automake's / CTest's "skipped").
# Options: --skip-vllm, --model DIR (for the 1P1D step), --presets swa,mla,mamba (the family
# presets run 1P1D after it; '' for none), --steps legacy,vmm,daemon,events,families (run a
# subset). $KVPUSH_PYTHON picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
EXIT_NO_GPU=77

if [[ ! -e /dev/nvidia0 && ! -e /dev/nvidiactl ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: NO GPU (no /dev/nvidia* device and no nvidia-smi); nothing was run (exit $EXIT_NO_GPU)"
    exit "$EXIT_NO_GPU"
fi

PY="${KVPUSH_PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import kvpush_dev.gpu_check" >/dev/null 2>&1; then
    echo "gpu_check: installing kvpush into $PY (editable, no dependencies)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || {
        echo "gpu_check: FAIL (kvpush is not importable by $PY)"; exit 2; }
fi
exec "$PY" -m kvpush_dev.gpu_check "$@"
