"""Tiny random causal LMs built offline from configs, and the packed batch the parity tests feed them.

Every architecture gets the same shrink (hidden 64, 2 layers, 4 heads / 2 kv heads, vocab 128, ...), applied only to
the fields its config actually has; what an architecture needs beyond that lives in `ARCH_OVERRIDES`, the one table of
per-architecture exceptions. Sliding windows and attention chunks are shrunk to 4 tokens so that the documents of
`PACKED_DOCUMENT_LENGTHS` (up to 9 tokens) cross them.
"""

import contextlib

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES


WINDOW = 4

# Two rows of 18 tokens: documents of different lengths (length-1 documents included, several longer than WINDOW),
# two trailing pad tokens in row 0, none in row 1.
PACKED_DOCUMENT_LENGTHS = ((5, 1, 7, 3), (9, 2, 1, 6))
PACKED_ROW_LENGTH = 18
VOCAB_SIZE = 128
MAX_PARAMETERS = 8_000_000

# Generic shrink: config field -> tiny value, applied when the default config has the field.
_LAYER_COUNTS = {"num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers"}
_SHRINK = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), 64),
    **dict.fromkeys(_LAYER_COUNTS, 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads"), 2),
    **dict.fromkeys(("intermediate_size", "ffn_hidden_size", "ffn_dim", "decoder_ffn_dim", "n_inner"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("num_local_experts", "n_routed_experts", "num_experts"), 4),
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "head_dim": 16,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"), VOCAB_SIZE),
    "hidden_size_per_layer_input": 16,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx"), 128),
    "sliding_window": WINDOW,
    # Sparse attention: the key indexer keeps 3 keys per query, fewer than most documents have.
    "index_topk": 3,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "attention_chunk_size": WINDOW,
}

# Per-architecture exceptions: fields whose generic value does not fit, or switches that turn a feature on (sliding
# windows that are off by default, softcapping) so that the parity matrix exercises it.
_SLIDING_ON = {
    "sliding_window": WINDOW,
    "use_sliding_window": True,
    "max_window_layers": 1,
    "layer_types": ["sliding_attention", "full_attention"],
}
_MAMBA2 = {"chunk_size": 4}
_MAMBA2_PREFIXED = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 4}
# Gated delta nets default to 16 key and 32 value heads of 128 dims, which made these the slowest types of the
# parity matrix (50-60 ms a forward against 2-5 ms for most types): 4 heads of 16.
_TINY_DELTA_NET = {
    "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
}
_QWEN3_5_TEXT = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention"],
} | _TINY_DELTA_NET
_TINY_EXPERTS = {
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
}
_QWEN4_EXP_TEXT = {
    "layer_types": ["linear_attention", "indexed_attention"], "ple_layer_ids": [1], "ple_embed_dim": 64,
    "ngram_vocab_size_base": 1000, "hc_lowrank": 16, "eos_token_id": 2, "indexer_n_heads": 2, "indexer_kv_heads": 1,
    "indexer_head_dim": 16, "indexer_budget": 4, "indexer_compress_ratio": 2,
} | _TINY_DELTA_NET
_DOTS3_SLIDING = {
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_q_lora_rank": 16, "swa_kv_lora_rank": 16,
    "swa_head_dim": 16, "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 16,
}
_TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
# Gemma 3n reuses the key/value cache of earlier layers in its last `num_kv_shared_layers`: four layers, so that a
# sliding and a full layer share those of the first two.
_GEMMA3N_TEXT = {
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "num_kv_shared_layers": 2,
    "laurel_rank": 8,
}

