"""Which kinds of layers a model has, and the start-up refusal of those kvpush cannot move yet.

kvpush implements vLLM's ``SupportsHMA`` and moves sliding-window groups beside full
attention (Gemma 3, gpt-oss: docs/models.md). Mamba and linear-attention state groups
(Nemotron-H, Qwen3-Next) do not move yet, and a model whose every layer is sliding-window has
no full-attention group to anchor it: such a model is refused before the engine serves
anything, with its layer kinds and what to do instead.

Pure: reads a Hugging Face text config by attribute (the engine passes vLLM's
``model_config.hf_text_config``; tests pass transformers' own config classes).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["MOVABLE", "HybridRefused", "check_model", "layer_kinds", "refusal"]

# Layer kinds whose KV kvpush moves today: full attention, MLA, and sliding window beside them.
MOVABLE = frozenset({"full_attention", "attention", "mla", "mlp", "moe", "sliding_attention"})
# Layer kinds that hold a prompt's whole KV: a model needs at least one of them.
_FULL = frozenset({"full_attention", "attention", "mla"})

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
    name = f"model {model!r}" if model else "this model"
    if not other and kinds and not _FULL.intersection(kinds) and "sliding_attention" in kinds:
        return (f"kvpush: {name} has only sliding-window layers ({len(kinds)}); kvpush moves sliding-window "
                "KV cache groups beside a full-attention group only (docs/models.md). Serve this model "
                "colocated, or disaggregated with vLLM's NixlConnector.")
    if not other:
        return None
    count = Counter(kinds)
    listed = ", ".join(f"{c} x {k}" for k, c in count.items())
    return (f"kvpush: {name} has {listed} layers; {', '.join(sorted(set(other)))} layers need vLLM's hybrid KV "
            "cache allocator with state groups (Mamba, linear attention), which kvpush does not transfer yet "
            "(docs/models.md). Serve this model colocated, or disaggregated with vLLM's NixlConnector; "
            "kvpush moves full-attention, MLA and sliding-window + full-attention models.")


def check_model(hf_config: Any, model: str = "") -> None:
    """Raise :class:`HybridRefused` for a model kvpush cannot move; return quietly otherwise."""
    msg = refusal(layer_kinds(hf_config), model)
    if msg is not None:
        raise HybridRefused(msg)
