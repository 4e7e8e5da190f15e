"""Which kinds of layers a model has, and the start-up refusal of those kvpush cannot move yet.

Why: kvpush does not implement vLLM's ``SupportsHMA``, so vLLM turns its hybrid KV cache
allocator off for it. A sliding-window model (Gemma 3, gpt-oss) then starts with every layer
keeping the whole prompt and the decode engine died on its first request; Mamba and
linear-attention hybrids (Nemotron-H, Qwen3-Next) fail inside vLLM with messages that do not
say why. Until hybrid groups move (docs/design.md, "Hybrid KV cache groups"), such a model is
refused before the engine serves anything, with its layer kinds and what to do instead.

Pure: reads a Hugging Face text config by attribute (the engine passes vLLM's
``model_config.hf_text_config``; tests pass transformers' own config classes).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["MOVABLE", "HybridRefused", "check_model", "layer_kinds", "refusal"]

# Layer kinds whose KV kvpush moves today: one full-attention (or MLA) group.
MOVABLE = frozenset({"full_attention", "attention", "mla", "mlp", "moe"})

# Nemotron-H style ``hybrid_override_pattern`` characters.
_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


class HybridRefused(RuntimeError):
    """The model needs vLLM's hybrid KV cache allocator, which kvpush does not transfer yet."""


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


def refusal(kinds: tuple[str, ...], model: str = "") -> str | None:
    """The start-up refusal for these layer kinds, or None when kvpush moves their KV."""
    other = [k for k in kinds if k not in MOVABLE]
    if not other:
        return None
    count = Counter(kinds)
    listed = ", ".join(f"{c} x {k}" for k, c in count.items())
    name = f"model {model!r}" if model else "this model"
    return (f"kvpush: {name} has {listed} layers; {', '.join(sorted(set(other)))} layers need vLLM's hybrid KV "
            "cache allocator (one KV cache group per layer kind), whose groups kvpush does not transfer yet "
            "(docs/models.md). Without it vLLM would run the model with every layer keeping the whole prompt "
            "(sliding window) or not at all (Mamba, linear attention). Serve this model colocated, or "
            "disaggregated with vLLM's NixlConnector; kvpush moves full-attention and MLA models.")


def check_model(hf_config: Any, model: str = "") -> None:
    """Raise :class:`HybridRefused` for a model kvpush cannot move; return quietly otherwise."""
    msg = refusal(layer_kinds(hf_config), model)
    if msg is not None:
        raise HybridRefused(msg)
