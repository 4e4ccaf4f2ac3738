"""`configure_packing(model)`: makes an indexed 2-D attention mask (`[1, 1, 2, 2, 2, 0]`) give exact per-document
attention on every backend, and `unconfigure_packing()`, which undoes it.

Configuring checks the architecture and backend (`hook.support`), then replaces, through the one registry
(`hook.registry`): the causal mask builders and FlashAttention's `_get_unpad_data` wherever transformers binds them
(`hook.builders`; models that call no builder refuse packed batches unless configured: `hook.builderless`), sdpa's
attention function (`hook.attention.varlen`), the hybrid mixers (`hook.mixers`), the sparse key indexers
(`hook.attention.indexers`), ALiBi builders (`hook.attention.alibi`), Llama 4's attention temperature
(`hook.attention.temperature`), the rotary embeddings whose frequencies follow the batch's length (`hook.rotary`),
`transformers.Trainer`'s choice of dataset columns, which keeps `seq_lengths` (`hook.trainer_columns`), and adds the
model's guards (`hook.guards`, `hook.media.multimodal`) and, for an image-text model, the pre-hook that passes its
top-level `use_cache=False` on to its text model (`hook.cache`); it raises dynamo's recompile limit
(`hook.compile_limits`). Nothing is patched at import time.
"""

import contextlib
import functools
import importlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .. import _compat
from .._compat import MASK_BUILDER_NAMES
from ..errors import PackingTypeError, UnsupportedSetupError
from . import (
    builderless,
    builders,
    cache,
    compile_limits,
    documents,
    guards,
    mixers,
    peft_methods,
    registry,
    rotary,
    router_loss,
    trainer_columns,
)
from .attention import alibi, indexers, route, temperature, varlen
from .media import multimodal
from .support.model_types import config_parts, modeling_module


# The functions the hook replaces: the mask builders (in masking_utils and in every module that imported them by name)
# and FlashAttention's unpad helper. `LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING` values are replaced too.
_MASKING_MODULE = "transformers.masking_utils"
_FLASH_MODULE = "transformers.modeling_flash_attention_utils"
_PATCH_TARGETS = {**dict.fromkeys(MASK_BUILDER_NAMES, _MASKING_MODULE), "_get_unpad_data": _FLASH_MODULE}


def configure_packing(
    model_or_config, *, attn_implementation: str | None = None, attention_route: str | None = None
):
    """
    Make indexed packed attention masks isolate documents exactly for this model's architecture and backend.

    Idempotent and process-wide (transformers binds its mask builders per module); undo with
    [`unconfigure_packing`] or use [`packing_configured`] as a context manager.

    Args:
        model_or_config ([`~transformers.PreTrainedModel`] or [`~transformers.PretrainedConfig`]):
            The causal LM (or its config) that will receive packed batches. Given a config, the functions and
            classes are patched, but the model's own guards (batches without documents, labels crossing documents,
            padding-free batches for hybrids, KV caches) need the model: pass the model you train.
        attn_implementation (`str`, *optional*):
            If given, switch the model (or config) to this attention backend first: `"eager"`, `"sdpa"`,
            `"flex_attention"`, `"flash_attention_2"`, `"flash_attention_3"` or `"flash_attention_4"`.
        attention_route (`str`, *optional*):
            How sdpa attends packed batches; by default the route already chosen in this process (`"auto"` at first,
            and again after [`unconfigure_packing`]), so that configuring a second time, as
            [`~llm_packing.trainers.sft.PackedSFTTrainer`] does, keeps a forced route. `"auto"`: the varlen route
            (each document's own causal block, memory linear in tokens; see `llm_packing.hook.attention.varlen`) where
            the architecture allows it, except on CUDA for rows up to 4,096 tokens and heads up to 128 wide (faster
            there, measured: `hook.attention.route.DENSE_ON_CUDA_UP_TO`), else transformers' dense
            `(batch, 1, length, length)` mask. `"dense"` forces the dense mask;
            `"varlen"` raises unless the varlen route is taken. Other backends ignore `"auto"` and `"dense"`.

    Returns:
        The same `model_or_config`, for chaining.

    Raises:
        `UnsupportedSetupError`: the architecture or backend cannot be isolated (hybrid linear-attention layers, an
            attention backend without a packed mask path, ...). Nothing is patched and the model keeps its backend.
        `IncompatibleTransformersError`: the installed transformers lacks an internal the hook needs.
        `PackingTypeError`: `model_or_config` is neither a model nor a config.

    An image-text model of a type the image-text parity matrix proved (`qwen2_5_vl`, `gemma3`, `llava`, `mllama`,
    ...: `llm_packing.hook.support.image_text`) packs its images with their documents: build the batch with
    `llm_packing.batches.image_text.pack_image_text_documents`. Any other multimodal model is supported on
    text-only batches as the parity matrix proved it: a packed forward that carries its images, and video or audio
    for every model, raises `UnsupportedSetupError`.
    """
    with registry.lock:
        configured = _configure(model_or_config, attn_implementation, attention_route)
        if not _blocks_on_this_thread.count:  # inside a block of this thread, the block's own (a trainer it builds)
            registry.keep_configured()
        return configured


