"""Which causal LM architectures the packing hook isolates exactly, and why the others are refused.

The candidates come from the installed transformers: every model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` whose
modeling module builds its attention mask through `create_causal_mask`, `create_sliding_window_causal_mask` or
`create_chunked_causal_mask` (the builders the hook replaces), found by reading the source text, not importing it.
A candidate is supported only if it is also in `VERIFIED_MODEL_TYPES` (`llm_packing/hook/support/table.py`, the
hand-kept table), the architectures the parity matrix (`tests/test_parity.py`) proved exact: packed logits equal
separate-document logits within 1e-5 in float32. Anything else is refused with the reason in `REFUSED_MODEL_TYPES`
(fail closed: a new architecture in a newer transformers is refused until the matrix covers it).

Regenerate the support table with `python -m llm_packing.hook.support.matrix > docs/support_matrix.md`.
"""

import functools
import importlib.util
import os
import re

from ..._compat import MASK_BUILDER_NAMES, TRANSFORMERS_VERSION
from ...errors import UnsupportedSetupError
from .image_text import PROVEN_IMAGE_TEXT_TYPES, backend_refusal as image_text_backend_refusal
from .mixers import MIXERS
from .model_types import causal_lm_classes as _causal_lm_classes, causal_lm_model_type, config_parts
from .releases import backend_too_old
from .table import (
    REFUSED_BACKENDS,
    REFUSED_CANDIDATES,
    REFUSED_CONFIG_VALUES,
    REFUSED_LAYER_TYPES,
    SDPA_DENSE_MODEL_TYPES,
    VERIFIED_MODEL_TYPES,
)


# Layer kinds that attend through the mask builders; any other entry of `config.layer_types` (linear_attention, mamba,
# conv, recurrent, ...) keeps a state across the whole row and would leak one document into the next.
ATTENTION_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "indexed_attention"}
)
# Backends the parity matrix runs on CPU. FlashAttention goes through tests/test_flash_path.py's reference kernels:
# every supported architecture on flash_attention_2, a sample on flash_attention_3 and flash_attention_4 (the same
# transformers code path with another kernel: flash_attn_interface, flash_attn.cute); the table marks their other
# cells as inferred.
MATRIX_BACKENDS = ("eager", "sdpa", "flex_attention")
FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
FLASH_ATTENTION_3_RUN = ("llama", "qwen2", "gemma2", "gpt_oss", "falcon")  # plain, sliding, softcap, sinks, own class
# FA4 takes attention sinks as `learnable_sink` and has no dropout: the same sample, and the architectures that name
# flash_attention_4 among their own kernels (`_compatible_flash_implementations`; mimo_v2_flash runs it for every
# FlashAttention request).
FLASH_ATTENTION_4_RUN = FLASH_ATTENTION_3_RUN + ("flint", "granite_swa", "granitemoe_swa", "mimo_v2_flash")
# The FlashAttention backends run for a sample only, with the sample.
FLASH_SAMPLES = {"flash_attention_3": FLASH_ATTENTION_3_RUN, "flash_attention_4": FLASH_ATTENTION_4_RUN}
# The model-class flag with which transformers declares a backend (building a model without it raises ValueError).
_BACKEND_FLAGS = {
    "eager": None,
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
    "flash_attention_4": "_supports_flash_attn",
}

# Source text that marks layers with a state across the row: the recurrent-mask builder, or a non-attention layer kind.
_HYBRID_MARKERS = ("create_recurrent_attention_mask", '"linear_attention"', '"mamba"', '"recurrent"')


@functools.cache
def _transformers_models_dir() -> str:
    spec = importlib.util.find_spec("transformers.models")
    return os.path.dirname(spec.origin)


@functools.cache
def _modeling_file(model_type: str) -> str | None:
    """Path of the modeling module defining `model_type`'s causal LM class, or None if not found."""
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
                path = os.path.join(folder, file_name)
                if definition.search(_read(path)):
                    return path
    return None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


@functools.cache
def _modeling_source(model_type: str) -> str | None:
    """Source text of the modeling module defining `model_type`'s causal LM class, or None if not found."""
    path = _modeling_file(model_type)
    return None if path is None else _read(path)


