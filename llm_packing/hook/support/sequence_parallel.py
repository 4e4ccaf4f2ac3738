"""Which model types sequence parallelism (`llm_packing.parallel`, Ulysses) is proven for, as data.

`tests/test_sequence_parallel.py` proves each on 2 and 4 gloo ranks: per-document logits, the loss and every
parameter's gradient of packed rows cut across the ranks equal each document run alone. In depth
(`SEQUENCE_PARALLEL_IN_DEPTH`): float32 and float64, fixed and drawn layouts (qwen2's tiny config slides a 4-token
window on one layer; llama runs with 2 key/value heads and with 1, fewer than the ranks). Every other listed type: the
fixed layouts in float64 (MoE experts on their eager loop, no dropout or router jitter), within 1e-6: 58 of the 89
within 1e-12, and the rest compute a norm, the rotary angles or the logits in float32 inside a float64 model (gemma,
cohere, llama4_text, ...: 1.2e-7 at worst, gemma4_unified_text). Pieces attended alone fail the same comparison by
more than 1e-3 (the test's negative control).

The list is every type that takes the hook's sdpa varlen route (docs/support_matrix.md: `exact (varlen)`) and is not
refused for another reason: hybrids (their mixers' state runs along the row), image-text models, and types whose sdpa
keeps the dense mask (sparse key indexers) are refused by design; so are rope types whose frequencies follow the
document's length, and MoE load-balancing losses (`output_router_logits`), checked per config. Not listed: whisper,
whose causal-LM loss takes neither `shift_labels` nor the batch's target count (each rank's loss would be its own
piece's mean). Edit only together with a passing test.
"""

SEQUENCE_PARALLEL_IN_DEPTH = ("llama", "qwen2", "qwen3")

SEQUENCE_PARALLEL_MODEL_TYPES = (
    "afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "axk1", "beam", "biogpt", "bitnet", "codegen",
    "cohere", "cohere2", "cohere2_moe", "cohere_compass_text", "ctrl", "cwm", "dbrx", "deepseek_v2", "deepseek_v3",
    "diffllama", "dory", "dots1", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "flex_olmo",
    "gemma", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm", "glm4", "glm4_moe",
    "glm4_moe_lite", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granite", "granitemoe", "granitemoeshared",
    "helium", "hrm_text", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder",
    "jais2", "jetmoe", "kolibri1", "laguna", "llama", "llama4_text", "longcat_flash", "mellum", "minicpm3",
    "minimax_m2", "minimax_m3_vl_text", "ministral", "ministral3", "mistral", "mixtral", "modernbert-decoder",
    "moshi", "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "opt", "persimmon", "phi", "phi3", "phimoe",
    "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "sarvam_mla", "sarvam_moe", "seed_oss", "smollm3", "solar_open",
    "stablelm", "starcoder2", "youtu",
)


def sequence_parallel_proof(model_type: str) -> str:
    """What `tests/test_sequence_parallel.py` runs for `model_type`, one of `SEQUENCE_PARALLEL_MODEL_TYPES`."""
    if model_type in SEQUENCE_PARALLEL_IN_DEPTH:
        return ("sdpa (varlen route), 2 and 4 ranks, fixed and drawn layouts: per-document logits, loss and every "
                "gradient equal each document alone (float32 1e-5, float64 1e-12)")
    return ("sdpa (varlen route), 2 and 4 ranks, fixed layouts: per-document logits, loss and every gradient equal "
            "each document alone (float64 1e-6)")
