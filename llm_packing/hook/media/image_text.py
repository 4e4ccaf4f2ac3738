"""Packed batches with images, for the image-text types the image-text parity matrix proved (`support.image_text`).

One forward pre-hook on the model's base (the module its conditional-generation class calls with every input, under
PEFT too) prepares each packed batch before any layer runs:
- media on a backend the matrix did not prove, videos of a type the video matrix did not prove (`hook.media.video`) and
  audio are refused;
- each image and video must land in one document, and they must fill the batch's placeholders exactly
  (`hook.media.placeholders`, `hook.media.video`), else the batch is refused with the row and column to look at;
- an mRoPE model gets its per-document 3-D positions (`hook.media.mrope`) when the batch carries 2-D `position_ids` or
  none; a `(4, batch, length)` tensor (text row + 3-D, the layout transformers reads) passes through.
Bidirectional image blocks are bounded by the document in the mask builders (`hook.attention.mask_functions`), Mllama's
cross-attention by `hook.media.cross_attention`. Everything a forward derives stays in that forward's arguments or on
its documents (`hook.documents`), so concurrent forwards on several threads keep their own.
"""

import functools

import torch

from ...errors import ContaminationError, PackingValueError
from .. import registry
from ..builders import check_documents, first_restart
from ..documents import documents_of
from ..guards import input_module
from ..masks import is_integer_mask
from ..support.image_text import IMAGE_TOKENS, PROVEN_IMAGE_TEXT_TYPES, require_images_supported
from . import cross_attention, video
from .mrope import packed_mrope_position_ids, rope_index_module
from .placeholders import documents_of_images, placeholder_mask


# Media argument names of a forward (`second_per_grid_ts`: Qwen2.5-VL's seconds per temporal patch of each video).
_MEDIA_WORDS = ("pixel", "image", "video", "audio", "input_features", "cross_attention", "aspect_ratio",
                "second_per_grid")


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
    registry.add_forward_pre_hook(base, "padding-free media", functools.partial(
        _refuse_padding_free_documents, model_type=config.model_type, rope=rope_index_module(base), media=media))
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
        video.refuse_media_not_packed(model_type, config._attn_implementation, given)
    videos = {name: value for name, value in given.items() if video.is_video_argument(name)}
    images = {name: value for name, value in given.items() if name not in videos}
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    type_ids = kwargs.get("mm_token_type_ids")
    owners = video_owners = None
    if isinstance(input_ids, torch.Tensor):
        owners, video_owners = _media_owners(model_type, config, documents, input_ids, type_ids, images, videos)
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
    n_documents = len(documents.starts)
    grids = video.per_document(images.get("image_grid_thw"), owners, n_documents)
    video_grids = video.per_document(videos.get("video_grid_thw"), video_owners, n_documents)
    if (grids is not None or video_grids is not None) and type_ids is None:
        raise PackingValueError(
            f"A packed batch of model_type {model_type!r} with images or videos needs `mm_token_type_ids` (its "
            "processor returns them) to give their tokens 3-D positions. Pass the processor's `mm_token_type_ids`."
        )
    kwargs["position_ids"] = packed_mrope_position_ids(
        rope, input_ids, attention_mask, documents, type_ids, image_grids=grids, video_grids=video_grids,
        video_seconds=video.per_document(videos.get("second_per_grid_ts"), video_owners, n_documents),
    )
    return args, kwargs


