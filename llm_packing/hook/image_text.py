"""Packed batches with images, for the image-text types the image-text parity matrix proved (`support.image_text`).

One forward pre-hook on the model's base (the module its conditional-generation class calls with every input, under
PEFT too) prepares each packed batch before any layer runs:
- media on a backend the matrix did not prove, video and audio (not packed yet) are refused;
- each image must land in one document, and the images must fill the batch's placeholders exactly
  (`hook.placeholders`), else the batch is refused with the row and column to look at;
- an mRoPE model gets its per-document 3-D positions (`hook.mrope`) when the batch carries 2-D `position_ids` or
  none; a `(4, batch, length)` tensor (text row + 3-D, the layout transformers reads) passes through.
Bidirectional image blocks are bounded by the document in the mask builders (`hook.mask_functions`), Mllama's
cross-attention by `hook.cross_attention`. Everything a forward derives stays in that forward's arguments or on its
documents (`hook.documents`), so concurrent forwards on several threads keep their own.
"""

import functools

import numpy as np
import torch

from ..errors import PackingValueError, UnsupportedSetupError
from . import cross_attention, registry
from .builders import check_documents
from .documents import documents_of
from .guards import input_module
from .masks import is_integer_mask
from .mrope import packed_mrope_position_ids, rope_index_module
from .placeholders import documents_of_images, placeholder_mask
from .support.image_text import require_images_supported


# Media argument names of a forward; those naming video or audio are refused in a packed batch.
_MEDIA_WORDS = ("pixel", "image", "video", "audio", "input_features", "cross_attention", "aspect_ratio")
_NOT_PACKED_WORDS = ("video", "audio", "input_features")


def install(model: torch.nn.Module) -> None:
    """Add the pre-hook to `model`'s base (idempotent; removed by `unconfigure_packing`), and Mllama's cross-attention
    bound."""
    import inspect

    base = input_module(model)
    parameters = inspect.signature(base.forward).parameters
    media = tuple(name for name in parameters if any(word in name for word in _MEDIA_WORDS))
    config = model.config
    hook = functools.partial(
        _prepare_packed_batch, model_type=config.model_type, config=config, rope=rope_index_module(base), media=media
    )
    registry.add_forward_pre_hook(base, "image-text", hook)
    if config.model_type == "mllama":
        cross_attention.install(base)


def causal_through_token_types(config) -> bool:
    """Whether the model's text attention layers are not causal by themselves (`use_bidirectional_attention=True`,
    PaliGemma's prefix-LM): its `token_type_ids` (0 prefix, 1 suffix) make the mask causal. Without them transformers
    attends a document causally on eager but bidirectionally on sdpa (the causal mask is skipped), so a packed batch
    of such a model must carry them; text documents are suffix (1)."""
    return getattr(config.get_text_config(), "use_bidirectional_attention", None) is True


def _prepare_packed_batch(module, args, kwargs, *, model_type, config, rope, media):
    attention_mask = kwargs.get("attention_mask")
    if not is_integer_mask(attention_mask) or not attention_mask.numel():
        return None
    position_ids = kwargs.get("position_ids")
    flat_positions = position_ids if position_ids is not None and position_ids.dim() == 2 else None
    # The ids, and 2-D positions restarting per document: an mRoPE model's are replaced below, so checked here.
    if not check_documents(attention_mask, flat_positions):
        return None
    documents = documents_of(attention_mask)
    if causal_through_token_types(config) and kwargs.get("token_type_ids") is None:
        raise PackingValueError(
            f"A packed batch of model_type {model_type!r} came without `token_type_ids`: its text attention is causal "
            "only through them (0 on the image and prompt, attended both ways; 1 on the suffix), and without them "
            "transformers attends a document causally on eager but bidirectionally on sdpa. Pass the processor's "
            "`token_type_ids` (all 1 for a text-only document)."
        )
    # Tensors (or lists of them); a model's settings passed along with them (`vision_aspect_ratio="anyres_max_9"`)
    # are not media.
    given = {name: kwargs[name] for name in media if isinstance(kwargs.get(name), (torch.Tensor, list, tuple))}
    if given:
        require_images_supported(model_type, config._attn_implementation)
        _refuse_media_not_packed(given)
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    type_ids = kwargs.get("mm_token_type_ids")
    owners = None
    if isinstance(input_ids, torch.Tensor):
        placeholders = placeholder_mask(config, input_ids, type_ids).cpu().numpy()
        owners = documents_of_images(model_type, config, documents, placeholders, given)
    elif given:
        raise PackingValueError(
            f"A packed batch with media {sorted(given)} came without `input_ids` (only `inputs_embeds`?): which "
            "document each image belongs to cannot be checked. Pass `input_ids`."
        )
    if rope is None or (position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] == 4):
        return None
    if position_ids is not None and position_ids.dim() != 2:
        raise PackingValueError(
            f"`position_ids` of shape {tuple(position_ids.shape)} in a packed batch of model_type {model_type!r}: "
            "pass the 2-D per-document positions (DataCollatorWithPacking's), from which the hook computes each "
            "document's 3-D positions, or the (4, batch_size, length) layout (text row, then the 3-D rows)."
        )
    grids = _grids_per_document(given.get("image_grid_thw"), owners, len(documents.starts))
    if grids is not None and type_ids is None:
        raise PackingValueError(
            f"A packed batch of model_type {model_type!r} with images needs `mm_token_type_ids` (its processor "
            "returns them) to give image tokens their 3-D positions. Pass the processor's `mm_token_type_ids`."
        )
    kwargs["position_ids"] = packed_mrope_position_ids(
        rope, input_ids, attention_mask, documents, type_ids, image_grids=grids
    )
    return args, kwargs


def _refuse_media_not_packed(given: dict) -> None:
    refused = sorted(name for name in given if any(word in name for word in _NOT_PACKED_WORDS))
    if refused:
        raise UnsupportedSetupError(
            f"A packed batch carries {', '.join(refused)}: llm_packing packs images with their documents, not video "
            "or audio yet. Pack the rows holding video or audio without packing, or leave those media out."
        )


def _grids_per_document(image_grid_thw, owners, n_documents: int):
    """Per document (order of the forward's documents), its rows of `image_grid_thw`, or None without images."""
    if image_grid_thw is None or owners is None or not len(owners):
        return None
    grids: list[torch.Tensor | None] = [None] * n_documents
    for document in np.unique(owners):
        grids[int(document)] = image_grid_thw[torch.from_numpy(np.flatnonzero(owners == document))]
    return grids
