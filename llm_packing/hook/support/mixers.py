"""The one table of the mixers the hook runs per document (`hook.mixers`): which classes of which hybrid and recurrent
model types, and how each is called. Plain data: a hybrid type absent from `MIXERS` is refused
(`hook.support.architectures`), and a type is added together with its parity test (tests/test_parity.py,
tests/test_mixers.py).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class MixerCall:
    """How a mixer's `forward` receives what the hook needs: the hidden states, the 2-D mask and the cache."""

    hidden: str = "hidden_states"
    mask: str | None = "attention_mask"
    # None: the cache argument under the name this transformers gives it (`_compat.CACHE_PARAMETER_NAMES`).
    cache: str | None = None
    # Returns `(output, final recurrent state, ...)`; without a cache the caller drops the state, which per document
    # group has no packed layout to go back to, so the wrapper returns `(output, None, ...)`.
    returns_state: bool = False
    # Other `(batch_size, length, ...)` arguments, re-batched per document like the hidden states.
    per_token: tuple[str, ...] = ()
    # Where the documents are read: "mask" (the indexed 2-D mask in `mask`); "position_ids" for a mixer handed
    # only the prepared 4-D mask (those positions restart at 0 per document, which the mask builder checked against
    # the indexed mask earlier in the same forward); or "model", the indexed mask that a call of the model class
    # named in `MASK_RECORDERS` received, for blocks handed no mask at all (RWKV, xLSTM).
    documents: str = "mask"
    # Said after the fix in the error for a packed batch with a cache: where else the model makes one.
    cache_hint: str = ""


_CACHE_PARAMS = MixerCall()

