"""The hand-kept architecture table: which model types the parity matrix proved, and which it cannot, with the reason;
which backends of a supported type are refused, and which types keep the dense mask on sdpa.

Plain data, edited only together with a passing parity matrix (`tests/test_parity.py`, `tests/test_flash_path.py`).
`llm_packing.hook.support.architectures` combines it with a scan of the installed transformers' source (a type in
`VERIFIED_MODEL_TYPES` is supported only while its modeling module still builds masks the hook reaches), and
`llm_packing.hook.support.matrix` renders the result as docs/support_matrix.md.
"""


# Proven exact by tests/test_parity.py on eager, sdpa and flex_attention (CPU, float32, tolerance 1e-5) and on the
# FlashAttention code path by tests/test_flash_path.py's reference kernel. Edit only together with a passing matrix.
VERIFIED_MODEL_TYPES = frozenset(
    {
        "afmoe",
        "apertus",
        "apertus1p5_text",
        "arcee",
        "aria_text",
        "axk1",
        "axk2",
        "bailing_hybrid",
        "bamba",
        "beam",
        "biogpt",
        "bitnet",
        "bloom",
        "codegen",
        "cohere",
        "cohere2",
        "cohere2_moe",
        "cohere_compass_text",
        "ctrl",
        "cwm",
        "dbrx",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "diffllama",
        "dory",
        "dots1",
        "dots3_note",
        "dots3_note_text",
        "emu3",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone",
        "exaone4",
        "exaone_moe",
        "falcon",
        "falcon_h1",
        "falcon_mamba",
        "flex_olmo",
        "flint",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gemma3n",
        "gemma3n_text",
        "gemma4",
        "gemma4_text",
        "gemma4_unified",
        "gemma4_unified_text",
        "git",
        "glm",
        "glm4",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "gpt-sw3",
        "gpt2",
        "gpt_bigcode",
        "gpt_neo",
        "gpt_neox",
        "gpt_neox_japanese",
        "gpt_oss",
        "gptj",
        "granite",
        "granite_swa",
        "granitemoe",
        "granitemoe_swa",
        "granitemoehybrid",
        "granitemoeshared",
        "helium",
        "hrm_text",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "hy_v3",
        "hy_v4",
        "hyperclovax",
        "inkling2_loop_text",
        "inkling2_text",
        "inkling_text",
        "internlm3",
        "iquestcoder",
        "jais2",
        "jamba",
        "jetmoe",
        "kimi_linear",
        "kolibri1",
        "laguna",
        "lara_mini",
        "lfm2",
        "lfm2_moe",
        "lfm3",
        "llama",
        "llama4",
        "llama4_text",
        "longcat_flash",
        "mamba",
        "mamba2",
        "mellum",
        "mimo_v2_flash",
        "minicpm3",
        "minimax",
        "minimax_m2",
        "minimax_m3_vl_text",
        "ministral",
        "ministral3",
        "mistral",
        "mixtral",
        "mllama",
        "modernbert-decoder",
        "moshi",
        "mpt",
        "nanochat",
        "nemotron",
        "nemotron_h",
        "olmo",
        "olmo2",
        "olmo3",
        "olmo_hybrid",
        "olmoe",
        "opt",
        "persimmon",
        "phi",
        "phi3",
        "phi4_multimodal",
        "phimoe",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_text",
        "qwen3_moe",
        "qwen3_next",
        "qwen4_exp",
        "qwen4_exp_text",
        "recurrent_gemma",
        "rwkv",
        "sarvam_mla",
        "sarvam_moe",
        "seed_oss",
        "smollm3",
        "solar_open",
        "stablelm",
        "starcoder2",
        "vaultgemma",
        "whisper",
        "xglm",
        "xlstm",
        "youtu",
        "zamba",
        "zamba2",
        "zaya",
    }
)

_MUSICGEN = (
    "AutoModelForCausalLM cannot build it from its own config (the CausalLM class reads decoder fields from the "
    "composite config); an audio-token decoder, not a text LM"
)
_ASSISTANT = (
    "a speculative-decoding assistant: it attends bidirectionally (create_bidirectional_mask) over the key/value "
    "states its target model shares with it, so it is not a causal decoder that packing could train on its own"
)