_LLAMA4_TEXT = {"no_rope_layers": [1, 0], "floor_scale": WINDOW}
# Gemma 4's small checkpoints reuse earlier layers' keys and values in their last layers (`num_kv_shared_layers`), and
# transformers slices every layer's mask before them (`_maybe_slice_kv_shared_inputs`): two sliding and full pairs,
# the second pair sharing. Its full-attention layers get a wider head (512 by default) through `global_head_dim`.
_GEMMA4_KV_SHARED = {
    "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2,
}
_GEMMA4_TEXT = {"global_head_dim": 32, **_GEMMA4_KV_SHARED}
ARCH_OVERRIDES: dict[str, dict] = {
    "qwen2": _SLIDING_ON,
    "qwen2_moe": _SLIDING_ON,
    "qwen3": _SLIDING_ON,
    "qwen3_moe": _SLIDING_ON,
    # Off by default, on in checkpoints people fine-tune (Phi-3-mini-4k: 2,047 tokens; StarCoder2: 4,096; Mistral-based
    # Mixtral, Ministral and SmolLM3 configs): the parity matrix proves their sliding layers too.
    **dict.fromkeys(("phi3", "phimoe", "mixtral", "ministral3", "starcoder2", "smollm3"), _SLIDING_ON),
    "gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
    "gemma3_text": {"query_pre_attn_scalar": 16},
    "gemma4_text": _GEMMA4_TEXT,
    "gemma4": {"text_config": _GEMMA4_TEXT},
    "gemma4_unified_text": _GEMMA4_KV_SHARED,
    "gemma4_unified": {"text_config": _GEMMA4_TEXT},
    "gemma3n_text": _GEMMA3N_TEXT,
    # Gemma 3n's image-audio-text wrapper on text-only batches: the text model above, a tiny audio encoder, and a
    # stand-in for its timm vision tower (`_timm_towers_stand_in`) that text-only batches never reach.
    "gemma3n": {"text_config": _GEMMA3N_TEXT},
    # Fields left None by the defaults (the real checkpoints set them), so the generic shrink does not touch them.
    "deepseek_v2": {"num_experts_per_tok": 2},
    # Llama 4: its second layer without rope (as every fourth layer of the checkpoints), where the attention
    # temperature grows every `floor_scale` positions (8,192 by default: never crossed by the tiny rows).
    "llama4_text": _LLAMA4_TEXT,
    "llama4": {"text_config": _LLAMA4_TEXT},
    "dots1": {**_SLIDING_ON, "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2},
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    "ministral": {"head_dim": 16},
    "nemotron": {"num_key_value_heads": 2},
    "longcat_flash": {"expert_ffn_hidden_size": 32, "zero_expert_num": 2, "moe_topk": 2},
    # DbrxAttention reads `rope_theta` and clamps with `clip_qkv` (8 in the checkpoint) from its attention sub-config,
    # whose defaults lack the one and leave the other None.
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"moe_num_experts": 4, "moe_top_k": 2},
    },
    # Rotary parameters are per layer kind and empty by default (the checkpoints set them). The M-RoPE sections are
    # sized for 16-dim heads: transformers 5.17-5.20 pre-rotate `sum(mrope_section)` = head_dim / 2 frequencies.
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
            for kind in ("sliding_attention", "full_attention")
        },
    },
    # The audio and vision towers' own widths and sizes, which the generic shrink does not know.
    "phi4_multimodal": {
        **_SLIDING_ON,
        "audio_config": {
            "num_blocks": 2,
            **dict.fromkeys(("depthwise_separable_out_channel", "ext_pw_out_channel", "nemo_conv_channels"), 64),
        },
        "vision_config": {"image_size": 28, "crop_size": 28},
    },
    # Partial rotary over part of each 16-dim head; GPT-Neo's local layers window over 4 tokens.
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "gpt_neo": {"num_heads": 4, "attention_layers": ["local", "global"], "window_size": WINDOW},
    # Hybrids: one mixer layer and one attention layer each (pure SSMs: mixers only); SSM chunks of 4 tokens, so the
    # documents cross chunk boundaries as well as the 3- and 4-token conv kernels.
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "nemotron_h": _MAMBA2 | {"mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16},
    "mamba2": _MAMBA2 | {"num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16},
    "falcon_h1": _MAMBA2_PREFIXED | {"mamba_d_ssm": 128},
    "bamba": _MAMBA2_PREFIXED | {"attn_layer_indices": [1]},
    "granitemoehybrid": _MAMBA2_PREFIXED | {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_state": 16, "mamba_dt_rank": 8},
    # zamba ties the shared attention block of its hybrid layers: it needs two of them.
    "zamba": {
        "layer_types": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3, "mamba_dt_rank": 8,
        "attention_head_dim": 32,
    },
    "minimax": {"block_size": 4},
    # Qwen4Exp: a gated delta net with n-gram embeddings (PLE) in layer 0, then indexed attention whose key indexer
    # keeps 2 blocks of 2 tokens per query, fewer than most documents have.
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "qwen4_exp": {"text_config": _QWEN4_EXP_TEXT, "vision_config": _TINY_VISION},
    # dots3_note's sliding-window layers take their attention sizes from `swa_*` fields, the checkpoint's by default.
    "dots3_note_text": _DOTS3_SLIDING,
    # Its vision and audio configs size their layer pyramid and adapters for the checkpoint's widths.
    "dots3_note": {
        "text_config": _DOTS3_SLIDING,
        "vision_config": {
            "mlp_layer_types": ["dense", "dense"], "hidden_size": 64, "adapter_in_dim": 64, "adapter_out_dim": 64,
        },
        "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64, "downsample_hidden_size": 32},
    },
    # Inkling 2 with a loop: layers 2-3 (a sliding and a full one) run twice, gated by a rank-16 message gate.
    "inkling2_loop_text": {
        "num_hidden_layers": 4, "layer_types": ["hybrid_sliding", "hybrid"] * 2, "n_layers_per_attn_res_block": 2,
        "loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 2, "loop_gate_rank": 16,
    },
    # ZAYA's router picks one expert per token (its config refuses more), plus a skip expert.
    "zaya": {"num_experts_per_tok": 1},
    # xLSTM runs its matrix memory over chunks of 64 tokens by default, longer than any packed row here.
    "xlstm": {"chunk_size": WINDOW},
    # Griffin: a recurrent block, then local attention over WINDOW tokens (both default to 2048-token scales).
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": WINDOW},
    "qwen3_next": _TINY_DELTA_NET,
    "qwen3_5_text": _TINY_DELTA_NET,
    "qwen3_5_moe_text": _TINY_DELTA_NET,
    "lara_mini": _TINY_DELTA_NET,
    # The Qwen3.5 image-text wrappers on text-only batches: a tiny text model (gated delta net, then attention) and a
    # one-block vision tower that the batches never reach.
    "qwen3_5": {"text_config": _QWEN3_5_TEXT, "vision_config": _TINY_VISION},
    "qwen3_5_moe": {"text_config": _QWEN3_5_TEXT | _TINY_EXPERTS, "vision_config": _TINY_VISION},
    # MLA attention needs as many key/value heads as query heads; the delta attention keeps 4-dim heads small.
    "kimi_linear": {"num_key_value_heads": 4, "linear_num_heads": 4, "linear_head_dim": 16},
    # zamba2 derives its hybrid layer ids from `layers_block_type` before the `layer_types` alias is applied.
    "zamba2": {
        "layer_types": ["linear_attention", "hybrid"], "layers_block_type": ["linear_attention", "hybrid"],
        "n_mamba_heads": 8, "mamba_d_state": 16, "chunk_size": 4,
    },
}


def tiny_config(model_type: str, **overrides):
    """The tiny config of `model_type`: the generic shrink (of nested text/vision/... configs too), then
    `ARCH_OVERRIDES[model_type]`, then `overrides`; a dict given for a nested config updates that config's fields.
    Skips the test if the installed transformers has no such model type (added in a later release)."""
    require_model_type(model_type)
    values = _shrunk_fields(AutoConfig.for_model(model_type))
    for fields in (ARCH_OVERRIDES.get(model_type, {}), overrides):
        for name, value in fields.items():
            nested = isinstance(value, dict) and isinstance(values.get(name), dict)
            values[name] = {**values[name], **value} if nested else value
    return AutoConfig.for_model(model_type, **values)


def require_model_type(model_type: str) -> None:
    """Skip the calling test where the installed transformers predates `model_type`: there is nothing to prove."""
    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"model type {model_type!r} is not in transformers {transformers.__version__}")


def _shrunk_fields(config) -> dict:
    """The fields of `config` that the generic shrink changes; a nested config becomes a dict of all its fields."""
    fields = config.to_dict()
    fields.update(getattr(config, "attribute_map", {}))
    values = {name: value for name, value in _SHRINK.items() if name in fields and fields.get(name) is not None}
    if "kv_lora_rank" in fields:
        # Multi-head latent attention: rotary acts on `qk_rope_head_dim` (what `head_dim` means there) and the latent
        # is expanded to one key/value head per query head.
        values["num_key_value_heads"] = values.get("num_attention_heads", 4)
        if "head_dim" in fields:
            values["head_dim"] = _SHRINK["qk_rope_head_dim"]
    # Read through the attribute map (nemotron_h stores it as `layers_block_type`); some configs derive it read-only.
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list) and not _read_only(config, "layer_types"):
        values["layer_types"] = _tiny_layer_types(layer_types)
        for name in _LAYER_COUNTS & values.keys():
            values[name] = len(values["layer_types"])
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(fields.get(token), int) and fields[token] >= VOCAB_SIZE:
            values[token] = 0
    for name in [name for name, value in fields.items() if isinstance(value, dict)]:
        nested = getattr(config, name, None)
        if isinstance(nested, PretrainedConfig):
            values[name] = _nested_fields(nested)
    return values