# model_type -> (modeling module, {mixer class name: how to call it}). Model types that share a module list it.
MIXERS: dict[str, tuple[str, dict[str, MixerCall]]] = {
    "qwen3_5": ("qwen3_5", {"Qwen3_5GatedDeltaNet": _CACHE_PARAMS}),
    "qwen3_5_text": ("qwen3_5", {"Qwen3_5GatedDeltaNet": _CACHE_PARAMS}),
    "qwen3_5_moe": ("qwen3_5_moe", {"Qwen3_5MoeGatedDeltaNet": _CACHE_PARAMS}),
    "qwen3_5_moe_text": ("qwen3_5_moe", {"Qwen3_5MoeGatedDeltaNet": _CACHE_PARAMS}),
    "qwen3_next": ("qwen3_next", {"Qwen3NextGatedDeltaNet": _CACHE_PARAMS}),
    "nemotron_h": ("nemotron_h", {"NemotronHMamba2Mixer": _CACHE_PARAMS}),
    "granitemoehybrid": ("granitemoehybrid", {"GraniteMoeHybridMambaLayer": _CACHE_PARAMS}),
    "falcon_h1": ("falcon_h1", {"FalconH1Mixer": _CACHE_PARAMS}),
    "bamba": ("bamba", {"BambaMixer": _CACHE_PARAMS}),
    "mamba2": ("mamba2", {"Mamba2Mixer": _CACHE_PARAMS}),
    "lfm2": ("lfm2", {"Lfm2ShortConv": _CACHE_PARAMS}),
    "lfm2_moe": ("lfm2_moe", {"Lfm2MoeShortConv": _CACHE_PARAMS}),
    "lfm3": ("lfm3", {"Lfm3ShortConv": _CACHE_PARAMS}),
    "jamba": ("jamba", {"JambaMambaMixer": _CACHE_PARAMS}),
    "zamba": ("zamba", {"ZambaMambaMixer": _CACHE_PARAMS}),
    "zamba2": ("zamba2", {"Zamba2MambaMixer": _CACHE_PARAMS}),
    "olmo_hybrid": ("olmo_hybrid", {"OlmoHybridGatedDeltaNet": _CACHE_PARAMS}),
    "kimi_linear": ("kimi_linear", {"KimiLinearDeltaAttention": _CACHE_PARAMS}),
    "bailing_hybrid": ("bailing_hybrid", {"BailingHybridDeltaAttention": _CACHE_PARAMS}),
    # Gated delta nets, and the per-layer n-gram embeddings (PLE): hashed n-grams of the token ids (reset at EOS) and a
    # dilated causal conv, so the ids are re-batched with the hidden states.
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), ("qwen4_exp", {
        "Qwen4ExpTextGatedDeltaNet": _CACHE_PARAMS,
        "Qwen4ExpTextPLELayer": MixerCall(mask="conv_mask", per_token=("input_ids",)),
    })),
    # Compressed convolutional attention: a causal conv over queries and keys, values delayed by one token.
    "zaya": ("zaya", {"ZayaCCAProjection": MixerCall(mask="conv_mask")}),
    # Short convolutions on the keys, values and residual streams of every layer; Inkling 2's full-attention layers
    # convolve keys and values with taps projected from each token (`dynamic_input`), which own no Conv1d.
    "inkling_text": ("inkling", {"InklingShortConvolution": MixerCall(mask="conv_mask")}),
    "inkling2_text": ("inkling2", {
        "Inkling2ShortConvolution": MixerCall(mask="conv_mask"),
        "Inkling2DynamicShortConvolution": MixerCall(mask="conv_mask", per_token=("dynamic_input",)),
    }),
    "inkling2_loop_text": ("inkling2_loop", {
        "Inkling2LoopShortConvolution": MixerCall(mask="conv_mask"),
        "Inkling2LoopDynamicShortConvolution": MixerCall(mask="conv_mask", per_token=("dynamic_input",)),
    }),
    "lara_mini": ("lara_mini", {"LaraMiniGatedDeltaNet": _CACHE_PARAMS}),
    # Griffin's recurrent block: a causal conv, then the RG-LRU, which resets its state where `position_ids` is 0.
    "recurrent_gemma": (
        "recurrent_gemma",
        {
            "RecurrentGemmaRecurrentBlock": MixerCall(
                "input_states", cache="use_cache", returns_state=True, per_token=("position_ids",),
                documents="position_ids",
            )
        },
    ),
    # Pure SSMs: the model hands its 2-D mask straight to every mixer.
    "mamba": ("mamba", {"MambaMixer": _CACHE_PARAMS}),
    "falcon_mamba": ("falcon_mamba", {"FalconMambaMixer": _CACHE_PARAMS}),
    "minimax": ("minimax", {"MiniMaxLightningAttention": MixerCall(returns_state=True)}),
    # Pure recurrent LMs whose blocks get no mask: RWKV's time and channel mixing both shift tokens by one and its WKV
    # recurrence runs along the row; xLSTM's mLSTM layer carries its matrix memory along the row. The whole block is
    # re-batched (its feed-forward is per token), with the documents of the mask the model was called with.
    "rwkv": ("rwkv", {"RwkvBlock": MixerCall("hidden", mask=None, cache="state", returns_state=True,
                                             documents="model")}),
    "xlstm": ("xlstm", {"xLSTMBlock": MixerCall(
        "x", mask=None, cache="state", returns_state=True, documents="model",
        cache_hint=" In eval mode xLSTM also runs rows longer than `config.max_inference_chunksize` in chunks through "
        "a cache of its own: set it to at least the packed `max_length`.",
    )}),
}

# model_type -> the classes (in the MIXERS module) whose calls receive the model's `attention_mask`, for mixers
# whose documents are read from it (`MixerCall.documents == "model"`), and for those that read them from
# `position_ids`: with an ordinary 0/1 mask the positions tell no documents (generation numbers left padding 0 too).
# The causal LM as well as the base model: RWKV's causal LM does not hand its mask on. Their `__call__` is wrapped,
# not `forward`: trainers may bind a model's original `forward` to the instance before the hook is configured
# (SFTTrainer does), which a class `forward` would miss.
MASK_RECORDERS: dict[str, tuple[str, ...]] = {
    "rwkv": ("RwkvForCausalLM", "RwkvModel"),
    "xlstm": ("xLSTMForCausalLM", "xLSTMModel"),
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaModel"),
}
