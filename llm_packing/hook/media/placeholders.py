"""Which document each image of a packed batch lands in, checked before any layer runs.

Every supported image-token model scatters image features into its placeholder tokens in row-major order: the
features of the i-th image (in packed order) fill the next `count_i` placeholders of the batch. A processor output
that does not match its placeholders (an image cut by truncation, a grid from another image, a document whose
`input_ids` lost a placeholder) shifts every later image: its features straddle two documents, and one document's
image is read by another. So, where the number of features of each image ("unit": an image, or a tile) follows from
the config and the media tensors (`IMAGE_UNITS`), every unit's placeholders must lie in one document and the counts
must add up to the placeholders of the batch. For the other types the batch must hold placeholders exactly when it
holds media, none in padding, and transformers checks the total after the vision tower.
"""

from collections.abc import Callable

import numpy as np
import torch

from ...errors import PackingValueError
from ..documents import ForwardDocuments


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


def _grids(config, media) -> list[int]:
    """mRoPE models: one unit per image, `t * h * w / merge_size**2` tokens of its `image_grid_thw` row."""
    merge = config.vision_config.spatial_merge_size
    return (media["image_grid_thw"].prod(-1) // merge**2).tolist()


def _real_images(pixel_values: torch.Tensor) -> int:
    """Images (or tiles) of an Idefics `(batch, images, channels, height, width)` tensor that are not all-zero
    padding, as the model counts them."""
    return int(pixel_values.flatten(2).ne(0).any(-1).sum())


def _patches(config, pixel_values) -> int:
    patch_height, patch_width = _pair(config.vision_config.patch_size)
    return (pixel_values.shape[-2] // patch_height) * (pixel_values.shape[-1] // patch_width)


def _llava(config, media) -> list[int]:
    extra = 1 if getattr(config, "vision_feature_select_strategy", "default") == "full" else 0
    return [_patches(config, media["pixel_values"]) + extra] * media["pixel_values"].shape[0]


def _idefics3(config, media) -> list[int]:
    vision = config.vision_config
    per_tile = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
    return [per_tile] * _real_images(media["pixel_values"])


def _mistral3(config, media) -> list[int]:
    step = config.vision_config.patch_size * config.spatial_merge_size
    return (media["image_sizes"] // step).prod(-1).tolist()


# model_type -> the number of placeholder tokens of each unit, in packed order, from (config, media kwargs).
IMAGE_UNITS: dict[str, Callable[..., list[int]]] = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v"), _grids),
    "gemma3": lambda config, media: [config.mm_tokens_per_image] * media["pixel_values"].shape[0],
    "paligemma": lambda config, media: [config.text_config.num_image_tokens] * media["pixel_values"].shape[0],
    "idefics2": lambda config, media: (
        [config.perceiver_config.resampler_n_latents] * _real_images(media["pixel_values"])
    ),
    "idefics3": _idefics3,
    "smolvlm": _idefics3,
    "llava": _llava,
    "vipllava": lambda config, media: [_patches(config, media["pixel_values"])] * media["pixel_values"].shape[0],
    "internvl": lambda config, media: (
        [int(_patches(config, media["pixel_values"]) * config.downsample_ratio**2)] * media["pixel_values"].shape[0]
    ),
    "aya_vision": lambda config, media: (
        [_patches(config, media["pixel_values"]) // config.downsample_factor**2] * media["pixel_values"].shape[0]
    ),
    "mistral3": _mistral3,
}


# The `mm_token_type_ids` value of each kind of placeholder, where the processor gives that column.
_TOKEN_TYPES = {"image": 1, "video": 2}


def media_token_id(config, kind: str = "image") -> int | None:
    """The placeholder token id of an image or a video (`kind`), under whichever name the config keeps it."""
    for part in (config, getattr(config, "text_config", None)):
        for name in (f"{kind}_token_id", f"{kind}_token_index"):
            value = getattr(part, name, None)
            if isinstance(value, int):
                return value
    return None


def placeholder_mask(config, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor | None,
                     kind: str = "image") -> torch.Tensor:
    """Where the image (or video, `kind`) placeholders of a batch are: `mm_token_type_ids` of that kind where the
    processor gives the column, else the config's placeholder token."""
    if mm_token_type_ids is not None:
        return mm_token_type_ids == _TOKEN_TYPES[kind]
    token = media_token_id(config, kind)
    return input_ids == token if token is not None else torch.zeros_like(input_ids, dtype=torch.bool)


def documents_of_images(
    model_type: str, config, documents: ForwardDocuments, placeholders: np.ndarray, media: dict
) -> np.ndarray | None:
    """
    The index (in the order of `documents.starts`) of the document each unit of the batch's images lands in, after
    checking that its placeholders lie in that one document and that the units fill the batch's placeholders exactly;
    None for a type without `IMAGE_UNITS`, whose presence checks are made here.

    Raises [`~llm_packing.errors.PackingValueError`] naming the unit, its token count and the documents it touches.
    """
    units = IMAGE_UNITS.get(model_type)
    if units is None:
        _check_placeholders_in_documents(placeholders, documents, "Image")
        found = int(placeholders.sum())
        if bool(media) != bool(found):
            raise PackingValueError(
                f"The packed batch holds {found} image placeholder tokens but "
                f"{'media ' + str(sorted(media)) if media else 'no media'}: every document's placeholders need its "
                "images and every image its placeholders. Pass each document's whole processor output."
            )
        return None
    try:
        counts = np.asarray(units(config, media) if media else [], dtype=np.int64)
    except KeyError as missing:
        raise PackingValueError(
            f"A packed batch for model_type {model_type!r} carries media {sorted(media)} without "
            f"`{missing.args[0]}`, which its processor returns with them: the batch was made by another model's "
            "processor, or a part of its output was dropped. Collate with the processor of this model's checkpoint "
            "(`AutoProcessor.from_pretrained` of the model you train), and pass each document's whole processor "
            "output."
        ) from None
    return unit_owners(counts, placeholders, documents, "Image")


def _check_placeholders_in_documents(placeholders: np.ndarray, documents: ForwardDocuments, kind: str) -> np.ndarray:
    """The flat positions of the placeholders, after checking that none sits in padding."""
    positions = np.flatnonzero(placeholders.reshape(-1))
    in_padding = positions[documents.ids.reshape(-1)[positions] == 0]
    if len(in_padding):
        row, column = divmod(int(in_padding[0]), placeholders.shape[-1])
        raise PackingValueError(
            f"{kind} placeholder tokens sit in padding of the packed batch (row {row}, column {column}, "
            f"{len(in_padding)} in all): the processor outputs and the rows do not match. Build the batch with "
            "`llm_packing.batches.image_text.pack_image_text_documents`."
        )
    return positions


def unit_owners(counts: np.ndarray, placeholders: np.ndarray, documents: ForwardDocuments, kind: str) -> np.ndarray:
    """
    The index (in the order of `documents.starts`) of the document each unit (image, tile or video: `kind`) lands in,
    its `counts[i]` placeholders being the next ones of the batch in packed order, after checking that none sits in
    padding, that every unit's placeholders lie in one document and that the counts fill the placeholders exactly.

    Example:
    ```python
    >>> import numpy as np, torch
    >>> from llm_packing.hook.documents import documents_of
    >>> documents = documents_of(torch.tensor([[1, 1, 1, 2, 2, 2, 0]]))
    >>> unit_owners(np.array([2, 1]), np.array([[0, 1, 1, 0, 1, 0, 0]], dtype=bool), documents, "Video")
    array([0, 1])

    ```
    """
    positions = _check_placeholders_in_documents(placeholders, documents, kind)
    length = placeholders.shape[-1]
    noun = kind.lower()
    if counts.sum() != len(positions):
        raise PackingValueError(
            f"The packed batch's {noun}s have {int(counts.sum())} features ({len(counts)} {noun}s or tiles: "
            f"{counts.tolist()}) but its `input_ids` hold {len(positions)} {noun} placeholder tokens: a processor "
            f"output whose media do not match its placeholders (truncated `input_ids`? media of another document?). "
            "Pass each document's whole processor output, truncated nowhere."
        )
    document = np.searchsorted(documents.starts, positions, side="right") - 1
    ends = np.cumsum(counts)
    firsts = ends - counts
    owners = document[firsts] if len(positions) else np.zeros(0, dtype=np.int64)
    straddling = np.flatnonzero(document[np.maximum(ends - 1, 0)] != owners) if len(counts) else []
    if len(straddling):
        unit = int(straddling[0])
        row, column = divmod(int(positions[firsts[unit]]), length)
        raise PackingValueError(
            f"{kind} {unit} (packed order) has {int(counts[unit])} features, but its placeholder tokens run from row "
            f"{row}, column {column} into the next document: a {noun} whose placeholder count does not match its "
            f"grid or feature count shifts every later {noun} into another document. Check the processor output of "
            f"the documents of that row (their `input_ids` and their media)."
        )
    return owners