def _nested_fields(config) -> dict:
    """All fields of a nested config, shrunk, less the per-layer ones the shrink does not rewrite (`per_layer_config`,
    `mlp_layer_types`, ...): sized for the default's layers, they are rebuilt by the config for the tiny ones."""
    shrunk = _shrunk_fields(config)
    layers = getattr(config, "num_hidden_layers", None)
    per_layer = {
        name
        for name, value in config.to_dict().items()
        if name == "per_layer_config" or (isinstance(value, list) and len(value) == layers and name not in shrunk)
    }
    # Fields every config serialises that some nested configs refuse as unknown kwargs (dbrx's before 5.20).
    per_layer |= {"_name_or_path", "output_attentions"}
    return {name: value for name, value in {**config.to_dict(), **shrunk}.items() if name not in per_layer}


def _read_only(config, name: str) -> bool:
    name = getattr(config, "attribute_map", {}).get(name, name)
    return isinstance(getattr(type(config), name, None), property)


def _tiny_layer_types(default_layer_types):
    """One layer of each kind the default uses (at least two layers): a windowed or mixer layer first (if any), then a
    full-attention one, then the other kinds, so that every kind of layer is in the parity matrix."""
    kinds = list(dict.fromkeys(default_layer_types))
    windowed = [kind for kind in kinds if kind != "full_attention"]
    full = [kind for kind in kinds if kind == "full_attention"]
    return list(dict.fromkeys(windowed[:1] + full[:1] + kinds)) if len(kinds) > 1 else kinds * 2