def _encoder_reason(difference: str, backends: str) -> str:
    return (
        "an encoder family: its causal-LM class attends bidirectionally unless the config sets `is_decoder=True`, so "
        f"documents see each other: packed logits differ from separate documents by {difference} ({backends}, default "
        "config); the `is_decoder=True` path is not in the parity matrix"
    )


def _encoder_decoder_reason(difference: str, backends: str) -> str:
    return (
        "the decoder of an encoder-decoder model: it takes no position_ids and numbers its learned positions along "
        "the whole row, so every document after the first is shifted: packed logits differ from separate documents by "
        f"{difference} ({backends})"
    )


# Candidates that the matrix cannot prove, by hand, with the reason. Types outside the candidate set get their reason
# from the source scan (`llm_packing.hook.support.architectures.refusal_reason`).
REFUSED_CANDIDATES: dict[str, str] = {
    "deepseek_v4": (
        "compressed attention pools keys over fixed windows of the whole row, across documents: packed logits differ "
        "from separate documents by 3.8e-01 (eager, compress rates 4 and 2)"
    ),
    "blt": (
        "byte latent transformer: its global transformer attends over patches of bytes (fixed 4-byte or entropy-cut) "
        "that straddle document starts, and its hashed byte n-gram embeddings read the bytes before each document "
        "start, neither of which a per-token document mask can separate: packed logits differ from separate "
        "documents by 5.2e+00 with the hook (eager, sdpa, static 4-byte patches)"
    ),
    "doge": "its dynamic mask keeps the `keep_window_size` keys of highest weight per query across the whole packed "
    "row once the row is longer than that (2048 by default): packed logits differ from separate documents by 4.5e-01 "
    "(eager, sdpa; window 4) and by 5.6e-01 on flex_attention, which adds that mask outside the document BlockMask",
    "bart": _encoder_decoder_reason("6.0e-01", "eager, sdpa"),
    "bert": _encoder_reason("1.5e-02", "eager, sdpa"),
    "bert-generation": _encoder_reason("1.9e-02", "eager, sdpa"),
    "big_bird": _encoder_reason("1.1e-02", "eager"),
    "bigbird_pegasus": _encoder_decoder_reason("1.2e-01", "eager"),
    "blenderbot": _encoder_decoder_reason("7.3e-01", "eager, sdpa"),
    "blenderbot-small": _encoder_decoder_reason("1.9e-02", "eager, sdpa"),
    "camembert": _encoder_reason("1.8e-02", "eager, sdpa"),
    "data2vec-text": _encoder_reason("1.4e-02", "eager, sdpa"),
    "electra": _encoder_reason("1.8e-02", "eager, sdpa"),
    "ernie": _encoder_reason("1.5e-02", "eager, sdpa"),
    "gemma4_assistant": _ASSISTANT,
    "gemma4_unified_assistant": _ASSISTANT,
    "marian": _encoder_decoder_reason("5.8e-01", "eager, sdpa"),
    "mbart": _encoder_decoder_reason("6.0e-01", "eager, sdpa"),
    "megatron-bert": _encoder_reason("3.2e-01", "eager"),
    "musicgen": _MUSICGEN,
    "musicgen_melody": _MUSICGEN,
    "mvp": _encoder_decoder_reason("6.0e-01", "eager"),
    "pegasus": _encoder_decoder_reason("5.8e-01", "eager, sdpa"),
    "plbart": _encoder_decoder_reason("9.9e-02", "eager, sdpa"),
    "rembert": _encoder_reason("9.3e-02", "eager"),
    "roberta": _encoder_reason("1.4e-02", "eager, sdpa"),
    "roberta-prelayernorm": _encoder_reason("1.4e-02", "eager, sdpa"),
    "roc_bert": _encoder_reason("6.5e-03", "eager, sdpa"),
    "roformer": _encoder_reason("1.5e-02", "eager"),
    "trocr": _encoder_decoder_reason("6.0e-01", "eager"),
    "xlm-roberta": _encoder_reason("1.8e-02", "eager, sdpa"),
    "xlm-roberta-xl": _encoder_reason("1.8e-01", "eager, sdpa"),
    "xmod": _encoder_reason("1.1e-02", "eager, sdpa"),
}

