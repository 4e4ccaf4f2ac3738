"""Which causal LM architectures the packing hook isolates exactly, and why the others are refused.

The candidates come from the installed transformers: every model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` whose
modeling module builds its attention mask through `create_causal_mask`, `create_sliding_window_causal_mask` or
`create_chunked_causal_mask` (the builders the hook replaces), found by reading the source text, not importing it.
A candidate is supported only if it is also in `VERIFIED_MODEL_TYPES`, the architectures the parity matrix
(`tests/test_parity.py`) proved exact: packed logits equal separate-document logits within 1e-5 in float32. Anything
else is refused with the reason in `REFUSED_MODEL_TYPES` (fail closed: a new architecture in a newer transformers is
refused until the matrix covers it).

Regenerate the support table with `python -m llm_packing.architectures --markdown > docs/support_matrix.md`.
"""

import functools
import importlib.util
import os
import re

from .errors import UnsupportedSetupError


MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
# Layer kinds that attend through the mask builders; any other entry of `config.layer_types` (linear_attention, mamba,
# conv, recurrent, ...) keeps a state across the whole row and would leak one document into the next.
ATTENTION_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "indexed_attention"}
)
# Backends the parity matrix runs on CPU. FlashAttention goes through tests/test_flash_path.py's reference kernel: every
# supported architecture on flash_attention_2, the sample `FLASH_ATTENTION_3_RUN` on flash_attention_3 (the same
# transformers code path); the table marks the other flash_attention_3 cells as inferred.
MATRIX_BACKENDS = ("eager", "sdpa", "flex_attention")
FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")
FLASH_ATTENTION_3_RUN = ("llama", "qwen2", "gemma2", "gpt_oss", "falcon")  # plain, sliding, softcap, sinks, own class
# The model-class flag with which transformers declares a backend (building a model without it raises ValueError).
_BACKEND_FLAGS = {
    "eager": None,
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
}