def tiny_model(model_type: str, attn_implementation: str = "sdpa", **overrides):
    """A float32 tiny random causal LM in eval mode, seeded so that every call builds the same weights."""
    config = tiny_config(model_type, **overrides)
    config.use_cache = False
    # A field the generic shrink does not know leaves a full-size model behind: refuse it before allocating.
    with torch.device("meta"), _timm_towers_stand_in():
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(
            f"tiny {model_type!r} still has {size:,} parameters (limit {MAX_PARAMETERS:,}): add overrides"
        )
    torch.manual_seed(0)
    with _timm_towers_stand_in():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


class UnreachedTower(torch.nn.Module):
    """Stands in for a vision tower built by timm (Gemma 3n's MobileNetV5): timm needs torchvision, which has no
    build for the CPU torch the tests run on. Packed batches are text-only (media inputs are refused), so a forward
    that reaches it fails the test rather than passing unseen."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, *args, **kwargs):
        raise AssertionError("a text-only batch reached the vision tower")


# Nested configs whose model timm builds.
_TIMM_TOWER_TYPES = ("gemma3n_vision", "timm_wrapper")


@contextlib.contextmanager
def _timm_towers_stand_in():
    """While a model is built, `AutoModel.from_config` gives an [`UnreachedTower`] for a timm-built tower."""
    own = AutoModel.__dict__.get("from_config")  # None: inherited from transformers' base auto class
    from_config = AutoModel.from_config.__func__

    def from_config_or_stand_in(cls, config, **kwargs):
        if getattr(config, "model_type", None) in _TIMM_TOWER_TYPES:
            return UnreachedTower(config)
        return from_config(cls, config, **kwargs)

    AutoModel.from_config = classmethod(from_config_or_stand_in)
    try:
        yield
    finally:
        if own is None:
            del AutoModel.from_config
        else:
            AutoModel.from_config = own


def packed_batch(document_lengths=PACKED_DOCUMENT_LENGTHS, row_length=PACKED_ROW_LENGTH, seed=0):
    """
    A packed batch with an indexed attention mask, per-document position_ids and labels.

    Returns a dict with `input_ids`, `attention_mask` (1-based document index, 0 on padding), `position_ids` (restart
    at 0 per document, 0 on padding), `labels` (the token ids, -100 at each document's first token and on padding) and
    `documents` (per row, the list of `(start, length)` spans).
    """
    generator = torch.Generator().manual_seed(seed)
    batch_size = len(document_lengths)
    input_ids = torch.randint(3, VOCAB_SIZE, (batch_size, row_length), generator=generator)
    attention_mask = torch.zeros(batch_size, row_length, dtype=torch.long)
    position_ids = torch.zeros(batch_size, row_length, dtype=torch.long)
    labels = torch.full((batch_size, row_length), -100)
    documents = []
    for row, lengths in enumerate(document_lengths):
        start, spans = 0, []
        for index, length in enumerate(lengths, start=1):
            attention_mask[row, start : start + length] = index
            position_ids[row, start : start + length] = torch.arange(length)
            labels[row, start + 1 : start + length] = input_ids[row, start + 1 : start + length]
            spans.append((start, length))
            start += length
        documents.append(spans)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "labels": labels,
        "documents": documents,
    }
