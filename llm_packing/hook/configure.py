"""The model hook: makes an indexed 2-D attention mask (`[1, 1, 2, 2, 2, 0]`) give exact per-document attention.

transformers casts 2-D masks to bool before any backend sees them, which merges packed documents. The hook replaces the
causal mask builders wherever transformers binds them, and FlashAttention's `_get_unpad_data`:
- eager / sdpa / flex_attention: the builder is called with `attention_mask=None` and per-document `position_ids`, so
  transformers' own packed-sequence masking builds the mask (bool for sdpa, additive float for eager, a document
  `BlockMask` for flex), sliding windows and chunked attention included;
- flash_attention_2/3/4: the builder hands the raw indexed mask through, and `_get_unpad_data` turns it into
  per-document `cu_seqlens` (batch size > 1 allowed).
Masks without a document index above 1 go to the original builders untouched. Nothing is patched at import time;
`unconfigure_packing()` restores every original object.
"""

import contextlib
import functools
import importlib
import inspect
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .. import _compat
from .._compat import MASK_BUILDER_NAMES
from ..errors import ContaminationError, PackingTypeError, UnsupportedSetupError
from . import alibi, mixers, multimodal, varlen
from .masks import _is_integer_2d, document_position_ids, get_unpad_data, host_copy, validate_document_ids
from .support.model_types import causal_lm_model_type


# Every object the hook replaces: the mask builders (in masking_utils and in every module that imported them by name)
# and FlashAttention's unpad helper. `LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING` values are replaced too.
_MASKING_MODULE = "transformers.masking_utils"
_FLASH_MODULE = "transformers.modeling_flash_attention_utils"
_PATCH_TARGETS = {**dict.fromkeys(MASK_BUILDER_NAMES, _MASKING_MODULE), "_get_unpad_data": _FLASH_MODULE}

_originals: dict[str, Any] = {}  # target name -> original object
_wrappers: dict[str, Any] = {}  # target name -> our replacement
_replaced_mapping_entries: dict[str, Any] = {}  # LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING key -> original value

# sdpa/eager masks are dense: warn once past this size (one mask; models with sliding layers build two).
DENSE_MASK_WARNING_BYTES = 1 << 30
_warned_dense_mask = False


def configure_packing(
    model_or_config, *, attn_implementation: str | None = None, attention_route: str | None = None
):
    """
    Make indexed packed attention masks isolate documents exactly for this model's architecture and backend.

    Idempotent and process-wide (transformers binds its mask builders per module); undo with
    [`unconfigure_packing`] or use [`packing_configured`] as a context manager.

    Args:
        model_or_config ([`~transformers.PreTrainedModel`] or [`~transformers.PretrainedConfig`]):
            The causal LM (or its config) that will receive packed batches.
        attn_implementation (`str`, *optional*):
            If given, switch the model (or config) to this attention backend first: `"eager"`, `"sdpa"`,
            `"flex_attention"`, `"flash_attention_2"`, `"flash_attention_3"` or `"flash_attention_4"`.
        attention_route (`str`, *optional*):
            How sdpa attends packed batches; by default the route already chosen in this process (`"auto"` at first,
            and again after [`unconfigure_packing`]), so that configuring a second time, as
            [`~llm_packing.trainers.sft.PackedSFTTrainer`] does, keeps a forced route. `"auto"`: the varlen route
            (each document's own causal block, memory
            linear in tokens; see `llm_packing.hook.varlen`) where the architecture allows it, else transformers' dense
            `(batch, 1, length, length)` mask. `"dense"` forces the dense mask; `"varlen"` raises unless the varlen
            route is taken. Other backends ignore `"auto"` and `"dense"`.

    Returns:
        The same `model_or_config`, for chaining.

    Raises:
        `UnsupportedSetupError`: the architecture or backend cannot be isolated (hybrid linear-attention layers, an
            attention backend without a packed mask path, ...). Nothing is patched and the model keeps its backend.
        `IncompatibleTransformersError`: the installed transformers lacks an internal the hook needs.
        `PackingTypeError`: `model_or_config` is neither a model nor a config.

    A multimodal model trained on text (`Gemma3ForConditionalGeneration`, `MllamaForCausalLM`, ...) is supported as
    the parity matrix proved it, on text-only batches: a packed forward that carries images, video or audio raises
    `UnsupportedSetupError`.
    """
    from .support.architectures import require_supported

    _compat.check_transformers_internals()
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "model_type"):
        raise PackingTypeError(
            f"`model_or_config` must be a transformers PreTrainedModel or PretrainedConfig, got "
            f"{type(model_or_config).__name__} ({model_or_config!r:.80}). Pass the model you train: "
            "`configure_packing(model)`."
        )
    previous_backend = getattr(config, "_attn_implementation", None)
    if attn_implementation is not None:
        _mask_route(attn_implementation, config)  # an unknown name is refused before anything is switched
        _set_backend(model_or_config, config, attn_implementation)
    try:
        require_supported(config)
        if isinstance(model_or_config, torch.nn.Module):
            mixers.check_mixers_covered(model_or_config)
        backend = getattr(config, "_attn_implementation", None)
        if backend is not None:
            _mask_route(backend, config)
        varlen.check_route(attention_route, config)
    except BaseException:
        # A refused setup leaves the model on the backend it came with, not half-configured.
        if attn_implementation is not None:
            _set_backend(model_or_config, config, previous_backend)
        raise
    _import_modeling_module(config)
    _patch_all()
    multimodal.guard_media_inputs(model_or_config)
    mixers.patch_mixers(config.model_type)
    alibi.patch_alibi(config.model_type)
    return model_or_config


