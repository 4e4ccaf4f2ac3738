"""The replacements of transformers' causal mask builders and of FlashAttention's `_get_unpad_data`.

transformers casts 2-D masks to bool before any backend sees them, which merges packed documents. The wrapped
builders read the indexed mask first:
- eager / sdpa (dense route) / flex_attention: the builder is called with `attention_mask=None` and per-document
  `position_ids`, so transformers' own packed-sequence masking builds the mask (bool for sdpa, additive float for
  eager, a document `BlockMask` for flex), sliding windows and chunked attention included;
- sdpa's varlen route: the builder returns the document layout instead of any `L x L` mask (`hook.attention.varlen`);
- flash_attention_2/3/4: the builder hands the raw indexed mask through, and `_get_unpad_data` turns it into
  per-document `cu_seqlens` (batch size > 1 allowed).
Masks without a document index above 1 go to the original builders untouched.
"""

import functools
import inspect
import warnings

import numpy as np
import torch

from .. import _compat
from ..errors import ContaminationError, PackingTypeError, UnsupportedSetupError
from . import registry
from .attention import chunked, mask_functions, varlen
from .attention.route import mask_for_builder
from .cache import use_cache_fix
from .documents import documents_of, get_unpad_data, positions_were_given, take_unchecked_positions
from .masks import document_position_ids, is_integer_mask
from .support.table import ROW_LENGTH_LIMITS


# sdpa/eager masks are dense: warn once past this size (one mask; models with sliding layers build two).
DENSE_MASK_WARNING_BYTES = 1 << 30
_warned_dense_mask = False

def wrap(name: str, original):
    """Our replacement for the transformers function `name` (a mask builder or `_get_unpad_data`)."""
    return registry.ours(_wrap_unpad(original) if name == "_get_unpad_data" else _wrap_builder(original))


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
        if isinstance(attention_mask, varlen.PackedAttentionMask):
            # A wrapper model (PaliGemma) built the mask and hands it on to its text model, whose builder must return
            # it unchanged, as transformers does for any prepared mask.
            return attention_mask
        if not getattr(attention_mask, _PREPARED, False):
            _refuse_prepared_mask_in_training(attention_mask)
        if not is_integer_mask(attention_mask):
            refuse_float_document_ids(attention_mask)
            positions = arguments.get("position_ids")
            if (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.numel()
                    and isinstance(positions, torch.Tensor) and positions.shape[-1] == attention_mask.shape[-1]
                    and positions_were_given()):
                # A bool or float 0/1 mask is no packed one, but `position_ids` restarting inside it are packed
                # documents attending to each other, as with an integer one (0.21 off alone on a tiny Llama). Only
                # with positions of the whole row that the forward was given: no host copy otherwise (a decoding
                # step's, or the `0..length` a model numbers its tokens with).
                check_documents(attention_mask, positions)
            _refuse_positions_the_builder_misses(arguments)
            return original(*args, **kwargs)
        if not check_documents(attention_mask, arguments.get("position_ids")):
            _refuse_positions_the_builder_misses(arguments)
            return original(*args, **kwargs)
        config = arguments["config"]
        _refuse_unconfigured_model_type(config)
        _refuse_piece_without_sequence_parallelism(attention_mask, arguments["inputs_embeds"])
        _refuse_rows_past_the_length_limit(config, attention_mask.shape[-1])
        if arguments.get(cache_name) is not None:
            raise ContaminationError(
                "A packed batch (indexed `attention_mask`) reached a forward with a KV cache "
                f"(`use_cache=True`, model_type {getattr(config, 'model_type', '?')!r}): the cache would mix the "
                f"documents. {use_cache_fix(documents_of(attention_mask))}"
            )
        return _packed_mask(original, bound, attention_mask, config)

    return build_mask_with_documents


def _packed_mask(original, bound, attention_mask: torch.Tensor, config):
    """What the builder `original` returns for a validated indexed mask, on the route of the model's backend. A dense
    mask transformers' own builder returns (eager, sdpa) is recorded with the forward's documents, for the sparse key
    indexers that read it (`hook.attention.indexers`)."""
    arguments = bound.arguments
    backend = config._attn_implementation
    route = mask_route(backend, config)
    if route == "flash":
        return attention_mask
    if route == "dense" and backend == "sdpa" and not mask_functions.carries_mask_functions(arguments):
        packed = mask_for_builder(original.__name__, arguments, attention_mask)
        if packed is not None:
            return packed
    if route == "dense":
        _warn_if_dense_mask_is_large(attention_mask, arguments["inputs_embeds"].dtype, backend)
    if mask_functions.carries_mask_functions(arguments):
        return _mark_prepared(mask_functions.build_with_mask_functions(original, bound, attention_mask))
    documents = documents_of(attention_mask)
    arguments["attention_mask"] = None
    arguments["position_ids"] = documents.derived("position_ids", lambda: document_position_ids(attention_mask))
    mask = chunked.per_document_builder(original)(*bound.args, **bound.kwargs)
    if isinstance(mask, torch.Tensor):
        documents.add_prepared_mask(mask)
    return _mark_prepared(mask)