def _refuse_padding_free_documents(module, args, kwargs, *, model_type, rope, media):
    """Refuse, before any layer runs, packed documents without an indexed mask (no mask, or a 0/1 one; `position_ids`
    restarting within a row) that transformers does not isolate for this type, where nothing else refuses them:
    - 3-D mRoPE `position_ids` `(3, batch, length)`, restarting at `(0, 0, 0)`: without the text row the mask builders
      get no positions, so the documents attend to each other (0.28-0.78 off alone on the tiny mRoPE models);
    - media with restarting 2-D positions, except for the image-token families (whose padding-free batches
      transformers isolates): mRoPE image tokens at text positions (qwen3_vl: 0.32 off alone), Gemma 3/4 image
      blocks that transformers reads in document coordinates (0.37, 0.71), Mllama's cross-attention of text before a
      document's first image to every image of the row (0.013).
    An indexed mask is handled by `_prepare_packed_batch`; the `(4, batch, length)` layout (text row first) by
    transformers and the mask builders."""
    positions, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    if not isinstance(positions, torch.Tensor) or positions.dim() not in (2, 3):
        return
    mrope_rows = rope is not None and positions.dim() == 3 and positions.shape[0] == 3
    has_media = any(isinstance(kwargs.get(name), (torch.Tensor, list, tuple)) for name in media)
    if not (mrope_rows or (positions.dim() == 2 and has_media
                           and PROVEN_IMAGE_TEXT_TYPES[model_type].family != IMAGE_TOKENS)):
        return
    restart = padding_free_restart(positions, mask)
    if restart is None:
        return
    row, col = restart
    layout = "3-D mRoPE `position_ids` restart at (0, 0, 0)" if mrope_rows else "`position_ids` restart"
    why = ("without their text row the mask builders get no positions, so its documents would attend to each other"
           if mrope_rows else "transformers does not keep its images to their documents in such a batch")
    raise ContaminationError(
        f"{layout} inside row {row} (token {col}) of a batch without an indexed `attention_mask`, for model_type "
        f"{model_type!r}: {why}. Collate image-text rows with `llm_packing.DataCollatorWithPacking(processor=...)` "
        "(its indexed mask; the hook computes each document's positions), or pack them with "
        "`llm_packing.batches.image_text.pack_image_text_documents`."
    )


def padding_free_restart(positions: torch.Tensor, mask: torch.Tensor | None) -> tuple[int, int] | None:
    """
    `(row, token)` of the first document start inside a row of a batch without an indexed mask (`mask` None, 0/1, or
    not the positions' shape), read from `position_ids` (2-D, or the 3 rows of mRoPE's `(3, batch, length)`, which
    restart where all three are 0); None if they never restart, or if `mask` is an indexed one. One host copy.

    Example:
    ```python
    >>> import torch
    >>> padding_free_restart(torch.tensor([[0, 1, 2, 0, 1]]), None)
    (0, 3)
    >>> mrope = torch.tensor([[[0, 1, 1, 0, 1]], [[0, 1, 2, 0, 1]], [[0, 1, 3, 0, 2]]])
    >>> padding_free_restart(mrope, None)
    (0, 3)
    >>> padding_free_restart(mrope, torch.tensor([[1, 1, 1, 0, 0]]))  # the restart is on padding
    >>> padding_free_restart(mrope, torch.tensor([[1, 1, 2, 2, 2]]))  # an indexed mask: not padding-free

    ```
    """
    if positions.shape[-1] < 2 or (is_integer_mask(mask) and mask.numel() and bool(mask.max() > 1)):
        return None
    if positions.dim() == 3:
        positions = torch.where((positions == 0).all(0), 0,
                                torch.arange(1, positions.shape[-1] + 1, device=positions.device))
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == positions.shape):
        mask = torch.ones_like(positions)
    host = torch.stack([mask.detach().to(positions.device).long(), positions.detach().long()]).cpu().numpy()
    return first_restart(host[0], host[1])


def _media_owners(model_type, config, documents, input_ids, type_ids, images, videos):
    """The document of each image unit (None for a type without `IMAGE_UNITS`) and of each video, checked."""
    placeholders = placeholder_mask(config, input_ids, type_ids).cpu().numpy()
    owners = documents_of_images(model_type, config, documents, placeholders, images)
    if model_type not in video.VIDEO_TYPES:
        return owners, None
    video_placeholders = placeholder_mask(config, input_ids, type_ids, "video").cpu().numpy()
    return owners, video.documents_of_videos(model_type, config, documents, video_placeholders, videos)

