"""What kvpush's connector needs to know about the vLLM release it runs in.

One place for the facts that differ between the vLLM releases kvpush is tested with
(``TESTED_VLLM``, the releases ``tests/compat`` drives through vLLM's own Scheduler), and for
the answers the connector gives to vLLM's hooks that are about the engine rather than a
request: sleep mode, CUDA graphs, how the KV cache is allocated, draft-model layers.

Everything here imports vLLM lazily, inside the function that needs it: a hook a release
does not have (``kv_cache_access`` before 0.34) must not break the import of the connector
on that release.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Any

from kvpush.engine_plugin.logs import plugin_logger

log = plugin_logger(__name__)

# The vLLM releases the conformance suite (tests/compat, marker vllm_compat) runs: vLLM's own
# Scheduler, connector factory and config validation, once per release. Oldest first.
TESTED_VLLM: tuple[str, ...] = ("0.32.0", "0.33.0", "0.34.0")

# The RequestStatus names of a normal finish: the prompt's KV is whole and someone may fetch
# it. By name, so that a release without one of them (or with a new status) still imports;
# a status not named here (aborted, error, ignored, or one a later release adds) is treated
# as a failure: its blocks are not held and its transfer is withdrawn.
NORMAL_FINISHES = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"})


def finished_normally(status: Any) -> bool:
    """Did vLLM finish the request normally (stop, length, repetition)?"""
    return getattr(status, "name", None) in NORMAL_FINISHES


# ----------------------------------------------------------------------------- versions

def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.34.1.dev3+gabc"`` -> (0, 34, 1); ``"0.32.0+cpu"`` -> (0, 32, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        return ()
    return tuple(int(p) for p in m.group(1).split("."))


def untested_reason(version: str) -> str | None:
    """Why ``version`` is outside what was tested (newer than the newest tested release),
    or None. A development build of the next release counts as newer."""
    have = release_tuple(version)
    newest = release_tuple(TESTED_VLLM[-1])
    if not have or have[:3] <= newest:
        return None
    return (f"kvpush: vLLM {version} is newer than the newest release kvpush was tested with "
            f"(tested: {', '.join(TESTED_VLLM)}); its connector API may have changed: run "
            f"`pytest -m vllm_compat` against it before serving")


_warned_lock = threading.Lock()
_warned: set[str] = set()


def warn_if_untested(version: str | None = None) -> str | None:
    """Log the warning of :func:`untested_reason` once per process (each engine process
    builds a scheduler-side and a worker-side connector); returns it, or None."""
    if version is None:
        try:
            import vllm

            version = str(vllm.__version__)
        except Exception:  # no vLLM, or one without a version: nothing to compare
            return None
    why = untested_reason(version)
    if why is None:
        return None
    with _warned_lock:
        if version in _warned:
            return why
        _warned.add(version)
    log.warning(why)
    return why


# ------------------------------------------------------------------------ engine set-up

class UnsupportedEngineSetting(ValueError):
    """An engine setting kvpush cannot serve correctly: refused at start-up."""


def refuse_sleep_mode(vllm_config: Any) -> None:
    """Sleep mode (``--enable-sleep-mode``) moves the KV cache to new physical pages on wake;
    the daemon's mapping of the old ones (CUDA IPC) cannot follow. vLLM 0.33+ asks the
    connector (``supports_sleep_mode``: False) and refuses itself; 0.32 does not ask, so the
    connector refuses here, on every release, with the same words."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None and getattr(mc, "enable_sleep_mode", False):
        raise UnsupportedEngineSetting(
            "kvpush: KVPushConnector does not support sleep mode (--enable-sleep-mode): after a wake "
            "the KV cache lives in new physical pages that kvpushd's mapping cannot follow; start "
            "the engine without --enable-sleep-mode")