def _refuse_unconfigured_model_type(config) -> None:
    """The mask builders are patched for every model, the rest of the hook (mixers, rotary, guards) per configured
    type: a packed batch reaching a model of another type would be isolated in its attention only, if at all."""
    model_type = getattr(config, "model_type", None)
    if not registry.is_configured_model_type(model_type):
        raise unconfigured_model_type_error(model_type, "indexed `attention_mask`")


def unconfigured_model_type_error(model_type: str | None, layout: str) -> ContaminationError:
    """The error for a packed batch (told by `layout`) reaching a model of a type `configure_packing` was not given."""
    return ContaminationError(
        f"A packed batch ({layout}) reached a model of model_type {model_type!r}, which `configure_packing` was not "
        f"called for (configured: {registry.configured_model_types()}): its documents are not proven isolated, and "
        "its mixers or rotary embeddings are not patched. Call `llm_packing.configure_packing(model)` on this model "
        "too."
    )


def _refuse_rows_past_the_length_limit(config, row_length: int) -> None:
    """A type whose attention cannot take rows past a config length (`ROW_LENGTH_LIMITS`) failed with a raw shape
    error on a packed row longer than that, though every document in it was short."""
    key = (getattr(config, "model_type", None), getattr(config, "_attn_implementation", None))
    field, reason = ROW_LENGTH_LIMITS.get(key, (None, None))
    limit = getattr(config, field, None) if field else None
    if limit is not None and row_length > limit:
        raise UnsupportedSetupError(
            f"A packed row of {row_length} tokens reached model_type {config.model_type!r}, whose `{field}` is "
            f"{limit}: {reason}, so it cannot run longer rows even of short documents. Pack with "
            f"`max_length` <= {limit}, or use another attention backend (`attn_implementation`)."
        )


def _refuse_piece_without_sequence_parallelism(attention_mask: torch.Tensor, inputs_embeds: torch.Tensor) -> None:
    """`shard_packed_batch` hands each rank a piece of every row with the whole rows' indexed mask. Only sequence
    parallelism's attention reads a piece against its row; the dense route, eager and flex_attention attended each
    piece on its own, against the document ids of the row's first tokens (0.50 off alone on a tiny Llama), and only
    the varlen route refused it. Refused for every backend, before any layer runs (a packed batch has no cache)."""
    length = inputs_embeds.shape[1]
    if length < attention_mask.shape[-1] and varlen.sharded_attention is None:
        raise UnsupportedSetupError(
            f"A piece of {length} tokens a row reached a model configured for packing with the indexed "
            f"`attention_mask` of whole rows of {attention_mask.shape[-1]} tokens (`shard_packed_batch`'s), without "
            "sequence parallelism configured: each piece would attend on its own. Call "
            "`llm_packing.parallel.configure_sequence_parallel(model, sequence_parallel_size)` on every rank, or "
            "pass the whole rows' `input_ids`."
        )


def _refuse_positions_the_builder_misses(arguments: dict) -> None:
    """transformers isolates a padding-free batch (no indexed mask, `position_ids` restarting within a row) only from
    the `position_ids` its mask builder gets. Some models build their masks without them (afmoe, gpt_oss, opt, biogpt,
    bloom, mpt): their documents attended to each other on eager, sdpa and flex_attention (0.02-0.87 off alone on tiny
    models). Refused before any layer runs, with one host copy in the first such builder call of a forward given
    `position_ids`; FlashAttention reads the positions in each layer instead, so its route is left alone."""
    config = arguments["config"]
    if arguments.get("position_ids") is not None or mask_route(config._attn_implementation, config) == "flash":
        return
    positions = take_unchecked_positions()
    length = arguments["inputs_embeds"].shape[1]
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[-1] != length or length < 2:
        return
    mask = arguments.get("attention_mask")
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] == length):
        mask = torch.ones_like(positions)
    host = torch.stack([mask.detach().to(positions.device).long().expand_as(positions), positions.detach().long()])
    ids, host_positions = host.cpu().numpy()
    restart = first_restart(ids, host_positions)
    if restart is not None:
        row, col = restart
        raise ContaminationError(
            f"`position_ids` restart inside row {row} (token {col}: position {int(host_positions[row, col])} after "
            f"{int(host_positions[row, col - 1])}) of a batch without an indexed `attention_mask`, and model_type "
            f"{config.model_type!r} builds its attention mask without `position_ids`: its packed documents would "
            "attend to each other. A padding-free batch (TRL's `padding_free`, `DataCollatorWithFlattening`, or a 0/1 "
            "mask with restarting positions) is isolated only on FlashAttention for this model. Collate with "
            "`llm_packing.DataCollatorWithPacking()` and its indexed mask (recipe: `padding_free: false`), or train "
            "with `attn_implementation='flash_attention_2'`."
        )