def _configure(model_or_config, attn_implementation: str | None, attention_route: str | None):
    from .support.architectures import require_supported, require_transformers_modeling_code

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
        builders.mask_route(attn_implementation, config)  # an unknown name is refused before anything is switched
        _set_backend(model_or_config, config, attn_implementation)
    try:
        require_supported(config)
        if isinstance(model_or_config, torch.nn.Module):
            require_transformers_modeling_code(model_or_config)
            peft_methods.check_adapters(model_or_config)
            mixers.check_mixers_covered(model_or_config)
            indexers.check_indexers_covered(model_or_config)
        backend = getattr(config, "_attn_implementation", None)
        if backend is not None:
            builders.mask_route(backend, config)
        route.check_route(attention_route, config)
    except BaseException:
        # A refused setup leaves the model on the backend it came with, not half-configured.
        if attn_implementation is not None:
            _set_backend(model_or_config, config, previous_backend)
        raise
    modeling_module(config)  # imported now, so that its module-level builder bindings get patched too
    registry.add_configured_model_types(_model_types(config))
    _patch_builders()
    builderless.refuse_packed_batches_in_builderless_models()
    varlen.install()
    if isinstance(model_or_config, torch.nn.Module):
        guards.scope_documents_to_forwards(model_or_config)
        guards.complete_document_positions(model_or_config)
        guards.refuse_batches_without_documents(model_or_config)
        guards.refuse_labels_across_documents(model_or_config)
        guards.refuse_broken_kernels(model_or_config)
        peft_methods.refuse_activated_lora_added_later(model_or_config)
        guards.refuse_flattened_batches_for_mixers(model_or_config, mixers.mask_reading_mixers(config.model_type),
                                                   builders.check_mask_and_positions)
        cache.honour_top_level_use_cache(model_or_config)
    multimodal.guard_media_inputs(model_or_config)
    mixers.patch_mixers(config.model_type)
    if isinstance(model_or_config, torch.nn.Module):
        mixers.record_model_masks(model_or_config, config.model_type)
    indexers.patch_indexers(config.model_type)
    alibi.patch_alibi(config.model_type)
    temperature.patch_attention_temperature(config.model_type)
    rotary.patch_rotary_embeddings(model_or_config)
    router_loss.patch_load_balancing_losses(config)
    trainer_columns.keep_packing_columns()
    trainer_columns.refuse_packed_rows_in_flattening_collator()
    compile_limits.raise_recompile_limit()
    return model_or_config


def _model_types(config) -> set[str]:
    """The model types of `config` and of the configs nested in it, at any depth (a wrapper's text config)."""
    found = {config.model_type}
    for part in config_parts(config)[1:]:
        found |= _model_types(part)
    return found


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
    """Restore every object [`configure_packing`] replaced, in every module that holds one. Safe to call twice.

    Raises:
        `UnsupportedSetupError`: a configured model's forward is running on another thread: its remaining layers
            would run unpatched, their documents attending to each other.
    """
    with registry.lock:
        running = documents.forwards_running_elsewhere()
        if running:
            raise UnsupportedSetupError(
                f"`unconfigure_packing()` was called while {len(running)} other thread(s) run a forward of a "
                "configured model: its remaining layers would run unpatched, with its documents attending to each "
                "other. Unconfigure once every thread's training or inference has ended (join them first)."
            )
        registry.restore_all()
        documents.end_all_forwards()
        route.reset_route()
        trainer_columns.keep_columns_for_live_collators()


def is_packing_configured() -> bool:
    """Whether [`configure_packing`] is in effect in this process."""
    return registry.is_active()


class _Blocks(threading.local):
    count = 0  # `packing_configured` blocks open on this thread


_open_blocks = 0  # `packing_configured` blocks open in this process, on any thread
_blocks_on_this_thread = _Blocks()


@contextlib.contextmanager
def packing_configured(
    model_or_config, *, attn_implementation: str | None = None, attention_route: str | None = None
) -> Iterator[Any]:
    """Context manager form of [`configure_packing`]; restores the originals when the last open block exits, unless
    packing was configured outside the blocks: before the first, or meanwhile by `configure_packing` on a thread with
    no open block (another thread's model trains on). `configure_packing` inside a block of its thread (a trainer
    built there) is the block's."""
    global _open_blocks
    with registry.lock:
        if _open_blocks == 0 and is_packing_configured():
            registry.keep_configured()
        _open_blocks += 1
        _blocks_on_this_thread.count += 1
    try:
        with registry.lock:
            configured = _configure(model_or_config, attn_implementation, attention_route)
        yield configured
    finally:
        with registry.lock:
            _open_blocks -= 1
            _blocks_on_this_thread.count -= 1
            if _open_blocks == 0 and not registry.kept_configured():
                unconfigure_packing()


def _patch_builders() -> None:
    """Bind our builders wherever transformers' are bound (modules imported later take them from the patched source
    module), and in the layer-pattern mapping."""
    from transformers import masking_utils

    replacements = {}
    for name, module_name in _PATCH_TARGETS.items():
        current = getattr(importlib.import_module(module_name), name)
        if not registry.is_ours(current):
            replacements[current] = builders.wrap(name, current)
    registry.replace_everywhere(replacements)
    mapping = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
    for key, value in list(mapping.items()):
        replacement = _replace_builder_in(value)
        if replacement is not value:
            registry.replace_item(mapping, key, replacement)


def _replace_builder_in(value):
    """The mapping holds builders, `functools.partial`s of them, and dicts of them (hybrid layer patterns)."""
    if callable(value) and (replacement := registry.replacement_for(value)) is not None:
        return replacement
    if isinstance(value, functools.partial):
        inner = _replace_builder_in(value.func)
        return functools.partial(inner, *value.args, **value.keywords) if inner is not value.func else value
    if isinstance(value, dict):
        replaced = {key: _replace_builder_in(item) for key, item in value.items()}
        return replaced if any(replaced[key] is not value[key] for key in value) else value
    return value