def _set_backend(model_or_config, config, backend: str) -> None:
    if not hasattr(model_or_config, "set_attn_implementation"):
        config._attn_implementation = backend
        return
    try:
        model_or_config.set_attn_implementation(backend)
    except (ValueError, ImportError) as error:  # transformers' own refusal: the kernel is missing or unsupported
        raise UnsupportedSetupError(
            f"`attn_implementation`={backend!r} cannot be used with model_type {config.model_type!r}: {error} "
            "Pick a backend the model supports, e.g. `attn_implementation='sdpa'`."
        ) from error


def unconfigure_packing() -> None:
    """Restore every object [`configure_packing`] replaced, in every module that holds one. Safe to call twice."""
    multimodal.remove_media_guards()
    mixers.unpatch_mixers()
    alibi.unpatch_alibi()
    if not _originals:
        return
    from transformers import masking_utils

    replaced = {id(wrapper): name for name, wrapper in _wrappers.items()}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        for attribute, value in list(namespace.items()):
            if id(value) in replaced and value is _wrappers[replaced[id(value)]]:
                namespace[attribute] = _originals[replaced[id(value)]]
    masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.update(_replaced_mapping_entries)
    _replaced_mapping_entries.clear()
    varlen.uninstall()
    _originals.clear()
    _wrappers.clear()


def is_packing_configured() -> bool:
    """Whether [`configure_packing`] is in effect in this process."""
    return bool(_originals)


@contextlib.contextmanager
def packing_configured(
    model_or_config, *, attn_implementation: str | None = None, attention_route: str | None = None
) -> Iterator[Any]:
    """Context manager form of [`configure_packing`]; restores the originals on exit (unless packing was already
    configured on entry)."""
    was_configured = is_packing_configured()
    try:
        yield configure_packing(
            model_or_config, attn_implementation=attn_implementation, attention_route=attention_route
        )
    finally:
        if not was_configured:
            unconfigure_packing()


def _patch_all() -> None:
    if not _originals:
        for name, module_name in _PATCH_TARGETS.items():
            original = getattr(importlib.import_module(module_name), name)
            _originals[name] = original
            _wrappers[name] = _wrap_unpad(original) if name == "_get_unpad_data" else _wrap_builder(original)
    originals = {id(original): name for name, original in _originals.items()}
    # Modules imported after this point bind the wrappers themselves, since masking_utils itself is patched.
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if namespace is None:
            continue
        for attribute, value in list(namespace.items()):
            name = originals.get(id(value))
            if name is not None and value is _originals[name]:
                namespace[attribute] = _wrappers[name]
    _patch_layer_pattern_mapping()
    varlen.install()


def _patch_layer_pattern_mapping() -> None:
    from transformers import masking_utils

    mapping = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
    for key, value in list(mapping.items()):
        replacement = _replace_builder_in(value)
        if replacement is not value:
            _replaced_mapping_entries.setdefault(key, value)
            mapping[key] = replacement