def _refuse_prepared_mask_in_training(attention_mask) -> None:
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and torch.is_grad_enabled():
        raise UnsupportedSetupError(
            f"A prepared 4-D `attention_mask` of shape {tuple(attention_mask.shape)} reached a training forward "
            "while packing is configured: it bypasses per-document masking and drops sliding windows. Pass the "
            "indexed 2-D mask from DataCollatorWithPacking instead, or call `unconfigure_packing()`."
        )


_PREPARED = "_llm_packing_prepared_mask"


def _mark_prepared(mask):
    """Mark a dense mask or BlockMask the hook built for a packed batch: a wrapper model (PaliGemma) hands it on to
    its text model, whose builder call gets it as a prepared mask and must return it unchanged."""
    if mask is not None and not isinstance(mask, varlen.PackedAttentionMask):
        setattr(mask, _PREPARED, True)
    return mask


def refuse_float_document_ids(attention_mask) -> None:
    """transformers casts a 2-D mask to bool, so a float mask holding document ids would merge the documents."""
    if (
        isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.is_floating_point()
        and attention_mask.numel() and bool(attention_mask.max() > 1)
    ):
        raise PackingTypeError(
            f"`attention_mask` is a {attention_mask.dtype} 2-D mask holding document ids up to "
            f"{attention_mask.max().item():g}: transformers would cast it to bool and merge the documents. Pass the "
            "indexed mask as integers (`attention_mask.long()`), as DataCollatorWithPacking emits it. (PEFT's prompt "
            "tuning, p-tuning and prefix tuning make the mask float to add their virtual tokens: those cannot be "
            "packed, since only a row's first document would follow them; use LoRA.)"
        )


def check_mask_and_positions(attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> None:
    """What a builder checks of a 2-D mask and the forward's `position_ids`, for the models that call no builder: no
    float document ids, positions restarting per document of an indexed mask, and none restarting inside a 0/1 one."""
    refuse_float_document_ids(attention_mask)
    check_documents(attention_mask, position_ids)


def check_documents(attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> bool:
    """Whether the mask is indexed (some id > 1); the ids and positions are checked once per forward, from the host
    copy every part of the hook shares (`hook.documents`)."""
    # While decoding with a KV cache, `position_ids` cover only the new tokens (generation, e.g. GRPO's rollouts).
    checks_positions = (position_ids is not None and position_ids.dim() == 2
                        and position_ids.shape[-1] == attention_mask.shape[-1])
    documents = documents_of(attention_mask, position_ids if checks_positions else None)
    if checks_positions:
        check = _positions_restart_per_document if documents.is_packed else _refuse_restarting_positions
        documents.check_positions(position_ids, functools.partial(check, documents.ids))
    return documents.is_packed


def _positions_restart_per_document(ids: np.ndarray, positions: np.ndarray) -> None:
    expected = document_position_ids(torch.from_numpy(ids)).numpy()
    wrong = (ids > 0) & (positions != expected)
    if wrong.any():
        row, col = map(int, np.argwhere(wrong)[0])
        raise ContaminationError(
            f"`position_ids` must restart at 0 for every document of a packed batch; row {row} position {col} "
            f"has {int(positions[row, col])} where document {int(ids[row, col])} needs {int(expected[row, col])}. "
            "Pass the `position_ids` that DataCollatorWithPacking emits."
        )


def _refuse_restarting_positions(mask: np.ndarray, positions: np.ndarray) -> None:
    """A 0/1 mask lets every token of a row attend to all before it: `position_ids` restarting inside the row mean
    packed documents attending to each other (TRL's `return_position_ids=True` collator on packed rows)."""
    restart = first_restart(mask, positions)
    if restart is not None:
        row, col = restart
        raise ContaminationError(
            f"`position_ids` restart inside a row whose `attention_mask` is 0/1 (row {row}, token {col}: position "
            f"{int(positions[row, col])} after {int(positions[row, col - 1])}), so packed documents would attend to "
            "each other. TRL's collator sends this with `return_position_ids=True`. Train with "
            "`llm_packing.PackedSFTTrainer`, or collate with `DataCollatorWithPacking` (indexed mask), or with TRL's "
            "`padding_free=True` (no mask) for a model without conv or recurrent mixers."
        )


def first_restart(mask: np.ndarray, positions: np.ndarray) -> tuple[int, int] | None:
    """`(row, token)` of the first token whose position is not above the one before it while both are unmasked (a
    document starting inside what the mask calls one sequence), or None.

    Example:
    ```python
    >>> import numpy as np
    >>> first_restart(np.array([[1, 1, 1, 1, 0]]), np.array([[0, 1, 0, 1, 0]]))
    (0, 2)

    ```
    """
    restarts = (mask[:, 1:] > 0) & (mask[:, :-1] > 0) & (positions[:, 1:] <= positions[:, :-1])
    if not restarts.any():
        return None
    row, col = np.argwhere(restarts)[0]
    return int(row), int(col) + 1


def mask_route(backend: str, config) -> str:
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