# Proven exact by tests/test_parity.py on eager, sdpa and flex_attention (CPU, float32, tolerance 1e-5) and on the
# FlashAttention code path by tests/test_flash_path.py's reference kernel. Edit only together with a passing matrix.
VERIFIED_MODEL_TYPES = frozenset(
    {
        "afmoe",
        "apertus",
        "arcee",
        "aria_text",
        "axk1",
        "axk2",
        "bamba",
        "beam",
        "biogpt",
        "bitnet",
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
        "dots1",
        "dots3_note_text",
        "emu3",
        "ernie4_5",
        "ernie4_5_moe",
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
        "internlm3",
        "iquestcoder",
        "jais2",
        "jamba",
        "jetmoe",
        "kimi_linear",
        "kolibri1",
        "laguna",
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
        "seed_oss",
        "smollm3",
        "solar_open",
        "stablelm",
        "starcoder2",
        "vaultgemma",
        "whisper",
        "xglm",
        "youtu",
        "zamba",
        "zamba2",
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
# Candidates that the matrix cannot prove, by hand, with the reason. Types outside the candidate set get their reason
# from the source scan (see `refusal_reason`).
_REFUSED_CANDIDATES: dict[str, str] = {
    "deepseek_v4": (
        "compressed attention pools keys over fixed windows of the whole row, across documents: packed logits differ "
        "from separate documents by 3.8e-01 (eager, compress rates 4 and 2)"
    ),
    "doge": "fails the parity matrix on flex_attention: packed logits differ from separate documents by 5.6e-01",
    "bart": "fails the parity matrix: packed logits differ from separate documents by 6.0e-01 (eager, sdpa)",
    "bert": "fails the parity matrix: packed logits differ from separate documents by 1.5e-02 (eager, sdpa)",
    "bert-generation": "fails the parity matrix: packed logits differ from separate documents by 1.9e-02 (eager, sdpa)",
    "big_bird": "fails the parity matrix: packed logits differ from separate documents by 1.1e-02 (eager)",
    "bigbird_pegasus": "fails the parity matrix: packed logits differ from separate documents by 1.2e-01 (eager)",
    "blenderbot": "fails the parity matrix: packed logits differ from separate documents by 7.3e-01 (eager, sdpa)",
    "blenderbot-small": "fails the parity matrix: packed logits differ from separate documents by 1.9e-02 (eager, sdpa)",
    "bloom": "fails the parity matrix: packed logits differ from separate documents by 1.0e-02 (eager)",
    "camembert": "fails the parity matrix: packed logits differ from separate documents by 1.8e-02 (eager, sdpa)",
    "data2vec-text": "fails the parity matrix: packed logits differ from separate documents by 1.4e-02 (eager, sdpa)",
    "dots3_note": "not verified: no tiny random model of it builds offline in the parity matrix yet",
    "electra": "fails the parity matrix: packed logits differ from separate documents by 1.8e-02 (eager, sdpa)",
    "ernie": "fails the parity matrix: packed logits differ from separate documents by 1.5e-02 (eager, sdpa)",
    "gemma4_assistant": _ASSISTANT,
    "gemma4_unified_assistant": _ASSISTANT,
    "gemma3n": (
        "not verified: its vision tower needs timm (not installed for the tests); gemma3n_text, its language model, "
        "is supported"
    ),
    "marian": "fails the parity matrix: packed logits differ from separate documents by 5.8e-01 (eager, sdpa)",
    "mbart": "fails the parity matrix: packed logits differ from separate documents by 6.0e-01 (eager, sdpa)",
    "megatron-bert": "fails the parity matrix: packed logits differ from separate documents by 3.2e-01 (eager)",
    "musicgen": _MUSICGEN,
    "musicgen_melody": _MUSICGEN,
    "mvp": "fails the parity matrix: packed logits differ from separate documents by 6.0e-01 (eager)",
    "pegasus": "fails the parity matrix: packed logits differ from separate documents by 5.8e-01 (eager, sdpa)",
    "plbart": "fails the parity matrix: packed logits differ from separate documents by 9.9e-02 (eager, sdpa)",
    "rembert": "fails the parity matrix: packed logits differ from separate documents by 9.3e-02 (eager)",
    "roberta": "fails the parity matrix: packed logits differ from separate documents by 1.4e-02 (eager, sdpa)",
    "roberta-prelayernorm": "fails the parity matrix: packed logits differ from separate documents by 1.4e-02 (eager, sdpa)",
    "roc_bert": "fails the parity matrix: packed logits differ from separate documents by 6.5e-03 (eager, sdpa)",
    "roformer": "fails the parity matrix: packed logits differ from separate documents by 1.5e-02 (eager)",
    "trocr": "fails the parity matrix: packed logits differ from separate documents by 6.0e-01 (eager)",
    "xlm-roberta": "fails the parity matrix: packed logits differ from separate documents by 1.8e-02 (eager, sdpa)",
    "xlm-roberta-xl": "fails the parity matrix: packed logits differ from separate documents by 1.8e-01 (eager, sdpa)",
    "xmod": "fails the parity matrix: packed logits differ from separate documents by 1.1e-02 (eager, sdpa)",
}

# Source text that marks layers with a state across the row: the recurrent-mask builder, or a non-attention layer kind.
# Supported types whose backend the matrix cannot prove: the hook refuses that backend, the others stay exact.
_SINKS_ON_CPU = "flex_attention with attention sinks cannot run on CPU, so the parity matrix cannot prove it"
REFUSED_BACKENDS: dict[tuple[str, str], str] = {
    (model_type, "flex_attention"): _SINKS_ON_CPU for model_type in ("flint", "gpt_oss", "granite_swa", "granitemoe_swa")
}

# Supported types whose sdpa attention the varlen route (llm_packing/varlen.py) cannot express: they keep transformers'
# dense packed mask on sdpa. Every other supported type takes the varlen route, proven by the parity matrix's route axis.
SDPA_DENSE_MODEL_TYPES: dict[str, str] = {
    "falcon": "its attention calls torch's scaled_dot_product_attention itself (ALiBi), not transformers' sdpa function",
    "gemma4_unified": "its mask builders get `block_sequence_ids` (bidirectional media blocks), which per-document SDPA "
    "does not express",
}

_HYBRID_MARKERS = ("create_recurrent_attention_mask", '"linear_attention"', '"mamba"', '"recurrent"')


@functools.cache
def _transformers_models_dir() -> str:
    spec = importlib.util.find_spec("transformers.models")
    return os.path.dirname(spec.origin)


@functools.cache
def _causal_lm_classes() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {model_type: name for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if isinstance(name, str)}


@functools.cache
def _modeling_source(model_type: str) -> str | None:
    """Source text of the modeling module defining `model_type`'s causal LM class, or None if not found."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    class_name = _causal_lm_classes().get(model_type)
    if class_name is None:
        return None
    definition = re.compile(rf"^class {re.escape(class_name)}\(", re.MULTILINE)
    models_dir = _transformers_models_dir()
    directory = os.path.join(models_dir, model_type_to_module_name(model_type))
    # A few types reuse another architecture's class (internlm3 -> LlamaForCausalLM): fall back to every directory.
    for folder in [directory] + sorted(os.path.join(models_dir, name) for name in os.listdir(models_dir)):
        if not os.path.isdir(folder):
            continue
        for file_name in sorted(os.listdir(folder)):
            if file_name.startswith("modeling_") and file_name.endswith(".py"):
                with open(os.path.join(folder, file_name), encoding="utf-8") as handle:
                    source = handle.read()
                if definition.search(source):
                    return source
    return None


def _scan_reason(model_type: str) -> str | None:
    """Why the source scan rules `model_type` out, or None if it is a candidate."""
    if model_type not in _causal_lm_classes():
        return "not a causal LM in the installed transformers (no entry in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"
    source = _modeling_source(model_type)
    if source is None:
        return f"the modeling module of {_causal_lm_classes()[model_type]} was not found"
    isolated_mixers = model_type in _mixer_model_types()
    if not isolated_mixers and any(marker in source for marker in _HYBRID_MARKERS):
        return "hybrid: linear-attention/SSM/conv layers carry state across documents (no per-document varlen path)"
    # Mixers take the 2-D mask as the model hands it to them (llm_packing.mixers re-batches); pure SSMs build no other.
    if not isolated_mixers and not any(re.search(rf"\b{builder}\b", source) for builder in MASK_BUILDERS):
        return "builds its attention mask without create_causal_mask and its siblings, so the hook cannot reach it"
    return None


def _mixer_model_types():
    from .mixers import MIXERS

    return MIXERS.keys()


@functools.cache
def candidate_model_types() -> tuple[str, ...]:
    """Causal LM types of the installed transformers whose masks go through the builders the hook replaces."""
    return tuple(sorted(t for t in _causal_lm_classes() if _scan_reason(t) is None))


@functools.cache
def supported_model_types() -> tuple[str, ...]:
    """
    The model types whose packed batches the hook isolates exactly: candidates of the installed transformers that
    the parity matrix proved.

    Example:
    ```python
    >>> from llm_packing.architectures import supported_model_types
    >>> "llama" in supported_model_types(), "rwkv" in supported_model_types()
    (True, False)

    ```
    """
    return tuple(sorted(t for t in VERIFIED_MODEL_TYPES if _scan_reason(t) is None))


def refusal_reason(model_type: str) -> str | None:
    """Why `model_type` is refused, or None if it is supported."""
    if model_type in _REFUSED_CANDIDATES:
        return _REFUSED_CANDIDATES[model_type]
    reason = _scan_reason(model_type)
    if reason is None and model_type not in VERIFIED_MODEL_TYPES:
        reason = "not verified by llm_packing's parity matrix for this transformers version"
    return reason


@functools.cache
def _refused_model_types() -> dict[str, str]:
    refused = {t: reason for t in _causal_lm_classes() if (reason := refusal_reason(t)) is not None}
    refused.update(_REFUSED_CANDIDATES)
    return dict(sorted(refused.items()))


def __getattr__(name: str):
    # `REFUSED_MODEL_TYPES` is computed on first use, so importing this module reads no transformers source.
    if name == "REFUSED_MODEL_TYPES":
        return _refused_model_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def non_attention_layer_types(config) -> list[str]:
    """
    The entries of `config.layer_types` (and of a nested `text_config`) that are not attention layers: each one keeps
    a state across the whole packed row.

    Example:
    ```python
    >>> from types import SimpleNamespace
    >>> from llm_packing.architectures import non_attention_layer_types
    >>> non_attention_layer_types(SimpleNamespace(layer_types=["linear_attention", "full_attention", "conv"]))
    ['conv', 'linear_attention']

    ```
    """
    kinds = set()
    for part in (config, getattr(config, "text_config", None)):
        kinds.update(getattr(part, "layer_types", None) or ())
    return sorted(kinds - ATTENTION_LAYER_TYPES)


def require_supported(config) -> None:
    """
    Raise [`UnsupportedSetupError`] unless packed batches of this architecture are isolated exactly.

    Args:
        config ([`~transformers.PretrainedConfig`]):
            The model's config; its `model_type` (for the text config of a multimodal model, the causal LM type of
            its package: `mllama_text_model` -> `mllama`) and `layer_types` are checked.

    Raises:
        `UnsupportedSetupError`: the model type is not in [`supported_model_types`], or its `layer_types` holds
            non-attention layers (linear attention, mamba, conv, ...). The message names the type and the reason.
    """
    from .multimodal import causal_lm_model_type

    model_type = causal_lm_model_type(config)
    reason = refusal_reason(model_type) if model_type else "the config has no `model_type`"
    backend = getattr(config, "_attn_implementation", None)
    if reason is None and (model_type, backend) in REFUSED_BACKENDS:
        reason = f"attention backend {backend!r}: {REFUSED_BACKENDS[model_type, backend]}"
    if reason is None and model_type not in _mixer_model_types() and (stateful := non_attention_layer_types(config)):
        reason = f"`layer_types` holds non-attention layers {stateful}, which carry state across documents"
    if reason is None:
        return
    raise UnsupportedSetupError(
        f"Packing cannot isolate documents for model_type {model_type!r}: {reason}. Supported model types: "
        f"{', '.join(supported_model_types())}. Use one of them, or train this model without packing (padding each "
        "document on its own row)."
    )


def sdpa_route(config) -> tuple[str, str | None]:
    """`("varlen", None)` if packed sdpa batches of this config take the varlen route, else `("dense", reason)`."""
    model_type = getattr(config, "model_type", None)
    if model_type in SDPA_DENSE_MODEL_TYPES:
        return "dense", SDPA_DENSE_MODEL_TYPES[model_type]
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "dense", "attention logit softcapping, which SDPA cannot apply"
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text_config, "index_topk", None) is not None:
        return "dense", "its sparse key indexer reads the dense mask itself"
    return "varlen", None


def _causal_lm_class(model_type: str):
    import transformers

    return getattr(transformers, _causal_lm_classes()[model_type])


def backend_available(model_type: str, backend: str) -> bool:
    """Whether transformers itself offers `backend` for `model_type`'s causal LM class (imports that class)."""
    flag = _BACKEND_FLAGS[backend]
    return flag is None or bool(getattr(_causal_lm_class(model_type), flag, False))


def _flash_substitute(model_type: str, backend: str) -> str | None:
    """The kernel transformers loads instead of a FlashAttention `backend` for architectures that name their own
    (`_compatible_flash_implementations`: attention sinks need a kernel that takes them), or None."""
    compatible = getattr(_causal_lm_class(model_type), "_compatible_flash_implementations", None) or ()
    return compatible[0] if backend in FLASH_BACKENDS and compatible and backend not in compatible else None


def _cell(model_type: str, backend: str) -> str:
    if not backend_available(model_type, backend):
        return "n/a"
    if (model_type, backend) in REFUSED_BACKENDS:
        return "refused: " + REFUSED_BACKENDS[model_type, backend]
    if backend == "sdpa":
        from transformers import AutoConfig

        route, reason = sdpa_route(AutoConfig.for_model(model_type))
        return "exact (varlen)" if route == "varlen" else f"exact (dense: {reason})"
    verdict = "inferred" if backend == "flash_attention_3" and model_type not in FLASH_ATTENTION_3_RUN else "exact"
    substitute = _flash_substitute(model_type, backend)
    return f"{verdict} (runs {substitute})" if substitute else verdict


def support_matrix_markdown() -> str:
    """The support table of the installed transformers, as committed in docs/support_matrix.md."""
    import transformers

    backends = MATRIX_BACKENDS + FLASH_BACKENDS
    lines = [
        "# Supported architectures",
        "",
        "Generated by `python -m llm_packing.architectures --markdown > docs/support_matrix.md` for transformers "
        f"{transformers.__version__}; `tests/test_architectures.py` keeps it true.",
        "",
        "`exact`: packed logits equal separate-document logits within 1e-5 (float32). `tests/test_parity.py` runs "
        "eager, sdpa and flex_attention on CPU (per-token losses too); `tests/test_flash_path.py` runs transformers' "
        "own FlashAttention code path with a reference varlen kernel (sliding windows, softcap, GQA, attention "
        "sinks): every architecture on flash_attention_2 and a sample on flash_attention_3. `inferred`: not run; "
        "flash_attention_3 takes flash_attention_2's path with another kernel (the test asserts it), so the cell "
        "follows from the flash_attention_2 one. `exact (varlen)` on sdpa: packed batches take the varlen route "
        "(per-document SDPA, `llm_packing/varlen.py`; `attention_route='dense'` forces the dense mask), proven on "
        "both routes by the parity matrix; `exact (dense: why)`: the varlen route cannot express the architecture, "
        "which keeps transformers' dense packed mask. `exact (runs K)` (or `inferred (runs K)`): transformers serves "
        "a FlashAttention request with the architecture's own kernel K (one that takes attention sinks); that is the "
        "path tested. `n/a`: transformers offers no such backend for the architecture.",
        "",
        f"## Supported ({len(supported_model_types())})",
        "",
        "| model_type | " + " | ".join(backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for model_type in supported_model_types():
        cells = [_cell(model_type, backend) for backend in backends]
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
    refused = _refused_model_types()
    lines += ["", f"## Refused ({len(refused)})", "", "| model_type | reason |", "|---|---|"]
    lines += [f"| {model_type} | {reason} |" for model_type, reason in refused.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Print the architectures llm_packing supports.")
    parser.add_argument("--markdown", action="store_true", help="print the support table in Markdown")
    if parser.parse_args().markdown:
        print(support_matrix_markdown(), end="")
    else:
        print("\n".join(supported_model_types()))