def _replace_builder_in(value):
    """The mapping holds builders, `functools.partial`s of them, and dicts of them (hybrid layer patterns)."""
    for name, original in _originals.items():
        if value is original:
            return _wrappers[name]
    if isinstance(value, functools.partial):
        inner = _replace_builder_in(value.func)
        return functools.partial(inner, *value.args, **value.keywords) if inner is not value.func else value
    if isinstance(value, dict):
        replaced = {key: _replace_builder_in(item) for key, item in value.items()}
        return replaced if any(replaced[key] is not value[key] for key in value) else value
    return value


def _wrap_unpad(original):
    @functools.wraps(original)
    def get_unpad_data_with_documents(attention_mask: torch.Tensor):
        # Bool masks come from transformers' own builders: they hold no document index.
        if attention_mask.dtype == torch.bool:
            return original(attention_mask)
        return get_unpad_data(attention_mask)

    return get_unpad_data_with_documents


def _wrap_builder(original):
    signature = inspect.signature(original)
    cache_name = _compat.cache_parameter(original)

    @functools.wraps(original)
    def build_mask_with_documents(*args, **kwargs):
        kwargs = _compat.rename_legacy_cache_argument(kwargs, signature)
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        attention_mask = arguments.get("attention_mask")
        if attention_mask is not None and attention_mask.dim() == 4 and torch.is_grad_enabled():
            raise UnsupportedSetupError(
                f"A prepared 4-D `attention_mask` of shape {tuple(attention_mask.shape)} reached a training forward "
                "while packing is configured: it bypasses per-document masking and drops sliding windows. Pass the "
                "indexed 2-D mask from DataCollatorWithPacking instead, or call `unconfigure_packing()`."
            )
        if not _is_integer_2d(attention_mask):
            _refuse_float_document_ids(attention_mask)
            return original(*args, **kwargs)
        position_ids = arguments.get("position_ids")
        if not _check_documents(attention_mask, position_ids):
            return original(*args, **kwargs)
        config = arguments["config"]
        if arguments.get(cache_name) is not None:
            raise ContaminationError(
                "A packed batch (indexed `attention_mask`) reached a forward with a KV cache "
                f"(`use_cache=True`, model_type {getattr(config, 'model_type', '?')!r}): the cache would mix the "
                "documents. Pass `use_cache=False` (Trainer does this for you) or set "
                "`model.config.use_cache = False`."
            )
        route = _mask_route(config._attn_implementation, config)
        if route == "flash":
            return attention_mask
        if route == "dense" and config._attn_implementation == "sdpa":
            packed = varlen.mask_for_builder(original.__name__, arguments, attention_mask)
            if packed is not None:
                return packed
        if route == "dense":
            _warn_if_dense_mask_is_large(attention_mask, arguments["inputs_embeds"].dtype, config._attn_implementation)
        arguments["attention_mask"] = None
        arguments["position_ids"] = document_position_ids(attention_mask)
        return original(*bound.args, **bound.kwargs)

    return build_mask_with_documents


def _refuse_float_document_ids(attention_mask) -> None:
    """transformers casts a 2-D mask to bool, so a float mask holding document ids would merge the documents."""
    if (
        isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.is_floating_point()
        and attention_mask.numel() and bool(attention_mask.max() > 1)
    ):
        raise PackingTypeError(
            f"`attention_mask` is a {attention_mask.dtype} 2-D mask holding document ids up to "
            f"{attention_mask.max().item():g}: transformers would cast it to bool and merge the documents. Pass the "
            "indexed mask as integers (`attention_mask.long()`), as DataCollatorWithPacking emits it."
        )