# Supported types whose backend the matrix cannot prove: the hook refuses that backend, the others stay exact.
_SINKS_ON_CPU = "flex_attention with attention sinks cannot run on CPU, so the parity matrix cannot prove it"
REFUSED_BACKENDS: dict[tuple[str, str], str] = {
    (model_type, "flex_attention"): _SINKS_ON_CPU
    for model_type in ("flint", "gpt_oss", "granite_swa", "granitemoe_swa")
}

# Layer kinds (`config.layer_types`) that no supported type isolates, with the reason: a config holding one is refused
# although its type is supported without it (the parity matrix's tiny config has none).
REFUSED_LAYER_TYPES: dict[str, str] = {
    "minimax_m3_sparse": (
        "MiniMax-M3's block-sparse attention, whose indexer ranks blocks of keys by their slot in the packed row and "
        "hides future keys by comparing slots with per-document positions, so that a packed document's queries choose "
        "among the blocks of the documents before it: packed logits differ from separate documents by 5.4e-01 (eager, "
        "sdpa; blocks of 4 tokens, 2 kept)"
    ),
}

# Config values that a supported type's default config leaves off, and under which its packed documents are not
# isolated (the parity matrix proves the defaults): (model_type, field, value) -> why. A value of None refuses any
# value set (not None or False).
_BIDIRECTIONAL = (
    "bidirectional attention over the whole sequence (an embedding model's setting), which the packed masks do not "
    "bound by the document: {} off alone (tiny config, documents of 1-20 tokens)"
)
REFUSED_CONFIG_VALUES: dict[tuple[str, str, object], str] = {
    ("inkling_text", "log_scaling_n_floor", None): (
        "Inkling's attention log scaling takes each query's position from the packed row (`arange`), not from "
        "`position_ids`, so a packed document is scaled by its row offset: up to 1.0e-04 off alone (tiny config, "
        "`log_scaling_n_floor=4`, `log_scaling_alpha=1`; Inkling 2 reads `position_ids` and is exact)"
    ),
    ("gemma", "use_bidirectional_attention", True): _BIDIRECTIONAL.format("1.1e-01 on sdpa"),
    **{
        (model_type, "use_bidirectional_attention", "all"): _BIDIRECTIONAL.format(difference)
        for model_type, difference in (
            ("gemma4", "7.3e-01"), ("gemma4_text", "7.3e-01"),
            ("gemma4_unified", "7.4e-01"), ("gemma4_unified_text", "7.4e-01"),
        )
    },
}

# Supported types whose attention on a backend cannot take a row longer than a config length, whatever its documents:
# a packed row past it is refused with the limit. (model_type, backend) -> (config field, reason).
ROW_LENGTH_LIMITS: dict[tuple[str, str], tuple[str, str]] = {
    ("gpt_neo", "eager"): ("max_position_embeddings", "its eager attention slices a causal buffer of that many tokens "
                           "by the row's length"),
}

# Supported types whose sdpa attention the varlen route (llm_packing/hook/attention/varlen.py) cannot express: they
# keep transformers' dense packed mask on sdpa. Every other supported type takes the varlen route, proven by the parity
# matrix's route axis.
SDPA_DENSE_MODEL_TYPES: dict[str, str] = {
    "falcon": "its attention calls torch's scaled_dot_product_attention itself (ALiBi), not transformers' sdpa "
    "function",
    "gemma4_unified": "its mask builders get `block_sequence_ids` (bidirectional media blocks), which per-document "
    "SDPA does not express",
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), "its QSA key indexer reads the dense mask itself"),
    "inkling_text": "its attention adds a learned relative position bias (`position_bias`), which per-document SDPA "
    "does not take",
}
