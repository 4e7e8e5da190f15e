"""Start-up refusal of models kvpush cannot move yet, read from the real transformers configs
of the project's family presets (kvpush_dev.tiny_model.FAMILIES) and vLLM's real KV specs."""

from __future__ import annotations

import pytest
import transformers

from kvpush.engine_plugin.model_kinds import HybridRefused, check_model, layer_kinds, refusal
from kvpush.engine_plugin.worker.layouts import LayoutRefused, check_kv_cache_config
from kvpush_dev.tiny_model import FAMILIES, PRESETS


def _config(preset: str):
    fam = FAMILIES[preset]
    return getattr(transformers, fam.config_class)(**fam.config)


def test_sliding_window_beside_full_attention_passes() -> None:
    cfg = _config("swa")
    assert layer_kinds(cfg) == FAMILIES["swa"].layer_kinds
    check_model(cfg, "swa")  # moved as KV cache groups (SupportsHMA)


@pytest.mark.parametrize("preset", ["linear", "mamba"])
def test_state_hybrids_pass(preset: str) -> None:
    """Mamba2 / gated-delta-net layers beside full attention move as state groups."""
    cfg = _config(preset)
    assert layer_kinds(cfg) == FAMILIES[preset].layer_kinds
    check_model(cfg, preset)


def test_mamba1_and_all_state_models_are_refused_naming_their_layer_kinds() -> None:
    jamba = transformers.JambaConfig(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2)
    with pytest.raises(HybridRefused, match=r"\(jamba\).*Mamba1") as err:
        check_model(jamba, "jamba")
    assert "NixlConnector" in str(err.value) and "colocated" in str(err.value)
    nemo = transformers.NemotronHConfig(num_hidden_layers=2, hybrid_override_pattern="M-")
    msg = refusal(layer_kinds(nemo))
    assert msg is not None and "no full-attention layer" in msg and "1 x mamba" in msg
    assert "unknown(Q)" in (refusal(("attention", "unknown(Q)")) or "")


def test_mla_and_llama_pass() -> None:
    check_model(_config("mla"))
    assert set(layer_kinds(_config("mla"))) == {"mla"}
    spec = PRESETS["tiny"]
    llama = transformers.LlamaConfig(num_hidden_layers=spec.layers, hidden_size=spec.hidden)
    assert layer_kinds(llama) == ("full_attention",) * spec.layers
    check_model(llama)


def test_all_sliding_and_qwen2_windows() -> None:
    mistral = transformers.MistralConfig(num_hidden_layers=2, sliding_window=64)
    assert refusal(layer_kinds(mistral)) is not None
    qwen2 = transformers.Qwen2Config(num_hidden_layers=2, sliding_window=64, use_sliding_window=False)
    assert refusal(layer_kinds(qwen2)) is None


def test_windowed_full_attention_spec_is_refused() -> None:
    """What vLLM builds for a sliding-window model when it turns the hybrid allocator off for
    a connector without SupportsHMA: one FullAttentionSpec group with a window."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    windowed = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                 sliding_window=128)
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, windowed)])
    with pytest.raises(LayoutRefused, match="window of 128 tokens"):
        check_kv_cache_config(cfg, pages=False)
    # the connector's windowed_as_full: moved as the dense model vLLM allocated (every layer's
    # whole prompt; the layer-wise hybrid bench's hybrid-off modes)
    check_kv_cache_config(cfg, pages=False, windowed_as_full=True)
    full = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.float32)
    check_kv_cache_config(KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(names, full)]), pages=False)