def piecewise_needed(extra_config: Mapping[str, Any] | None) -> bool:
    """``requires_piecewise_for_cudagraph``: True when layer-wise push can stream on a GPU.
    Full CUDA graphs replay the forward without calling ``save_kv_layer``, so a stream would
    report no layer and the daemon would wait for progress that never comes. Streaming on a
    GPU happens with ``layerwise: "on"`` (``auto`` streams on CPU engines only); a config
    that does not parse keeps to the safe answer (the connector refuses it at start anyway)."""
    from kvpush.engine_plugin.config import PluginConfig

    extra = dict(extra_config or {})
    try:
        cfg = PluginConfig.from_extra(extra)
    except Exception:
        return extra.get("layerwise", "auto") != "off"
    return cfg.stream_min_tokens(None, gpu=True) is not None


def legacy_ipc_access() -> Any:
    """``kv_cache_access`` (vLLM 0.34+): the plain allocation, whose CUDA IPC handles the
    daemon opens (0.34 allocates a VMM-backed "extensible" KV cache by default on CUDA, and
    legacy CUDA IPC cannot export driver-mapped memory). vLLM then keeps the extensible KV
    cache off, or refuses to start if it was asked for explicitly."""
    try:
        from vllm.config.kv_transfer import KVCacheAccess
    except ImportError as e:  # only 0.34+ asks, and 0.34+ has it
        raise RuntimeError("kvpush: this vLLM has no KVCacheAccess (vLLM < 0.34 does not ask for "
                           "kv_cache_access)") from e
    access = getattr(KVCacheAccess, "LEGACY_IPC", None)
    if access is None:
        raise RuntimeError(
            "kvpush: this vLLM's KVCacheAccess has no LEGACY_IPC: it cannot give kvpush a KV cache "
            "that CUDA IPC can export (kvpush is tested with vLLM " + ", ".join(TESTED_VLLM) + ")")
    return access


def check_kv_allocation(vllm_config: Any) -> None:
    """GPU, before exporting the KV cache: refuse a VMM-backed ("extensible") cache, whose
    legacy CUDA IPC handles will not open in the daemon, with the fix instead of a failed
    attach. vLLM 0.34+ honours ``kv_cache_access`` (LEGACY_IPC) by keeping it off; this
    catches a vLLM that does not."""
    cc = getattr(vllm_config, "cache_config", None)
    if cc is not None and getattr(cc, "enable_extensible_kv_cache", None) is True:
        raise UnsupportedEngineSetting(
            "kvpush: the KV cache is VMM-backed (vLLM's extensible KV cache), and kvpushd maps it "
            "through legacy CUDA IPC handles, which cannot export driver-mapped memory; start vLLM "
            "with --no-enable-extensible-kv-cache (kvpush asks for KVCacheAccess.LEGACY_IPC; "
            "docs/gpu-memory.md)")


def draft_layer_names(vllm_config: Any) -> set[str]:
    """The attention layers a speculative-decoding draft model owns (vLLM 0.33+ marks them
    ``is_draft_layer``; earlier releases mark none)."""
    cc = getattr(vllm_config, "compilation_config", None)
    ctx = getattr(cc, "static_forward_context", None) or {}
    return {name for name, layer in ctx.items() if getattr(layer, "is_draft_layer", False) is True}


def target_layers(kv_caches: dict[str, Any], vllm_config: Any) -> dict[str, Any]:
    """``kv_caches`` without the draft model's layers: only the target model's KV crosses.
    A prefill engine usually runs no drafter while its decode engine does, and the two
    layouts must match; the drafter's KV of the prompt is its own to compute."""
    draft = draft_layer_names(vllm_config) & set(kv_caches)
    if not draft:
        return kv_caches
    kept = {n: t for n, t in kv_caches.items() if n not in draft}
    if not kept:
        raise UnsupportedEngineSetting("kvpush: every KV cache layer belongs to a draft model")
    log.info("kvpush: %d draft-model KV layers are not transferred (%d target layers are)",
             len(draft), len(kept))
    return kept