def _check_documents(attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> bool:
    """Whether the mask is indexed (some id > 1); if so, validate ids and positions. One host sync per forward, shared
    with the varlen layout and the mixers (`masks.host_copy`)."""
    # While decoding with a KV cache, `position_ids` cover only the new tokens (generation, e.g. GRPO's rollouts).
    checks_positions = (position_ids is not None and position_ids.dim() == 2
                        and position_ids.shape[-1] == attention_mask.shape[-1])
    ids, positions = host_copy(attention_mask, position_ids if checks_positions else None)
    if ids.max(initial=0) <= 1:
        if checks_positions:
            _refuse_restarting_positions(ids, positions)
        return False
    validate_document_ids(ids)
    if checks_positions:
        expected = document_position_ids(torch.from_numpy(ids)).numpy()
        wrong = (ids > 0) & (positions != expected)
        if wrong.any():
            row, col = map(int, np.argwhere(wrong)[0])
            raise ContaminationError(
                f"`position_ids` must restart at 0 for every document of a packed batch; row {row} position {col} "
                f"has {int(positions[row, col])} where document {int(ids[row, col])} needs {int(expected[row, col])}. "
                "Pass the `position_ids` that DataCollatorWithPacking emits."
            )
    return True


def _refuse_restarting_positions(mask: np.ndarray, positions: np.ndarray) -> None:
    """A 0/1 mask lets every token of a row attend to all before it: `position_ids` restarting inside the row mean
    packed documents attending to each other (TRL's `return_position_ids=True` collator on packed rows)."""
    restarts = (mask[:, 1:] > 0) & (mask[:, :-1] > 0) & (positions[:, 1:] <= positions[:, :-1])
    if restarts.any():
        row, col = map(int, np.argwhere(restarts)[0] + [0, 1])
        raise ContaminationError(
            f"`position_ids` restart inside a row whose `attention_mask` is 0/1 (row {row}, token {col}: position "
            f"{int(positions[row, col])} after {int(positions[row, col - 1])}), so packed documents would attend to "
            "each other. TRL's collator sends this with `return_position_ids=True`. Train with "
            "`llm_packing.PackedSFTTrainer`, or collate with `DataCollatorWithPacking` (indexed mask) or TRL's "
            "`padding_free=True` (no mask)."
        )


def _mask_route(backend: str, config) -> str:
    """"flash" for backends that run transformers' FlashAttention integration, which unpads with `_get_unpad_data`
    (flash_attention_2/3/4 and hub FlashAttention kernels); "dense" (sdpa, eager) and "flex" for those whose mask
    transformers builds from per-document positions. Anything else cannot be isolated, including a hub kernel that
    registers one of these masks with an attention function of its own (MiniMaxAI/msa ignores the mask)."""
    from transformers import masking_utils
    from transformers.integrations import flash_attention, flex_attention, sdpa_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    routes = {
        (masking_utils.flash_attention_mask, flash_attention.flash_attention_forward): "flash",
        (masking_utils.sdpa_mask, sdpa_attention.sdpa_attention_forward): "dense",
        (masking_utils.sdpa_mask, varlen.sdpa_attention_forward): "dense",  # its varlen route, see `_wrap_builder`
        (masking_utils.eager_mask, None): "dense",  # eager is each model's own function, not a registered one
        (masking_utils.flex_attention_mask, flex_attention.flex_attention_forward): "flex",
    }
    mask_function = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(backend)
    route = routes.get((mask_function, ALL_ATTENTION_FUNCTIONS._global_mapping.get(backend)))
    if route is not None:
        return route
    raise UnsupportedSetupError(
        f"Attention backend {backend!r} (model_type {getattr(config, 'model_type', '?')!r}) has no mask path that "
        "llm_packing can make per-document (only transformers' own eager, sdpa, flex and FlashAttention functions "
        "honour it). Use one of 'eager', 'sdpa', 'flex_attention', 'flash_attention_2', 'flash_attention_3', "
        "'flash_attention_4', e.g. `configure_packing(model, attn_implementation='sdpa')`."
    )


def _warn_if_dense_mask_is_large(attention_mask: torch.Tensor, dtype: torch.dtype, backend: str) -> None:
    """sdpa and eager get a materialised (batch, 1, length, length) mask per mask type: memory quadratic in length."""
    global _warned_dense_mask
    batch_size, length = attention_mask.shape
    element_size = 1 if backend == "sdpa" else dtype.itemsize
    size = batch_size * length * length * element_size
    if size > DENSE_MASK_WARNING_BYTES and not _warned_dense_mask:
        _warned_dense_mask = True
        warnings.warn(
            f"The packed {backend} attention mask for a batch of shape {tuple(attention_mask.shape)} takes "
            f"{size / 2**30:.1f} GiB (batch x length^2 x {element_size} bytes, per mask type): above "
            f"{DENSE_MASK_WARNING_BYTES / 2**30:.0f} GiB. sdpa's varlen route (`attention_route='auto'`), "
            "FlashAttention ('flash_attention_2') and flex_attention keep packing memory linear in tokens; otherwise "
            "lower per_device_train_batch_size or max_length.",
            UserWarning,
            stacklevel=4,
        )


def _import_modeling_module(config) -> None:
    """Import the architecture's modeling module now, so its module-level builder bindings get patched too."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    model_type = causal_lm_model_type(config)
    if not model_type:
        return
    module_name = model_type_to_module_name(model_type)
    with contextlib.suppress(ModuleNotFoundError):
        importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