def _calls_no_builder(source: str) -> bool:
    return not any(re.search(rf"\b{builder}\b", source) for builder in MASK_BUILDER_NAMES)


@functools.cache
def causal_lm_modeling_modules() -> tuple[str, ...]:
    """The modeling modules that hold the causal LM classes of the installed transformers, by transformers' naming
    (`transformers.models.<module>.modeling_<module>`), without reading or importing them."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    names = {model_type_to_module_name(model_type) for model_type in _causal_lm_classes()}
    return tuple(sorted(f"transformers.models.{name}.modeling_{name}" for name in names))


@functools.cache
def calls_no_mask_builder(module_name: str) -> bool:
    """
    Whether the source of the module `module_name` names none of the mask builders the hook replaces (read, not
    imported): pure SSMs and recurrent LMs, and older architectures with masks of their own.

    Example:
    ```python
    >>> from llm_packing.hook.support.architectures import calls_no_mask_builder
    >>> calls_no_mask_builder("transformers.models.mamba.modeling_mamba")
    True
    >>> calls_no_mask_builder("transformers.models.llama.modeling_llama")
    False

    ```
    """
    spec = importlib.util.find_spec(module_name)
    return spec is not None and spec.origin is not None and _calls_no_builder(_read(spec.origin))


def _scan_reason(model_type: str) -> str | None:
    """Why the source scan rules `model_type` out, or None if it is a candidate."""
    if model_type not in _causal_lm_classes():
        if model_type in VERIFIED_MODEL_TYPES:  # proven on a newer release
            return f"not in transformers {TRANSFORMERS_VERSION} (a later release has it; the matrix proved it there)"
        return "not a causal LM in the installed transformers (no entry in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"
    source = _modeling_source(model_type)
    if source is None:
        return f"the modeling module of {_causal_lm_classes()[model_type]} was not found"
    isolated_mixers = model_type in MIXERS
    if not isolated_mixers and any(marker in source for marker in _HYBRID_MARKERS):
        return "hybrid: linear-attention/SSM/conv layers carry state across documents (no per-document varlen path)"
    # Mixers take the 2-D mask as the model hands it to them (hook.mixers re-batches); pure SSMs build no other.
    if not isolated_mixers and _calls_no_builder(source):
        return "builds its attention mask without create_causal_mask and its siblings, so the hook cannot reach it"
    return None


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
    >>> from llm_packing.hook.support.architectures import supported_model_types
    >>> "llama" in supported_model_types(), "openai-gpt" in supported_model_types()
    (True, False)

    ```
    """
    return tuple(sorted(t for t in VERIFIED_MODEL_TYPES if _scan_reason(t) is None))


def refusal_reason(model_type: str) -> str | None:
    """Why `model_type` is refused, or None if it is supported."""
    if model_type in REFUSED_CANDIDATES:
        return REFUSED_CANDIDATES[model_type]
    reason = _scan_reason(model_type)
    if reason is None and model_type not in VERIFIED_MODEL_TYPES:
        reason = "not verified by llm_packing's parity matrix for this transformers version"
    return reason


@functools.cache
def _refused_model_types() -> dict[str, str]:
    # Proven types an older transformers lacks are listed too: on that release they are refused, and say why.
    known = set(_causal_lm_classes()) | VERIFIED_MODEL_TYPES
    refused = {t: reason for t in known if (reason := refusal_reason(t)) is not None}
    refused.update(REFUSED_CANDIDATES)
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
    >>> from llm_packing.hook.support.architectures import non_attention_layer_types
    >>> non_attention_layer_types(SimpleNamespace(layer_types=["linear_attention", "full_attention", "conv"]))
    ['conv', 'linear_attention']

    ```
    """
    kinds = set()
    for part in (config, getattr(config, "text_config", None)):
        kinds.update(getattr(part, "layer_types", None) or ())
    return sorted(kinds - ATTENTION_LAYER_TYPES)


def require_transformers_modeling_code(model) -> None:
    """
    Raise [`UnsupportedSetupError`] if a module of `model` runs modeling code from outside transformers' own package
    (a hub checkpoint loaded with `trust_remote_code=True` lands in `transformers_modules`): the model type's proof
    is for transformers' code, and remote code builds its own masks and positions (a remote `LlamaModel` that makes
    its mask from `attention_mask[:, None, None, :]`, as older hub code does, fails `verify_packing` under the hook:
    `tests/test_patch.py`).
    """
    for module in model.modules():
        if type(module).__module__.startswith("transformers_modules."):
            model_type = getattr(getattr(model, "config", None), "model_type", "?")
            raise UnsupportedSetupError(
                f"{type(module).__name__} (module {type(module).__module__}) runs a checkpoint's own modeling code "
                f"(`trust_remote_code=True`): packing is proven for transformers' code of model_type {model_type!r}, "
                "and remote code builds its own masks and positions. Load the model without `trust_remote_code` "
                "(transformers ships this model type), or train without packing."
            )


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
    model_type = causal_lm_model_type(config)
    reason = refusal_reason(model_type) if model_type else "the config has no `model_type`"
    backend = getattr(config, "_attn_implementation", None)
    if reason is not None and getattr(config, "model_type", None) in PROVEN_IMAGE_TEXT_TYPES:
        # An image-text model without a causal LM entry (llava, qwen2_5_vl, ...): the image-text matrix proved it.
        model_type, reason = config.model_type, None
        if backend is not None:
            reason = image_text_backend_refusal(model_type, backend)
    if reason is None and (model_type, backend) in REFUSED_BACKENDS:
        reason = f"attention backend {backend!r}: {REFUSED_BACKENDS[model_type, backend]}"
    if reason is None and (value_reason := refused_config_value(config, model_type)) is not None:
        raise UnsupportedSetupError(
            f"Packing cannot isolate documents for model_type {model_type!r} with {value_reason}. The type is proven "
            "with its default config, where this setting is off; train this config without packing (each document "
            "padded on its own row)."
        )
    stateful = non_attention_layer_types(config) if reason is None else []
    if refused_kinds := [kind for kind in stateful if kind in REFUSED_LAYER_TYPES]:
        reason = f"`layer_types` holds {refused_kinds[0]!r} layers: {REFUSED_LAYER_TYPES[refused_kinds[0]]}"
    elif stateful and model_type not in MIXERS:
        reason = f"`layer_types` holds non-attention layers {stateful}, which carry state across documents"
    if reason is None:
        return
    raise UnsupportedSetupError(
        f"Packing cannot isolate documents for model_type {model_type!r}: {reason}. Supported model types: "
        f"{', '.join(supported_model_types())}. Use one of them, or train this model without packing (padding each "
        "document on its own row)."
    )


def refused_config_value(config, model_type: str) -> str | None:
    """Why a value set in `config` (or a config nested in it: an image-text model's text config) is refused for
    `model_type` (`REFUSED_CONFIG_VALUES`), or None. Keyed by the model's own type: PaliGemma's gemma text config
    sets bidirectional attention, which PaliGemma's packing bounds by the document."""
    for (refused_type, field, refused), why in REFUSED_CONFIG_VALUES.items():
        if refused_type != model_type:
            continue
        for each in config_parts(config):
            value = getattr(each, field, None)
            is_refused = value not in (None, False) if refused is None else value == refused
            if is_refused:
                return f"`{field}`={value!r}: {why}"
    return None


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
    if getattr(text_config, "use_bidirectional_attention", None) is True:
        return "dense", (
            "its text attention layers are not causal (`use_bidirectional_attention`, PaliGemma's prefix-LM): only "
            "the mask makes them causal"
        )
    return "varlen", None


def _causal_lm_class(model_type: str):
    import transformers

    return getattr(transformers, _causal_lm_classes()[model_type])


def backend_available(model_type: str, backend: str) -> bool:
    """Whether transformers itself offers `backend` for `model_type`'s causal LM class (imports that class)."""
    if backend_too_old(model_type, backend) is not None:
        return False
    flag = _BACKEND_FLAGS[backend]
    return flag is None or bool(getattr(_causal_lm_class(model_type), flag, False))


if __name__ == "__main__":
    print("\n".join(supported_model_types()))
